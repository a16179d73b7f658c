"""Tensor- and pipeline-parallel ranks as processes, driven by rank 0.

Rank 0 lives in the engine's process: the scheduler and KV-cache manager stay there, and each
step it broadcasts the SchedulerOutput to the other ranks, then runs its own part of the step.
Every other rank is a worker process running the same `ModelRunner` over its part of the model:
it receives the step, runs it, and samples the same tokens as rank 0 (every rank computes the
same logits from the same bytes and samples with the same seeds), so no output travels back.
With each step rank 0 sends a digest of its previous step's tokens and a worker that sampled
otherwise stops with an error.

Launch: on one machine the engine spawns ranks 1..N-1 itself. Across machines every node runs
the same command with `--nnodes`, `--node-rank`, `--master-addr` (and `--master-port`); node 0
holds rank 0 and the server, the others only workers (`run_node`). Under `torchrun` each process
is one rank and nothing is spawned. A rank that exits is noticed before the next step (and while
idle, by `check_health`), a rank that dies inside a collective makes its peers' collective raise:
either way the engine stops with an error naming the rank, never hangs.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import ShardPlan, init_parallel
from tokenmill.distributed.group import output_digest
from tokenmill.distributed.shm import shm_dir
from tokenmill.executor.worker import WorkerArgs, rank_device, worker_main
from tokenmill.models.loader import LoadedCheckpoint
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Launch:
    """Where this process and the ranks it starts sit among the engine's ranks."""

    world_size: int
    ranks: range  # the ranks this process stands for: itself first, then those it spawns
    init_method: str
    torchrun: bool  # each rank was started by torchrun: spawn nothing

    @classmethod
    def from_config(cls, config: EngineConfig) -> "Launch":
        world = config.world_size
        env = os.environ
        if "TORCHELASTIC_RUN_ID" in env or ("RANK" in env and "LOCAL_RANK" in env and int(env.get("WORLD_SIZE", 1)) > 1):
            if int(env["WORLD_SIZE"]) != world:
                raise RuntimeError(f"torchrun started {env['WORLD_SIZE']} processes; the engine has {world} ranks "
                                   "(tensor_parallel_size x pipeline_parallel_size)")
            rank = int(env["RANK"])
            return cls(world, range(rank, rank + 1), "env://", torchrun=True)
        per_node = world // config.nnodes
        first = config.node_rank * per_node
        port = config.master_port or (_free_port() if config.nnodes == 1 else 29500)
        return cls(world, range(first, first + per_node), f"tcp://{config.master_addr}:{port}", torchrun=False)

    @property
    def rank(self) -> int:
        return self.ranks.start


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def threads_per_rank(config: EngineConfig, num_local_ranks: int) -> int:
    """The machine's CPU threads shared between the ranks that run on it."""
    return max(1, config.resolved_num_threads() // num_local_ranks)


def without_grammars(sched: SchedulerOutput) -> SchedulerOutput:
    """`sched` as it travels to the workers: compiled grammars do not pickle, so new requests go
    without theirs and each worker compiles them again from their sampling parameters."""
    if not any(data.grammar is not None for data in sched.scheduled_new_reqs):
        return sched
    return dataclasses.replace(sched, scheduled_new_reqs=[dataclasses.replace(d, grammar=None)
                                                          for d in sched.scheduled_new_reqs])


class WorkerProcess:
    """A worker rank in a child process of its own (`python -m tokenmill.executor`, its arguments
    pickled on stdin): nothing of the parent's main module is imported again."""

    def __init__(self, args: WorkerArgs):
        self.args = args
        self.process = subprocess.Popen([sys.executable, "-m", "tokenmill.executor"], stdin=subprocess.PIPE)
        self.process.stdin.write(pickle.dumps(args))
        self.process.stdin.close()

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def exitcode(self) -> int | None:
        return self.process.poll()

    def join(self, timeout: float | None = None) -> None:
        try:
            self.process.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def terminate(self) -> None:
        self.process.terminate()
        self.join(5)
        if self.exitcode is None:
            self.process.kill()


class MultiprocExecutor:
    """Rank 0's side: spawns this machine's other ranks, joins the process group, and stands in
    for the runner behind `execute_model`. `runner` is rank 0's own ModelRunner."""

    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint, device: str, dtype: str, max_model_len: int):
        launch = Launch.from_config(config)
        assert launch.rank == 0, "rank 0 runs the engine"
        # Refuse what cannot be split before any process starts (every rank would refuse it alike).
        ShardPlan(checkpoint.config, config.tensor_parallel_size, 0, config.pipeline_parallel_size, 0)
        if checkpoint.quantization is not None:
            raise ConfigError("tensor_parallel_size", f"{checkpoint.source.name} was written by `tokenmill quantize`; "
                              "a model split over ranks loads dense, GGUF or round-to-nearest weights")
        threads = threads_per_rank(config, len(launch.ranks))
        torch.set_num_threads(threads)
        # Every rank on this machine: step messages (and on a CPU tensor-parallel sums) through shared memory.
        shm = None
        if config.nnodes == 1 and not launch.torchrun:
            slot_bytes = config.max_num_batched_tokens * checkpoint.config.hidden_size * 4
            shm = (str(shm_dir() / f"tokenmill-allreduce-{os.getpid()}-{launch.init_method.rsplit(':', 1)[-1]}"), slot_bytes)
        self.workers = {rank: WorkerProcess(WorkerArgs(config, rank, rank - launch.rank, launch.init_method, device, dtype,
                                                       max_model_len, threads, shm))
                         for rank in launch.ranks[1:]}
        self._closed = False
        self.parallel = self._while_workers_live(lambda: init_parallel(
            0, config.tensor_parallel_size, config.pipeline_parallel_size, launch.init_method, rank_device(device, 0), shm))
        self.parallel.set_liveness_check(self.check_health)
        self.runner = ModelRunner(config, checkpoint, device, dtype, max_model_len, self.parallel)
        self._last_digest: bytes | None = None
        atexit.register(self.shutdown)  # an LLM never shut down still stops its ranks with this process
        logger.info("%d ranks (tensor parallel %d x pipeline parallel %d, %s), %d threads each; rank 0 here, %s",
                    launch.world_size, config.tensor_parallel_size, config.pipeline_parallel_size,
                    torch.distributed.get_backend(), threads,
                    ", ".join(f"rank {r} pid {p.pid}" for r, p in self.workers.items()) or "the others under torchrun or on other nodes")

    def _while_workers_live(self, fn):
        """fn(), which blocks until every rank joins, given up with an error if a local worker exits first."""
        result: list = []
        errors: list[BaseException] = []

        def target():
            try:
                result.append(fn())
            except BaseException as e:  # noqa: BLE001 - re-raised below
                errors.append(e)

        thread = threading.Thread(target=target, daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.2)
            if thread.is_alive():
                self.check_health()
        if errors:
            raise errors[0]
        return result[0]

    def check_health(self) -> None:
        """Raise RuntimeError naming a local worker rank that has exited."""
        for rank, process in self.workers.items():
            if process.exitcode is not None:
                raise RuntimeError(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                                   "the engine cannot run without it")

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.check_health()
        try:
            self.parallel.broadcast_object((without_grammars(sched), self._last_digest))
            out = self.runner.execute_model(sched)
        except RuntimeError:
            time.sleep(0.5)  # a peer that broke the collective is usually gone by now: name it
            self.check_health()
            raise
        self._last_digest = output_digest(out.sampled_token_ids)
        return out

    def _send_stop(self) -> None:
        try:
            self.parallel.broadcast_object(None)
        except RuntimeError:
            pass

    def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the workers (they leave their loop) and leave the process group."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.shutdown)
        stop = None
        if all(p.exitcode is None for p in self.workers.values()):
            # Workers waiting for a step (here or on other machines) leave their loop; ones stuck in
            # a collective rank 0 left (a step that raised half-way) do not answer: local ones are
            # terminated below, and the process group is then left as it is.
            stop = threading.Thread(target=self._send_stop, daemon=True)
            stop.start()
        deadline = time.monotonic() + timeout
        for process in self.workers.values():
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                process.terminate()
        if stop is not None:
            stop.join(max(0.0, deadline - time.monotonic()))
        if (stop is None or not stop.is_alive()) and not any(p.exitcode is None for p in self.workers.values()):
            self.parallel.close()
        else:  # a rank that did not stop: the shared-memory files go all the same
            for waiter in (self.parallel.shm, self.parallel.mailbox):
                if waiter is not None:
                    waiter.close(unlink=True)


def holds_rank_zero(config: EngineConfig) -> bool:
    """Whether this process is rank 0 (and so runs the engine) among the ranks of `config`."""
    return Launch.from_config(config).rank == 0


def run_node(config: EngineConfig) -> None:
    """A process that holds no rank 0 (a node other than the first, or a torchrun rank other than
    0): run this node's ranks until rank 0 stops them."""
    launch = Launch.from_config(config)
    device = config.resolved_device()
    dtype, max_model_len = config.resolved_dtype(device), None  # as the engine resolves them (engine_core.py)
    threads = threads_per_rank(config, len(launch.ranks))
    args = [WorkerArgs(config, rank, rank - launch.rank, launch.init_method, device, dtype, max_model_len, threads)
            for rank in launch.ranks]
    others = [WorkerProcess(a) for a in args[1:]]
    logger.info("node %d: ranks %d..%d of %d, rank 0 at %s", config.node_rank, launch.ranks.start, launch.ranks.stop - 1,
                launch.world_size, launch.init_method)
    worker_main(args[0])
    for process in others:
        process.join()
        if process.exitcode:
            raise SystemExit(f"rank {process.args.rank} exited with code {process.exitcode}")
