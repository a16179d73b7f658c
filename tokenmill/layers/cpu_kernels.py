"""tokenmill's own CPU kernels (`tokenmill/csrc/cpu_kernels.cpp`), compiled for this machine at
first use with `torch.utils.cpp_extension` (g++ and ninja; -O3 -march=native -ffast-math -fopenmp) and cached
by torch under ~/.cache/torch_extensions (`TORCH_EXTENSIONS_DIR`), so one build (~20 s on 2
cores) serves every later process.

- `paged_decode_attention`: decode attention read in place from the paged KV cache through the
  block tables (the PyTorch path gathers every sequence's blocks, then runs SDPA).
- `rms_norm`: one pass per row instead of the ~8 ops of `F.rms_norm` on CPU; `add_rms_norm`:
  the residual add before it in the same pass.
- `rope_write_kv`: RoPE of q and k and the store of k and v in the paged cache, one call.
- `bf16_linear`, `int8_linear`, `int4_linear` (csrc/cpu_gemv.cpp): matmuls of 1-4 rows (the
  linears use them up to `layers.linear.KERNEL_MAX_ROWS`) where the CPU has AVX-512 BF16
  (`gemv_supported()`); `Int4Linear` packs its codes for `int4_linear`.
- `paged_prefill_attention` (csrc/cpu_prefill.cpp): causal flash attention of a step's bf16
  prefill chunks over the paged cache (AVX-512 BF16: `prefill_attention_supported()`).
- `DecoderStack` (csrc/cpu_decoder.cpp): a model's decoder layers for a step (decode-only, or
  with bf16 prefill chunks) in one call, the same ops as the Python layers without the
  interpreter between them (`LlamaForCausalLM.enable_cpu_decoder`).

`load()` returns the module, or None when it cannot be built here (no compiler, no ninja); then
`build_error()` says why and callers use their PyTorch path.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CSRC = Path(__file__).resolve().parent.parent / "csrc"
SOURCES = [CSRC / "cpu_kernels.cpp", CSRC / "cpu_decoder.cpp", CSRC / "cpu_gemv.cpp", CSRC / "cpu_prefill.cpp"]
_error: str | None = None


@functools.cache
def load():
    """The compiled module, or None (see build_error)."""
    global _error
    try:
        from torch.utils import cpp_extension

        t0 = time.perf_counter()
        module = cpp_extension.load(
            name="tokenmill_cpu_kernels",
            sources=[str(p) for p in SOURCES],
            extra_cflags=["-O3", "-march=native", "-ffast-math", "-fopenmp"],
            extra_ldflags=["-fopenmp", "-lm"],
            verbose=False,
        )
        logger.debug("CPU kernels ready in %.1fs", time.perf_counter() - t0)
        return module
    except Exception as e:  # a missing compiler or ninja surfaces as several exception types
        lines = str(e).strip().splitlines() or [""]
        _error = f"{type(e).__name__}: " + next((line for line in lines if "error:" in line), lines[-1])
        logger.warning("tokenmill CPU kernels unavailable (%s); using the PyTorch ops instead", _error)
        return None


def build_error() -> str | None:
    """Why load() returned None (None if it has not failed)."""
    return _error
