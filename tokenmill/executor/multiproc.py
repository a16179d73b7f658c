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

Lifetime: a worker never outlives the engine's process, however that process ends (lifeline.py).
`MultiprocExecutor.shutdown`, which also runs when the executor is garbage-collected, when the
interpreter exits and when the constructor raises, stops the workers and destroys the process
group, so engines of any shape may follow one another in one process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.distributed import ParallelGroup, Rendezvous, ShardPlan, init_parallel
from tokenmill.distributed.group import output_digest
from tokenmill.distributed.shm import shm_dir
from tokenmill.executor.lifeline import write_frame
from tokenmill.executor.worker import WorkerArgs, rank_device, worker_main
from tokenmill.models.loader import LoadedCheckpoint
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

STOP_TIMEOUT = 10.0  # how long idle workers get to leave their loop at shutdown
TERMINATE_GRACE = 5.0  # from SIGTERM to SIGKILL for a worker that must be ended


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
    """A worker rank in a child process of its own (`python -m tokenmill.executor PARENT_PID`, its
    arguments pickled on stdin): nothing of the parent's main module is imported again, and it
    ends with this process however this process ends (lifeline.py: stdin stays open until `end`)."""

    def __init__(self, args: WorkerArgs):
        self.args = args
        command = [sys.executable, "-m", "tokenmill.executor", str(os.getpid())]
        if threading.current_thread() is threading.main_thread():
            command.append("--pdeathsig")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE)
        try:
            write_frame(self.process.stdin, pickle.dumps(args))
        except BrokenPipeError:  # it exited already: check_health names it
            pass

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

    def end(self, grace: float = TERMINATE_GRACE) -> None:
        """SIGTERM if it still runs, SIGKILL `grace` seconds later; return once it has exited."""
        if self.exitcode is None:
            self.process.terminate()
            self.join(grace)
            if self.exitcode is None:
                self.process.kill()
                self.process.wait()
        with contextlib.suppress(OSError):
            self.process.stdin.close()


class LocalRanks:
    """What an engine split over ranks holds in this process besides its model: the worker
    processes it started and the process group it joined. `release` gives all of it back, once.
    Nothing here refers to the executor, so the executor's finalizer may hold it."""

    def __init__(self):
        self.workers: dict[int, WorkerProcess] = {}
        self.parallel: ParallelGroup | None = None
        # Every worker waits for rank 0's next message (set once they have started, cleared
        # while a step runs): only then does a stop message reach them.
        self.idle = False
        self.released = False

    def check_health(self) -> None:
        """Raise RuntimeError naming a local worker rank that has exited."""
        for rank, process in self.workers.items():
            if process.exitcode is not None:
                raise RuntimeError(f"rank {rank} (pid {process.pid}) exited with code {process.exitcode}; "
                                   "the engine cannot run without it")

    def release(self, timeout: float = STOP_TIMEOUT) -> None:
        """Stop the workers (idle ones leave their loop; any other, starting or stuck in a
        collective rank 0 left, is terminated), then leave the process group."""
        if self.released:
            return
        self.released = True
        stop = None
        deadline = time.monotonic() + timeout
        if self.idle and self.parallel is not None and all(p.exitcode is None for p in self.workers.values()):
            # (workers on other machines leave their loop too)
            stop = threading.Thread(target=self._send_stop, daemon=True)
            stop.start()
            for process in self.workers.values():
                process.join(max(0.0, deadline - time.monotonic()))
        for process in self.workers.values():
            process.end()
        if self.parallel is None:
            return
        if stop is not None:
            stop.join(max(0.0, deadline - time.monotonic()))
            if stop.is_alive():  # a rank on another machine that does not answer
                logger.warning("a rank did not take the stop message in %gs; the process group is left as it is",
                               timeout)
                return
        self.parallel.close()

    def _send_stop(self) -> None:
        try:
            self.parallel.broadcast_object(None)
        except RuntimeError:  # a worker exited meanwhile
            pass


