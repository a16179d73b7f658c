"""benchmarks/multiturn_cache.py: its flags, the rows and targets it derives from the runs, and a
tiny real run (the tiered server and its restart on the default model) through to the report."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))  # the script imports its neighbour `common`
    spec = importlib.util.spec_from_file_location("multiturn_cache", BENCHMARKS / "multiturn_cache.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_flags_are_checked(script, capsys):
    args = script.parse_args(["--configs", "device,tiered", "--num-users", "3"])
    assert args.configs == ["device", "tiered"] and args.control_users == 3
    for bad in (["--configs", "restart"], ["--configs", "device,swap"], ["--replay-from", "1"],
                ["--num-rounds", "3", "--replay-from", "4"], ["--concurrency", "0"]):
        with pytest.raises(SystemExit):
            script.parse_args(bad)
    assert "restart replays on the tiered server's disk folder" in capsys.readouterr().err


def _run(hit_rate, ttft, req_per_s, first_turn=None):
    return {"requests": 8, "hit_rate": hit_rate, "ttft_mean_ms": ttft, "ttft_p90_ms": 2 * ttft,
            "req_per_s": req_per_s, **({"first_turn_ttft_mean_ms": first_turn} if first_turn else {})}


def test_rows_compare_each_config_with_its_reference_and_targets_say_which_are_met(script):
    runs = {
        "device": {"what": "m", "server": "s", "round_1": _run(0.5, 900, 1), "rounds_2_on": _run(0.5, 1000, 1.0)},
        "control-device": {"what": "c", "server": "s", **_run(0.0, 500, 2.0)},
        "tiered": {"what": "m", "server": "s", "round_1": _run(0.5, 900, 1), "rounds_2_on": _run(0.85, 300, 2.5)},
        "control-tiered": {"what": "c", "server": "s", **_run(0.0, 520, 1.9)},
        "restart": {"what": "r", "server": "s", **_run(0.9, 400, 2.0, first_turn=100)},
        "cold": {"what": "r", "server": "s", **_run(0.4, 2000, 0.5, first_turn=2000)},
    }
    rows = {r["config"]: r for r in script.rows(runs)}
    assert rows["device"]["ref"] is None and rows["device"]["ttft_vs_ref"] is None
    assert rows["tiered"]["ref"] == "device" and rows["tiered"]["ttft_vs_ref"] == pytest.approx(0.3)
    assert rows["tiered"]["req_per_s_vs_ref"] == pytest.approx(2.5) and rows["tiered"]["hit_rate"] == 0.85
    assert rows["control-tiered"]["req_per_s_vs_ref"] == pytest.approx(0.95)
    # restart against cold: first turns only (cold sends no later rounds)
    assert rows["restart"]["ttft_vs_ref"] == pytest.approx(0.05) and rows["restart"]["req_per_s_vs_ref"] is None
    met = {t["target"]: t["met"] for t in script.targets(runs)}
    assert met == {
        "prefix hit rate, rounds >= 2 (tiered)": True,
        "mean TTFT change, rounds >= 2, tiered vs device": True,
        "requests/s, rounds >= 2, tiered / device": True,
        "first-turn TTFT after a restart, cold / restart": True,
        "no-reuse control requests/s, tiered vs device": False,  # -5 %
    }


@pytest.mark.slow
def test_a_tiny_run_of_the_tiered_server_and_its_restart_writes_the_report(tmp_path):
    out = tmp_path / "multiturn_cache.json"
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "multiturn_cache.py"), "--configs", "tiered,restart", "--num-users", "4",
         "--num-rounds", "3", "--system-prompt-len", "64", "--history-len", "48", "--output-len", "2",
         "--concurrency", "1", "--replay-from", "2", "--host-cache-gb", "0.05",
         "--disk-cache-gb", "0.1", "--output", str(out)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["benchmark"] == "multiturn_cache" and report["config"]["working_set_over_pool"] > 2
    rows = {r["config"]: r for r in report["results"]}
    assert set(rows) == {"tiered", "restart"}
    assert rows["tiered"]["requests"] == 8 and rows["restart"]["requests"] == 8
    # the working set outgrew the pool, so later rounds came back from the host tier
    assert report["runs"]["tiered"]["rounds_2_on"]["cache_counters"]["promotions_total"] > 0
    # the restarted server found the earlier rounds' blocks on disk
    restart = report["runs"]["restart"]["cache_counters"]
    assert restart["disk_read_blocks_total"] > 0 and restart["disk_corrupt_blocks_total"] == 0
    assert rows["restart"]["hit_rate"] > rows["tiered"]["hit_rate"] * 0.9
