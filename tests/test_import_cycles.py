from pathlib import Path

from tests.scripts import load_script

REPO = Path(__file__).resolve().parent.parent


def test_the_checker_finds_a_cycle(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (pkg / "c.py").write_text("import pkg.a\n")
    m = load_script("import_cycles")
    assert m.cycles(m.import_graph(pkg)) == [["pkg.a", "pkg.sub.b"]]


def test_tokenmill_has_no_import_cycle():
    m = load_script("import_cycles")
    assert m.cycles(m.import_graph(REPO / "tokenmill")) == []
