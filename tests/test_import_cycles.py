import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _load_script():
    spec = importlib.util.spec_from_file_location("import_cycles", REPO / "scripts" / "import_cycles.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_checker_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    m = _load_script()
    assert m.cycles(m.import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]


def test_tokenmill_has_no_import_cycle():
    m = _load_script()
    assert m.cycles(m.import_graph(REPO / "tokenmill")) == []
