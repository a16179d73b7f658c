#!/usr/bin/env python
"""The whole GPU run in one command: `bash scripts/gpu_run.sh` (docs/gpu.md has the recipe).

On a GPU machine that reaches no network, from the checkout, with `.gpurun/` carried along
(`python scripts/gpu_pack.py` writes it here): checks what it needs in seconds (the Python the
wheels are for, every carried file, torch, Triton, a CUDA device), installs the wheels into a
folder of its own, then runs stages in order of importance, each a subprocess with a time cap,
inside one overall budget (a stage that would not fit is skipped and says so):

  probe       the GPU, its versions, its device-to-device copy bandwidth
  tests       the suite's GPU part (Triton kernels compiled, CUDA graphs, the families under Triton, ...)
  parity      greedy tokens against transformers in fp32, bf16 log-probs (benchmarks/gpu_parity.py)
  decode      Qwen2.5-1.5B shapes, bf16: decode step at batch 1, 8, 64 with and without CUDA graphs
  throughput  256 requests, 100-1024 in / out, against transformers generate; triton vs torch attention
  quant_gemm  the int8 / int4 weight-only GEMMs against bf16 (benchmarks/cuda_quant_gemm.py)
  decode_8b   Llama-3.1-8B shapes, bf16, batch 1 with CUDA graphs

Models are built there from real configurations with random weights (`--synthetic`): no model
file travels. Every figure goes to OUT/gpu_run.json (rewritten after each stage, so a run cut
short keeps what it measured) with the GPU's name, and every stage's output to OUT/gpu_run.log;
OUT is --out, else $OUT, else ./gpu-out. The targets the run is measured against are evaluated
at the end (`targets` in the JSON).

`--dry-run` rehearses the same stages on a CPU (tiny shapes, Triton's interpreter, the current
Python with what it has installed, no wheels): tests/scripts/test_gpu_run.py runs it in the suite.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")
SITE = Path(tempfile.gettempdir()) / "tokenmill-gpurun-site"
# The suite's GPU part, most telling first: the Triton kernels compiled, the engine on the Triton
# backend (CUDA graphs, padding, preemption, swaps, speculation), every family against
# transformers on the device, memory sizing, the quantized linears' CUDA paths. (Not the tests of
# the compiled CPU kernels: building them takes a minute of the budget and measures the CPU.)
GPU_TESTS = (
    "tests/layers/test_triton_attention.py", "tests/layers/test_triton_gemm.py", "tests/engine/test_triton_backend.py",
    "tests/models/test_families.py", "tests/worker", "tests/layers/test_linear.py",
)
DRY_TESTS = ("tests/worker/test_memory.py", "-k", "budget")
IMPORTS = "import tokenmill, tokenmill.entrypoints.openai.api_server, gguf, llguidance, openai, jsonschema, triton"


@dataclass
class Stage:
    name: str
    cap_s: int  # the most it may take (it is skipped when less than min_s of the budget is left)
    min_s: int
    argv: list[str]  # {json} is replaced by the stage's report path
    dry_argv: list[str] | None  # None: not rehearsed (the same code as another stage)


def stages() -> list[Stage]:
    py = "benchmarks/"
    qwen = ["--synthetic", "qwen2.5-1.5b"]
    tiny_cpu = ["--synthetic", "tiny", "--device", "cpu"]
    return [
        Stage("probe", 60, 10, ["scripts/gpu_run.py", "--probe", "{json}"], ["scripts/gpu_run.py", "--probe", "{json}"]),
        Stage("tests", 200, 60, ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-m", "not slow", *GPU_TESTS],
              ["-m", "pytest", "-v", "-p", "no:cacheprovider", *DRY_TESTS]),
        Stage("parity", 120, 40, [py + "gpu_parity.py", "--output", "{json}"],
              [py + "gpu_parity.py", *tiny_cpu[:2], "--device", "cpu", "--attention-backend", "triton",
               "--max-tokens", "3", "--num-prompts", "2", "--prompt-len", "12", "--no-bf16", "--output", "{json}"]),
        Stage("decode", 150, 60, [py + "gpu_decode.py", *qwen, "--batch-sizes", "1,8,64", "--output-len", "64",
                                  "--repeats", "2", "--output", "{json}"],
              [py + "gpu_decode.py", *tiny_cpu, "--dtype", "float32", "--attention-backend", "triton",
               "--batch-sizes", "1,2", "--prompt-len", "8", "--output-len", "3", "--repeats", "1",
               "--bandwidth-mib", "16", "--output", "{json}"]),
        Stage("throughput", 180, 90, [py + "offline_throughput.py", *qwen, "--num-requests", "256",
                                      "--input-len", "100:1024", "--output-len", "100:1024", "--hf-batch-size", "256",
                                      "--attention-backends", "triton,torch", "--output", "{json}"],
              [py + "offline_throughput.py", *tiny_cpu, "--dtype", "float32", "--num-requests", "3",
               "--input-len", "8:12", "--output-len", "2:3", "--hf-batch-size", "3", "--attention-backends", "triton",
               "--output", "{json}"]),
        Stage("quant_gemm", 90, 30, [py + "cuda_quant_gemm.py", "--output", "{json}"],
              [py + "cuda_quant_gemm.py", "--dry-run", "--output", "{json}"]),
        Stage("decode_8b", 150, 80, [py + "gpu_decode.py", "--synthetic", "llama-3.1-8b", "--batch-sizes", "1",
                                     "--output-len", "64", "--repeats", "2", "--cuda-graphs", "--output", "{json}"],
              None),
    ]


def fail(message: str) -> None:
    print(f"gpu_run: {message}", file=sys.stderr)
    raise SystemExit(2)


# -- before anything runs: what is missing, in seconds --------------------------------------------


def preflight(pack: Path, dry_run: bool) -> dict:
    """Stops with a message naming what is missing: the pack, a carried file, the Python the
    wheels are for, torch, Triton, a CUDA device. Returns the manifest (empty in a dry run)."""
    manifest: dict = {}
    if not dry_run:
        path = pack / "manifest.json"
        if not path.is_file():
            fail(f"{path} is missing: run `python scripts/gpu_pack.py` where pip reaches the package index, and carry "
                 f"{pack.name} with the checkout")
        manifest = json.loads(path.read_text())
        running = ".".join(platform.python_version_tuple()[:2])
        if running != manifest["python"]:
            fail(f"the wheels in {pack} are for Python {manifest['python']}, this is Python {running} ({sys.executable}); "
                 "run with that Python (PYTHON=... bash scripts/gpu_run.sh) or pack for this one")
        for name, entry in manifest["files"].items():
            f = pack / name
            if not f.is_file():
                fail(f"{f} is missing (listed in {path}): carry all of {pack.name}, or pack again")
            if f.stat().st_size != entry["bytes"] or hashlib.sha256(f.read_bytes()).hexdigest() != entry["sha256"]:
                fail(f"{f} differs from {path} (size or sha256): pack again")
    try:
        import torch
    except ImportError:
        fail(f"{sys.executable} has no torch")
    try:
        import triton  # noqa: F401
    except ImportError:
        fail(f"{sys.executable} has no triton (the attention kernels need it)")
    if not dry_run and not torch.cuda.is_available():
        fail("no GPU: torch.cuda.is_available() is False (on a CPU, rehearse with --dry-run)")
    return manifest


def install(pack: Path, env: dict) -> None:
    """The carried wheels into SITE (replaced), then one import of everything the run needs."""
    if SITE.exists():
        shutil.rmtree(SITE)
    wheels = sorted(str(w) for w in (pack / "wheels").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--disable-pip-version-check", "--target", str(SITE), *wheels], check=True)
    if not TEXT_FILE.is_file() and (pack / "GPL-3").is_file():
        try:  # where the benchmarks cut their prompts from
            TEXT_FILE.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(pack / "GPL-3", TEXT_FILE)
        except OSError as exc:
            print(f"gpu_run: could not place {TEXT_FILE} ({exc}); the benchmarks that cut prompts from it will fail")
    check = subprocess.run([sys.executable, "-c", IMPORTS], env=env, capture_output=True, text=True)
    if check.returncode:
        fail(f"after installing {pack / 'wheels'}, an import failed:\n{check.stderr[-2000:]}")


# -- stages -----------------------------------------------------------------------------------------


def probe(path: Path) -> None:
    """What the figures were measured on: the GPU (or CPU), versions, copy bandwidth."""
    import torch
    import triton
    import transformers

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from common import copy_bandwidth

    info: dict = {"python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
                  "transformers": transformers.__version__, "cuda": torch.version.cuda}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info |= {"device": "cuda", "gpu": p.name, "capability": list(torch.cuda.get_device_capability(0)),
                 "multiprocessors": p.multi_processor_count, "memory_bytes": p.total_memory,
                 "copy_bandwidth": copy_bandwidth("cuda", 1 << 30)}
        smi = shutil.which("nvidia-smi")
        if smi:
            info["nvidia_smi"] = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout.strip()
    else:
        info |= {"device": "cpu", "gpu": None, "copy_bandwidth": copy_bandwidth("cpu", 16 << 20)}
    path.write_text(json.dumps(info, indent=2, default=str))


def run_stage(stage: Stage, argv: list[str], timeout: float, env: dict, report: Path, log) -> dict:
    cmd = [sys.executable, *(str(report) if a == "{json}" else a for a in argv)]
    log.write(f"\n===== {stage.name}: {' '.join(cmd)} (cap {timeout:.0f}s)\n")
    log.flush()
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, errors="replace")
        output, status, code = proc.stdout, "ok" if proc.returncode == 0 else "failed", proc.returncode
    except subprocess.TimeoutExpired as exc:
        out = exc.stdout or ""
        output, status, code = out.decode(errors="replace") if isinstance(out, bytes) else out, "timeout", None
    seconds = time.perf_counter() - t0
    log.write(output)
    log.write(f"\n===== {stage.name}: {status} in {seconds:.1f}s\n")
    log.flush()
    result: dict = {"status": status, "returncode": code, "seconds": round(seconds, 1)}
    if report.is_file():
        result["report"] = json.loads(report.read_text())
    if stage.name == "tests":
        result["tests"] = pytest_counts(output)
    if status != "ok":
        result["output_tail"] = output[-3000:]
    print(f"{stage.name}: {status} in {seconds:.1f}s", flush=True)
    return result


def pytest_counts(output: str) -> dict:
    """Outcomes from `pytest -v` lines (complete even when the run was cut short), failures by name."""
    outcomes: dict[str, list[str]] = {}
    for name, outcome in re.findall(r"^(\S+::\S+) (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)", output, re.M):
        outcomes.setdefault(outcome.lower(), []).append(name)
    counts = {k: len(v) for k, v in outcomes.items()}
    counts["failed_tests"] = outcomes.get("failed", []) + outcomes.get("error", [])
    summary = re.findall(r"^=+ (.*(?:passed|failed|error|skipped).*) =+$", output, re.M)
    counts["summary"] = summary[-1] if summary else None
    return counts


# -- targets ----------------------------------------------------------------------------------------


def targets(results: dict) -> dict:
    """Each target's figure from this run's reports, and whether it is met (None: not measured)."""
    out: dict = {}

    def decode_fraction(stage: str, name: str, goal: float) -> None:
        rows = results.get(stage, {}).get("report", {}).get("results", [])
        batch1 = [r for r in rows if r["batch_size"] == 1]
        value = max((r["fraction_of_copy_bandwidth"] for r in batch1), default=None)
        out[name] = {"value": value, "target": goal, "met": None if value is None else value >= goal}

    decode_fraction("decode", "qwen2.5-1.5b_bf16_b1_fraction_of_copy_bandwidth", 0.75)
    decode_fraction("decode_8b", "llama-3.1-8b_bf16_b1_fraction_of_copy_bandwidth", 0.8)
    rows = results.get("decode", {}).get("report", {}).get("results", [])
    steps = {(r["cuda_graphs"], r["batch_size"]): r["step_s"] for r in rows}
    out["decode_step_ms"] = {f"batch {b}, graphs {g}": s * 1000 for (g, b), s in sorted(steps.items(), key=str)}
    report = results.get("throughput", {}).get("report", {})
    ratios = report.get("ratios_output_tok_per_s_over_hf") or {}
    value = max(ratios.values(), default=None)
    out["offline_throughput_over_transformers"] = {"value": value, "by_backend": ratios, "target": 10.0,
                                                   "met": None if value is None else value >= 10.0}
    parity = results.get("parity", {}).get("report", {}).get("results", [])
    out["greedy_identical_to_transformers_fp32"] = {
        "value": {r["model"]: r["greedy_identical"] for r in parity},
        "bf16_logprob_max_abs_diff": {r["model"]: r.get("logprob_max_abs_diff_bfloat16") for r in parity},
        "met": all(r["greedy_identical"] for r in parity) if parity else None,
    }
    tests = results.get("tests", {}).get("tests", {})
    out["tests"] = {"summary": tests.get("summary"), "failed": tests.get("failed_tests"),
                    "met": None if not tests else not tests.get("failed_tests") and results["tests"]["status"] == "ok"}
    return out


# -- the run ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="The GPU run: preflight, wheels, tests, parity and benchmarks in one "
                                "command, every figure in OUT/gpu_run.json (docs/gpu.md).")
    p.add_argument("--dry-run", action="store_true",
                   help="rehearse on a CPU: tiny shapes, Triton's interpreter, this Python's packages, no wheels")
    p.add_argument("--out", type=Path, default=None, help="where the JSON and the log go (default: $OUT, else ./gpu-out)")
    p.add_argument("--pack", type=Path, default=ROOT / ".gpurun", help="what scripts/gpu_pack.py wrote")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run's time, preflight included")
    p.add_argument("--stages", default=None, help="comma-separated subset of the stages, in their order "
                   f"(default: all of {', '.join(s.name for s in stages())})")
    p.add_argument("--probe", type=Path, default=None, help=argparse.SUPPRESS)  # the probe stage's own entry
    args = p.parse_args(argv)
    if args.probe is not None:
        probe(args.probe)
        return 0
    t_start = time.perf_counter()
    known = {s.name: s for s in stages()}
    chosen = [s.strip() for s in args.stages.split(",")] if args.stages else list(known)
    unknown = [s for s in chosen if s not in known]
    if unknown:
        fail(f"--stages: unknown {unknown}; choose from {list(known)}")
    out = args.out or Path(os.environ.get("OUT") or ROOT / "gpu-out")
    out.mkdir(parents=True, exist_ok=True)

    manifest = preflight(args.pack, args.dry_run)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "TQDM_DISABLE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if args.dry_run:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
        env["TRITON_INTERPRET"] = "1"
    else:
        env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT)])
        env["TOKENMILL_TEST_TOKENIZER"] = str(args.pack / "tokenizer")
        t0 = time.perf_counter()
        install(args.pack, env)
        print(f"installed {len(manifest['packages'])} wheels in {time.perf_counter() - t0:.1f}s", flush=True)

    results: dict = {}
    summary = {"dry_run": args.dry_run, "budget_s": args.budget_s, "packages": manifest.get("packages"),
               "stages": results}
    json_path = out / "gpu_run.json"
    with tempfile.TemporaryDirectory() as tmp, (out / "gpu_run.log").open("w") as log:
        for stage in (known[name] for name in chosen):
            argv = stage.dry_argv if args.dry_run else stage.argv
            left = args.budget_s - (time.perf_counter() - t_start)
            if argv is None:
                results[stage.name] = {"status": "skipped", "reason": "not rehearsed in a dry run"}
            elif left < stage.min_s:
                results[stage.name] = {"status": "skipped", "reason": f"{left:.0f}s of the budget left, needs {stage.min_s}s"}
                print(f"{stage.name}: skipped ({results[stage.name]['reason']})", flush=True)
            else:
                results[stage.name] = run_stage(stage, argv, min(stage.cap_s, left), env, Path(tmp) / f"{stage.name}.json", log)
            probe_report = results.get("probe", {}).get("report", {})
            summary |= {"gpu": probe_report.get("gpu"), "device": probe_report.get("device"),
                        "seconds": round(time.perf_counter() - t_start, 1),
                        "targets": targets(results)}
            if args.dry_run:  # the same evaluation, over figures no target applies to
                summary["note"] = "dry run: tiny shapes on a CPU in Triton's interpreter; the targets need a GPU run"
            json_path.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    failed = [name for name, r in results.items() if r["status"] in ("failed", "timeout")]
    print(f"wrote {json_path} ({summary['seconds']:.0f}s); "
          + (f"stages not ok: {', '.join(failed)}" if failed else "every stage that ran is ok"))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
