"""The generated parts of the docs match their sources, and the docs keep to what they describe."""

import argparse
import re
import subprocess
import sys
from pathlib import Path

from tests.scripts import load_script

REPO = Path(__file__).resolve().parent.parent


def test_cli_reference_is_generated_from_the_current_parsers():
    # a subprocess: the script sets $COLUMNS, which argparse reads
    proc = subprocess.run([sys.executable, str(REPO / "scripts" / "cli_reference.py"), "--check"],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_flag_of_every_command_has_help_and_is_in_the_reference():
    from tokenmill.cli import build_parser

    reference = (REPO / "docs" / "cli.md").read_text()
    for name, parser in load_script("cli_reference").subcommands(build_parser(), "tokenmill"):
        assert f"## {name}\n" in reference
        for action in parser._actions:
            if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                continue
            assert action.help, f"{name} {action.option_strings or action.dest} has no help"
            for option in action.option_strings:
                assert re.search(re.escape(option) + r"\b", reference), f"{name} {option} not in docs/cli.md"


def test_scaling_tables_are_generated_from_their_formulas():
    m = load_script("scaling_tables")
    text = m.DOC.read_text()
    assert text.count("<!-- scaling-table: ") == len(m.TABLES)
    assert m.regenerate(text) == text, "docs/scaling.md: run `make docs`"
    # one figure by hand: Llama-3-70B, TP=8, one decode token on NVLink: 2L all-reduces of h x 2 bytes
    link = m.LINKS[0]
    assert m.LLAMA3_70B.tp_bytes_per_token == 2 * 80 * 8192 * 2
    assert link.allreduce_seconds(8192 * 2, 8) == 5e-6 + 2 * 7 / 8 * 16384 / 450e9
    assert m.LLAMA3_8B.params == 8_030_261_248  # Llama-3-8B's published parameter count


def test_benchmark_tables_are_generated_from_the_published_results():
    m = load_script("bench_tables")
    for doc in m.DOCS:
        text = doc.read_text()
        assert m.regenerate(text) == text, f"{doc.name}: run `make docs`"


def test_every_published_result_names_its_host_class_and_command():
    m = load_script("bench_tables")
    names = [p.stem for p in sorted(m.PUBLISHED.glob("*.json"))]
    assert names
    shown = "".join(doc.read_text() for doc in m.DOCS)
    for name in names:
        record = m.load_record(name)  # validates host class, required fields, row widths
        assert record["name"] == name
        assert f"<!-- bench-table: {name} -->" in shown, f"{name} is published but shown nowhere"


def test_a_script_report_becomes_a_table():
    m = load_script("bench_tables")
    report = {"benchmark": "decode_latency", "date": "2026-01-01T00:00:00+00:00", "command": "decode_latency.py --configs int8",
              "config": {}, "machine": {"cpu_model": "X", "physical_cores": 2, "torch_threads": 2, "cpu_isa": "avx2"},
              "results": [{"engine": "tokenmill", "decode_tok_s": 89.84, "nested": {"a": 1}},
                          {"engine": "llama.cpp", "decode_tok_s": 102.2}]}
    record = m.record_from_report(report, "decode_latency-avx2")
    assert record["host_class"] == "CPU with AVX2"
    assert record["command"] == "python benchmarks/decode_latency.py --configs int8"
    assert record["columns"] == ["engine", "decode_tok_s"]
    assert record["rows"] == [["tokenmill", "89.84"], ["llama.cpp", "102.2"]]
    assert "| tokenmill | 89.84 |" in m.render(record)


def test_the_docs_name_no_work_items():
    pattern = re.compile(r"session [0-9]|issue #?[0-9]", re.I)
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *(REPO / "benchmarks").rglob("*.md")]
    hits = [f"{f.relative_to(REPO)}:{i}" for f in files for i, line in enumerate(f.read_text().splitlines(), 1)
            if pattern.search(line)]
    assert not hits, hits


def test_readme_starts_with_the_two_commands_ci_and_newcomers_run():
    readme = (REPO / "README.md").read_text().splitlines()
    top = "\n".join(readme[:12])
    assert "make run" in top and "make test" in top
    assert "make test" in (REPO / ".ci" / "run").read_text()
