"""The benchmark tables of README.md, docs/benchmarks.md and docs/quantization.md, generated from the
published results.

A published result is one JSON file in benchmarks/published/: a table (columns, rows) with the
host class it was measured on, the host, the command that reproduces it and the peers measured
in the same run. A Markdown file asks for one with a pair of markers

    <!-- bench-table: NAME -->
    ...generated, do not edit...
    <!-- /bench-table -->

and this script rewrites what lies between them.

    python scripts/bench_tables.py                 # rewrite the tables (make docs)
    python scripts/bench_tables.py --check         # exit 1 if a table is out of date
    python scripts/bench_tables.py --add benchmarks/results/decode_latency.json --name decode_latency-avx2
                                                   # publish a script's JSON report as a table
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "benchmarks" / "published"
DOCS = (REPO / "README.md", REPO / "docs" / "benchmarks.md", REPO / "docs" / "quantization.md")
HOST_CLASSES = ("CPU with AVX-512 BF16", "CPU with AVX-512 VNNI", "CPU with AVX-512", "CPU with AVX2",
                "CPU, generic", "GPU")
REQUIRED = ("name", "title", "host_class", "host", "command", "peers", "columns", "rows")
MARKER = re.compile(r"(<!-- bench-table: (?P<name>[\w.-]+) -->\n)(?P<body>.*?)(<!-- /bench-table -->)", re.S)
ISA_CLASSES = {"avx512_bf16": "CPU with AVX-512 BF16", "avx512_vnni": "CPU with AVX-512 VNNI",
               "avx512": "CPU with AVX-512", "avx2": "CPU with AVX2", "generic": "CPU, generic"}


class PublishedError(ValueError):
    pass


def load_record(name: str) -> dict:
    path = PUBLISHED / f"{name}.json"
    if not path.is_file():
        raise PublishedError(f"no published result {name!r} ({path.relative_to(REPO)} does not exist)")
    record = json.loads(path.read_text())
    missing = [k for k in REQUIRED if k not in record]
    if missing:
        raise PublishedError(f"{path.name}: missing {', '.join(missing)}")
    if record["host_class"] not in HOST_CLASSES:
        raise PublishedError(f"{path.name}: host_class must be one of {HOST_CLASSES}, got {record['host_class']!r}")
    for i, row in enumerate(record["rows"]):
        if len(row) != len(record["columns"]):
            raise PublishedError(f"{path.name}: row {i} has {len(row)} cells, expected {len(record['columns'])}")
    return record


def _cell(value) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


def _table(record: dict) -> list[str]:
    """The table itself, then the notes below it."""
    lines = [
        "| " + " | ".join(_cell(c) for c in record["columns"]) + " |",
        "|" + "---|" * len(record["columns"]),
    ]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in record["rows"]]
    if record.get("notes"):
        lines += ["", record["notes"]]
    return lines


def render(record: dict) -> str:
    """One table with the host class, the host and the command above it, the notes below."""
    command = record["command"]
    lines = [
        f"**{record['title']}** — {record['host_class']}: {record['host']}.",
        f"Command: `{command}`." if not command.startswith("`") and "`" not in command else f"Command: {command}.",
        f"Peers in the same run: {record['peers']}.",
        "",
    ]
    return "\n".join(lines + _table(record)) + "\n"


def render_headline(record: dict) -> str:
    """Headline tables carry a command per row, so only the host class and notes go around them."""
    return "\n".join(_table(record)) + "\n"


def regenerate(text: str) -> str:
    def replace(match: re.Match) -> str:
        record = load_record(match["name"])
        body = render_headline(record) if record["name"].startswith("headline-") else render(record)
        return match.group(1) + body + match.group(4)

    return MARKER.sub(replace, text)


def record_from_report(report: dict, name: str) -> dict:
    """A script's JSON report (benchmarks/common.py `write_report`) as a published table: one row per
    result, one column per scalar field."""
    machine = report.get("machine", {})
    results = report.get("results")
    if isinstance(results, dict):
        results = [results]
    if not isinstance(results, list) or not all(isinstance(r, dict) for r in results):
        raise PublishedError("the report's 'results' is not a list of objects; write the table by hand")
    columns: list[str] = []
    for result in results:
        columns += [k for k, v in result.items() if k not in columns and isinstance(v, (str, int, float, bool, type(None)))]

    def fmt(value) -> str:
        if isinstance(value, float):
            return f"{value:.4g}"
        return "" if value is None else str(value)

    gpu = machine.get("gpu") if report.get("config", {}).get("device") != "cpu" else None
    host_class = "GPU" if gpu else ISA_CLASSES.get(machine.get("cpu_isa"), "CPU, generic")
    host = gpu["name"] if gpu else (f"{machine.get('cpu_model')}, {machine.get('physical_cores')} cores, "
                                   f"{machine.get('torch_threads')} torch threads")
    return {
        "name": name,
        "title": report.get("benchmark", name),
        "host_class": host_class,
        "host": host,
        "date": report.get("date", "")[:10],
        "command": f"python benchmarks/{report.get('command', '')}",
        "peers": "the other rows of the table",
        "columns": columns,
        "rows": [[fmt(r.get(c)) for c in columns] for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a generated table differs from its JSON")
    parser.add_argument("--add", type=Path, metavar="REPORT.json",
                        help="write a benchmark script's JSON report to benchmarks/published/NAME.json")
    parser.add_argument("--name", help="with --add: the published name (default: the report's benchmark)")
    args = parser.parse_args(argv)
    if args.add:
        report = json.loads(args.add.read_text())
        name = args.name or report.get("benchmark", args.add.stem)
        path = PUBLISHED / f"{name}.json"
        path.write_text(json.dumps(record_from_report(report, name), indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {path.relative_to(REPO)}; add <!-- bench-table: {name} --><!-- /bench-table --> to a doc")
        return 0
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        new = regenerate(text)
        if new != text:
            stale.append(doc.relative_to(REPO))
            if not args.check:
                doc.write_text(new)
    if args.check and stale:
        print("out of date (run `make docs`): " + ", ".join(map(str, stale)))
        return 1
    print(("updated: " + ", ".join(map(str, stale))) if stale else "benchmark tables up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
