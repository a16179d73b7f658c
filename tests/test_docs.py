"""The generated parts of the docs match their sources, and the docs keep to what they describe."""

import argparse
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

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


def test_no_results_table_is_typed_by_hand():
    m = load_script("bench_tables")
    typed = {doc.name: m.hand_typed_tables(doc.read_text()) for doc in m.DOCS}
    assert not any(typed.values()), typed
    generated = "<!-- bench-table: x -->\n| engine | tok/s |\n|---|---|\n<!-- /bench-table -->\n"
    typed_by_hand = "\n  | engine | tok/s |\n  |---|---|\n  | tokenmill | 1 |\n"
    assert m.hand_typed_tables(generated + "\n" + m.REFERENCE_TABLES[0] + "\n|---|\n") == []
    assert m.hand_typed_tables(generated + typed_by_hand) == ["| engine | tok/s |"]


def test_every_published_result_is_a_script_report_shown_somewhere():
    m = load_script("bench_tables")
    names = [p.stem for p in sorted(m.PUBLISHED.glob("*.json"))]
    assert names
    shown = "".join(doc.read_text() for doc in m.DOCS)
    for name in names:
        record = m.load_record(name)  # a headline names a source per row; the others hold the script's report
        assert record["name"] == name
        assert f"<!-- bench-table: {name} -->" in shown, f"{name} is published but shown nowhere"
        if name.startswith("headline-"):
            for row in record["rows"]:
                source = m.load_record(row["source"])
                assert m.host_class(source["report"]) == record["host_class"]
                assert m.command(source["report"]).startswith(("python benchmarks/", "tokenmill "))
        else:
            assert m.host_class(record["report"]) in m.HOST_CLASSES
            assert m.rows_of(record), f"{name}: the view shows no row"


REPORT = {"benchmark": "decode_latency", "date": "2026-01-01T00:00:00+00:00",
          "command": "decode_latency.py --configs int8 --llama-bench /opt/lcpp/llama-bench --output /tmp/x.json",
          "config": {"output_len": 64}, "machine": {"cpu_model": "X", "physical_cores": 2, "torch_threads": 2,
                                                    "cpu_isa": "avx2", "cpu_isa_detected": "avx512_bf16"},
          "results": [{"engine": "tokenmill", "decode_tok_s": 89.84, "nested": {"a": 1}},
                      {"engine": "llama.cpp", "decode_tok_s": 102.2}]}


def test_a_script_report_becomes_a_table():
    m = load_script("bench_tables")
    record = m.new_record(REPORT, "decode_latency-avx2")
    assert m.host_class(REPORT) == "CPU with AVX2"
    assert m.host(REPORT) == "X, 2 cores, 2 torch threads, kernels at avx2 (the CPU has avx512_bf16)"
    # the output path is the report's own; absolute paths are the measurer's
    assert m.command(REPORT) == "python benchmarks/decode_latency.py --configs int8 --llama-bench PATH/llama-bench"
    assert record["columns"] == ["engine", "decode_tok_s"]
    assert m.rows_of(record) == [["tokenmill", "89.84"], ["llama.cpp", "102.2"]]
    assert "| tokenmill | 89.84 |" in m.render(record)
    assert "measured 2026-01-01" in m.render(record)


def test_a_host_line_names_the_cpu_generation(monkeypatch):
    """A virtual machine's model name is often "AMD EPYC" alone: the report's generation (from
    /proc/cpuinfo's family and model) goes beside it, since Zen 4 and Zen 5 share a level."""
    m = load_script("bench_tables")
    report = {**REPORT, "machine": {**REPORT["machine"], "cpu_generation": "Zen 5"}}
    assert m.host(report).startswith("X (Zen 5), 2 cores")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from common import cpu_generation

    def cpuinfo(vendor, family, model):
        return f"processor\t: 0\nvendor_id\t: {vendor}\ncpu family\t: {family}\nmodel\t\t: {model}\n\nprocessor\t: 1\n"

    assert cpu_generation(cpuinfo("AuthenticAMD", 25, 17)) == "Zen 4"
    assert cpu_generation(cpuinfo("AuthenticAMD", 25, 1)) == "Zen 3"
    assert cpu_generation(cpuinfo("AuthenticAMD", 26, 2)) == "Zen 5"
    assert cpu_generation(cpuinfo("GenuineIntel", 6, 143)) is None
    assert cpu_generation("") is None


def test_a_view_computes_its_cells_from_the_report_and_nothing_else():
    m = load_script("bench_tables")
    record = {"name": "t", "title": "t", "peers": "p", "report": REPORT, "columns": ["engine", "tok/s", "ratio"],
              "rows": [{"each": ["{engine}", "**{decode_tok_s:.1f}**", "{decode_tok_s / r['llama.cpp'].decode_tok_s:.2f}x"],
                        "keys": ["tokenmill"]},
                       ["{{literal}}", "{config.output_len}", "{max(1, 2) * -3}"]]}
    assert m.rows_of(record) == [["tokenmill", "**89.8**", "0.88x"], ["{literal}", "64", "-6"]]
    for bad in ("{r['vllm'].decode_tok_s}", "{__import__('os')}", "{results.__class__}", "{(lambda: 1)()}"):
        record["rows"] = [[bad, "", ""]]
        with pytest.raises(m.PublishedError):
            m.rows_of(record)
    record["rows"] = [["{engine}"]]  # a name that only an "each" row has
    with pytest.raises(m.PublishedError, match="engine"):
        m.rows_of(record)


def test_a_hand_typed_table_is_not_a_published_result(tmp_path, monkeypatch):
    m = load_script("bench_tables")
    monkeypatch.setattr(m, "PUBLISHED", tmp_path)
    (tmp_path / "typed.json").write_text(json.dumps({"name": "typed", "title": "t", "peers": "p", "columns": ["a"],
                                                     "rows": [["1"]], "report": {"results": []}}))
    with pytest.raises(m.PublishedError, match="publish what a script wrote"):
        m.load_record("typed")
    (tmp_path / "headline-x.json").write_text(json.dumps({"name": "headline-x", "title": "t", "host_class": "GPU",
                                                          "columns": ["a"], "rows": [["typed"]]}))
    with pytest.raises(m.PublishedError, match="source"):
        m.load_record("headline-x")


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
