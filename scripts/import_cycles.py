"""tokenmill's import graph, from its `import` statements (at any depth: an import inside a
function ties two modules together for a reader as much as one at the top, and one under
`if TYPE_CHECKING:` names a type the module's interface depends on, so all three count alike):

- no circles: no two modules import each other, directly or through others;
- the package graph: every import from one package to another is an edge of `LAYERS` below, or
  one of the named exceptions in `DEBT` (edges that run against the layering, each with the
  reason it is still there); and every edge listed there is used, so the list stays the graph.

docs/architecture.md draws the same graph between `<!-- package-graph -->` markers; `--write`
redraws it from the lists here, and the tests fail when the drawing and the lists differ.

    python scripts/import_cycles.py            # check; exit 1 and one line (file:line) per violation
    python scripts/import_cycles.py --write    # redraw the graph in docs/architecture.md
"""

from __future__ import annotations

import ast
import re
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DOC = REPO / "docs" / "architecture.md"
ROOT = "tokenmill"  # the package itself (tokenmill/__init__.py: the public API, LLM and SamplingParams)

# The packages of the graph: tokenmill's subpackages and top-level modules, by name, plus these
# command modules, which load, run or measure a model and so sit above the rest of their package.
SPLIT = ("eval.cli", "quantization.cli", "quantization.report", "sparsity.cli")

# Who may import whom, top to bottom. An edge is a dependency on purpose; anything else is an error.
LAYERS: dict[str, tuple[str, ...]] = {
    # commands and the public API
    "cli": ("bench", "cpu_isa", "engine_args", "entrypoints", "eval.cli", "executor", "layers",
            "quantization.cli", "sparsity.cli", ROOT),
    "eval.cli": ("engine_args", "eval", ROOT),
    "sparsity.cli": ("engine_args", "eval", "models", "sparsity"),
    "engine_args": ("config", "cpu_isa", "faults", "quantization.cli"),
    "quantization.cli": ("config", "eval", "models", "quantization", "quantization.report"),
    "quantization.report": ("eval", "sampling_params", ROOT),
    ROOT: ("entrypoints", "outputs", "sampling_params", "version"),
    "bench": ("core", "packaged", "sampling_params"),
    # the server and the engine
    "entrypoints": ("config", "core", "engine", "models", "outputs", "sampling_params", "version"),
    "engine": ("config", "core", "cpu_isa", "executor", "faults", "layers", "models", "outputs",
               "sampling_params", "spec_decode", "structured", "version", "worker"),
    "executor": ("config", "core", "distributed", "models", "structured", "worker"),
    "worker": ("config", "core", "cpu_isa", "distributed", "layers", "models", "quantization",
               "sampling_params", "sparsity", "spec_decode", "structured"),
    # the model and what is computed around it
    "distributed": ("config", "layers", "models"),
    "sparsity": ("config", "layers", "models", "quantization"),
    "quantization": ("config", "eval", "layers", "models"),
    "models": ("config", "layers", "packaged"),
    "spec_decode": ("config", "core", "layers", "sampling_params"),
    "layers": ("config", "cpu_isa", "sampling_params", "structured"),
    "eval": ("packaged", "sampling_params"),
    "core": ("sampling_params",),
    "structured": ("sampling_params",),
    # leaves
    "config": ("cpu_isa", "faults"),
    "cpu_isa": (),
    "faults": (),
    "outputs": (),
    "packaged": (),
    "sampling_params": (),
    "version": (),
}

# Edges against the layering, each allowed only from the module(s) and to the module named, with
# why it is still there. Fixing one means deleting its line.
DEBT: tuple[tuple[str, str, str], ...] = ()


@dataclass(frozen=True)
class Import:
    source: str  # module, e.g. tokenmill.layers.sampler
    target: str  # module of the package, e.g. tokenmill.spec_decode.rejection
    path: Path
    line: int
    kind: str  # "module" (runs on import), "function" (runs when called) or "type-checking"

    def where(self) -> str:
        try:
            return f"{self.path.relative_to(REPO)}:{self.line}"
        except ValueError:
            return f"{self.path}:{self.line}"


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _kinds(tree: ast.AST) -> dict[int, str]:
    """id(import node) -> its kind; imports at module level are absent."""
    kinds: dict[int, str] = {}

    def visit(node: ast.AST, kind: str | None) -> None:
        for child in ast.iter_child_nodes(node):
            inner = kind
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                inner = kind or "function"
            elif isinstance(node, ast.If) and child in node.body and "TYPE_CHECKING" in ast.unparse(node.test):
                inner = "type-checking"
            if isinstance(child, (ast.Import, ast.ImportFrom)) and inner:
                kinds[id(child)] = inner
            visit(child, inner)

    visit(tree, None)
    return kinds


def imports(package_dir: Path) -> list[Import]:
    """Every import of a module of the package by another. `from a import b` imports `a.b` when
    that is a module, else `a`."""
    files = {module_name(p, package_dir): p for p in sorted(package_dir.rglob("*.py"))}
    found: list[Import] = []
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        tree = ast.parse(path.read_text(), str(path))
        kinds = _kinds(tree)
        for node in ast.walk(tree):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != name:
                    found.append(Import(name, target, path, node.lineno, kinds.get(id(node), "module")))
    return list(dict.fromkeys(found))


