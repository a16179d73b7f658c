"""The results tables of README.md and docs/*.md, generated from the JSON reports the benchmark
scripts wrote.

A published result is one JSON file in benchmarks/published/: the report a script wrote
(`benchmarks/common.py` `write_report`: date, command line, code version, machine, results), kept
verbatim under "report", and a view of it: column headers, and rows whose cells are templates over
the report's figures. Host class, host, date and command are read from the report, never typed.
A headline table (the README's) is a list of rows, each drawn from one published result and
carrying that result's command. A Markdown file asks for a table with a pair of markers

    <!-- bench-table: NAME -->
    ...generated, do not edit...
    <!-- /bench-table -->

and this script rewrites what lies between them. Every other table in those files states what
the code does (flags, formats, limits), not what it measured, and is listed in REFERENCE_TABLES
by its header; a table that is neither is a hand-typed result, which `--check` refuses.

    python scripts/bench_tables.py                 # rewrite the tables (make docs)
    python scripts/bench_tables.py --check         # exit 1 if a table is out of date
    python scripts/bench_tables.py --stale         # the results measured on code that has changed since
    python scripts/bench_tables.py --add benchmarks/results/decode_latency.json --name decode_latency-avx2
                                                   # publish a report (a new view lists its fields;
                                                   # an existing one keeps its view, with the new report)

Templates: `{expr}` or `{expr:spec}` (a format spec, as in `format()`); `{{` and `}}` are braces.
`expr` reads the report: `results`, `config`, `machine`, `report`, `r` (the results by their key
field, e.g. `r['int4'].decode_tok_s`), inside an "each" row (every result, those its "keys"
name, or the items of the list its "over" expression gives) also the item's own fields and
the item itself as `item` (which hide a report name they share: `report.config` still
reaches the report's); it may use
+ - * /, parentheses, numbers, strings, min/max/abs/round/len/sum and opt(value, spec) (an en
dash for a missing value). Nothing else is evaluated.
"""

from __future__ import annotations

import argparse
import ast
import json
import operator
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "benchmarks" / "published"
DOCS = (REPO / "README.md", *sorted((REPO / "docs").glob("*.md")))
# the tables written by hand: what the code does, not what it measured (their header rows)
REFERENCE_TABLES = (
    "| family | checkpoints | tested against transformers |",
    "| family | from | what it adds | tested against transformers |",
    "| GGUF type | runs as | how |",
    "| level | compiler flags | CPUs | compute dtype (auto) | matmul kernels |",
    "| method | weights | activations | kernels (CPU / CUDA) |",
    "| stage | what | cap |",
    "| figure | target |",
    "| What | Limit (default) | Flag | Answer |",
    "| situation | what a client sees |",
    "| link | bandwidth used | from | α |",
    "| situation | choose | why (formula above) |",
    "| endpoint | |",
    "| | `/v1/completions` | `/v1/chat/completions` |",
    "| value | what the engine does |",
)
# generated tables: these scripts' markers (scripts/scaling_tables.py writes the formula tables)
GENERATED = re.compile(r"<!-- (bench|scaling)-table: [\w.-]+ -->\n.*?<!-- /\1-table -->\n?", re.S)
HOST_CLASSES = ("CPU with AVX-512 BF16", "CPU with AVX-512 VNNI", "CPU with AVX-512", "CPU with AVX2",
                "CPU, generic", "GPU")
