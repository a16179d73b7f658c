"""The ranks of one engine and the collectives its model and runner use.

An engine of `tp * pp` ranks: rank = pp_rank * tp + tp_rank, so the ranks of one pipeline
stage are consecutive (on one machine with several per node). Tensor-parallel collectives run in
the stage's group; pipeline sends go to the same tp_rank of the next stage. Control messages
(each step's SchedulerOutput) and the final hidden states travel over a gloo group spanning all
ranks, which on CUDA sits beside the NCCL one.

Every rank runs the same steps in the same order and every collective is called by all ranks of
its group: that is the contract that keeps them from deadlocking.
"""

from __future__ import annotations

import datetime
import hashlib
import pickle
import time
from pathlib import Path
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from tokenmill.distributed.shm import ShmAllReduce, ShmMailbox

# How long a collective waits for a rank before it raises (a rank that dies closes its sockets
# and its peers raise at once; this bounds a rank that hangs).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
MAILBOX_BYTES = 8 << 20  # a step message larger than this (pickled) goes over gloo
ARRIVAL_POLL_SECONDS = 0.05  # how often rank 0 looks for ranks that have not arrived yet


class ParallelGroup:
    """This process's place among the engine's ranks, and the collectives over them."""

    def __init__(self, rank: int, tp_size: int, pp_size: int, device: torch.device, shm: tuple[str, int] | None = None):
        """shm: (path prefix, bytes per all-reduce slot) when every rank is on this machine: step
        messages then go through a shared-memory mailbox, and on a CPU the tensor-parallel sums
        through a shared-memory all-reduce; else gloo (sums: gloo or NCCL)."""
        self.rank, self.tp_size, self.pp_size = rank, tp_size, pp_size
        self.world_size = tp_size * pp_size
        self.tp_rank, self.pp_rank = rank % tp_size, rank // tp_size
        self.device = device
        # Every rank creates every group, in the same order (torch.distributed's rule).
        self.tp_group = None
        for stage in range(pp_size):
            group = dist.new_group(list(range(stage * tp_size, (stage + 1) * tp_size)))
            if stage == self.pp_rank:
                self.tp_group = group
        self.cpu_group = dist.group.WORLD if dist.get_backend() == "gloo" else dist.new_group(backend="gloo")
        self.world = dist.group.WORLD  # the default group init_parallel created for this engine: `close` destroys it
        self.shm = self.mailbox = None
        if shm is not None:
            self._map_shared_memory(shm[0], shm[1], sums=tp_size > 1 and device.type == "cpu")

    def _map_shared_memory(self, prefix: str, slot_bytes: int, sums: bool) -> None:
        """The step mailbox (rank 0 creates its file) and on a CPU with tp > 1 each stage's
        all-reduce (its tp_rank 0 creates one): created, mapped by every rank, and then their names
        removed, so no file outlives the ranks however they end (the mappings keep the memory)."""
        steps, stage = Path(f"{prefix}-steps"), Path(f"{prefix}-stage{self.pp_rank}")
        created: list[Path] = []
        try:
            if self.rank == 0:
                created.append(steps)
                self.mailbox = ShmMailbox(steps, 0, self.world_size, MAILBOX_BYTES, create=True)
            if sums and self.tp_rank == 0:
                created.append(stage)
                self.shm = ShmAllReduce(stage, 0, self.tp_size, slot_bytes, create=True)
            dist.barrier(group=self.cpu_group)  # every file exists
            if self.rank != 0:
                self.mailbox = ShmMailbox(steps, self.rank, self.world_size, MAILBOX_BYTES, create=False)
            if sums and self.tp_rank != 0:
                self.shm = ShmAllReduce(stage, self.tp_rank, self.tp_size, slot_bytes, create=False)
            dist.barrier(group=self.cpu_group)  # every rank has mapped its files
        finally:
            for path in created:
                path.unlink(missing_ok=True)

    def set_liveness_check(self, check) -> None:
        """`check()` runs now and then while this rank waits for its peers in shared memory (an
        all-reduce, a step message), and raises if one of them is gone (gloo's own collectives
        notice by themselves)."""
        for waiter in (self.shm, self.mailbox):
            if waiter is not None:
                waiter.alive = check

    def close(self) -> None:
        """Leave the engine's process group: destroy the default group if it is still the one
        init_parallel created (a later engine in this process then creates its own), and drop the
        shared memory. Idempotent; no collective may run on this group afterwards."""
        self.shm = self.mailbox = None
        if dist.is_initialized() and dist.group.WORLD is self.world:
            dist.destroy_process_group()

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    # -- tensor parallelism --------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the stage's tensor-parallel ranks, in place (every rank gets the same bytes)."""
        if self.tp_size > 1 and not (self.shm is not None and x.is_contiguous() and self.shm.all_reduce(x)):
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_columns(self, x: torch.Tensor, widths: list[int]) -> torch.Tensor:
        """[rows, widths[tp_rank]] from each tensor-parallel rank -> [rows, sum(widths)], ranks in order."""
        if self.tp_size == 1:
            return x
        width = max(widths)
        padded = x if x.shape[1] == width else torch.nn.functional.pad(x, (0, width - x.shape[1]))
        padded = padded.contiguous()
        parts = self.shm.all_gather(padded) if self.shm is not None else None
        if parts is None:
            parts = [torch.empty_like(padded) for _ in widths]
            dist.all_gather(parts, padded, group=self.tp_group)
        return torch.cat([p[:, :w] for p, w in zip(parts, widths)], dim=1)

    # -- pipeline parallelism ------------------------------------------------------------------

    def send_next(self, x: torch.Tensor) -> dist.Work:
        """Start sending `x` to this tp_rank of the next stage."""
        return dist.isend(x.contiguous(), self.rank + self.tp_size)

    def recv_prev(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Receive what this tp_rank of the previous stage sends (its shape and dtype known to both)."""
        x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.recv(x, self.rank - self.tp_size)
        return x

    def broadcast_from_last_stage(self, x: torch.Tensor | None, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The last stage's `x` on every rank (the others pass None)."""
        if self.pp_size == 1:
            return x
        src = (self.pp_size - 1) * self.tp_size
        if x is None or self.rank != src:
            x = torch.empty(shape, dtype=dtype, device=self.device)
        dist.broadcast(x.contiguous() if self.rank == src else x, src)
        return x

    # -- control -------------------------------------------------------------------------------

    def broadcast_object(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled: through the mailbox on one machine, else or when
        too large over the gloo group)."""
        if self.mailbox is not None:
            if self.rank == 0:
                if self.mailbox.send(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)):
                    return obj
            else:
                message = self.mailbox.receive()
                if message is not ShmMailbox.NOT_CARRIED:
                    return pickle.loads(message)
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())


class Rendezvous:
    """Where the ranks of one engine meet: the TCPStore at `tcp://host:port`, hosted by rank 0.
    Each rank announces itself there on arrival, before it joins the process group, and rank 0
    joins only once every rank has (`wait_for_ranks`): a rank that dies while it starts leaves
    rank 0 waiting here, where it checks on it and where Ctrl-C reaches it, never inside
    torch.distributed's own rendezvous, which can be neither interrupted nor abandoned (a
    thread left in it would confuse the next process group this process creates)."""

    def __init__(self, init_method: str, rank: int, world_size: int):
        address = urlsplit(init_method)
        self.world_size = world_size
        self.store = dist.TCPStore(address.hostname, address.port, world_size, is_master=rank == 0,
                                   timeout=COLLECTIVE_TIMEOUT, wait_for_workers=False)
        self.store.set(self._arrived(rank), b"")

    @classmethod
    def at(cls, init_method: str, rank: int, world_size: int) -> "Rendezvous | None":
        """This rank's arrival at `init_method`: a Rendezvous for tcp://host:port, None for env://
        (torchrun's, which init_process_group reads by itself)."""
        return cls(init_method, rank, world_size) if init_method.startswith("tcp://") else None

    @staticmethod
    def _arrived(rank: int) -> str:
        return f"tokenmill/arrived/{rank}"

    def wait_for_ranks(self, check=lambda: None) -> None:
        """Return once every rank has arrived; `check()` runs every ARRIVAL_POLL_SECONDS and may
        raise (a local worker that exited). RuntimeError after COLLECTIVE_TIMEOUT."""
        keys = [self._arrived(r) for r in range(self.world_size)]
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while not self.store.check(keys):
            check()
            if time.monotonic() > deadline:
                missing = [r for r, key in enumerate(keys) if not self.store.check([key])]
                raise RuntimeError(f"ranks {missing} did not arrive in {COLLECTIVE_TIMEOUT}")
            time.sleep(ARRIVAL_POLL_SECONDS)


def init_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
                  shm: tuple[str, int] | None = None, rendezvous: Rendezvous | None = None) -> ParallelGroup:
    """Join the engine's process group (blocks until every rank has joined): NCCL on CUDA, else
    gloo, with `shm` as ParallelGroup takes it. The ranks meet at `rendezvous` when given (made
    for `init_method`), else at `init_method` itself (`env://`, torchrun's)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    meet = {"store": rendezvous.store} if rendezvous is not None else {"init_method": init_method}
    dist.init_process_group(backend, rank=rank, world_size=tp_size * pp_size, timeout=COLLECTIVE_TIMEOUT, **meet)
    try:
        return ParallelGroup(rank, tp_size, pp_size, device, shm)
    except BaseException:
        dist.destroy_process_group()  # (a peer that failed): this process may build an engine again
        raise


def output_digest(sampled_token_ids: dict[str, list[int]]) -> bytes:
    """A digest of one step's sampled tokens: ranks that sample apart are caught by comparing it."""
    return hashlib.blake2b(pickle.dumps(sorted(sampled_token_ids.items())), digest_size=8).digest()
