"""tokenmill's own CPU kernels (`tokenmill/csrc/`), compiled with `torch.utils.cpp_extension`
(g++ and ninja; -O3 -ffast-math -fopenmp and the flags of an instruction-set level,
cpu_isa.py), one build per level (`tokenmill_cpu_kernels_<level>`, about 35 s on 2 cores;
the Python module is csrc/cpu_bindings.cpp). No build runs on a CPU without its instructions.

- Prebuilt at install: `tokenmill build-kernels` (which `make setup` runs, and a non-isolated
  `pip install .` / `pip wheel .` through setup.py) compiles the host's level into the package's
  `_kernels/` folder beside a fingerprint of what it was built from (the sources, the compiler
  flags, torch's and Python's versions). `load()` imports such a module directly, without a
  compiler, when its fingerprint matches.
- Otherwise compiled at first use and cached by torch under ~/.cache/torch_extensions
  (`TORCH_EXTENSIONS_DIR`), so every later process reuses it.

- `paged_decode_attention`: decode attention read in place from the paged KV cache through the
  block tables (the PyTorch path gathers every sequence's blocks, then runs SDPA).
- `rms_norm`: one pass per row instead of the ~8 ops of `F.rms_norm` on CPU; `add_rms_norm`:
  the residual add before it in the same pass.
- `rope_write_kv`: RoPE of q and k and the store of k and v in the paged cache, one call.
- `int8_linear`, `int8_gemm`, `int4_linear` (csrc/cpu_gemv.cpp): quantized matmuls of few rows,
  of many, and (int4) of any number (`gemv_supported()`: avx2 and up). At avx512_bf16 they take
  bf16 activations (vdpbf16ps, csrc/cpu_gemv.cpp); at avx2 to avx512_vnni fp32 activations
  quantized to int8 per block of 32 (vpmaddubsw, vpdpbusd at avx512_vnni: `integer_dot()`;
  int8_gemm: weights widened to fp32 panels; csrc/cpu_gemv_avx2.cpp). `bf16_linear`: bf16 weights at 1-3 rows
  (`native_bf16()`: avx512_bf16 only).
- `paged_prefill_attention` (csrc/cpu_prefill.cpp): causal flash attention of a step's prefill
  chunks over the paged cache, for the query dtypes `prefill_attention_dtypes()` lists: float32
  (an fp32 or int8 cache; AVX2 + FMA, every level from avx2 up) and bfloat16 (a bf16 or int8
  cache; avx512_bf16).
- `DecoderStack` (csrc/cpu_decoder.cpp): a model's decoder layers for a step (decode-only, or
  with prefill chunks the prefill kernel takes) in one call, the same ops as the Python layers without the
  interpreter between them (`models.base.CausalLM.enable_cpu_decoder`).
- `sample_rows` (csrc/cpu_sampler.cpp): one sampled token per row of fp32 logits (temperature,
  min-p, Gumbel-max with noise hashed from a per-row key) in one pass; plain C++, every level.
- `isa()`: the level the module was built for.

`load()` returns the module, or None when it cannot be built here (no compiler, no ninja); then
`build_error()` says why and callers use their PyTorch path.

Builds are serialized by an advisory lock (`flock`) on a file in the build folder, which the
kernel releases when its holder dies. torch's own build lock is a bare file that a build killed
midway leaves behind, and every later `cpp_extension.load` of that extension would wait on it
forever; holding the advisory lock proves no live process is building, so `load()` removes such a
leftover before it builds.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import importlib.machinery
import importlib.util
import logging
import os
import platform
import shutil
import sys
import time
from pathlib import Path

from tokenmill import cpu_isa

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "cpu_bindings.cpp", CSRC / "cpu_kernels.cpp", CSRC / "cpu_decoder.cpp", CSRC / "cpu_gemv.cpp",
           CSRC / "cpu_gemv_avx2.cpp", CSRC / "cpu_prefill.cpp", CSRC / "cpu_sampler.cpp"]
HEADERS = [CSRC / "cpu_common.h", CSRC / "cpu_kernels.h"]
PREBUILT = Path(__file__).resolve().parent.parent / "_kernels"
_errors: dict[str, str] = {}


def build_name(isa: str) -> str:
    """The extension's name (and torch_extensions folder) for a level: one build per level."""
    return f"tokenmill_cpu_kernels_{isa}"


def load(isa: str | None = None):
    """The module built for `isa` (default: the host's, cpu_isa.host_isa()), or None (see
    build_error). A level this CPU does not execute is refused (ValueError), never loaded."""
    isa = isa or cpu_isa.host_isa()
    cpu_isa.check_isa("isa", isa)
    return _load(isa)


@functools.cache
def _load(isa: str):
    if not cpu_isa.runs_here(isa):
        raise ValueError(f"isa: this CPU ({cpu_isa.detected_isa()}) cannot execute {isa} code")
    t0 = time.perf_counter()
    module = _load_prebuilt(isa)
    if module is not None:
        logger.info("CPU kernels: %s, prebuilt (ready in %.1fs)", isa, time.perf_counter() - t0)
        return module
    try:
        with _build_lock(build_directory(isa)):
            module = _compile(isa, build_directory(isa))
        logger.info("CPU kernels: %s (ready in %.1fs)", isa, time.perf_counter() - t0)
        return module
    except Exception as e:  # a missing compiler or ninja surfaces as several exception types
        _errors[isa] = _reason(e)
        logger.warning("tokenmill CPU kernels (%s) unavailable (%s); using the PyTorch ops instead (%s)",
                       isa, _errors[isa], NEEDS)
        return None