REQUIRED = ("name", "title", "report", "peers", "columns", "rows")
HEADLINE_REQUIRED = ("name", "title", "host_class", "columns", "rows")
REPORT_REQUIRED = ("benchmark", "date", "command", "machine", "results")
MARKER = re.compile(r"(<!-- bench-table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.S)
ISA_CLASSES = {"avx512_bf16": "CPU with AVX-512 BF16", "avx512_vnni": "CPU with AVX-512 VNNI",
               "avx512": "CPU with AVX-512", "avx2": "CPU with AVX2", "generic": "CPU, generic"}
# what a result measures: a change here after the report's commit makes it stale
MEASURED_CODE = ("tokenmill", "csrc")


class PublishedError(ValueError):
    pass


# --- templates ---------------------------------------------------------------------------------

_BINOPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def _or_dash(value, spec: str = "") -> str:
    """A value that may be missing: formatted, or an en dash."""
    return "–" if value is None else format(value, spec)


_FUNCS = {"min": min, "max": max, "abs": abs, "round": round, "len": len, "sum": sum, "opt": _or_dash}
_FIELD = re.compile(r"\{((?:[^{}'\"]|'[^']*'|\"[^\"]*\")+)\}")
_SPEC = re.compile(r"[<>=^]?[+-]?[,_]?\d*(\.\d+)?[bcdeEfFgGnosxX%]?")


def _item(value, key, expr: str):
    try:
        return value[key]
    except (KeyError, IndexError, TypeError):
        raise PublishedError(f"{expr!r}: no {key!r} in the report") from None


def _eval(node: ast.AST, names: dict, expr: str):
    if isinstance(node, ast.Expression):
        return _eval(node.body, names, expr)
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, str)):
        return node.value
    if isinstance(node, ast.Name):
        if node.id in _FUNCS:
            return _FUNCS[node.id]
        return _item(names, node.id, expr)
    if isinstance(node, ast.Subscript):
        return _item(_eval(node.value, names, expr), _eval(node.slice, names, expr), expr)
    if isinstance(node, ast.Attribute):
        return _item(_eval(node.value, names, expr), node.attr, expr)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINOPS:
        left, right = _eval(node.left, names, expr), _eval(node.right, names, expr)
        try:
            return _BINOPS[type(node.op)](left, right)
        except (TypeError, ZeroDivisionError) as e:
            raise PublishedError(f"{expr!r}: {e}") from None
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_eval(node.operand, names, expr)
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_eval(e, names, expr) for e in node.elts]
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _FUNCS and not node.keywords:
        return _FUNCS[node.func.id](*(_eval(a, names, expr) for a in node.args))
    raise PublishedError(f"{expr!r}: only names, [], ., + - * /, numbers, strings and "
                         f"{'/'.join(_FUNCS)} are allowed in a template")


def _split_spec(field: str) -> tuple[str, str]:
    """`expr:spec` at the last colon outside brackets and quotes, when what follows is a format spec."""
    depth, quote, cut = 0, None, None
    for i, c in enumerate(field):
        if quote:
            quote = None if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif c == ":" and depth == 0:
            cut = i
    if cut is not None and _SPEC.fullmatch(field[cut + 1:]):
        return field[:cut], field[cut + 1:]
    return field, ""


def evaluate(expr: str, names: dict):
    """The value of one template expression over the report."""
    try:
        tree = ast.parse(expr.strip(), mode="eval")
    except SyntaxError as e:
        raise PublishedError(f"{expr!r}: {e.msg}") from None
    return _eval(tree, names, expr)


def fill(template: str, names: dict) -> str:
    """A cell: the template with each {expr[:spec]} replaced by its value from the report."""
    def one(match: re.Match) -> str:
        expr, spec = _split_spec(match[1])
        value = evaluate(expr, names)
        try:
            return format(value, spec)
        except (TypeError, ValueError) as e:
            raise PublishedError(f"{match[0]!r}: {e}") from None

    text = template.replace("{{", "\0").replace("}}", "\1")
    return _FIELD.sub(one, text).replace("\0", "{").replace("\1", "}")


# --- published results -------------------------------------------------------------------------

def load_record(name: str) -> dict:
    path = PUBLISHED / f"{name}.json"
    if not path.is_file():
        raise PublishedError(f"no published result {name!r} ({path.relative_to(REPO)} does not exist)")
    record = json.loads(path.read_text())
    headline = name.startswith("headline-")
    missing = [k for k in (HEADLINE_REQUIRED if headline else REQUIRED) if k not in record]
    if missing:
        raise PublishedError(f"{path.name}: missing {', '.join(missing)}")
    if headline:
        if record["host_class"] not in HOST_CLASSES:
            raise PublishedError(f"{path.name}: host_class must be one of {HOST_CLASSES}, got {record['host_class']!r}")
        for i, row in enumerate(record["rows"]):
            if not isinstance(row, dict) or "source" not in row or "cells" not in row:
                raise PublishedError(f"{path.name}: row {i} must name its source result and its cells")
        return record
    report = record["report"]
    missing = [k for k in REPORT_REQUIRED if not report.get(k)]
    if missing:
        raise PublishedError(f"{path.name}: the report has no {', '.join(missing)} (publish what a script wrote)")
    return record


def host_class(report: dict) -> str:
    machine = report["machine"]
    if machine.get("gpu") and report.get("config", {}).get("device") != "cpu":
        return "GPU"
    return ISA_CLASSES.get(machine.get("cpu_isa"), "CPU, generic")


def host(report: dict) -> str:
    m = report["machine"]
    if host_class(report) == "GPU":
        gpu = m["gpu"]
        return gpu["name"] if isinstance(gpu, dict) else str(gpu)
    generation = f" ({m['cpu_generation']})" if m.get("cpu_generation") else ""
    text = f"{m.get('cpu_model')}{generation}, {m.get('physical_cores')} cores, {m.get('torch_threads')} torch threads"
    isa, detected = m.get("cpu_isa"), m.get("cpu_isa_detected")
    if isa:
        text += f", kernels at {isa}" + (f" (the CPU has {detected})" if detected and detected != isa else "")
    return text


