#!/usr/bin/env python
"""Prepare what travels to a GPU machine for `scripts/gpu_run.sh`: the folder `.gpurun/` (git-ignored).

The GPU machine has Python 3.12 with PyTorch, Triton, transformers and the usual scientific stack,
but no network and not the packages below; the working tree it receives is capped at 64 MiB. So:

- `wheels/`: every package tokenmill and its GPU tests import that the GPU image lacks, with
  what those need in turn, as wheels for CPython 3.12 on manylinux x86-64, at the versions
  installed here (both machines then run the same code);
- `tokenizer/`: the default model's tokenizer (a few MB, read from the default model here), which
  the tests' tiny models use; no model file travels, the run builds its checkpoints there;
- `GPL-3`: the text the benchmarks cut prompts from, for a machine without it;
- `manifest.json`: each file with its size and sha256, the Python the wheels are for, and the total.

    python scripts/gpu_pack.py            # writes .gpurun/, prints its size; refuses more than --max-mib

Then, with the device tool: `carry: [".gpurun"]`, command `bash scripts/gpu_run.sh` (docs/gpu.md).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_DIR = ROOT / ".gpurun"
TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")
MIB = 1 << 20
PYTHON_VERSION = "3.12"  # the GPU image's
# Requirement markers are evaluated for that machine (an optional extra is never asked for).
TARGET_ENV = {"python_version": PYTHON_VERSION, "python_full_version": f"{PYTHON_VERSION}.3", "sys_platform": "linux",
              "platform_system": "Linux", "platform_machine": "x86_64", "platform_python_implementation": "CPython",
              "implementation_name": "cpython", "os_name": "posix", "extra": ""}
# Its glibc is 2.39 (Ubuntu 24.04 under Python 3.12.3): pip matches each manylinux tag exactly.
PLATFORMS = tuple(f"manylinux_2_{n}_x86_64" for n in range(39, 16, -1)) + ("manylinux2014_x86_64", "manylinux1_x86_64")
# What tokenmill, its server and its GPU tests import beyond the GPU image; their dependencies are
# added by walking the installed metadata.
ROOTS = ("gguf", "fastapi", "uvicorn", "pydantic", "llguidance", "openai", "jsonschema")
# On the GPU image already (the device notes' package list), at versions these roots accept: not
# carried. Everything else in the closure travels, so a stale copy there cannot break an import.
ON_IMAGE = {
    "torch", "numpy", "triton", "transformers", "tokenizers", "safetensors", "huggingface-hub", "hf-xet", "jinja2",
    "markupsafe", "psutil", "httpx", "httpcore", "h11", "idna", "certifi", "click", "pyyaml", "tqdm", "attrs",
    "prometheus-client", "filelock", "fsspec", "packaging", "regex", "requests", "urllib3", "charset-normalizer",
    "sympy", "networkx", "mpmath", "setuptools", "sniffio", "colorama", "sentencepiece",
}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(roots: tuple[str, ...]) -> dict[str, str]:
    """{distribution: installed version} for the roots and their non-optional requirements,
    less what the GPU image has."""
    found: dict[str, str] = {}
    todo = list(roots)
    while todo:
        name = canonical(todo.pop())
        if name in found or name in ON_IMAGE:
            continue
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            raise SystemExit(f"gpu_pack: {name} is not installed here (run `make setup` first)") from None
        found[name] = dist.version
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(TARGET_ENV):
                todo.append(req.name)
    return found


def download_wheels(pins: dict[str, str], dest: Path) -> None:
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check", "--no-deps",
           "--only-binary=:all:", "--python-version", PYTHON_VERSION, "--implementation", "cp", "-d", str(dest)]
    for platform in PLATFORMS:
        cmd += ["--platform", platform]
    subprocess.run(cmd + [f"{n}=={v}" for n, v in sorted(pins.items())], check=True)


def save_tokenizer(dest: Path) -> None:
    from tokenmill.models.loader import load_checkpoint
    from tokenmill.models.registry import DEFAULT_MODEL, resolve_model

    load_checkpoint(resolve_model(DEFAULT_MODEL)).tokenizer.save_pretrained(str(dest))


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Write .gpurun/ (wheels, tokenizer, text, manifest) for scripts/gpu_run.sh.")
    p.add_argument("--dir", type=Path, default=DEFAULT_DIR, help="the folder to write (replaced)")
    p.add_argument("--max-mib", type=float, default=40.0, help="refuse a folder larger than this")
    args = p.parse_args(argv)

    if args.dir.exists():
        shutil.rmtree(args.dir)
    wheels = args.dir / "wheels"
    wheels.mkdir(parents=True)
    pins = closure(ROOTS)
    print(f"wheels for CPython {PYTHON_VERSION}: {', '.join(f'{n}=={v}' for n, v in sorted(pins.items()))}", flush=True)
    download_wheels(pins, wheels)
    save_tokenizer(args.dir / "tokenizer")
    if TEXT_FILE.is_file():
        shutil.copy(TEXT_FILE, args.dir / "GPL-3")
    files = sorted(f for f in args.dir.rglob("*") if f.is_file())
    total = sum(f.stat().st_size for f in files)
    manifest = {
        "python": PYTHON_VERSION,
        "packages": pins,
        "files": {str(f.relative_to(args.dir)): {"bytes": f.stat().st_size, "sha256": sha256(f)} for f in files},
        "total_bytes": total,
    }
    (args.dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"{args.dir}: {len(files)} files, {total / MIB:.1f} MiB ({len(pins)} wheels)")
    if total > args.max_mib * MIB:
        print(f"gpu_pack: {total / MIB:.1f} MiB is over --max-mib {args.max_mib}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
