"""The KV cache's block copies that run before a step's forward pass: swaps between the device
cache and the host pool, and copy-on-write within the device cache.

Every cache tensor is indexed by block along dim 0 (`layers.attention.backend`), and every copy
moves whole blocks of every tensor of every layer.

Swaps go as slices: the (source, destination) pairs are sorted by their host block and cut into
runs of consecutive host blocks; a run whose device blocks are consecutive too is one slice
copy per tensor, any other run one slice copy plus a gather (out) or scatter (in) on the device.
On CUDA the host pool is pinned and the copies are non-blocking. Nothing waits for them: the
swaps, the forward pass that may overwrite a swapped-out device block, and a later swap-in that
reads a host block are queued in that order on one stream, which runs them in that order; the
host pool is never read on the CPU.

Copy-on-write pairs run in order (a copy may read a block an earlier one wrote): `resolve_copies`
turns them into one simultaneous copy, done per tensor as one gather of every source followed
by one scatter.
"""

from __future__ import annotations

import torch

from tokenmill.layers.attention.kv_quant import indexable

KVCache = tuple[torch.Tensor, ...]


def host_runs(pairs: list[tuple[int, int]], host_side: int) -> list[tuple[int, list[int]]]:
    """The pairs as runs of consecutive host blocks: (first host block, the device blocks paired
    with the run's host blocks, in order). `host_side` is the index of the host block in a pair
    (1: swap-out's (device, host) pairs; 0: swap-in's (host, device))."""
    runs: list[tuple[int, list[int]]] = []
    last = None
    for pair in sorted(pairs, key=lambda p: p[host_side]):
        host, dev = pair[host_side], pair[1 - host_side]
        assert host != last, f"host block {host} in two pairs"
        if last is not None and host == last + 1:
            runs[-1][1].append(dev)
        else:
            runs.append((host, [dev]))
        last = host
    return runs


def _block_ids(ids: list, device: torch.device) -> torch.Tensor:
    """Block ids (a list, or a list of equally long lists) as int64 on `device`, in one copy: on
    CUDA from pinned memory and without waiting for the stream."""
    cuda = device.type == "cuda"
    return torch.tensor(ids, dtype=torch.long, pin_memory=cuda).to(device, non_blocking=cuda)


def _consecutive(ids: list[int]) -> bool:
    return all(b == a + 1 for a, b in zip(ids, ids[1:]))


def swap_blocks(device_caches: list[KVCache], host_caches: list[KVCache], pairs: list[tuple[int, int]],
                out: bool) -> None:
    """Copy whole blocks between the device caches and the host pool, every layer and tensor:
    out, `pairs` are (device block, host block) and device -> host; else (host block, device
    block) and host -> device. Each device block appears in one pair at most."""
    if not pairs:
        return
    runs = host_runs(pairs, host_side=1 if out else 0)
    device = device_caches[0][0].device
    non_blocking = device.type == "cuda"
    # The device blocks of the runs that gather or scatter, uploaded at once.
    scattered = [(i, ids) for i, (_, ids) in enumerate(runs) if not _consecutive(ids)]
    index: dict[int, torch.Tensor] = {}
    if scattered:
        flat = _block_ids([b for _, ids in scattered for b in ids], device)
        start = 0
        for i, ids in scattered:
            index[i] = flat[start : start + len(ids)]
            start += len(ids)
    for device_kv, host_kv in zip(device_caches, host_caches, strict=True):
        for dev_cache, host_cache in zip(device_kv, host_kv, strict=True):
            dev_cache, host_cache = indexable(dev_cache), indexable(host_cache)
            for i, (h0, ids) in enumerate(runs):
                host = host_cache[h0 : h0 + len(ids)]
                if out:
                    src = dev_cache.index_select(0, index[i]) if i in index else dev_cache[ids[0] : ids[0] + len(ids)]
                    host.copy_(src, non_blocking=non_blocking)
                elif i in index:
                    dev_cache.index_copy_(0, index[i], host.to(device, non_blocking=non_blocking))
                else:
                    dev_cache[ids[0] : ids[0] + len(ids)].copy_(host, non_blocking=non_blocking)


def resolve_copies(pairs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """(src, dst) block copies meant to run one after another, as copies that may all run at
    once: each block written, paired with the block whose content before any of the copies it
    ends up holding. A block that ends up holding its own content is left out."""
    holds: dict[int, int] = {}  # block -> the block whose original content it holds now
    for src, dst in pairs:
        holds[dst] = holds.get(src, src)
    return [(src, dst) for dst, src in holds.items() if src != dst]


def copy_blocks(caches: list[KVCache], pairs: list[tuple[int, int]]) -> None:
    """Run the (src, dst) block copies in order within each cache: per tensor, one gather of
    every source then one scatter, equivalent to the sequential copies (`resolve_copies`)."""
    copies = resolve_copies(pairs)
    if not copies:
        return
    device = caches[0][0].device
    src, dst = _block_ids([[s for s, _ in copies], [d for _, d in copies]], device)
    for layer in caches:
        for cache in layer:
            cache = indexable(cache)
            cache.index_copy_(0, dst, cache.index_select(0, src))
