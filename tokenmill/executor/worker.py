"""A worker rank: its process runs `worker_main` (`python -m tokenmill.executor`, started by
executor/multiproc.py), or `run_node` calls it in-process."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from tokenmill.config import EngineConfig
from tokenmill.distributed import Rendezvous, init_parallel
from tokenmill.distributed.group import output_digest
from tokenmill.models.loader import load_checkpoint
from tokenmill.models.registry import resolve_model
from tokenmill.structured.grammar import GrammarCompiler
from tokenmill.worker.cpu import keep_large_allocations_in_heap
from tokenmill.worker.model_runner import ModelRunner


@dataclass(frozen=True)
class WorkerArgs:
    config: EngineConfig
    rank: int
    local_rank: int  # its index among the ranks of its machine (its GPU on CUDA)
    init_method: str  # where the ranks meet (torch.distributed)
    device: str
    dtype: str
    max_model_len: int | None  # None: the engine's default, the model's context length
    num_threads: int
    shm: tuple[str, int] | None = None  # the shared-memory all-reduce (ParallelGroup), ranks on one machine


def rank_device(device: str, local_rank: int) -> torch.device:
    return torch.device(f"cuda:{local_rank}") if device == "cuda" else torch.device(device)


def worker_main(args: WorkerArgs) -> None:
    """A worker rank: join the group first (so rank 0 learns at once if this process cannot),
    load its part of the model, then run every step rank 0 broadcasts until it sends None."""
    config, rank = args.config, args.rank
    torch.set_num_threads(args.num_threads)
    dev = rank_device(args.device, args.local_rank)
    if dev.type == "cpu":
        keep_large_allocations_in_heap()
    else:
        torch.cuda.set_device(dev)
    rendezvous = Rendezvous.at(args.init_method, rank, config.world_size)
    parallel = init_parallel(rank, config.tensor_parallel_size, config.pipeline_parallel_size, args.init_method, dev,
                             args.shm, rendezvous)
    parent = os.getppid()

    def parent_alive() -> None:  # a worker whose engine process died stops waiting for it
        if os.getppid() != parent:
            raise RuntimeError(f"rank {rank}: the engine's process exited")

    parallel.set_liveness_check(parent_alive)
    checkpoint = load_checkpoint(resolve_model(config.model))
    max_model_len = args.max_model_len or config.max_model_len or checkpoint.config.max_position_embeddings
    runner = ModelRunner(config, checkpoint, str(dev), args.dtype, max_model_len, parallel)
    # Constraints arrive as sampling parameters (executor/multiproc.py: without_grammars) and are
    # compiled here as the engine compiles them.
    grammars = GrammarCompiler(checkpoint.tokenizer, checkpoint.config.vocab_size, list(checkpoint.config.eos_token_ids))
    digest = None
    while (message := parallel.broadcast_object()) is not None:
        sched, expected = message
        for data in sched.scheduled_new_reqs:
            if data.sampling_params.structured_output is not None:
                data.grammar = grammars.compile(data.sampling_params.structured_output)
        if expected is not None and expected != digest:
            raise RuntimeError(f"rank {rank} sampled other tokens than rank 0 in the last step: the ranks' logits "
                               "differ (different CPUs or libraries on the nodes?)")
        digest = output_digest(runner.execute_model(sched).sampled_token_ids)
    parallel.close()

