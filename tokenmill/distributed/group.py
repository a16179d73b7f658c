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
from pathlib import Path

import torch
import torch.distributed as dist

from tokenmill.distributed.shm import ShmAllReduce, ShmMailbox

# How long a collective waits for a rank before it raises (a rank that dies closes its sockets
# and its peers raise at once; this bounds a rank that hangs).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=10)
MAILBOX_BYTES = 8 << 20  # a step message larger than this (pickled) goes over gloo


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
        self.shm = self.mailbox = None
        if shm is not None:
            path = Path(f"{shm[0]}-steps")
            if rank == 0:
                self.mailbox = ShmMailbox(path, 0, self.world_size, MAILBOX_BYTES, create=True)
            dist.barrier(group=self.cpu_group)
            if rank != 0:
                self.mailbox = ShmMailbox(path, rank, self.world_size, MAILBOX_BYTES, create=False)
        if shm is not None and tp_size > 1 and device.type == "cpu":
            path = Path(f"{shm[0]}-stage{self.pp_rank}")
            if self.tp_rank == 0:
                self.shm = ShmAllReduce(path, 0, tp_size, shm[1], create=True)
            dist.barrier(group=self.tp_group)
            if self.tp_rank != 0:
                self.shm = ShmAllReduce(path, self.tp_rank, tp_size, shm[1], create=False)

    def set_liveness_check(self, check) -> None:
        """`check()` runs now and then while this rank waits for its peers in shared memory (an
        all-reduce, a step message), and raises if one of them is gone (gloo's own collectives
        notice by themselves)."""
        for waiter in (self.shm, self.mailbox):
            if waiter is not None:
                waiter.alive = check

    def close(self) -> None:
        """Leave the process group; the rank that created the shared-memory file removes it."""
        if self.shm is not None:
            self.shm.close(unlink=self.tp_rank == 0)
        if self.mailbox is not None:
            self.mailbox.close(unlink=self.rank == 0)
        if dist.is_initialized():
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


def init_parallel(rank: int, tp_size: int, pp_size: int, init_method: str, device: torch.device,
                  shm: tuple[str, int] | None = None) -> ParallelGroup:
    """Join the engine's process group (blocks until every rank has joined): NCCL on CUDA, else
    gloo, with `shm` as ParallelGroup takes it."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=tp_size * pp_size,
                            timeout=COLLECTIVE_TIMEOUT)
    return ParallelGroup(rank, tp_size, pp_size, device, shm)


def output_digest(sampled_token_ids: dict[str, list[int]]) -> bytes:
    """A digest of one step's sampled tokens: ranks that sample apart are caught by comparing it."""
    return hashlib.blake2b(pickle.dumps(sorted(sampled_token_ids.items())), digest_size=8).digest()
