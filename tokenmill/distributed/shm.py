"""All-reduce and step messages through shared memory, for the ranks of one machine.

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

`ShmMailbox` carries rank 0's message of each step (the pickled SchedulerOutput) to the other
ranks of the machine the same way, in place of a gloo broadcast (two loopback round trips): one
sequence number for the message, one acknowledgement per reader, and rank 0 writes message k + 1
only once every reader has acknowledged message k. A reader that waits long (an idle server)
sleeps between looks, up to `MAX_IDLE_SLEEP`.

Each file is named only while the ranks start: once every rank has mapped it, its creator
removes the name (group.py), and the memory goes with the last rank's mapping, however the
ranks end.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import torch

HEADER_BYTES = 4096  # one sequence number per rank, each on its own 64-byte line
LINE = 8  # int64s per cache line
WAIT_CHECK_SECONDS = 0.2  # how often a waiting rank checks that its peers live
SPINS = 64  # looks before a waiting rank starts yielding its core
MAX_IDLE_SLEEP = 0.002  # the longest sleep between looks of a rank waiting for a step


def _create_private(path: Path, size: int) -> None:
    """A new file of `size` zero bytes that only this user may read or write (the ranks unpickle
    the step messages in it)."""
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


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
            _create_private(path, total)
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
        parity = self._exchange(x)
        if parity is None:
            return False
        torch.add(self._slot(parity, 0, x), self._slot(parity, 1, x), out=x)
        for r in range(2, self.size):
            x.add_(self._slot(parity, r, x))
        return True

    def all_gather(self, x: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `x` (same shape on all), in rank order; None, nothing done, if it exceeds a slot."""
        parity = self._exchange(x)
        return None if parity is None else [self._slot(parity, r, x).clone() for r in range(self.size)]

    def _exchange(self, x: torch.Tensor) -> int | None:
        """Post `x` in this rank's slot and wait for every rank's: the set of slots they are in
        (None, nothing done, if `x` exceeds a slot)."""
        if x.numel() * x.element_size() > self.slot_bytes:
            return None
        self.calls += 1
        parity = self.calls % 2
        self._slot(parity, self.rank, x).copy_(x)
        self.seq[self.rank] = self.calls
        self._wait(self.calls)
        return parity

    def _wait(self, call: int) -> None:
        wait_until(lambda: self.seq.min() >= call, self.alive, self.timeout,
                   lambda: f"ranks {[r for r in range(self.size) if self.seq[r] < call]} did not reach the all-reduce")


def wait_until(ready, alive, timeout: float | None, late) -> None:
    """Return once `ready()`: spin a little, then yield the core between looks, then (after
    WAIT_CHECK_SECONDS) sleep up to MAX_IDLE_SLEEP; call `alive()` every WAIT_CHECK_SECONDS and
    raise RuntimeError(late()) after `timeout` seconds (None: no limit)."""
    for _ in range(SPINS):
        if ready():
            return
    start = check = time.monotonic()
    sleep = 0.0
    while not ready():
        if sleep:
            time.sleep(sleep)
        else:
            os.sched_yield()
        now = time.monotonic()
        if now - check > WAIT_CHECK_SECONDS:
            check = now
            sleep = min(MAX_IDLE_SLEEP, sleep * 2 or 1e-4)
            alive()
            if timeout is not None and now - start > timeout:
                raise RuntimeError(f"{late()} in {timeout:g}s")


class ShmMailbox:
    """Rank 0's messages to ranks 1..size-1 of one machine (rank 0 creates the file at `path`,
    the others open it after a barrier). A message over `capacity` bytes is not carried: `send`
    returns False after telling the readers so (`receive` returns NOT_CARRIED) and the caller
    sends it another way."""

    NOT_CARRIED = object()

    def __init__(self, path: Path, rank: int, size: int, capacity: int, create: bool, alive=None):
        self.path, self.rank, self.size, self.capacity = path, rank, size, capacity
        total = HEADER_BYTES + capacity
        if create:
            _create_private(path, total)
        self.buf = torch.from_file(str(path), shared=True, size=total, dtype=torch.uint8)
        # line 0: [message number, its length (-1: not carried)]; line r: reader r's last message read
        header = self.buf[: size * LINE * 8].view(torch.int64).numpy()
        self.head, self.acks = header[:2], header[::LINE]  # acks[r], r >= 1 (acks[0] is the head)
        self.data = self.buf[HEADER_BYTES:].numpy()
        self.count = int(self.head[0])
        self.alive = alive or (lambda: None)

    def send(self, message: bytes) -> bool:
        """Rank 0: wait until every reader has read the last message, then post this one."""
        wait_until(lambda: self.acks[1 : self.size].min() >= self.count, self.alive, None, lambda: "")
        carried = len(message) <= self.capacity
        if carried:
            self.data[: len(message)] = memoryview(message)
        self.head[1] = len(message) if carried else -1
        self.count += 1
        self.head[0] = self.count  # last: the message is complete before it is announced
        return carried

    def receive(self):
        """Ranks 1..: the next message's bytes (or NOT_CARRIED), waiting for it as long as it takes."""
        self.count += 1
        wait_until(lambda: self.head[0] >= self.count, self.alive, None, lambda: "")
        length = int(self.head[1])
        message = self.NOT_CARRIED if length < 0 else self.data[:length].tobytes()
        self.acks[self.rank] = self.count
        return message
