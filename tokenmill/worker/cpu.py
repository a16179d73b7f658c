"""Process-wide CPU settings for the model's host process."""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import mmap

import torch
from torch import nn

logger = logging.getLogger(__name__)

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_done = False


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, or None where it cannot be opened."""
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


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
    libc = _libc()
    try:
        ok = (libc is not None and libc.mallopt(_M_MMAP_THRESHOLD, threshold_bytes) == 1
              and libc.mallopt(_M_TRIM_THRESHOLD, 2 * threshold_bytes) == 1)
    except AttributeError:  # a C library without mallopt (not glibc)
        ok = False
    if not ok:
        logger.debug("mallopt unavailable (libc %s): leaving the allocator as it is", libc)
    _done = ok
    return ok


HUGE_PAGE = 2 << 20  # a transparent huge page on x86-64 and most aarch64 kernels
_ALIGN = 64  # each storage starts on a cache line
_TRIM_EVERY = 128 << 20  # bytes moved between returns of the freed heap to the OS


def gather_weights(model: nn.Module, skip: tuple[type[nn.Module], ...] = ()) -> int:
    """Move the CPU tensors a model's modules hold (parameters, buffers and the plain tensor
    attributes the linears keep for their kernels) into one buffer, in the order the modules were
    registered, which is the order a step reads them; returns the bytes moved.

    A decode step streams every weight once from memory. Loaded one by one, the weights land
    wherever the heap has room (`keep_large_allocations_in_heap` keeps them out of their own
    mappings), between the loader's temporaries; back to back in a 2 MiB-aligned mapping advised
    for transparent huge pages (`madvise(MADV_HUGEPAGE)`, where the OS has it) the stream crosses
    fewer pages and the prefetchers lose less at each tensor's end. Tensors that share a storage
    (views, tied weights) still share one after the move. The modules of `skip` (the embedding
    tables, of which a step reads a row per token) keep theirs, as does any tensor that shares
    a storage with them, and so do tensors without a plain storage (oneDNN's opaque layouts).
    Each old storage is freed as soon as its tensors point at the new buffer, and the freed heap
    goes back to the OS every 128 MiB moved (`malloc_trim`), so the resident peak is the weights
    plus about that."""
    skipped = {_storage_key(t) for m in model.modules() if isinstance(m, skip) for _, t in held_tensors(m)}
    groups: dict[int, list[tuple[nn.Module, str, torch.Tensor]]] = {}  # storage -> its tensors, in module order
    for module in model.modules():
        if not isinstance(module, skip):
            for name, t in held_tensors(module):
                key = _storage_key(t)
                if key is not None and key not in skipped and t.device.type == "cpu":
                    groups.setdefault(key, []).append((module, name, t))
    sizes = [(group[0][2].untyped_storage().nbytes() + _ALIGN - 1) // _ALIGN * _ALIGN for group in groups.values()]
    if not sizes:
        return 0
    arena = _huge_page_buffer(sum(sizes))
    offset = 0
    for group, size in zip(list(groups.values()), sizes):
        old = group[0][2].untyped_storage()
        arena[offset:offset + old.nbytes()].copy_(torch.empty(0, dtype=torch.uint8).set_(old))
        for module, name, tensor in group:
            moved = torch.empty(0, dtype=tensor.dtype).set_(
                arena.untyped_storage(), (arena.storage_offset() + offset) // tensor.element_size() + tensor.storage_offset(),
                tensor.size(), tensor.stride())
            if isinstance(tensor, nn.Parameter):
                tensor.data = moved
            else:
                setattr(module, name, moved)
        offset += size
        del old, tensor, group[:]  # the last references this function holds to the old storage
        if offset // _TRIM_EVERY != (offset - size) // _TRIM_EVERY:
            _release_free_heap()
    _release_free_heap()
    return offset


def held_tensors(module: nn.Module):
    """(attribute, tensor) for each tensor a module holds itself (not its children's):
    parameters, buffers and plain tensor attributes."""
    for items in (module._parameters.items(), module._buffers.items(), vars(module).items()):
        for name, t in items:
            if isinstance(t, torch.Tensor):
                yield name, t


def _storage_key(t: torch.Tensor) -> int | None:
    """Where t's storage starts; None for an empty one or a tensor without a plain storage."""
    if t.layout != torch.strided or t.is_mkldnn:
        return None
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def _huge_page_buffer(num_bytes: int) -> torch.Tensor:
    """num_bytes of fresh memory as a uint8 tensor starting on a 2 MiB boundary, advised for
    transparent huge pages; plain torch memory where anonymous mappings or the advice are
    missing."""
    span = (num_bytes + HUGE_PAGE - 1) // HUGE_PAGE * HUGE_PAGE
    try:
        mapping = mmap.mmap(-1, span + HUGE_PAGE)
    except (OSError, ValueError):
        return torch.empty(num_bytes, dtype=torch.uint8)
    whole = torch.frombuffer(mapping, dtype=torch.uint8)  # holds the mapping while any view lives
    start = -whole.data_ptr() % HUGE_PAGE
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is not None:
        try:
            mapping.madvise(advice, start, span)
        except OSError as e:  # a kernel built without transparent huge pages
            logger.debug("madvise(MADV_HUGEPAGE) failed: %s", e)
    return whole[start:start + num_bytes]


def _release_free_heap() -> None:
    """Hand the heap's free pages back to the OS (`malloc_trim`): the weights' old homes, which
    `keep_large_allocations_in_heap` would otherwise keep as resident memory. A no-op where glibc
    is not the allocator."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:  # a C library without malloc_trim (not glibc)
        pass
