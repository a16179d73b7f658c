"""All-reduce through shared memory, for the tensor-parallel ranks of one CPU machine.

gloo sums a few-KB tensor over loopback TCP in about a millisecond here, and a tensor-parallel
decode step has two all-reduces per layer. Ranks on one machine can instead meet in a shared
file (in /dev/shm): each writes its tensor to its own slot, raises its sequence number, waits
until every rank's number has reached this call's, and adds the slots up in rank order, so
every rank gets the same bytes. Two sets of slots alternate between calls: a rank can only
start call k + 2 (which overwrites call k's set) after every rank has announced call k + 1,
which each does after it has finished reading call k's slots.

Ordering: x86's stores become visible in program order (slot data, then the sequence number),
and the numbers are read before the slots. A weaker memory model (aarch64) would need fences
between the two; this path is for x86 hosts.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

HEADER_BYTES = 4096  # one sequence number per rank, each on its own 64-byte line
LINE = 8  # int64s per cache line
WAIT_CHECK_SECONDS = 0.2  # how often a waiting rank checks that its peers live


def shm_dir() -> Path:
    return Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(os.environ.get("TMPDIR", "/tmp"))


class ShmAllReduce:
    """A sum over `size` ranks of one machine; rank 0 of the group creates the file at `path`
    (the others open it after a barrier). Tensors over `slot_bytes` are not taken (`all_reduce`
    returns False and the caller uses gloo). `alive()` is called while waiting and may raise."""

    def __init__(self, path: Path, rank: int, size: int, slot_bytes: int, create: bool, alive=None,
                 timeout: float = 600.0):
        self.path, self.rank, self.size = path, rank, size
        self.slot_bytes = -(-slot_bytes // 64) * 64
        total = HEADER_BYTES + 2 * size * self.slot_bytes
        if create:
            with open(path, "wb") as f:
                f.truncate(total)
        self.buf = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        self.seq = self.buf[: size * LINE * 8].view(torch.int64).numpy()[::LINE]  # [size], shared
        self.calls = int(self.seq[rank])  # 0 for a new file
        self.alive = alive or (lambda: None)
        self.timeout = timeout

    def _slot(self, parity: int, rank: int, x: torch.Tensor) -> torch.Tensor:
        start = HEADER_BYTES + (parity * self.size + rank) * self.slot_bytes
        return self.buf[start : start + x.numel() * x.element_size()].view(x.dtype).view(x.shape)

    def all_reduce(self, x: torch.Tensor) -> bool:
        """Sum `x` (contiguous) over the ranks in place; False, untouched, if it exceeds a slot."""
        if x.numel() * x.element_size() > self.slot_bytes:
            return False
        self.calls += 1
        parity = self.calls % 2
        self._slot(parity, self.rank, x).copy_(x)
        self.seq[self.rank] = self.calls
        self._wait(self.calls)
        torch.add(self._slot(parity, 0, x), self._slot(parity, 1, x), out=x)
        for r in range(2, self.size):
            x.add_(self._slot(parity, r, x))
        return True

    def _wait(self, call: int) -> None:
        seq = self.seq
        if seq.min() >= call:
            return
        start = check = time.monotonic()
        spins = 0
        while seq.min() < call:
            spins += 1
            if spins > 64:  # past a short spin, give the core away between looks
                os.sched_yield()
                now = time.monotonic()
                if now - check > WAIT_CHECK_SECONDS:
                    check = now
                    self.alive()
                    if now - start > self.timeout:
                        late = [r for r in range(self.size) if seq[r] < call]
                        raise RuntimeError(f"ranks {late} did not reach the all-reduce in {self.timeout:g}s")

    def close(self, unlink: bool) -> None:
        if unlink:
            self.path.unlink(missing_ok=True)
