"""Every import between tokenmill's packages is an edge of the graph in scripts/import_cycles.py,
which docs/architecture.md draws."""

from pathlib import Path

from tests.scripts import load_script

REPO = Path(__file__).resolve().parent.parent


def test_tokenmill_imports_only_along_the_package_graph():
    m = load_script("import_cycles")
    assert m.check_layers(m.imports(REPO / "tokenmill")) == []


def test_architecture_md_draws_the_graph_the_check_enforces():
    m = load_script("import_cycles")
    text = m.DOC.read_text()
    assert m.regenerate(text) == text, "docs/architecture.md: run `python scripts/import_cycles.py --write`"
    for package, targets in m.LAYERS.items():
        assert f"\n{package} " in text, package
    for source, target, _ in m.DEBT:
        assert f"`{source} → {target}`" in text


def _package(tmp_path: Path) -> Path:
    """pkg: low <- mid <- top, and a few imports that break it."""
    pkg = tmp_path / "pkg"
    for sub in ("low", "mid", "top"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("X = 1\n")
    (pkg / "low" / "b.py").write_text("from pkg.top.cmd import run\n")  # against the layering, excused below
    (pkg / "mid" / "m.py").write_text("from pkg.low import a\n\n\ndef f():\n    from ..top import cmd\n")
    (pkg / "top" / "cmd.py").write_text(
        "from typing import TYPE_CHECKING\n\nfrom pkg.mid.m import f\n\nif TYPE_CHECKING:\n    from pkg.low.b import Y\n")
    return pkg


def test_an_import_outside_the_graph_fails_with_its_file_and_line(tmp_path):
    m = load_script("import_cycles")
    pkg = _package(tmp_path)
    found = m.imports(pkg)
    kinds = {(i.source, i.target): i.kind for i in found}
    assert kinds[("pkg.mid.m", "pkg.top.cmd")] == "function"
    assert kinds[("pkg.top.cmd", "pkg.low.b")] == "type-checking"
    assert kinds[("pkg.top.cmd", "pkg.mid.m")] == "module"

    layers = {"top": ("mid", "low"), "mid": ("low",), "low": ()}
    debt = (("low.b", "top.cmd", "why"),)
    errors = m.check_layers(found, layers, debt, split=(), root="pkg")
    assert errors == [f"{pkg / 'mid' / 'm.py'}:5: mid.m imports top.cmd (function import), but mid → top is not "
                      f"in the package graph (scripts/import_cycles.py LAYERS)"]

    # the exception names a module: the same edge from another module of the package is still an error
    (pkg / "low" / "c.py").write_text("import pkg.top.cmd\n")
    errors = m.check_layers(m.imports(pkg), layers, debt, split=(), root="pkg")
    assert any(e.startswith(f"{pkg / 'low' / 'c.py'}:1: low.c imports top.cmd,") for e in errors)


def test_the_graph_lists_only_edges_in_use_and_has_no_circle(tmp_path):
    m = load_script("import_cycles")
    found = m.imports(_package(tmp_path))
    layers = {"top": ("mid", "low"), "mid": ("low", "top"), "low": ("mid",)}
    debt = (("low.b", "top.cmd", "why"), ("low.a", "mid", "never used"))
    errors = m.check_layers(found, layers, debt, split=(), root="pkg")
    assert "LAYERS: low → mid is listed but nothing imports along it; remove it" in errors
    assert "DEBT: low.a → mid is listed but nothing imports along it; remove it" in errors
    assert "LAYERS has a circle: low <-> mid <-> top" in errors
    assert not any(e.startswith(str(tmp_path)) for e in errors)


def test_a_split_module_is_a_package_of_its_own():
    m = load_script("import_cycles")
    assert m.package_of("tokenmill") == "tokenmill"
    assert m.package_of("tokenmill.config") == "config"
    assert m.package_of("tokenmill.quantization.awq") == "quantization"
    assert m.package_of("tokenmill.quantization.cli") == "quantization.cli"
    assert m.package_of("tokenmill.eval.cli") == "eval.cli"
