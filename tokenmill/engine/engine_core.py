"""The engine step: schedule -> execute -> update, over token ids only (no text)."""

from __future__ import annotations

import logging
import sys
import time

import torch


from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.outputs import EngineCoreOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.draft_plan import StepCost
from tokenmill.core.scheduler import RequestRejectedError, Scheduler, SchedulerConfig
from tokenmill.cpu_isa import host_isa
from tokenmill.faults import FaultPlan
from tokenmill.executor import MultiprocExecutor
from tokenmill.layers import cpu_kernels
from tokenmill.models.loader import LoadedCheckpoint, ModelArchConfig
from tokenmill.spec_decode.cost import (
    MEASURE_CONTEXT, MEASURE_METHOD, MEASURED_BATCHES, MEASURED_SIZES, StepCostCache, measure_step_cost, probe_blocks,
)
from tokenmill.version import __version__
from tokenmill.worker.cpu import keep_large_allocations_in_heap
from tokenmill.worker.disk_store import DiskBlockStore
from tokenmill.worker.model_runner import ModelRunner

logger = logging.getLogger(__name__)

# How long a shutdown may spend writing the prefix cache's blocks to disk (`persist_cache`);
# the disk tier's byte budget bounds it too.
MAX_PERSIST_SECONDS = 30.0