def command(report: dict) -> str:
    """The command line that wrote the report, with absolute paths shown as PATH/name and the
    report's own output path left out."""
    words = shlex.split(report["command"])
    shown, skip = [], False
    for word in words:
        if skip:
            skip = False
            continue
        if word in ("--output", "-o"):
            skip = True
            continue
        if word.startswith("--output="):
            continue
        if "=" in word and word.startswith("--"):
            flag, value = word.split("=", 1)
            word = f"{flag}={_path(value)}"
        shown.append(_path(word))
    line = " ".join(_quoted(w) for w in shown)
    return line if shown[0] == "tokenmill" else f"python benchmarks/{line}"


def _path(word: str) -> str:
    return f"PATH/{Path(word).name}" if word.startswith("/") else word


def _quoted(word: str) -> str:
    """As a shell would need it (a `$VAR` left to expand)."""
    return word if re.fullmatch(r"[\w@%+=:,./$-]+", word) else shlex.quote(word)


def _key_field(results: list, record: dict) -> str | None:
    if record.get("key"):
        return record["key"]
    for field in results[0] if results else ():
        values = [r.get(field) for r in results]
        if all(isinstance(v, str) for v in values) and len(set(values)) == len(values):
            return field
    return None


def names_of(record: dict) -> dict:
    """What a template may read: the report's parts and its results by their key field."""
    report = record["report"]
    results = report["results"]
    if isinstance(results, list):
        key = _key_field(results, record)
        by_key = {r[key]: r for r in results if isinstance(r, dict) and key in r} if key else {}
    else:
        by_key = results
    return {"report": report, "results": results, "config": report.get("config", {}),
            "machine": report["machine"], "r": by_key}