def import_graph(package_dir: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, less the packages it lies in (whose
    `__init__` has run before it)."""
    graph: dict[str, set[str]] = {module_name(p, package_dir): set() for p in package_dir.rglob("*.py")}
    for imp in imports(package_dir):
        if not imp.source.startswith(imp.target + "."):
            graph[imp.source].add(imp.target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one node (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    sys.setrecursionlimit(10_000)
    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


# --- the package graph -------------------------------------------------------------------------

def relative(module: str, root: str = ROOT) -> str:
    """tokenmill.layers.sampler -> layers.sampler; the package itself keeps its name."""
    return module[len(root) + 1:] if module.startswith(root + ".") else module


def package_of(module: str, split: tuple[str, ...] = SPLIT, root: str = ROOT) -> str:
    """The graph's package a module belongs to: a SPLIT module, else the first name below the root."""
    if module == root:
        return root
    rel = relative(module, root)
    for name in sorted(split, key=len, reverse=True):
        if rel == name or rel.startswith(name + "."):
            return name
    return rel.split(".")[0]


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def check_layers(found: list[Import], layers: dict[str, tuple[str, ...]] = LAYERS,
                 debt: tuple[tuple[str, str, str], ...] = DEBT, split: tuple[str, ...] = SPLIT,
                 root: str = ROOT) -> list[str]:
    """One line per import outside the graph (file:line first), per package the graph does not
    name, per listed edge or exception no import uses, and per circle in the graph itself."""
    errors: list[str] = []
    used: set[tuple[str, str]] = set()
    used_debt: set[int] = set()
    packages: set[str] = set()
    for imp in found:
        src, dst = package_of(imp.source, split, root), package_of(imp.target, split, root)
        packages |= {src, dst}
        if src == dst:
            continue
        if dst in layers.get(src, ()):
            used.add((src, dst))
            continue
        a, b = relative(imp.source, root), relative(imp.target, root)
        hits = [i for i, (s, t, _) in enumerate(debt) if _within(a, s) and _within(b, t)]
        if hits:
            used_debt.update(hits)
            continue
        how = "" if imp.kind == "module" else f" ({imp.kind} import)"
        errors.append(f"{imp.where()}: {a} imports {b}{how}, but {src} → {dst} is not in the package graph "
                      f"(scripts/import_cycles.py LAYERS)")
    for package in sorted(packages - layers.keys()):
        errors.append(f"package {package} is not in the package graph (scripts/import_cycles.py LAYERS)")
    for src, targets in layers.items():
        for dst in targets:
            if dst not in layers:
                errors.append(f"LAYERS: {src} → {dst}: {dst} is not a package of the graph")
            elif (src, dst) not in used:
                errors.append(f"LAYERS: {src} → {dst} is listed but nothing imports along it; remove it")
    for i, (s, t, _) in enumerate(debt):
        if i not in used_debt:
            errors.append(f"DEBT: {s} → {t} is listed but nothing imports along it; remove it")
    for component in cycles({p: set(t) for p, t in layers.items()}):
        errors.append("LAYERS has a circle: " + " <-> ".join(component))
    return errors


def levels(layers: dict[str, tuple[str, ...]] = LAYERS) -> dict[str, int]:
    """Each package's height: 0 for a leaf, else one more than the highest package it imports."""
    height: dict[str, int] = {}

    def visit(p: str) -> int:
        if p not in height:
            height[p] = 0
            height[p] = 1 + max((visit(q) for q in layers.get(p, ())), default=-1)
        return height[p]

    for p in layers:
        visit(p)
    return height


def drawing(layers: dict[str, tuple[str, ...]] = LAYERS, debt: tuple[tuple[str, str, str], ...] = DEBT) -> str:
    """The graph as docs/architecture.md shows it: one line per package, highest first, then
    the exceptions with their reasons."""
    height = levels(layers)
    order = sorted(layers, key=lambda p: (-height[p], p))
    width = max(len(p) for p in order)
    lines = ["```"]
    for p in order:
        line = f"{p:<{width}} →"
        for i, q in enumerate(sorted(layers[p])):
            word = q + ("," if i < len(layers[p]) - 1 else "")
            if len(line) + 1 + len(word) > MAX_WIDTH:
                lines.append(line)
                line = " " * (width + 2)
            line += " " + word
        lines.append(line if layers[p] else line + " (nothing of tokenmill)")
    lines.append("```")
    if debt:
        lines += ["", "Imports against it, each allowed from and to the module named until it moves:", ""]
    for s, t, reason in debt:
        lines += textwrap.wrap(f"- `{s} → {t}`: {reason}.", MAX_WIDTH, subsequent_indent="  ", break_on_hyphens=False)
    return "\n".join(lines) + "\n"


MAX_WIDTH = 100  # the drawing's lines, as the page's prose
BLOCK = re.compile(r"(<!-- package-graph -->\n)(.*?)(<!-- /package-graph -->)", re.S)


def regenerate(text: str) -> str:
    if not BLOCK.search(text):
        raise ValueError(f"{DOC.name} has no <!-- package-graph --> block")
    return BLOCK.sub(lambda m: m.group(1) + drawing() + m.group(3), text)


def main(argv: list[str]) -> int:
    if "--write" in argv:
        DOC.write_text(regenerate(DOC.read_text()))
        print(f"redrew the package graph in {DOC.relative_to(REPO)}")
        return 0
    package_dir = REPO / "tokenmill"
    found = imports(package_dir)
    problems = ["import cycle: " + " <-> ".join(c) for c in cycles(import_graph(package_dir))]
    problems += check_layers(found)
    text = DOC.read_text()
    if not BLOCK.search(text) or regenerate(text) != text:
        problems.append(f"{DOC.relative_to(REPO)}: the package graph differs from scripts/import_cycles.py; "
                        f"run `python scripts/import_cycles.py --write`")
    for line in problems:
        print(line)
    if not problems:
        print(f"no import cycles in tokenmill; every import between its packages is in the package graph "
              f"({sum(map(len, LAYERS.values()))} edges, {len(DEBT)} exceptions)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
