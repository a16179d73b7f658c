"""Turns a SchedulerOutput into one forward pass over a flat token batch, then samples.

The runner keeps the state of every request it has seen (token ids, block table, progress:
worker/request_state.py) and receives only what changed each step. Tokens of all scheduled
requests are concatenated into one `[num_tokens]` batch, decodes first then prefill chunks, with
their positions and cache slots (worker/inputs.py); the model runs once over it; logits are
computed only at the last position of requests whose known tokens are now all computed, and
those rows are sampled.

A request verifying draft tokens (speculative decoding) contributes its last token and its k
drafts as one causal chunk (the prefill path of the attention backend); its k + 1 logit rows go
through spec_decode's `RejectionSampler`, and the runner then proposes the next step's drafts
(spec_decode/: the model-free proposers, or the draft model's `DraftModelProposer`).

Structured output: a request with a grammar has a `GrammarMatcher` that follows its output
tokens. Before sampling, the constrained rows' allowed-token bitmasks are filled into one tensor
that the sampler applies to those rows only (worker/grammar_masks.py); each token the request
keeps is then accepted by its matcher. Draft tokens are cut to the prefix the grammar accepts
when proposed (a draft model samples from its masked distribution), and a verified request's
k + 1 rows get the masks of the states after drafts 0..i (walked and rolled back). A preempted
request's matcher is rebuilt from its tokens when it resumes.

A step, `execute_model`: update the request states, the block copies, prepare the inputs, run the
model (and the draft model), prompt logprobs, sample, verify drafts, propose the next drafts.
Start-up, `__init__`: the formats, the CPU kernels, the models (worker/loading.py), the step's
helpers, then the KV caches (worker/kv_cache.py), sized on CUDA by a profiled step
(worker/memory.py), and the disk tier.
"""

from __future__ import annotations

import logging
import time

import torch
from torch import nn

from tokenmill.config import EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput, TierOps
from tokenmill.cpu_isa import native_bf16
from tokenmill.distributed import ParallelGroup, ShardPlan
from tokenmill.distributed.pipeline import pipeline_forward
from tokenmill.layers.attention import BatchLayout
from tokenmill.layers.embedding import QuantizedEmbedding
from tokenmill.layers.sampler import AllowedTokens, Sampler
from tokenmill.layers.step_inputs import StepInputs
from tokenmill.models.loader import LoadedCheckpoint
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.proposers import make_proposer
from tokenmill.spec_decode.rejection import RejectionSampler
from tokenmill.structured.matcher import MaskFiller
from tokenmill.worker.block_copies import copy_blocks, swap_blocks
from tokenmill.worker.cpu import gather_weights
from tokenmill.worker.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs, decode_graphs_unavailable
from tokenmill.worker.disk_store import DiskBlockStore
from tokenmill.worker.grammar_masks import allowed_draft_tokens, allowed_tokens
from tokenmill.worker.inputs import SpecJob, StepBatch, prepare_inputs
from tokenmill.worker.kv_cache import (KVCaches, block_identity, check_backend_reads, kv_bytes_per_token, kv_cache_format,
                                       make_caches)
from tokenmill.worker.loading import activation_thresholds, draft_checkpoint, load_model
from tokenmill.worker.logprobs import prompt_logprobs
from tokenmill.worker.memory import (GRAPH_POOL_MARGIN, GiB, MemoryProfile, kv_cache_budget_bytes, profile_prompt_lens,
                                     worst_case_step)
