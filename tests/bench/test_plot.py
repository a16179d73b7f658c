"""`tokenmill bench plot` draws two result files (e.g. two servers) into one valid PNG."""

from __future__ import annotations

import json
import struct

from tokenmill.bench.benchmark import RESULT_KIND, BenchConfig
from tokenmill.bench.client import RequestResult
from tokenmill.bench.metrics import parse_slos, summarize
from tokenmill.bench.sweep import SWEEP_KIND
from tokenmill.cli import main


def _sweep(label: str, concurrencies: list[int], ttft_base: float, tpot_base: float) -> dict:
    """A sweep result whose latencies grow with load, built through the real summary code."""
    config = BenchConfig(label=label, slo="ttft_p99=1s,tpot=60ms").to_json() | {"model": "m", "api": "completions"}
    runs = []
    for c in concurrencies:
        ttft, tpot, n = ttft_base * c, tpot_base * (1 + c / 8), 64
        results = [RequestResult(index=i, success=True, ttft=ttft, e2e=ttft + tpot * (n - 1), itl=[tpot] * (n - 1),
                                 prompt_tokens=256, output_tokens=n, usage_reported=True) for i in range(8)]
        duration = 8 * (ttft + tpot * (n - 1)) / c
        runs.append({"kind": RESULT_KIND, "label": label, "load": f"concurrency {c}", "load_kind": "concurrency",
                     "load_value": c, "config": config,
                     "summary": summarize(results, duration, slos=parse_slos(config["slo"]))})
    met = [r["load_value"] for r in runs if r["summary"]["slo"]["met"]]
    return {"kind": SWEEP_KIND, "label": label, "load_kind": "concurrency", "loads": concurrencies,
            "config": config, "best_load_meeting_slos": max(met) if met else None, "runs": runs}


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n", "not a PNG signature"
    length, chunk = struct.unpack(">I4s", data[8:16])
    assert chunk == b"IHDR" and length == 13
    return struct.unpack(">II", data[16:24])


def test_plot_two_result_files(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_sweep("server A", [1, 2, 4, 8], 0.1, 0.03)))
    b.write_text(json.dumps(_sweep("server B", [1, 2, 4, 8], 0.2, 0.05)))
    png = tmp_path / "out" / "frontier.png"
    assert main(["bench", "plot", str(a), str(b), "-o", str(png), "--title", "A vs B"]) == 0
    assert str(png) in capsys.readouterr().out
    data = png.read_bytes()
    width, height = _png_size(data)
    assert 800 <= width <= 3000 and 300 <= height <= 2000
    assert 20_000 < len(data) < 2_000_000  # two panels with lines, markers and labels, not an empty canvas
    assert data.endswith(b"IEND\xaeB`\x82")


def test_plot_rejects_a_file_that_is_not_a_result(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"hello": 1}')
    assert main(["bench", "plot", str(bad), "-o", str(tmp_path / "x.png")]) == 2
    assert "not a `tokenmill bench serve` or `sweep` result" in capsys.readouterr().err


def test_plot_labels_must_match_the_files(tmp_path, capsys):
    a = tmp_path / "a.json"
    a.write_text(json.dumps(_sweep("A", [1, 2], 0.1, 0.03)))
    assert main(["bench", "plot", str(a), "--labels", "x,y", "-o", str(tmp_path / "x.png")]) == 2
    assert "labels: 2 given for 1 result files" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
