"""The engine replicas of `tokenmill serve --data-parallel-size N`: N child processes, each a whole
tokenmill server (`api_server.run_server`) on 127.0.0.1 and a free port, with the same engine
and server settings except its share of the CPU threads (and, with at least N GPUs visible, a GPU
of its own).

Children are spawned (not forked: the front end has threads), start their own session (a Ctrl-C
in the terminal reaches the front end, which stops them in order) and get SIGTERM if the front
end dies without stopping them (Linux).
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass

from tokenmill.config import EngineConfig
from tokenmill.entrypoints.openai.args import ServerConfig

logger = logging.getLogger(__name__)

REPLICA_HOST = "127.0.0.1"
_PR_SET_PDEATHSIG = 1  # linux/prctl.h


@dataclass
class Replica:
    index: int
    port: int
    num_threads: int
    process: multiprocessing.process.BaseProcess

    @property
    def url(self) -> str:
        return f"http://{REPLICA_HOST}:{self.port}"

    def __str__(self) -> str:
        return f"replica {self.index} (pid {self.process.pid}, {self.url})"


class ReplicaSet:
    """Starts, watches and stops the replicas. Contract: `stop` leaves no child running."""

    def __init__(self, engine_config: EngineConfig, config: ServerConfig, log_level: str):
        n = config.data_parallel_size
        self.num_threads = max(1, engine_config.resolved_num_threads() // n)
        gpus = _gpu_per_replica(engine_config, n)
        context = multiprocessing.get_context("spawn")
        self.replicas: list[Replica] = []
        for index, port in enumerate(_free_ports(n)):
            replica_engine = dataclasses.replace(engine_config, num_threads=self.num_threads)
            replica_server = dataclasses.replace(config, host=REPLICA_HOST, port=port, data_parallel_size=1)
            process = context.Process(target=serve_replica, name=f"tokenmill-replica-{index}",
                                      args=(index, replica_engine, replica_server, log_level, os.getpid(), gpus[index]))
            self.replicas.append(Replica(index, port, self.num_threads, process))

    def start(self) -> None:
        for replica in self.replicas:
            replica.process.start()
            logger.info("started %s with %d CPU threads", replica, self.num_threads)

    def first_exited(self) -> Replica | None:
        return next((r for r in self.replicas if r.process.exitcode is not None), None)

    def all_exited(self) -> bool:
        return all(r.process.exitcode is not None for r in self.replicas)

    def terminate(self) -> None:
        """SIGTERM to each running replica: it stops taking requests and drains (`--shutdown-timeout`)."""
        for replica in self.replicas:
            if replica.process.pid is not None and replica.process.exitcode is None:
                replica.process.terminate()

    def stop(self, timeout: float) -> None:
        """SIGTERM, then SIGKILL for replicas still running `timeout` seconds later."""
        self.terminate()
        deadline = time.monotonic() + timeout
        for replica in self.replicas:
            if replica.process.pid is not None:
                replica.process.join(max(0.0, deadline - time.monotonic()))
        for replica in self.replicas:
            if replica.process.pid is not None and replica.process.exitcode is None:
                logger.warning("%s did not stop in %gs: killing it", replica, timeout)
                replica.process.kill()
                replica.process.join()


def exit_description(exitcode: int) -> str:
    if exitcode < 0:
        return f"was killed by {signal.Signals(-exitcode).name}"
    return f"exited with status {exitcode}"


def serve_replica(index: int, engine_config: EngineConfig, config: ServerConfig, log_level: str,
                  parent_pid: int, gpu: str | None) -> None:
    """A replica process's main: one tokenmill server, its log lines marked with its index."""
    os.setsid()
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the front end died before the line above
            sys.exit(1)
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before CUDA initializes
    logging.basicConfig(level=log_level.upper(),
                        format=f"%(asctime)s %(levelname)s replica {index} %(name)s: %(message)s")
    from tokenmill.entrypoints.openai.api_server import run_server

    try:
        sys.exit(run_server(engine_config, config, log_level=log_level))
    except ValueError as e:  # config and model errors: one line, as `tokenmill serve` prints them
        print(f"error: replica {index}: {e}", file=sys.stderr)
        sys.exit(2)


def _free_ports(n: int) -> list[int]:
    """n distinct free ports on REPLICA_HOST (all held open until all are found)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind((REPLICA_HOST, 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def _gpu_per_replica(engine_config: EngineConfig, n: int) -> list[str | None]:
    """With CUDA and at least n visible GPUs, replica i gets the i-th; otherwise the replicas
    share what is visible (None: environment unchanged)."""
    if engine_config.device == "cpu":
        return [None] * n
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if count < n:
        if count:
            logger.warning("%d replicas share %d GPU(s): give each its memory with --kv-cache-memory-gb", n, count)
        return [None] * n
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(count)]
    return ids[:n]