from tokenmill.worker.request_state import CachedRequestState, append_tokens, sampling_row

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelRunner:
    def __init__(self, config: EngineConfig, checkpoint: LoadedCheckpoint, device: str, dtype: str, max_model_len: int,
                 parallel: ParallelGroup | None = None):
        """parallel: this rank's place when the model is split over ranks (executor/): the runner
        then holds its part of the model and of every layer's KV cache, runs every step it is
        given like the other ranks, and samples what they sample."""
        self.device = torch.device(device)
        self.parallel = parallel
        self.shard = None
        if parallel is not None:  # (what cannot be split is refused by the config and the executor)
            self.shard = ShardPlan(checkpoint.config, parallel.tp_size, parallel.tp_rank, parallel.pp_size, parallel.pp_rank)
        self.dtype = TORCH_DTYPES[dtype]
        # KV cache codes: the compute dtype, float16 under float32, or int8 / fp8 with a float32
        # scale per token and head.
        self.kv_code_dtype, self.kv_quantized = kv_cache_format(config.kv_cache_dtype, self.dtype)
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.vocab_size = checkpoint.config.vocab_size  # the logits' width, and the bitmasks'
        self.attention_backend = config.resolved_attention_backend(self.device.type)
        check_backend_reads(config.kv_cache_dtype, self.attention_backend, self.device)
        self.cpu_kernels = self._load_cpu_kernels(config)
        self._load_models(config, checkpoint)
        self._make_step_helpers(config)
        # Decode-only steps replayed from CUDA graphs (worker/cuda_graphs.py), or why not.
        self.graphs_unavailable = decode_graphs_unavailable(config, self.model.config, self.device.type)
        if self.graphs_unavailable is not None and self.device.type == "cuda":
            logger.info("CUDA graphs: off, decode steps run eagerly (%s)", self.graphs_unavailable)
        self._allocate_caches(config)
        # Last: its threads start here (`close` stops them).
        if config.disk_cache_dir is not None and self.num_host_cache_blocks:
            identity = block_identity(config, checkpoint, self.dtype, self.kv_code_dtype, self.host_cache_kv_caches,
                                      [m.config for m in self.models])
            self.disk_store = DiskBlockStore(config.disk_cache_dir, identity, self.host_cache_kv_caches,
                                             int(config.disk_cache_gb * 2**30), cuda=self.device.type == "cuda")

    # -- start-up ------------------------------------------------------------------------------

    def _load_cpu_kernels(self, config: EngineConfig):
        """tokenmill's compiled CPU kernels (norms, RoPE + KV store, decode and prefill attention
        of the torch backend), or None: not on the CPU, turned off, an fp8 KV cache (the decode
        kernel reads the compute dtype or int8 codes), or they could not be built."""
        if self.device.type != "cpu":
            return None
        kernels = None
        isa = config.resolved_cpu_isa()
        if config.cpu_kernels and config.kv_cache_dtype != "fp8":
            from tokenmill.layers import cpu_kernels

            kernels = cpu_kernels.load(isa)
        logger.info("CPU: instruction-set level %s (kernels %s), %s", isa, "on" if kernels is not None else "off",
                    self.dtype)
        if self.dtype == torch.bfloat16 and not native_bf16(isa):
            logger.warning("dtype bfloat16 at CPU level %s (no native bf16): it runs, many times slower than "
                           "float32 (dtype auto)", isa)
        return kernels

    def _load_models(self, config: EngineConfig, checkpoint: LoadedCheckpoint) -> None:
        """The target model (with activation sparsity when asked) and, with speculative_method
        "draft", the draft model; on a CPU their weights gathered and the compiled decoder on."""
        # Activation sparsity's thresholds, read (and checked against the checkpoint) before the weights load.
        sparsity = self._activation_thresholds(config, checkpoint) if config.activation_sparsity > 0 else None
        t0 = time.perf_counter()
        self.model = self._load_model(checkpoint, config)
        if sparsity is not None:  # the target's linears only (not a draft model's)
            self.model.enable_activation_sparsity(sparsity, config.activation_sparsity_prefill)
        # Speculative decoding with a draft model: its own KV cache, under the same block
        # tables as the target's (same block count and size, its own layer shapes), so every
        # slot the scheduler hands out holds both models' K/V for that token.
        self.draft_model = None
        if config.speculative_method == "draft":
            self.draft_model = self._load_model(draft_checkpoint(config, checkpoint, self.max_model_len), config)
        if self.device.type == "cpu":  # each model's weights back to back, in the order a step reads them
            gathered = sum(gather_weights(m, skip=(nn.Embedding, QuantizedEmbedding)) for m in self.models)
            logger.info("CPU: %.1f MiB of weights gathered into one buffer", gathered / 2**20)
        self.load_seconds = time.perf_counter() - t0
        # Decode-only steps run the decoder layers in one compiled call where every linear has a
        # compiled form (models/base.py: enable_cpu_decoder).
        for m in self.models:
            if self.cpu_kernels is not None and getattr(m.attn_backend, "kernels", None) is self.cpu_kernels:
                m.enable_cpu_decoder(self.cpu_kernels)

    def _load_model(self, checkpoint: LoadedCheckpoint, config: EngineConfig):
        return load_model(checkpoint, config, self.max_model_len, self.device, self.dtype, self.attention_backend,
                          self.cpu_kernels, self.parallel, self.shard)

    @staticmethod
    def _activation_thresholds(config: EngineConfig, checkpoint: LoadedCheckpoint) -> torch.Tensor:
        """[num_layers, 4] thresholds for config.activation_sparsity (models/base.py:
        enable_activation_sparsity), from the model's thresholds file (worker/loading.py)."""
        table = activation_thresholds(config, checkpoint)
        logger.info("activation sparsity %g on %s steps, thresholds from %s", config.activation_sparsity,
                    "all" if config.activation_sparsity_prefill else "decode", table.path)
        return torch.tensor(table.at(config.activation_sparsity))

    def _make_step_helpers(self, config: EngineConfig) -> None:
        """What every step uses besides the models and caches: the samplers, the grammar masks'
        filler, the request states, the drafts' proposers and the step's input buffers."""
        self.sampler = Sampler(seed=config.seed, kernels=self.cpu_kernels)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.mask_filler = MaskFiller(torch.get_num_threads())  # structured output's bitmasks
        self.requests: dict[str, CachedRequestState] = {}
        self.proposer = make_proposer(config)  # n-gram or suffix drafts (None: off, or the draft model's)
        self.disk_store: DiskBlockStore | None = None  # the disk tier, made last (__init__): none in the profiled step
        # Each step's integer inputs, uploaded at once (layers/step_inputs.py), sized for a full
        # token budget's ids, positions and slots.
        self.step_inputs = StepInputs(self.device, capacity=3 * config.max_num_batched_tokens + config.max_num_seqs)
        self.drafter = None if self.draft_model is None else DraftModelProposer(
            self.draft_model, self.sampler, self.block_size, self.max_model_len, self.device, self._metadata,
            sampling_row, self._allowed_tokens)

    def _allocate_caches(self, config: EngineConfig) -> None:
        """The device KV caches (on CUDA sized after a profiled step through execute_model, over a
        scratch cache and without CUDA graphs, which are captured once the real cache exists),
        the swap pool, the prefix cache's host tier, then the CUDA graphs. Split over ranks,
        every count is the smallest rank's: every rank's cache holds its own heads, so the
        scheduler's count fits them all."""
        self.kv_caches: KVCaches = []
        self.draft_kv_caches: KVCaches = []
        self.decode_graphs: DecodeGraphs | None = None
        self.num_blocks = self._min_over_ranks(self._num_kv_blocks(config))
        self.kv_caches = self._make_caches(self.model.config, self.num_blocks, self.device)
        self.draft_kv_caches = self._make_caches(self.draft_model.config, self.num_blocks, self.device) if self.draft_model else []
        # The host pool that preempted requests are swapped out to (pinned for fast copies on CUDA).
        self.num_host_blocks = self._min_over_ranks(
            config.num_host_kv_blocks if config.num_host_kv_blocks is not None
            else self._blocks_for_budget(config.swap_space_gb) if config.swap_space_gb > 0 else 0
        )
        self.host_kv_caches = self._host_caches(self.num_host_blocks)
        # The prefix cache's host tier (separate from the swap pool) and the disk tier below it.
        self.num_host_cache_blocks = self._min_over_ranks(
            self._blocks_for_budget(config.host_cache_gb) if config.host_cache_gb > 0 and config.enable_prefix_caching else 0
        )
        self.host_cache_kv_caches = self._host_caches(self.num_host_cache_blocks)
        if self.graphs_unavailable is None:
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.max_graph_batch(config), self.block_size,
                                              self.max_model_len, self.device)

    def _min_over_ranks(self, count: int) -> int:
        return count if self.parallel is None else self.parallel.min_over_ranks(count)

    def _host_caches(self, num_blocks: int) -> KVCaches:
        """Every model's layer caches in a host pool of `num_blocks` (none: an empty list)."""
        host = ([self._make_caches(m.config, num_blocks, "cpu", host_pool=True) for m in self.models]
                if num_blocks else [[]])
        return [layer for caches in host for layer in caches]

    def _make_caches(self, arch, num_blocks: int, device, host_pool: bool = False) -> KVCaches:
        """The layer caches of a model of `arch` (worker/kv_cache.py: make_caches); a host pool's
        pinned on CUDA, for fast copies."""
        return make_caches(arch, num_blocks, self.block_size, self.kv_code_dtype, self.kv_quantized, device,
                           host_pool=host_pool, pin=host_pool and self.device.type == "cuda")

    @property
    def models(self) -> list:
        """The target model, then the draft model when there is one."""
        return [self.model] if self.draft_model is None else [self.model, self.draft_model]

    def kv_bytes_per_token(self) -> int:
        """Both models' K and V for one token (the draft model's too, when there is one), with
        the scales of a quantized cache (one float32 per KV head)."""
        return kv_bytes_per_token([m.config for m in self.models], self.kv_code_dtype, self.kv_quantized)

    @property
    def bytes_per_block(self) -> int:
        return self.block_size * self.kv_bytes_per_token()

    def _blocks_for_budget(self, memory_gb: float) -> int:
        return max(1, int(memory_gb * 2**30) // self.bytes_per_block)

    # -- KV cache sizing -----------------------------------------------------------------------

    def _num_kv_blocks(self, config: EngineConfig) -> int:
        """num_kv_blocks if given; else the blocks of kv_cache_memory_gb (CPU_KV_CACHE_MEMORY_GB
        on CPU when not given); else, on CUDA, what gpu_memory_utilization leaves."""
        if config.num_kv_blocks is not None:
            return config.num_kv_blocks
        memory_gb = config.resolved_kv_cache_memory_gb(self.device.type)
        if memory_gb is not None:
            return self._blocks_for_budget(memory_gb)
        return self._blocks_for_gpu_memory(config)

    @staticmethod
    def max_graph_batch(config: EngineConfig) -> int:
        """The largest decode batch captured in a CUDA graph."""
        return min(config.max_num_seqs, MAX_GRAPH_BATCH)

    def _profiled_peak(self, run) -> int:
        """The peak bytes allocated on CUDA while `run()` runs, above what was live before it
        and less what `run` returns (its scratch KV cache)."""
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.empty_cache()
        live_before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        scratch_bytes = run()
        torch.cuda.synchronize(dev)
        return max(0, torch.cuda.max_memory_allocated(dev) - live_before - scratch_bytes)

    def _blocks_for_gpu_memory(self, config: EngineConfig) -> int:
        """KV blocks on CUDA: profile the worst-case step with the weights loaded (and, when
        decode steps will replay CUDA graphs, the largest captured step, whose activations the
        graphs' memory pool holds from capture on), then give the cache what
        gpu_memory_utilization of the device leaves (`memory.kv_cache_budget_bytes`)."""
        dev = self.device
        peak = self._profiled_peak(lambda: self.run_worst_case_step(config))
        graph_pool = 0
        if self.graphs_unavailable is None:
            graph_pool = GRAPH_POOL_MARGIN * self._profiled_peak(lambda: self.run_graph_step(config))
        torch.cuda.empty_cache()  # so that `free` counts the steps' released memory as free
        free, total = torch.cuda.mem_get_info(dev)
        profile = MemoryProfile(total=total, free=free, torch_allocated=torch.cuda.memory_allocated(dev),
                                torch_reserved=torch.cuda.memory_reserved(dev), peak_activation=peak,
                                graph_pool=graph_pool)
        # The PyTorch backend's attention gathers, one layer at a time, the K/V of the blocks it
        # reads into the compute dtype (decodes: every decoding sequence's, padded per length
        # group): each block of the cache is given room for twice its one-layer gathered copy, in
        # the larger layer of the target and draft models (they run one after the other).
        gather = 0
        if self.attention_backend == "torch":
            gather = max(2 * 2 * self.block_size * m.config.num_key_value_heads * m.config.head_dim * self.dtype.itemsize
                         for m in self.models)
        per_block = self.bytes_per_block + gather
        blocks_per_request = -(-self.max_model_len // self.block_size)
        budget = kv_cache_budget_bytes(profile, config.gpu_memory_utilization, blocks_per_request * per_block)
        num_blocks = budget // per_block
        logger.info(
            "GPU memory: %.2f GiB x gpu_memory_utilization %g = %.2f GiB: weights %.2f GiB, peak activations "
            "%.2f GiB (profiled step of %d tokens), %soutside torch %.2f GiB (CUDA context, other processes), "
            "%sKV cache %.2f GiB = %d blocks = %d tokens in flight at most (%.1f requests of max_model_len %d)",
            total / GiB, config.gpu_memory_utilization, config.gpu_memory_utilization * total / GiB,
            profile.torch_allocated / GiB, peak / GiB,
            sum(profile_prompt_lens(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)),
            f"CUDA graph pool {graph_pool / GiB:.2f} GiB ({GRAPH_POOL_MARGIN} x the profiled decode step of "
            f"{self.max_graph_batch(config)}), " if graph_pool else "",
            profile.non_torch / GiB,
            f"the torch attention backend's gathered K/V {num_blocks * gather / GiB:.2f} GiB, " if gather else "",
            num_blocks * self.bytes_per_block / GiB, num_blocks, num_blocks * self.block_size,
            num_blocks / blocks_per_request, self.max_model_len,
        )
        return num_blocks

    @torch.inference_mode()
    def run_worst_case_step(self, config: EngineConfig) -> int:
        """Run the largest step the scheduler can hand over through execute_model, over a scratch
        KV cache of just its blocks, and return that cache's bytes.

        The step (`memory.profile_prompt_lens`): the whole max_num_batched_tokens as prompts of
        as many requests as may run (max_num_seqs), the first as long as max_model_len allows.
        Every request is sampled along the sampler's costliest path (`memory.worst_case_step`).
        With speculation the runner also proposes drafts (the draft model runs over every token).
        Not covered: a prefill chunk over a long cached context and decodes over long contexts
        (their attention reads the cache; what the PyTorch backend gathers on the side is
        reserved by `_blocks_for_gpu_memory`).

        Runs only on an idle runner and leaves no trace: no request state, the caches as they
        were, and the sampler's shared generator untouched (the rows are seeded)."""
        assert not self.requests, "the profiling step runs before any request"
        step, num_blocks = worst_case_step(config, self.block_size, self.max_model_len)
        saved = self.kv_caches, self.draft_kv_caches
        self.kv_caches = self._make_caches(self.model.config, num_blocks, self.device)
        self.draft_kv_caches = self._make_caches(self.draft_model.config, num_blocks, self.device) if self.draft_model else []
        try:
            self.execute_model(step)
        finally:
            self.requests.clear()
            self.kv_caches, self.draft_kv_caches = saved
        return num_blocks * self.bytes_per_block

    @torch.inference_mode()
    def run_graph_step(self, config: EngineConfig) -> int:
        """Run eagerly the decode step the largest CUDA graph captures (every row padding: no
        cache slot written or read) over a scratch KV cache of one block, with static buffers of
        its own like the real graphs'; return that cache's bytes."""
        scratch = self._make_caches(self.model.config, 1, self.device)
        DecodeGraphs(self.model, scratch, self.max_graph_batch(config), self.block_size, self.max_model_len,
                     self.device, capture=False).run_largest()
        return sum(t.numel() * t.element_size() for layer in scratch for t in layer)

    def _swap(self, copies: list[tuple[int, int]], out: bool) -> None:
        """Copy whole blocks between the device cache and the host pool, every layer: out,
        (device block, host block) pairs; in, (host block, device block)."""
        if copies:  # (none in the profiled step, which runs before the host pool exists)
            swap_blocks(self.kv_caches + self.draft_kv_caches, self.host_kv_caches, copies, out)

    def _move_between_tiers(self, ops: TierOps) -> None:
        """The prefix cache's copies (core/cache_tiers.py): evicted blocks into host slots, those
        slots to disk, disk reads started, host slots into device blocks."""
        device_caches = self.kv_caches + self.draft_kv_caches
        if ops.demote:
            swap_blocks(device_caches, self.host_cache_kv_caches, ops.demote, out=True)
        if self.disk_store is not None:
            self.disk_store.store(ops.disk_store)
            self.disk_store.read(ops.disk_read)
        if ops.promote:
            swap_blocks(device_caches, self.host_cache_kv_caches, ops.promote, out=False)

    @torch.inference_mode()
    def persist(self, ops: TierOps, timeout: float) -> bool:
        """Run a batch of the prefix cache's shutdown writes (`KVCacheManager.persist_batches`)
        and wait up to `timeout` seconds for them to reach disk; whether they did."""
        self._move_between_tiers(ops)
        return self.disk_store.drain(timeout)

    def close(self) -> None:
        """Stop the disk tier's threads once its queued writes are done. Idempotent."""
        if self.disk_store is not None:
            self.disk_store.close()

    # -- one step ------------------------------------------------------------------------------

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        """One step: the request states and block copies the schedule brings, then (when it has
        tokens) the flat batch, the forward pass, prompt logprobs, sampling, the verification
        of drafts and the next step's drafts."""
        self._update_states(sched)
        self._copy_blocks(sched)
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        batch = prepare_inputs(self.requests, sched, self.block_size, self.step_inputs)
        hidden = self._run_model(batch, drafted=self.draft_model is not None and sched.propose_drafts)
        out = ModelRunnerOutput(sampled_token_ids={})
        prompt_logprobs(self.model, hidden, batch.prompt_lp_jobs, self.requests, self.device, out)
        if not batch.sample_req_ids and not batch.spec_jobs:
            return out
        self._sample_and_verify(hidden, batch, out)
        if sched.propose_drafts:
            self._propose(sched.num_drafts_to_propose, out)
        return out

    def _update_states(self, sched: SchedulerOutput) -> None:
        """What the schedule changed: finished and preempted requests dropped (what a finished
        one generated handed to the proposer), new and resumed ones added, running ones given
        their new blocks and progress."""
        if self.proposer is not None:  # what a finished request generated may feed later drafts
            for req_id in sched.finished_req_ids:
                state = self.requests.get(req_id)
                if state is None:  # (ended while preempted: nothing of it is here)
                    self.proposer.drop(req_id)
                else:
                    self.proposer.finish(req_id, state.token_ids, state.num_prompt_tokens)
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.requests.pop(req_id, None)
        for data in sched.scheduled_new_reqs:
            self.requests[data.req_id] = CachedRequestState.from_new(data)
        for data in sched.scheduled_cached_reqs:
            state = self.requests[data.req_id]
            state.block_ids.extend(data.new_block_ids)
            state.num_computed_tokens = data.num_computed_tokens

    def _copy_blocks(self, sched: SchedulerOutput) -> None:
        """The step's block copies, before its forward pass (a block swapped out this step may be
        reused by this step's tokens): swap-out, the prefix cache's tiers, swap-in, copy-on-write."""
        self._swap(sched.blocks_to_swap_out, out=True)
        self._move_between_tiers(sched.tier_ops)
        self._swap(sched.blocks_to_swap_in, out=False)
        copy_blocks(self.kv_caches + self.draft_kv_caches, sched.blocks_to_copy)  # copy-on-write, in order

    def _run_model(self, batch: StepBatch, drafted: bool) -> torch.Tensor:
        """The forward pass over the flat batch, [num_tokens, hidden]: a CUDA graph's replay for a
        decode-only step that fits one, the pipeline over ranks, or the eager model (then, when
        `drafted`, the draft model's). Counts the batch's tokens as computed."""
        inputs, layout = self.step_inputs, batch.layout
        if self.decode_graphs is not None and not layout.prefill_query_lens and self.decode_graphs.fits(len(batch.input_ids)):
            inputs.upload()
            hidden = self.decode_graphs.run(batch.input_ids, batch.positions, layout)
        elif self.parallel is not None and self.parallel.pp_size > 1:
            inputs.upload()
            hidden = pipeline_forward(self.model, self.parallel, batch.input_ids, batch.positions, layout, self.kv_caches)
        else:
            hidden = self._forward_eager(batch, drafted)
        for req_id, num_new in batch.order:
            state = self.requests[req_id]
            state.num_computed_tokens += num_new
            if drafted:  # caught up, then this step's tokens
                state.draft_num_computed = state.num_computed_tokens
        return hidden

    def _forward_eager(self, batch: StepBatch, drafted: bool) -> torch.Tensor:
        """The model's forward over the batch; with `drafted`, then the draft model's (a draft
        model is the eager path's only: it rules out CUDA graphs and ranks)."""
        inputs = self.step_inputs
        meta = self._metadata(self.model, batch.layout, inputs)
        input_t, positions_t = inputs.longs(batch.input_ids), inputs.longs(batch.positions)
        inputs.upload()
        hidden = self.model(input_t, positions_t, self.kv_caches, meta)
        if drafted:
            # The draft model's K/V follows every computed token while anyone speculates (under
            # load no draft model runs, and requests catch up here once speculation resumes).
            self.drafter.forward(self.requests, batch.order, input_t, positions_t, meta, self.draft_kv_caches)
        return hidden

    def _metadata(self, model, layout: BatchLayout, inputs: StepInputs):
        """`model`'s attention metadata for a forward pass: the Triton backend's tensors are
        staged in `inputs` (valid once it uploads, with the pass's token ids and positions);
        the PyTorch backend builds its own."""
        if self.attention_backend == "triton":
            return model.attn_backend.build_metadata(layout, self.device, inputs)
        return model.attn_backend.build_metadata(layout, self.device)

    def _sample_and_verify(self, hidden: torch.Tensor, batch: StepBatch, out: ModelRunnerOutput) -> None:
        """Logits at the batch's sampled rows: a token for each plainly sampled request, then the
        verified tokens of each request with drafts."""
        logits = self.model.compute_logits(hidden[batch.sampled_rows])  # [num_sampled, vocab]
        num_plain = len(batch.sample_req_ids)
        if num_plain:
            self._sample(logits[:num_plain] if batch.spec_jobs else logits, batch.sample_req_ids, out)
        if batch.spec_jobs:
            self._verify(logits[num_plain:], batch.spec_jobs, out)

    def _sample(self, logits: torch.Tensor, req_ids: list[str], out: ModelRunnerOutput) -> None:
        """One token for each of `req_ids` (logits: one row each, in order)."""
        states = [self.requests[req_id] for req_id in req_ids]
        rows = [sampling_row(state) for state in states]
        allowed = self._allowed_tokens(states)
        sampled = self.sampler(logits, rows, allowed)
        for i, req_id in enumerate(req_ids):
            token_id = sampled.token_ids[i]
            append_tokens(states[i], [token_id])
            out.sampled_token_ids[req_id] = [token_id]
            if rows[i].params.logprobs is not None:
                out.logprobs[req_id] = [sampled.logprobs[i]]
                out.top_logprobs[req_id] = [sampled.top_logprobs[i]]

    def _verify(self, logits: torch.Tensor, jobs: list[SpecJob], out: ModelRunnerOutput) -> None:
        """Accept or reject the drafts of `jobs` (logits: each job's 1 + k rows, in order)."""
        rows = [
            sampling_row(self.requests[req_id], drafts[:i])
            for req_id, _, drafts in jobs for i in range(len(drafts) + 1)
        ]
        draft_probs = None
        if self.draft_model is not None:
            draft_probs = torch.cat([self.requests[req_id].draft_probs[: len(drafts)] for req_id, _, drafts in jobs])
        allowed = allowed_draft_tokens([(self.requests[req_id], drafts) for req_id, _, drafts in jobs], self.vocab_size)
        verified = self.rejection_sampler.verify(logits, rows, [drafts for _, _, drafts in jobs], draft_probs, allowed)
        for j, (req_id, _, drafts) in enumerate(jobs):
            state = self.requests[req_id]
            tokens = verified.token_ids[j]
            append_tokens(state, tokens)
            state.num_computed_tokens -= len(drafts) + 1 - len(tokens)  # rejected drafts' KV is not kept
            state.draft_num_computed = min(state.draft_num_computed, state.num_computed_tokens)
            out.sampled_token_ids[req_id] = tokens
            if state.sampling_params.logprobs is not None:
                out.logprobs[req_id] = verified.logprobs[j]
                out.top_logprobs[req_id] = verified.top_logprobs[j]

    def _propose(self, num_drafts: dict[str, int], out: ModelRunnerOutput) -> None:
        """The next step's drafts of every request that got tokens this step (spec_decode/): the
        model-free proposer's, cut to what the request's grammar accepts, or the draft model's."""
        if self.proposer is not None:
            for req_id in out.sampled_token_ids:
                k = num_drafts.get(req_id, 0)
                state = self.requests[req_id]
                params = state.sampling_params
                drafts = self.proposer.propose(req_id, state.token_ids, k, shared=params.seed is None or params.greedy)
                if drafts and state.grammar is not None:  # verify only what the grammar allows
                    drafts = drafts[: state.grammar.num_valid_drafts(drafts)]
                if drafts:
                    out.spec_token_ids[req_id] = drafts
        elif self.draft_model is not None:
            out.spec_token_ids.update(self.drafter.propose(self.requests, list(out.sampled_token_ids), num_drafts,
                                                           self.draft_kv_caches))

    def _allowed_tokens(self, states: list[CachedRequestState]) -> AllowedTokens | None:
        """The bitmasks of the constrained ones among `states` (one row each, in order), or None
        (worker/grammar_masks.py)."""
        return allowed_tokens(states, self.vocab_size, self.mask_filler)