# What building the kernels takes, for the messages of a failed build.
NEEDS = "building them needs a C++ compiler (g++) and ninja: apt-get install g++, pip install ninja"


def _reason(e: Exception) -> str:
    lines = str(e).strip().splitlines() or [""]
    return f"{type(e).__name__}: " + next((line for line in lines if "error:" in line), lines[-1])


def _compile(isa: str, folder: Path):
    """Build (or reuse torch's up-to-date build of) `isa`'s module in `folder` and import it."""
    from torch.utils import cpp_extension

    if shutil.which("ninja") is None:  # the pip package's (a dependency), outside PATH in an unactivated venv
        with contextlib.suppress(ImportError):
            import ninja

            os.environ["PATH"] = f"{ninja.BIN_DIR}{os.pathsep}{os.environ.get('PATH', '')}"

    module = cpp_extension.load(
        name=build_name(isa),
        sources=[str(p) for p in SOURCES],
        extra_cflags=_cflags(isa),
        extra_ldflags=["-fopenmp", "-lm"],
        build_directory=str(folder),
        verbose=False,
    )
    assert module.isa() == isa, (module.isa(), isa)
    return module


def _cflags(isa: str) -> list[str]:
    return ["-O3", "-ffast-math", "-fopenmp", *cpu_isa.compile_flags(isa), f"-DTOKENMILL_ISA_NAME={isa}"]


def fingerprint(isa: str) -> str:
    """What a build of `isa` is made from: the sources and headers, the compiler flags, torch's
    and Python's versions and the machine type (a prebuilt module is used only where it matches)."""
    import torch

    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    digest.update(" ".join(_cflags(isa)).encode())
    digest.update(f"{torch.__version__} {sys.version_info[:2]} {platform.machine()}".encode())
    return digest.hexdigest()


def prebuilt_path(isa: str, folder: Path | None = None) -> Path:
    """Where `build_prebuilt` puts `isa`'s module (and its fingerprint, with suffix .sha256) in
    `folder` (default: the package's PREBUILT folder)."""
    return (folder or PREBUILT) / f"{build_name(isa)}.so"


def _load_prebuilt(isa: str):
    """The prebuilt module of `isa` when one is there and its fingerprint matches, else None."""
    path = prebuilt_path(isa)
    stamp = path.with_suffix(".sha256")
    if not path.is_file() or not stamp.is_file():
        return None
    if stamp.read_text().strip() != fingerprint(isa):
        logger.info("CPU kernels: the prebuilt %s module is from other sources or versions; building instead", isa)
        return None
    import torch  # noqa: F401 - the module links against torch's libraries, loaded by importing it

    spec = importlib.util.spec_from_file_location(build_name(isa), path,
                                                  loader=importlib.machinery.ExtensionFileLoader(build_name(isa), str(path)))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.isa() == isa, (module.isa(), isa)
    return module


def build_prebuilt(isa: str | None = None, folder: Path | None = None) -> Path:
    """Compile `isa`'s module (default: the host's level) into `folder` with its fingerprint,
    for `load()` to import without a compiler; returns the module's path. Raises RuntimeError
    naming what to install when it cannot be built."""
    isa = isa or cpu_isa.host_isa()
    cpu_isa.check_isa("isa", isa)
    if isa == "generic":
        raise RuntimeError("the generic level has no compiled kernels")
    folder = folder or PREBUILT
    folder.mkdir(parents=True, exist_ok=True)
    # (built in torch's cache folder, as at first use: a later compile of this level finds it current)
    with _build_lock(build_directory(isa)):
        try:
            module = _compile(isa, build_directory(isa))
        except Exception as e:  # noqa: BLE001 - reported with what to install
            raise RuntimeError(f"the CPU kernels ({isa}) could not be built ({_reason(e)}); {NEEDS}") from e
        target = prebuilt_path(isa, folder)
        shutil.copyfile(module.__file__, target.with_suffix(".so.tmp"))
        target.with_suffix(".so.tmp").replace(target)
    target.with_suffix(".sha256").write_text(fingerprint(isa) + "\n")
    return target


def build_directory(isa: str) -> Path:
    """The folder torch builds and caches `isa`'s extension in (created if missing)."""
    from torch.utils import cpp_extension

    return Path(cpp_extension._get_build_directory(build_name(isa), verbose=False))


@contextlib.contextmanager
def _build_lock(folder: Path):
    """Hold the folder's advisory lock (waiting while another live process builds), and drop a
    torch build lock (`lock`) that a killed build left: while the advisory lock is held, no
    tokenmill process is inside torch's build, so that file has no owner."""
    with open(folder / "tokenmill.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            stale = folder / "lock"
            if stale.exists():
                logger.warning("removing %s, left by a kernel build that did not finish", stale)
                stale.unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def build_error(isa: str | None = None) -> str | None:
    """Why load(isa) returned None (None if it has not failed)."""
    return _errors.get(isa or cpu_isa.host_isa())


def loadable_levels() -> list[str]:
    """Every level this process runs (the CPU's, capped by TOKENMILL_CPU_ISA), lowest first: the
    kernel tests run each."""
    top = cpu_isa.ISA_LEVELS.index(cpu_isa.host_isa())
    return list(cpu_isa.ISA_LEVELS[: top + 1])
