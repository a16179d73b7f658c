"""scripts/gpu_run.sh, the one command of a GPU session, rehearsed on this CPU: the dry run goes
through every stage the GPU run has (tiny shapes, Triton's interpreter) and writes the JSON the
GPU run writes; bad input (no pack, a missing or altered file, the wrong Python, no GPU) stops
it in seconds with a message naming what is missing. And what scripts/gpu_pack.py would carry."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.scripts import load_script

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "gpu_run.sh"


def gpu_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHON": sys.executable}
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


@pytest.mark.triton
def test_dry_run_goes_through_every_stage_and_writes_the_report(tmp_path):
    pytest.importorskip("triton")
    proc = gpu_run("--dry-run", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads((tmp_path / "gpu_run.json").read_text())
    stages = report["stages"]
    assert list(stages) == ["probe", "tests", "parity", "decode", "throughput", "quant_gemm", "decode_8b"]
    for name in ("probe", "tests", "parity", "decode", "throughput", "quant_gemm"):
        assert stages[name]["status"] == "ok", (name, stages[name])
        # each benchmark's own JSON carried into the one report; the tests' outcomes counted
        assert ("tests" if name == "tests" else "report") in stages[name], name
    assert stages["decode_8b"]["status"] == "skipped"
    assert report["device"] == "cpu" and report["dry_run"]
    targets = report["targets"]
    assert targets["greedy_identical_to_transformers_fp32"]["value"] == {"tiny": True}
    assert targets["tests"]["met"] and targets["tests"]["summary"]
    assert targets["offline_throughput_over_transformers"]["value"] > 0
    assert targets["decode_step_ms"]
    log = (tmp_path / "gpu_run.log").read_text()
    assert "===== parity: ok" in log


def write_pack(pack: Path, python: str, files: dict[str, bytes], listed: dict[str, bytes] | None = None) -> None:
    """A pack whose manifest lists `listed` (default: `files`) and holds `files`."""
    (pack / "wheels").mkdir(parents=True)
    for name, data in files.items():
        (pack / name).write_bytes(data)
    listed = files if listed is None else listed
    manifest = {"python": python, "packages": {},
                "files": {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in listed.items()}}
    (pack / "manifest.json").write_text(json.dumps(manifest))


THIS_PYTHON = ".".join(platform.python_version_tuple()[:2])


@pytest.mark.parametrize("case, expected", [
    ("no pack", "manifest.json is missing"),
    ("wrong python", "the wheels in"),
    ("missing wheel", "wheels/a-1.0-py3-none-any.whl is missing"),
    ("altered file", "differs from"),
    ("no gpu", "no GPU"),
])
def test_bad_input_stops_in_seconds_naming_what_is_missing(tmp_path, case, expected):
    if case == "no gpu" and torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    pack = tmp_path / "pack"
    wheel = {"wheels/a-1.0-py3-none-any.whl": b"wheel"}
    if case == "wrong python":
        write_pack(pack, "2.7", wheel)
    elif case == "missing wheel":
        write_pack(pack, THIS_PYTHON, {}, listed=wheel)
    elif case == "altered file":
        write_pack(pack, THIS_PYTHON, wheel, listed={"wheels/a-1.0-py3-none-any.whl": b"other"})
    elif case != "no pack":
        write_pack(pack, THIS_PYTHON, wheel)
    t0 = time.perf_counter()
    proc = gpu_run("--pack", str(pack), "--out", str(tmp_path / "out"), timeout=60)
    assert proc.returncode == 2
    assert expected in proc.stderr, proc.stderr
    assert time.perf_counter() - t0 < 30
    assert not (tmp_path / "out" / "gpu_run.json").exists()  # nothing ran


def test_unknown_stage_is_refused(tmp_path):
    proc = gpu_run("--dry-run", "--stages", "probe,bench", "--out", str(tmp_path), timeout=60)
    assert proc.returncode == 2 and "unknown ['bench']" in proc.stderr


def test_pack_carries_the_closure_of_what_the_image_lacks():
    """The packages scripts/gpu_pack.py downloads: the server's, the loader's, the grammar engine's
    and the tests' imports with what they need on the GPU machine's Python, at the versions
    installed here; not what the GPU image has (torch, numpy, transformers, ...)."""
    pack = load_script("gpu_pack")
    pins = pack.closure(pack.ROOTS)
    for name in ("fastapi", "starlette", "pydantic", "pydantic-core", "uvicorn", "gguf", "llguidance", "openai",
                 "jsonschema", "rpds-py"):
        assert name in pins, name
    assert not {"torch", "numpy", "transformers", "triton", "tokenizers"} & set(pins)
    from importlib.metadata import version

    assert pins["pydantic"] == version("pydantic")
