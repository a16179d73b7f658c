"""Process-wide CPU settings for the model's host process."""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


def keep_large_allocations_in_heap(threshold_bytes: int = 1 << 30) -> bool:
    """Stop glibc from serving every large tensor with a fresh mmap.

    By default glibc maps allocations above 32 MiB (less before its threshold adapts) straight
    from the kernel and unmaps them on free, so each step's activations and gathered KV are
    page-faulted in anew: a 4x slowdown of the decode gather at 64 sequences in fp32.
    Raising the mmap and trim thresholds keeps freed memory in the
    heap for reuse; the price is that the process holds on to its peak working set, which a
    server does anyway. A no-op where glibc is not the allocator."""
    global _done
    if _done:
        return True
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1 and libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1
    except (OSError, AttributeError):
        ok = False
    if not ok:
        logger.debug("mallopt unavailable (libc %s): leaving the allocator as it is", name)
    _done = ok
    return ok