def rows_of(record: dict) -> list[list[str]]:
    names = names_of(record)
    rows = []
    for row in record["rows"]:
        if isinstance(row, dict) and "each" in row:
            # every result, or those named in "keys", in that order, or the items of the list "over" names
            if "over" in row:
                chosen = evaluate(row["over"], names)
            elif "keys" in row:
                chosen = [_item(names["r"], k, row["keys"]) for k in row["keys"]]
            else:
                chosen = names["results"]
            for result in chosen:
                rows.append([fill(t, {**names, **result, "item": result}) for t in row["each"]])
        else:
            rows.append([fill(t, names) for t in row])
    for i, row in enumerate(rows):
        if len(row) != len(record["columns"]):
            raise PublishedError(f"{record['name']}: row {i} has {len(row)} cells, expected {len(record['columns'])}")
    return rows


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(columns: list[str], rows: list[list[str]], notes: str = "") -> list[str]:
    lines = ["| " + " | ".join(_cell(c) for c in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines + (["", notes] if notes else [])


def _command_cell(record: dict) -> str:
    """The result's command as code, with what had to be set up first."""
    setup = f" ({record['setup']})" if record.get("setup") else ""
    return f"`{command(record['report'])}`{setup}"


def render(record: dict) -> str:
    """One table with the host class, the host, the date and the command above it, the notes below."""
    report = record["report"]
    names = names_of(record)
    notes = fill(record.get("notes", ""), names)
    lines = [
        f"**{fill(record['title'], names)}** — {host_class(report)}: {host(report)}; measured {report['date'][:10]}.",
        f"Command: {_command_cell(record)}.",
        f"Peers in the same run: {fill(record['peers'], names)}.",
        "",
    ]
    return "\n".join(lines + _table(record["columns"], rows_of(record), notes)) + "\n"


def render_headline(record: dict) -> str:
    """Each row drawn from one published result; the command column is that result's command."""
    columns = [*record["columns"], "command"]
    rows, hosts, previous = [], {}, None
    for row in record["rows"]:
        source = load_record(row["source"])
        if host_class(source["report"]) != record["host_class"]:
            raise PublishedError(f"{record['name']}: {row['source']} was measured on "
                                 f"{host_class(source['report'])}, not {record['host_class']}")
        names = names_of(source)
        cells = [fill(t, names) for t in row["cells"]]
        if len(cells) != len(record["columns"]):
            raise PublishedError(f"{record['name']}: a row from {row['source']} has {len(cells)} cells, "
                                 f"expected {len(record['columns'])}")
        if row["source"] == previous:
            cells.append("(same run)")
        else:
            cells.append(_command_cell(source))
        previous = row["source"]
        rows.append(cells)
        hosts.setdefault(host(source["report"]), set()).add(source["report"]["date"][:10])
    notes = "Measured on " + "; ".join(f"{h} ({', '.join(sorted(d))})" for h, d in hosts.items()) + "."
    if record.get("notes"):
        notes += " " + record["notes"]
    return "\n".join(_table(columns, rows, notes)) + "\n"


def regenerate(text: str) -> str:
    def replace(match: re.Match) -> str:
        record = load_record(match["name"])
        body = render_headline(record) if record["name"].startswith("headline-") else render(record)
        return match.group(1) + body + match.group(4)

    return MARKER.sub(replace, text)


def hand_typed_tables(text: str) -> list[str]:
    """The header rows of the tables in `text` that no script generates and REFERENCE_TABLES does not list."""
    lines = GENERATED.sub("", text).splitlines()
    headers = [line.strip() for i, line in enumerate(lines)
               if line.lstrip().startswith("|") and (i == 0 or not lines[i - 1].lstrip().startswith("|"))]
    return [h for h in headers if h not in REFERENCE_TABLES]


def new_record(report: dict, name: str) -> dict:
    """A first view of a script's report: one row per result, one column per scalar field."""
    results = report.get("results")
    if isinstance(results, dict):
        results = [results]
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise PublishedError("the report's 'results' is not a list of objects; write the view by hand")
    columns: list[str] = []
    for result in results:
        columns += [k for k, v in result.items() if k not in columns and isinstance(v, (str, int, float, bool, type(None)))]
    cell = lambda c: f"{{{c}:.4g}}" if any(isinstance(r.get(c), float) for r in results) else f"{{{c}}}"  # noqa: E731
    return {"name": name, "title": report.get("benchmark", name), "peers": "the other rows of the table",
            "columns": columns, "rows": [{"each": [cell(c) for c in columns]}], "report": report}


def stale(record: dict) -> str | None:
    """Why a result no longer measures the code as it is, or None."""
    code = record["report"].get("code")
    if not code:
        return "the report names no commit"
    if code.get("modified"):
        return f"measured on uncommitted changes over {code['commit'][:10]}"
    diff = subprocess.run(["git", "diff", "--stat", code["commit"], "HEAD", "--", *MEASURED_CODE], cwd=REPO,
                          capture_output=True, text=True)
    if diff.returncode != 0:
        return f"commit {code['commit'][:10]} is not in this repository"
    if diff.stdout.strip():
        return f"{diff.stdout.strip().splitlines()[-1].strip()} since {code['commit'][:10]}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated table differs from its JSON")
    parser.add_argument("--stale", action="store_true",
                        help="list the published results measured on code that has changed since")
    parser.add_argument("--add", type=Path, metavar="REPORT.json",
                        help="publish a benchmark script's JSON report as benchmarks/published/NAME.json")
    parser.add_argument("--name", help="with --add: the published name (default: the report's benchmark)")
    args = parser.parse_args(argv)
    if args.add:
        report = json.loads(args.add.read_text())
        missing = [k for k in REPORT_REQUIRED if not report.get(k)]
        if missing:
            raise SystemExit(f"{args.add}: not a benchmark report (no {', '.join(missing)})")
        name = args.name or report["benchmark"]
        path = PUBLISHED / f"{name}.json"
        record = {**json.loads(path.read_text()), "report": report} if path.is_file() else new_record(report, name)
        if path.is_file():
            rows_of(record)  # the kept view must still read the new report
        path.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path.relative_to(REPO)}" +
              ("" if path.is_file() else f"; add <!-- bench-table: {name} --><!-- /bench-table --> to a doc"))
        return 0
    if args.stale:
        for path in sorted(PUBLISHED.glob("*.json")):
            if not path.stem.startswith("headline-"):
                why = stale(load_record(path.stem))
                if why:
                    print(f"{path.stem}: {why}")
        return 0
    out_of_date, typed = [], []
    for doc in DOCS:
        text = doc.read_text()
        typed += [f"{doc.relative_to(REPO)}: {h}" for h in hand_typed_tables(text)]
        new = regenerate(text)
        if new != text:
            out_of_date.append(doc.relative_to(REPO))
            if not args.check:
                doc.write_text(new)
    if typed:
        print("hand-typed tables (generate them from a script's report, or list a reference table's header "
              "in REFERENCE_TABLES):\n  " + "\n  ".join(typed))
    if args.check and (out_of_date or typed):
        if out_of_date:
            print("out of date (run `make docs`): " + ", ".join(map(str, out_of_date)))
        return 1
    print(("updated: " + ", ".join(map(str, out_of_date))) if out_of_date else "benchmark tables up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
