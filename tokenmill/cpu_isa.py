"""The CPU instruction-set levels tokenmill's compiled kernels are built for, and which one this
host runs.

Each level is one build of the kernels (layers/cpu_kernels.py), compiled with flags that name
the level, never `-march=native`, so a build cached in a home directory or image shared between
machines only ever loads on a CPU that has its instructions:

- `generic`: no SIMD intrinsics (any CPU, aarch64 included); the compiler's own vectorization.
- `avx2`: x86-64-v3 (AVX2, FMA, F16C; AMD Zen 2/3, most Intel desktops and laptops): int8/int4
  weights times int8-quantized activations (`vpmaddubsw`), fp32 activations, fp32 decode and
  prefill attention (FMA).
- `avx512`: x86-64-v4 (AVX-512 F/BW/DQ/VL without bf16 dot products; Intel Skylake-SP): the
  avx2 kernels, with the compiler free to use AVX-512 around them.
- `avx512_vnni`: x86-64-v4 plus AVX-512 VNNI (Intel Cascade Lake, Ice Lake, Tiger Lake): the
  avx2 kernels with `vpdpbusd` (4 byte products added to int32 in one instruction) in place of
  `vpmaddubsw` + `vpmaddwd`: the same integer sums, fewer instructions where the matmuls are
  compute-bound (prefill, batched decode); and oneDNN's int8 matmul is exact.
- `avx512_bf16`: the above plus AVX-512 BF16 (`vdpbf16ps`; Zen 4/5, Cooper Lake, Sapphire
  Rapids): bf16 activations, the bf16 matmul and bf16 prefill attention kernels.

The host's level is read from /proc/cpuinfo once. `TOKENMILL_CPU_ISA` caps it for the whole
process (as `ONEDNN_MAX_CPU_ISA` caps oneDNN), so an AVX-512 machine runs and measures the AVX2
code exactly as an AVX2-only machine would; `EngineConfig.cpu_isa` picks a level per engine.

A leaf of the package graph (the standard library only), so that config can resolve the level.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

ISA_LEVELS = ("generic", "avx2", "avx512", "avx512_vnni", "avx512_bf16")  # lowest first
ISA_ENV = "TOKENMILL_CPU_ISA"

# /proc/cpuinfo flags each x86 level needs (each level needs the ones below it too).
_LEVEL_FLAGS = {
    "avx2": {"avx2", "fma", "f16c", "bmi2"},
    "avx512": {"avx512f", "avx512bw", "avx512dq", "avx512vl"},
    "avx512_vnni": {"avx512_vnni"},
    "avx512_bf16": {"avx512_bf16"},
}
# Compiler flags per level (g++). -march is the level's, so the build runs on every CPU of the
# level; -mtune=native only schedules (and picks vector widths) for the machine that builds it,
# as -march=native would: tuning changes which reductions vectorize, and with them the
# last bits of bf16 results.
_LEVEL_CFLAGS = {
    "generic": [],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avx512_vnni": ["-march=x86-64-v4", "-mavx512vnni", "-mtune=native"],
    "avx512_bf16": ["-march=x86-64-v4", "-mavx512vnni", "-mavx512bf16", "-mtune=native"],
}


def _cpu_flags() -> set[str]:
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        return set()
    for line in cpuinfo.read_text().splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


@functools.cache
def detected_isa() -> str:
    """The highest level this CPU executes, from its flags (generic off x86-64)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return "generic"
    flags, level, needed = _cpu_flags(), "generic", set()
    for name in ISA_LEVELS[1:]:
        needed |= _LEVEL_FLAGS[name]
        if not needed <= flags:
            break
        level = name
    return level


def check_isa(field: str, value: str) -> None:
    """Raise ValueError naming `field` unless `value` is a level."""
    if value not in ISA_LEVELS:
        raise ValueError(f"{field}: must be one of {', '.join(ISA_LEVELS)}, got {value!r}")


def host_isa() -> str:
    """The level this process runs: the CPU's, capped by TOKENMILL_CPU_ISA when it is set."""
    detected = detected_isa()
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return detected
    check_isa(ISA_ENV, forced)
    return min(forced, detected, key=ISA_LEVELS.index)


def runs_here(isa: str) -> bool:
    """Whether this CPU executes `isa`'s instructions."""
    return ISA_LEVELS.index(isa) <= ISA_LEVELS.index(detected_isa())


def compile_flags(isa: str) -> list[str]:
    return list(_LEVEL_CFLAGS[isa])


def native_bf16(isa: str) -> bool:
    """Whether `isa` computes bf16 natively (dtype auto is bf16 there, fp32 below)."""
    return isa == "avx512_bf16"


def onednn_int8_exact(isa: str) -> bool:
    """Whether oneDNN's int8 x int8 matmul (`torch._int_mm` on CPU) is exact at `isa`. It needs
    VNNI (avx512_vnni and up); without it oneDNN multiplies with vpmaddubsw on codes shifted to
    unsigned, and the int16 pair sums saturate (wrong results, not a rounding)."""
    return ISA_LEVELS.index(isa) >= ISA_LEVELS.index("avx512_vnni")


def onednn_bf16(isa: str) -> bool:
    """Whether oneDNN's bf16 matmul (and weight pre-packing) runs at `isa`: it needs AVX-512
    BW/VL/DQ (or AVX-NE-CONVERT, which no level here has)."""
    return ISA_LEVELS.index(isa) >= ISA_LEVELS.index("avx512")
