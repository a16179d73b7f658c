"""The compiled instruction-set levels the kernel tests run."""

from __future__ import annotations

from tokenmill.layers import cpu_kernels


def kernel_test_levels() -> list[str]:
    """Every level this process executes (an AVX-512 machine checks the AVX2 code too) but
    generic, which the suite does not build, and but avx512 where avx512_vnni runs too: avx512
    is the avx2 source built for x86-64-v4 and avx512_vnni the same build with VNNI, so avx2 and
    avx512_vnni cover both of its code paths, and the suite builds one level fewer (about 40 s on
    2 cores). `TOKENMILL_CPU_ISA=avx512` runs the tests at avx512 itself."""
    levels = [isa for isa in cpu_kernels.loadable_levels() if isa != "generic"]
    if "avx512_vnni" in levels:
        levels.remove("avx512")
    return levels