class MultiprocExecutor:
    """Rank 0's side: spawns this machine's other ranks, joins the process group, and stands in
    for the runner behind `execute_model`. `runner` is rank 0's own ModelRunner.

    Contract: `shutdown` (idempotent) stops every worker and leaves the process group, after which
    another engine, of any shape, may be built in this process; it runs by itself when the
    executor is garbage-collected or the interpreter exits, and when the constructor raises."""

    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint, device: str, dtype: str, max_model_len: int):
        launch = Launch.from_config(config)
        assert launch.rank == 0, "rank 0 runs the engine"
        # Refuse what cannot be split before any process starts (every rank would refuse it alike).
        ShardPlan(checkpoint.config, config.tensor_parallel_size, 0, config.pipeline_parallel_size, 0)
        if checkpoint.quantization is not None:
            raise ConfigError("tensor_parallel_size", f"{checkpoint.source.name} was written by `tokenmill quantize`; "
                              "a model split over ranks loads dense, GGUF or round-to-nearest weights")
        if torch.distributed.is_initialized():
            raise RuntimeError("this process already has a torch.distributed process group (an engine split over "
                               "ranks that is still open?): call its shutdown() (or build it in `with LLM(...)`) first")
        threads = threads_per_rank(config, len(launch.ranks))
        torch.set_num_threads(threads)
        # Every rank on this machine: step messages (and on a CPU tensor-parallel sums) through shared memory.
        shm = None
        if config.nnodes == 1 and not launch.torchrun:
            slot_bytes = config.max_num_batched_tokens * checkpoint.config.hidden_size * 4
            shm = (str(shm_dir() / f"tokenmill-allreduce-{os.getpid()}-{launch.init_method.rsplit(':', 1)[-1]}"), slot_bytes)
        self.ranks = LocalRanks()
        self._finalizer = weakref.finalize(self, self.ranks.release)
        try:
            rendezvous = Rendezvous.at(launch.init_method, 0, launch.world_size)
            for rank in launch.ranks[1:]:
                self.ranks.workers[rank] = WorkerProcess(WorkerArgs(
                    config, rank, rank - launch.rank, launch.init_method, device, dtype, max_model_len, threads, shm))
            if rendezvous is not None:  # (the long wait, while the workers start: here, not inside torch.distributed)
                rendezvous.wait_for_ranks(self.ranks.check_health)
            self.parallel = self.ranks.parallel = self._while_workers_live(lambda: init_parallel(
                0, config.tensor_parallel_size, config.pipeline_parallel_size, launch.init_method, rank_device(device, 0),
                shm, rendezvous))
            self.parallel.set_liveness_check(self.ranks.check_health)
            self.runner = ModelRunner(config, checkpoint, device, dtype, max_model_len, self.parallel)
        except BaseException:  # a worker that failed, a config error, Ctrl-C: no rank is left behind
            self.shutdown()
            raise
        self.ranks.idle = True
        self._last_digest: bytes | None = None
        logger.info("%d ranks (tensor parallel %d x pipeline parallel %d, %s), %d threads each; rank 0 here, %s",
                    launch.world_size, config.tensor_parallel_size, config.pipeline_parallel_size,
                    torch.distributed.get_backend(), threads,
                    ", ".join(f"rank {r} pid {p.pid}" for r, p in self.ranks.workers.items())
                    or "the others under torchrun or on other nodes")

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
        self.ranks.check_health()

    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        if self.ranks.released:
            raise RuntimeError("the engine was shut down")
        self.check_health()
        self.ranks.idle = False
        try:
            self.parallel.broadcast_object((without_grammars(sched), self._last_digest))
            out = self.runner.execute_model(sched)
        except RuntimeError:
            time.sleep(0.5)  # a peer that broke the collective is usually gone by now: name it
            self.check_health()
            raise
        self.ranks.idle = True
        self._last_digest = output_digest(out.sampled_token_ids)
        return out

    def shutdown(self) -> None:
        """Stop the workers and leave the process group (see the class's contract)."""
        self._finalizer()


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
    try:
        worker_main(args[0])
    except BaseException:
        for process in others:
            process.end()
        raise
    for process in others:
        process.join()
        if process.exitcode:
            raise SystemExit(f"rank {process.args.rank} exited with code {process.exitcode}")