class EngineCore:
    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint):
        arch = checkpoint.config
        self.device = config.resolved_device()
        self.dtype = config.resolved_dtype(self.device)
        if self.device == "cpu" and config.world_size == 1:  # (split over ranks, the executor shares them out)
            torch.set_num_threads(config.resolved_num_threads())
            keep_large_allocations_in_heap()
        self.max_model_len = config.max_model_len or arch.max_position_embeddings
        if self.max_model_len > arch.max_position_embeddings:
            raise ConfigError(
                "max_model_len",
                f"{self.max_model_len} exceeds the model's context length {arch.max_position_embeddings}",
            )
        self.config = config
        self.num_steps = 0
        self._in_step = False  # a step began and has not returned (after a failure, no cached block is trusted)
        self._persisted = False
        self.faults = FaultPlan.parse(config.fault_injection) if config.fault_injection else None  # tests only
        self.last_num_prompt_tokens = 0
        self.last_num_generated_tokens = 0
        # What runs each step: the runner, or with the model split over ranks the executor that
        # drives them all (rank 0's runner is `runner`, for its sizes and its model).
        if config.world_size > 1:
            self.executor = MultiprocExecutor(config, checkpoint, self.device, self.dtype, self.max_model_len)
            self.runner = self.executor.runner
        else:
            self.executor = self.runner = ModelRunner(config, checkpoint, self.device, self.dtype, self.max_model_len)
        try:
            disk = self.runner.disk_store if self.runner.disk_store is not None and self.runner.disk_store.enabled else None
            self.kv_cache_manager = self._make_kv_cache_manager(config, arch, disk)
            self.scheduler = Scheduler(self._scheduler_config(config, checkpoint), self.kv_cache_manager)
            self._log_ready(config, checkpoint, disk)
        except BaseException:  # the ranks already started do not outlive a failed start
            self.shutdown()
            raise
        if config.speculative_method:
            self._log_speculation(config)

    def _make_kv_cache_manager(self, config: EngineConfig, arch: ModelArchConfig,
                               disk: DiskBlockStore | None) -> KVCacheManager:
        """The block pool over the runner's blocks, with the host tiers it allocated and the disk
        tier (`disk`, when enabled)."""
        # Blocks no layer's window reaches are freed early (every layer slides; a draft model,
        # whose layers may not, reads the same tables).
        window = arch.sliding_window if arch.all_layers_slide and self.runner.draft_model is None else None
        return KVCacheManager(
            self.runner.num_blocks, config.block_size, enable_caching=config.enable_prefix_caching,
            num_host_blocks=self.runner.num_host_blocks, sliding_window=window,
            num_host_cache_blocks=self.runner.num_host_cache_blocks,
            num_disk_cache_blocks=disk.max_blocks if disk else 0, disk_hashes=disk.hashes_at_start if disk else (),
        )

    def _scheduler_config(self, config: EngineConfig, checkpoint: LoadedCheckpoint) -> SchedulerConfig:
        """The scheduler's limits; with adaptive speculation, the step cost measured (or cached) here."""
        return SchedulerConfig(
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=self.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            num_speculative_tokens=config.num_speculative_tokens if config.speculative_method else 0,
            spec_adaptive=config.speculative_adaptive,
            spec_max_running=config.speculative_max_running,
            step_cost=self._step_cost(config, checkpoint),
            spec_lookahead=config.num_speculative_tokens if config.speculative_method == "draft" else 0,
        )

    def _log_ready(self, config: EngineConfig, checkpoint: LoadedCheckpoint, disk: DiskBlockStore | None) -> None:
        logger.info(
            "engine ready: %s on %s (%s, %d threads, %s attention), weights loaded in %.1fs, KV cache %d blocks x %d tokens "
            "(%s, %.0f MiB) + %d host blocks for swapping, prefix caching %s, max_model_len %d",
            checkpoint.source.name, self.device, self.dtype, torch.get_num_threads(), self.runner.attention_backend,
            self.runner.load_seconds,
            self.runner.num_blocks, config.block_size, self.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
            self.runner.num_blocks * config.block_size * self.runner.kv_bytes_per_token() / 2**20,
            self.runner.num_host_blocks, "on" if config.enable_prefix_caching else "off", self.max_model_len,
        )
        if self.runner.num_host_cache_blocks:
            logger.info("prefix cache tiers: %d host blocks (%.0f MiB)%s", self.runner.num_host_cache_blocks,
                        self.runner.num_host_cache_blocks * self.runner.bytes_per_block / 2**20,
                        f", disk {disk.dir} ({len(disk.hashes_at_start)} of up to {disk.max_blocks} blocks there)"
                        if disk else "")

    def _log_speculation(self, config: EngineConfig) -> None:
        cost = self.scheduler.config.step_cost
        logger.info(
            "speculative decoding: %s, up to %d drafts per request and step, %s%s",
            f"draft model {config.draft_model}" if config.speculative_method == "draft" else
            "suffix decoding" if config.speculative_method == "suffix" else
            f"n-gram {config.speculative_ngram_min}..{config.speculative_ngram_max}",
            config.num_speculative_tokens,
            f"drafts per step from the step cost t(1+k)/t(1): {cost.describe()}" if cost else
            "adaptive (no step cost)" if config.speculative_adaptive else "not adaptive",
            f", off while more than {config.speculative_max_running} requests are running or waiting"
            if config.speculative_max_running else "",
        )

    def _step_cost(self, config: EngineConfig, checkpoint: LoadedCheckpoint) -> StepCost | None:
        """What a step of n tokens costs here, for choosing drafts (spec_decode/cost.py):
        measured once per model, precision and host, then read from the cache."""
        if not (config.speculative_method and config.speculative_adaptive):
            return None
        room = self.runner.num_blocks * config.block_size
        context = min(MEASURE_CONTEXT, room // 2)
        # a probe holds its context and twice the largest step, rounded up to a block (probe_blocks)
        limit = min(config.max_num_batched_tokens, (room - context - config.block_size) // 2,
                    (self.max_model_len - context - config.block_size) // 2)
        sizes = tuple(sorted({n for n in (*MEASURED_SIZES, 1 + config.num_speculative_tokens) if n <= limit}))
        per_request = probe_blocks(context, sizes, config.block_size)
        batches = tuple(b for b in MEASURED_BATCHES if b <= min(config.max_num_seqs, self.runner.num_blocks // per_request)
                        and b * context <= config.max_num_batched_tokens)
        source = checkpoint.source
        key = {
            "model": str(source.resolve()), "bytes": source.stat().st_size if source.is_file() else None,
            "quantization": config.quantization, "dtype": str(self.dtype), "kv_cache_dtype": config.kv_cache_dtype,
            "device": self.device if self.device == "cpu" else torch.cuda.get_device_name(),
            "cpu_isa": host_isa(), "threads": torch.get_num_threads(), "tp": config.tensor_parallel_size,
            "pp": config.pipeline_parallel_size, "block_size": config.block_size, "sizes": sizes, "batches": batches,
            "context": context, "method": MEASURE_METHOD, "version": __version__,
            # the code that runs the steps: the CPU kernels' sources and flags, and what the step computes
            "kernels": cpu_kernels.fingerprint(host_isa())[:16] if self.device == "cpu" else None,
            "activation_sparsity": config.activation_sparsity,
        }
        cache = StepCostCache()
        cost = cache.get(key)
        if cost is None:
            start = time.perf_counter()
            cost = measure_step_cost(self.executor.execute_model, config.block_size, sizes, batches, context)
            cache.put(key, cost)
            logger.info("step cost measured in %.1fs: one request verifying n tokens %s; B requests decoding %s",
                        time.perf_counter() - start,
                        ", ".join(f"t({n}) {s * 1e3:.1f} ms" for n, s in zip(cost.sizes, cost.seconds)),
                        ", ".join(f"d({b}) {s * 1e3:.1f} ms" for b, s in zip(cost.decode_sizes, cost.decode_seconds)))
        return cost

    def check_health(self) -> None:
        """Raise if a rank the engine needs has exited (split over ranks; a no-op otherwise)."""
        if self.executor is not self.runner:
            self.executor.check_health()

    def shutdown(self) -> None:
        """Write the prefix cache's blocks that are not on disk yet (with a disk tier, unless a
        step failed: `persist_cache`), then stop the disk tier's threads after its queued writes,
        and the other ranks and the process group (split over ranks). Idempotent."""
        if hasattr(self, "kv_cache_manager"):  # (not when the constructor failed)
            self.persist_cache()
        self.runner.close()
        if self.executor is not self.runner:
            self.executor.shutdown()

    def persist_cache(self) -> int:
        """Write to the disk tier every full cached block of the device pool and the host tier
        that it does not hold yet (`KVCacheManager.persist_batches`), so that a restart finds what
        never left the device, within the disk's byte budget and `MAX_PERSIST_SECONDS`. Only once,
        and not after a step that did not return (its blocks may not hold what their hashes say).
        Returns how many blocks were written; the engine must not step afterwards."""
        store, kv = self.runner.disk_store, self.kv_cache_manager
        if self._persisted or self._in_step or store is None or not store.enabled or kv.disk_index is None:
            return 0
        if sys.is_finalizing():  # (the interpreter's exit: the writer thread may never run again)
            return 0
        self._persisted = True
        self._finish_disk_reads()
        start = time.perf_counter()
        deadline = start + MAX_PERSIST_SECONDS
        before = kv.num_persisted_blocks
        for ops in kv.persist_batches():
            if not self.runner.persist(ops, deadline - time.perf_counter()) or not store.enabled:
                logger.warning("prefix cache: writing the cached blocks to disk at shutdown stopped after %.1fs (%s)",
                               time.perf_counter() - start,
                               "the disk tier is off" if not store.enabled else f"more than {MAX_PERSIST_SECONDS:g}s")
                break
        num = kv.num_persisted_blocks - before
        if num:
            logger.info("prefix cache: %d cached blocks written to %s at shutdown in %.2fs", num, store.dir,
                        time.perf_counter() - start)
        return num

    def add_request(self, request: Request) -> None:
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > self.config.max_num_batched_tokens:
            raise RequestRejectedError(
                f"prompt of {request.num_prompt_tokens} tokens exceeds max_num_batched_tokens "
                f"{self.config.max_num_batched_tokens} with chunked prefill disabled"
            )
        self.scheduler.add_request(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        self.scheduler.finish_requests(request_ids, status)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def _finish_disk_reads(self) -> None:
        """Hand the disk tier's finished reads to the KV-cache manager; with nothing running,
        first wait for the reads a waiting request needs (nothing else could run)."""
        store, kv = self.runner.disk_store, self.kv_cache_manager
        if store is None or kv.host_tier is None:
            return
        kv.finish_disk_reads(store.poll(wait=bool(kv.host_tier.loading) and not self.scheduler.running))
        if not store.enabled and kv.disk_index is not None:
            kv.disable_disk_tier()

    def step(self) -> list[EngineCoreOutput]:
        self._in_step = True
        outputs = self._step()
        self._in_step = False
        return outputs

    def _step(self) -> list[EngineCoreOutput]:
        start = time.perf_counter()
        self._finish_disk_reads()
        scheduled = self.scheduler.schedule()
        requests = self.scheduler.requests
        spec = scheduled.scheduled_spec_tokens
        decodes = sum(
            1 + len(spec.get(data.req_id, ())) for data in scheduled.scheduled_cached_reqs
            if scheduled.num_scheduled_tokens[data.req_id] == 1 + len(spec.get(data.req_id, ()))
            and data.num_computed_tokens >= requests[data.req_id].num_prompt_tokens
        )
        self.num_steps += 1
        if self.faults is not None:
            self.faults.before_forward(self.num_steps)
        forward_start = time.perf_counter()
        result = self.executor.execute_model(scheduled)
        forward = time.perf_counter() - forward_start
        outputs = self.scheduler.update(scheduled, result)
        if scheduled.total_num_scheduled_tokens:
            self.scheduler.step_overhead.record(start, forward, time.perf_counter())
        # For throughput stats: tokens prefilled (prompts, and outputs recomputed after a
        # preemption) and tokens generated by this step.
        self.last_num_prompt_tokens = scheduled.total_num_scheduled_tokens - decodes
        self.last_num_generated_tokens = sum(len(o.new_token_ids) for o in outputs)
        return outputs
