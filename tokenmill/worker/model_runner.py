"""Turns a SchedulerOutput into one forward pass over a flat token batch, then samples.

The runner keeps the state of every request it has seen (token ids, block table, progress)
and receives only what changed each step. Tokens of all scheduled requests are concatenated
into one `[num_tokens]` batch, decodes first then prefill chunks, with their positions and
cache slots; the model runs once over it; logits are computed only at the last position of
requests whose known tokens are now all computed, and those rows are sampled.

A request verifying draft tokens (speculative decoding) contributes its last token and its k
drafts as one causal chunk (the prefill path of the attention backend); its k + 1 logit rows go
through spec_decode's `RejectionSampler`, and the runner then proposes the next step's drafts
(spec_decode/: the model-free proposers, or the draft model's `DraftModelProposer`).

Structured output: a request with a grammar has a `GrammarMatcher` that follows its output
tokens. Before sampling, the constrained rows' allowed-token bitmasks are filled into one tensor
that the sampler applies to those rows only; each token the request keeps is then accepted by
its matcher. Draft tokens are cut to the prefix the grammar accepts when proposed (a draft
model samples from its masked distribution), and a verified request's k + 1 rows get the masks
of the states after drafts 0..i (walked and rolled back). A preempted request's matcher is
rebuilt from its tokens when it resumes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.outputs import ModelRunnerOutput, NewRequestData, SchedulerOutput, TierOps
from tokenmill.distributed import ParallelGroup, ShardPlan
from tokenmill.distributed.pipeline import pipeline_forward
from tokenmill.layers.attention import BatchLayout
from tokenmill.layers.attention.kv_quant import KV_CODE_DTYPES, KV_STORE_DTYPES
from tokenmill.layers.cpu_isa import native_bf16
from tokenmill.layers.embedding import QuantizedEmbedding
from tokenmill.layers.sampler import AllowedTokens, Sampler, SamplingRow
from tokenmill.models import build_model
from tokenmill.models.loader import LoadedCheckpoint, load_checkpoint
from tokenmill.models.registry import resolve_model
from tokenmill.models.streaming import load_streaming
from tokenmill.quantization.quantize import QuantConfig, load_quantized_weights, quant_config_from_checkpoint, quantized_tensors
from tokenmill.sampling_params import SamplingParams
from tokenmill.spec_decode.draft_model import DraftModelProposer
from tokenmill.spec_decode.proposers import make_proposer
from tokenmill.spec_decode.rejection import RejectionSampler
from tokenmill.structured.bitmask import allocate_bitmask
from tokenmill.structured.matcher import GrammarMatcher, MaskFiller
from tokenmill.worker.block_copies import copy_blocks, swap_blocks
from tokenmill.worker.disk_store import DiskBlockStore, cache_identity
from tokenmill.worker.cpu import gather_weights
from tokenmill.worker.cuda_graphs import MAX_GRAPH_BATCH, DecodeGraphs, decode_graphs_unavailable
from tokenmill.worker.memory import GRAPH_POOL_MARGIN, GiB, MemoryProfile, kv_cache_budget_bytes, profile_prompt_lens
from tokenmill.layers.step_inputs import StepInputs

logger = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CachedRequestState:
    req_id: str
    token_ids: list[int]  # prompt + every sampled token
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # Draft-model speculation: the draft's distribution for each proposed token; and how many
    # of the request's first tokens have their draft K/V in the cache (steps run while nobody
    # speculates skip the draft model; its K/V is caught up when speculation resumes). K/V
    # adopted from the prefix cache or kept through a swap is counted as present.
    draft_probs: torch.Tensor | None = None
    draft_num_computed: int = 0
    # Structured output: where the output so far leaves the request in its grammar.
    grammar: GrammarMatcher | None = None

    @classmethod
    def from_new(cls, data: NewRequestData) -> "CachedRequestState":
        state = cls(
            data.req_id,
            list(data.token_ids),
            data.num_prompt_tokens,
            data.sampling_params,
            data.eos_token_ids,
            list(data.block_ids),
            data.num_computed_tokens,
            draft_num_computed=data.num_computed_tokens,
        )
        if data.grammar is not None:  # new, or resumed after preemption: replay the output so far
            state.grammar = GrammarMatcher(data.grammar)
            output = state.token_ids[state.num_prompt_tokens :]
            if state.grammar.accept(output) != len(output):
                _drop_grammar(state, output)
        return state


def _drop_grammar(state: CachedRequestState, token_ids: list[int]) -> None:
    """A token the grammar rejects reached a constrained request: the masks allow only tokens
    it accepts, so this is a backend bug. The request goes on unconstrained rather than stop
    the engine."""
    logger.error("%s: tokens %s are outside its grammar; it continues without the constraint", state.req_id, token_ids)
    state.grammar = None


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
        self.kv_code_dtype = {**KV_CODE_DTYPES, **KV_STORE_DTYPES}.get(config.kv_cache_dtype, self.dtype)
        self.kv_quantized = config.kv_cache_dtype in KV_CODE_DTYPES
        if config.kv_cache_dtype in KV_STORE_DTYPES and self.dtype != torch.float32:
            raise ConfigError("kv_cache_dtype", f"{config.kv_cache_dtype} stores a float32 model's keys and values in "
                              f"half the bytes; this model computes in {dtype} (use auto, int8 or fp8)")
        self.block_size = config.block_size
        self.max_model_len = max_model_len
        self.vocab_size = checkpoint.config.vocab_size  # the logits' width, and the bitmasks'
        self.attention_backend = config.resolved_attention_backend(self.device.type)
        if self.attention_backend == "triton" and config.kv_cache_dtype in KV_STORE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"{config.kv_cache_dtype} is read by the torch attention backend and "
                              "the CPU kernels; with the triton backend use auto, int8 or fp8")
        if (self.device.type == "cuda" and self.attention_backend == "triton" and config.kv_cache_dtype == "fp8"
                and torch.cuda.get_device_capability(self.device) < (8, 9)):
            raise ConfigError("kv_cache_dtype", "fp8 with the triton attention backend needs a GPU of compute "
                              "capability 8.9+ (Ada, Hopper; Triton has no e4m3 type below); use int8, or "
                              "--attention-backend torch")
        # tokenmill's compiled CPU kernels (norms, RoPE + KV store, decode and prefill attention of
        # the torch backend), or None: not on the CPU, turned off, an fp8 KV cache (the decode kernel reads
        # the compute dtype or int8 codes), or they could not be built.
        self.cpu_kernels = None
        if self.device.type == "cpu":
            isa = config.resolved_cpu_isa()
            if config.cpu_kernels and config.kv_cache_dtype != "fp8":
                from tokenmill.layers import cpu_kernels

                self.cpu_kernels = cpu_kernels.load(isa)
            logger.info("CPU: instruction-set level %s (kernels %s), %s", isa,
                        "on" if self.cpu_kernels is not None else "off", self.dtype)
            if self.dtype == torch.bfloat16 and not native_bf16(isa):
                logger.warning("dtype bfloat16 at CPU level %s (no native bf16): it runs, many times slower than "
                               "float32 (dtype auto)", isa)
        # Activation sparsity's thresholds, read (and checked against the checkpoint) before the weights load.
        sparsity = self._activation_thresholds(config, checkpoint) if config.activation_sparsity > 0 else None
        t0 = time.perf_counter()
        self.model = self._load_model(checkpoint, config, max_model_len)
        if sparsity is not None:  # the target's linears only (not a draft model's)
            self.model.enable_activation_sparsity(sparsity, config.activation_sparsity_prefill)
        # Speculative decoding with a draft model: its own KV cache, under the same block
        # tables as the target's (same block count and size, its own layer shapes), so every
        # slot the scheduler hands out holds both models' K/V for that token.
        self.draft_model = None
        if config.speculative_method == "draft":
            self.draft_model = self._load_draft(config, checkpoint, max_model_len)
        if self.device.type == "cpu":  # each model's weights back to back, in the order a step reads them
            gathered = sum(gather_weights(m, skip=(nn.Embedding, QuantizedEmbedding)) for m in self.models)
            logger.info("CPU: %.1f MiB of weights gathered into one buffer", gathered / 2**20)
        self.load_seconds = time.perf_counter() - t0
        # Decode-only steps run the decoder layers in one compiled call where every linear has a
        # compiled form (models/llama.py: enable_cpu_decoder).
        for m in self.models:
            if self.cpu_kernels is not None and getattr(m.attn_backend, "kernels", None) is self.cpu_kernels:
                m.enable_cpu_decoder(self.cpu_kernels)
        self.sampler = Sampler(seed=config.seed, kernels=self.cpu_kernels)
        self.rejection_sampler = RejectionSampler(self.sampler)
        self.mask_filler = MaskFiller(torch.get_num_threads())  # structured output's bitmasks
        self.requests: dict[str, CachedRequestState] = {}
        self.proposer = make_proposer(config)  # n-gram or suffix drafts (None: off, or the draft model's)
        self.disk_store: DiskBlockStore | None = None  # the disk tier, made last (below): none in the profiled step
        # Each step's integer inputs, uploaded at once (layers/step_inputs.py), sized for a full
        # token budget's ids, positions and slots.
        self.step_inputs = StepInputs(self.device, capacity=3 * config.max_num_batched_tokens + config.max_num_seqs)
        self.drafter = None if self.draft_model is None else DraftModelProposer(
            self.draft_model, self.sampler, self.block_size, max_model_len, self.device, self._metadata,
            self._sampling_row, self._allowed_tokens)
        # Decode-only steps replayed from CUDA graphs (worker/cuda_graphs.py), or why not.
        self.graphs_unavailable = decode_graphs_unavailable(config, self.model.config, self.device.type)
        if self.graphs_unavailable is not None and self.device.type == "cuda":
            logger.info("CUDA graphs: off, decode steps run eagerly (%s)", self.graphs_unavailable)
        # Sized below (on CUDA after a profiled step through execute_model, over a scratch cache
        # and without CUDA graphs, which are captured once the real cache exists).
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.draft_kv_caches: list[tuple[torch.Tensor, ...]] = []
        self.decode_graphs: DecodeGraphs | None = None
        self.num_blocks = self._num_kv_blocks(config)
        if parallel is not None:  # every rank's cache holds its own heads: the scheduler's count fits them all
            self.num_blocks = parallel.min_over_ranks(self.num_blocks)
        self.kv_caches = self._make_caches(self.model.config, self.num_blocks, self.device)
        self.draft_kv_caches = self._make_caches(self.draft_model.config, self.num_blocks, self.device) if self.draft_model else []
        # The host pool that preempted requests are swapped out to (pinned for fast copies on CUDA).
        self.num_host_blocks = (
            config.num_host_kv_blocks if config.num_host_kv_blocks is not None
            else self._blocks_for_budget(config.swap_space_gb) if config.swap_space_gb > 0 else 0
        )
        if parallel is not None:
            self.num_host_blocks = parallel.min_over_ranks(self.num_host_blocks)
        host = ([self._make_caches(m.config, self.num_host_blocks, "cpu", host_pool=True) for m in self.models]
                if self.num_host_blocks else [[]])
        self.host_kv_caches = [layer for caches in host for layer in caches]
        # The prefix cache's host tier (separate from the swap pool) and the disk tier below it.
        self.num_host_cache_blocks = (self._blocks_for_budget(config.host_cache_gb)
                                      if config.host_cache_gb > 0 and config.enable_prefix_caching else 0)
        if parallel is not None:
            self.num_host_cache_blocks = parallel.min_over_ranks(self.num_host_cache_blocks)
        tier = ([self._make_caches(m.config, self.num_host_cache_blocks, "cpu", host_pool=True) for m in self.models]
                if self.num_host_cache_blocks else [[]])
        self.host_cache_kv_caches = [layer for caches in tier for layer in caches]
        if self.graphs_unavailable is None:
            self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.max_graph_batch(config), self.block_size,
                                              max_model_len, self.device)
        # Last: its threads start here (`close` stops them).
        if config.disk_cache_dir is not None and self.num_host_cache_blocks:
            self.disk_store = DiskBlockStore(config.disk_cache_dir, self._cache_identity(config, checkpoint),
                                             self.host_cache_kv_caches, int(config.disk_cache_gb * 2**30),
                                             cuda=self.device.type == "cuda")

    def _cache_identity(self, config: EngineConfig, checkpoint: LoadedCheckpoint) -> bytes:
        """What decides a KV block's bytes besides its tokens (worker/disk_store.py): the
        model's files and shape, the draft model's, precision, quantization, KV-cache dtype and
        layout, block size."""
        from tokenmill.sparsity.thresholds import model_identity

        fields = {
            "model": model_identity(checkpoint.source, checkpoint.config)["fingerprint"],
            "draft_model": config.draft_model and str(resolve_model(config.draft_model)),
            "dtype": str(self.dtype), "kv_cache_dtype": config.kv_cache_dtype, "kv_code_dtype": str(self.kv_code_dtype),
            "block_size": self.block_size,
            "layout": [[list(t.shape[1:]), str(t.dtype)] for t in (self.host_cache_kv_caches[0] if self.host_cache_kv_caches else ())],
            "layers": [(m.config.num_hidden_layers, m.config.num_key_value_heads, m.config.head_dim) for m in self.models],
            "quantization": [config.quantization, config.quantization_group_size, config.quantization_lm_head,
                             config.quantization_algorithm, config.calibration, config.calibration_samples,
                             config.calibration_seq_len, config.smoothquant_alpha],
            "activation_sparsity": [config.activation_sparsity, config.activation_sparsity_prefill,
                                    config.activation_sparsity_file],
        }
        return cache_identity(fields)

    def _load_model(self, checkpoint: LoadedCheckpoint, config: EngineConfig, max_model_len: int):
        qconfig = QuantConfig.from_engine(config, checkpoint)

        def build(device: str = "cpu"):
            return build_model(checkpoint, max_model_len, self.dtype, self.attention_backend, self.cpu_kernels, device,
                               self.parallel, self.shard)

        if checkpoint.quantization is None and (qconfig is None or qconfig.algorithm == "rtn"):
            return load_streaming(checkpoint, build, self.device, self.dtype, qconfig, self.cpu_kernels, self.shard)
        assert self.parallel is None, "a model split over ranks loads through load_streaming"
        model = build()
        if checkpoint.quantization is not None:  # written by `tokenmill quantize`
            if qconfig is not None:
                raise ConfigError("quantization", f"{checkpoint.source} is already quantized "
                                  f"({checkpoint.quantization.get('method')}); leave quantization auto")
            tensors, qconfig = dict(checkpoint.weights()), quant_config_from_checkpoint(checkpoint.quantization)
        else:
            # Exactly the tensors `tokenmill quantize` writes (quantized from the fp32 weights,
            # calibrated in fp32 with PyTorch's ops), then loaded as a saved checkpoint is.
            tensors = quantized_tensors(checkpoint, qconfig, self.device, torch.float32)
        load_quantized_weights(model, tensors, qconfig, self.device, self.dtype, self.cpu_kernels)
        return model.eval()

    @staticmethod
    def _activation_thresholds(config: EngineConfig, checkpoint: LoadedCheckpoint) -> torch.Tensor:
        """[num_layers, 4] thresholds for config.activation_sparsity (models/llama.py:
        enable_activation_sparsity), from the model's thresholds file (sparsity/thresholds.py), which
        must have been calibrated for this checkpoint."""
        from tokenmill.sparsity.thresholds import find_thresholds, load_thresholds, model_identity

        identity = model_identity(checkpoint.source, checkpoint.config)
        table = load_thresholds(find_thresholds(checkpoint.source, identity, config.activation_sparsity_file), identity)
        logger.info("activation sparsity %g on %s steps, thresholds from %s", config.activation_sparsity,
                    "all" if config.activation_sparsity_prefill else "decode", table.path)
        return torch.tensor(table.at(config.activation_sparsity))

    def _load_draft(self, config: EngineConfig, target: LoadedCheckpoint, max_model_len: int):
        draft = load_checkpoint(resolve_model(config.draft_model))
        if draft.config.vocab_size != target.config.vocab_size or draft.tokenizer.get_vocab() != target.tokenizer.get_vocab():
            raise ConfigError(
                "draft_model",
                f"{draft.source.name} does not share the vocabulary of {target.source.name} "
                f"({draft.config.vocab_size} vs {target.config.vocab_size} token ids, or different tokens)",
            )
        if draft.config.max_position_embeddings < max_model_len:
            raise ConfigError("draft_model", f"{draft.source.name} has a context of {draft.config.max_position_embeddings} "
                              f"tokens, less than max_model_len {max_model_len}")
        return self._load_model(draft, config, max_model_len)

    def _make_caches(self, arch, num_blocks: int, device, host_pool: bool = False) -> list[tuple[torch.Tensor, ...]]:
        """Per layer (key, value) caches, or (key codes, value codes, key scales, value scales)
        when quantized: the layouts of `layers.attention.backend`. The device cache is zeroed
        (padded attention reads unwritten slots, masked); the host pool, whose blocks are always
        written before they are read, is left uninitialized and costs no memory until used."""
        shape = (num_blocks, self.block_size, arch.num_key_value_heads, arch.head_dim)
        pin = host_pool and self.device.type == "cuda"  # host pool: pinned for fast copies
        specs = [(shape, self.kv_code_dtype)] * 2 + ([(shape[:-1], torch.float32)] * 2 if self.kv_quantized else [])
        make = torch.empty if host_pool else torch.zeros
        return [
            tuple(make(s, dtype=dt, device=device, pin_memory=pin) for s, dt in specs)
            for _ in range(arch.num_hidden_layers)
        ]

    @property
    def models(self) -> list:
        """The target model, then the draft model when there is one."""
        return [self.model] if self.draft_model is None else [self.model, self.draft_model]

    def kv_bytes_per_token(self) -> int:
        """Both models' K and V for one token (the draft model's too, when there is one), with
        the scales of a quantized cache (one float32 per KV head)."""
        scale_bytes = 4 if self.kv_quantized else 0
        return sum(
            2 * c.num_hidden_layers * c.num_key_value_heads * (c.head_dim * self.kv_code_dtype.itemsize + scale_bytes)
            for c in (m.config for m in self.models)
        )

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
        Every request is sampled along the sampler's costliest path, so its fp32 [rows, vocab]
        tensors are as large as they get: top-p alone and so close to 1 that no row is settled
        by its top candidates (each is sorted in full), min-p, repetition / frequency / presence
        penalties over an output token (each request is a resumed one whose last token is
        output), 20 logprobs and prompt logprobs. With speculation the runner also proposes
        drafts (the draft model runs over every token). Not covered: a prefill chunk over a long
        cached context and decodes over long contexts (their attention reads the cache; what
        the PyTorch backend gathers on the side is reserved by `_blocks_for_gpu_memory`).

        Runs only on an idle runner and leaves no trace: no request state, the caches as they
        were, and the sampler's shared generator untouched (the rows are seeded)."""
        assert not self.requests, "the profiling step runs before any request"
        params = SamplingParams(temperature=1.0, top_p=1 - 1e-6, min_p=0.01, repetition_penalty=1.1,
                                frequency_penalty=0.1, presence_penalty=0.1, logprobs=20, prompt_logprobs=True,
                                seed=0, max_tokens=1)
        new_reqs = []
        num_blocks = 0
        for i, n in enumerate(profile_prompt_lens(config.max_num_batched_tokens, config.max_num_seqs, self.max_model_len)):
            blocks = list(range(num_blocks, num_blocks + -(-n // self.block_size)))
            num_prompt = max(1, n - 1)  # the last token, if there are two, is output
            new_reqs.append(NewRequestData(f"profile-{i}", [0] * n, num_prompt, params, [], blocks, 0))
            num_blocks += len(blocks)
        saved = self.kv_caches, self.draft_kv_caches
        self.kv_caches = self._make_caches(self.model.config, num_blocks, self.device)
        self.draft_kv_caches = self._make_caches(self.draft_model.config, num_blocks, self.device) if self.draft_model else []
        try:
            self.execute_model(SchedulerOutput(
                scheduled_new_reqs=new_reqs,
                scheduled_cached_reqs=[],
                num_scheduled_tokens={r.req_id: len(r.token_ids) for r in new_reqs},
                total_num_scheduled_tokens=sum(len(r.token_ids) for r in new_reqs),
                propose_drafts=config.speculative_method is not None,
                num_drafts_to_propose={r.req_id: config.num_speculative_tokens for r in new_reqs},
            ))
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

    def _update_states(self, sched: SchedulerOutput) -> None:
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

    @torch.inference_mode()
    def execute_model(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        # Block copies first: a block swapped out this step may be reused by this step's tokens.
        self._swap(sched.blocks_to_swap_out, out=True)
        self._move_between_tiers(sched.tier_ops)
        self._swap(sched.blocks_to_swap_in, out=False)
        copy_blocks(self.kv_caches + self.draft_kv_caches, sched.blocks_to_copy)  # copy-on-write, in order
        if sched.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput(sampled_token_ids={})
        # Decodes (one query token) first, shortest context first, then prefill chunks, as the
        # attention backend expects.
        order = sorted(
            sched.num_scheduled_tokens.items(),
            key=lambda item: (item[1] != 1, self.requests[item[0]].num_computed_tokens if item[1] == 1 else 0),
        )
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        decode_tables: list[list[int]] = []
        decode_seq_lens: list[int] = []
        prefill_q_lens: list[int] = []
        prefill_seq_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        sample_req_ids: list[str] = []
        sample_indices: list[int] = []
        # Requests verifying drafts: (req_id, flat index of its last known token, drafts).
        spec_jobs: list[tuple[str, int, list[int]]] = []
        # (req_id, flat indices, the prompt tokens those positions predict)
        prompt_lp_jobs: list[tuple[str, range, list[int]]] = []
        bs = self.block_size
        for req_id, num_new in order:
            state = self.requests[req_id]
            start = state.num_computed_tokens
            end = start + num_new
            drafts = sched.scheduled_spec_tokens.get(req_id)
            known_end = end - len(drafts) if drafts else end
            assert known_end <= len(state.token_ids), f"{req_id}: scheduled past its known tokens"
            blocks = state.block_ids
            last_predicting = min(end, state.num_prompt_tokens - 1)
            if state.sampling_params.prompt_logprobs and start < last_predicting:
                first = len(input_ids)
                prompt_lp_jobs.append(
                    (req_id, range(first, first + last_predicting - start), state.token_ids[start + 1 : last_predicting + 1])
                )
            input_ids.extend(state.token_ids[start:known_end])
            if drafts:
                input_ids.extend(drafts)
            positions.extend(range(start, end))
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, end))
            num_ctx_blocks = -(-end // bs)
            if num_new == 1:
                decode_tables.append(blocks[:num_ctx_blocks])
                decode_seq_lens.append(end)
            else:
                prefill_q_lens.append(num_new)
                prefill_seq_lens.append(end)
                prefill_tables.append(blocks[:num_ctx_blocks])
            if drafts:
                spec_jobs.append((req_id, len(input_ids) - len(drafts) - 1, drafts))
            elif end == len(state.token_ids):
                sample_req_ids.append(req_id)
                sample_indices.append(len(input_ids) - 1)

        for _, first, drafts in spec_jobs:  # each scores its last known token and every draft
            sample_indices.extend(range(first, first + len(drafts) + 1))
        # The hidden rows that get logits: the first ones, in order (a step whose decodes are all
        # sampled: plain indices ascend, so the last one says it), or gathered.
        inputs = self.step_inputs
        in_order = not spec_jobs and (not sample_indices or sample_indices[-1] == len(sample_indices) - 1)
        sampled_rows = slice(0, len(sample_indices)) if in_order else inputs.longs(sample_indices)
        layout = BatchLayout(bs, slots, decode_tables, decode_seq_lens, prefill_q_lens, prefill_seq_lens, prefill_tables)
        if self.decode_graphs is not None and not prefill_q_lens and self.decode_graphs.fits(len(input_ids)):
            inputs.upload()
            hidden = self.decode_graphs.run(input_ids, positions, layout)
        elif self.parallel is not None and self.parallel.pp_size > 1:
            inputs.upload()
            hidden = pipeline_forward(self.model, self.parallel, input_ids, positions, layout, self.kv_caches)
        else:
            meta = self._metadata(self.model, layout, inputs)
            input_t, positions_t = inputs.longs(input_ids), inputs.longs(positions)
            inputs.upload()
            hidden = self.model(input_t, positions_t, self.kv_caches, meta)
        drafted = self.draft_model is not None and sched.propose_drafts
        if drafted:
            # The draft model's K/V follows every computed token while anyone speculates (under
            # load no draft model runs, and requests catch up here once speculation resumes).
            self.drafter.forward(self.requests, order, input_t, positions_t, meta, self.draft_kv_caches)
        for req_id, num_new in order:
            state = self.requests[req_id]
            state.num_computed_tokens += num_new
            if drafted:  # caught up, then this step's tokens
                state.draft_num_computed = state.num_computed_tokens
        out = ModelRunnerOutput(sampled_token_ids={})
        for req_id, indices, targets in prompt_lp_jobs:
            num_top = self.requests[req_id].sampling_params.logprobs or 0
            out.prompt_logprobs[req_id], tops = self._token_logprobs(hidden, indices, targets, num_top)
            if num_top:
                out.prompt_top_logprobs[req_id] = tops
        if not sample_req_ids and not spec_jobs:
            return out

        logits = self.model.compute_logits(hidden[sampled_rows])  # [num_sampled, vocab]
        num_plain = len(sample_req_ids)
        if num_plain:
            states = [self.requests[req_id] for req_id in sample_req_ids]
            rows = [self._sampling_row(state) for state in states]
            allowed = self._allowed_tokens(states)
            sampled = self.sampler(logits[:num_plain] if spec_jobs else logits, rows, allowed)
            for i, req_id in enumerate(sample_req_ids):
                token_id = sampled.token_ids[i]
                self._append_tokens(states[i], [token_id])
                out.sampled_token_ids[req_id] = [token_id]
                if rows[i].params.logprobs is not None:
                    out.logprobs[req_id] = [sampled.logprobs[i]]
                    out.top_logprobs[req_id] = [sampled.top_logprobs[i]]
        if spec_jobs:
            self._verify(logits[num_plain:], spec_jobs, out)
        if sched.propose_drafts and self.proposer is not None:
            for req_id in out.sampled_token_ids:
                k = sched.num_drafts_to_propose.get(req_id, 0)
                state = self.requests[req_id]
                params = state.sampling_params
                drafts = self.proposer.propose(req_id, state.token_ids, k, shared=params.seed is None or params.greedy)
                if drafts and state.grammar is not None:  # verify only what the grammar allows
                    drafts = drafts[: state.grammar.num_valid_drafts(drafts)]
                if drafts:
                    out.spec_token_ids[req_id] = drafts
        elif sched.propose_drafts and self.draft_model is not None:
            out.spec_token_ids.update(self.drafter.propose(self.requests, list(out.sampled_token_ids),
                                                           sched.num_drafts_to_propose, self.draft_kv_caches))
        return out

    def _metadata(self, model, layout: BatchLayout, inputs: StepInputs):
        """`model`'s attention metadata for a forward pass: the Triton backend's tensors are
        staged in `inputs` (valid once it uploads, with the pass's token ids and positions);
        the PyTorch backend builds its own."""
        if self.attention_backend == "triton":
            return model.attn_backend.build_metadata(layout, self.device, inputs)
        return model.attn_backend.build_metadata(layout, self.device)

    def _verify(self, logits: torch.Tensor, jobs: list[tuple[str, int, list[int]]], out: ModelRunnerOutput) -> None:
        """Accept or reject the drafts of `jobs` (logits: each job's 1 + k rows, in order)."""
        rows = [
            self._sampling_row(self.requests[req_id], drafts[:i])
            for req_id, _, drafts in jobs for i in range(len(drafts) + 1)
        ]
        draft_probs = None
        if self.draft_model is not None:
            draft_probs = torch.cat([self.requests[req_id].draft_probs[: len(drafts)] for req_id, _, drafts in jobs])
        allowed = self._allowed_draft_tokens([(self.requests[req_id], drafts) for req_id, _, drafts in jobs])
        verified = self.rejection_sampler.verify(logits, rows, [drafts for _, _, drafts in jobs], draft_probs, allowed)
        for j, (req_id, _, drafts) in enumerate(jobs):
            state = self.requests[req_id]
            tokens = verified.token_ids[j]
            self._append_tokens(state, tokens)
            state.num_computed_tokens -= len(drafts) + 1 - len(tokens)  # rejected drafts' KV is not kept
            state.draft_num_computed = min(state.draft_num_computed, state.num_computed_tokens)
            out.sampled_token_ids[req_id] = tokens
            if state.sampling_params.logprobs is not None:
                out.logprobs[req_id] = verified.logprobs[j]
                out.top_logprobs[req_id] = verified.top_logprobs[j]

    def _token_logprobs(self, hidden: torch.Tensor, indices: range, targets: list[int], num_top: int = 0,
                        rows_per_slice: int = 256) -> tuple[list[float], list[list[tuple[int, float]]]]:
        """log p(targets[i] | context up to flat position indices[i]) and, with num_top, the
        num_top most likely (token_id, logprob) there; a slice of rows at a time so the
        [rows, vocab] logits stay small."""
        result: list[float] = []
        tops: list[list[tuple[int, float]]] = []
        for lo in range(0, len(indices), rows_per_slice):
            idx = indices[lo : lo + rows_per_slice]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden[idx.start : idx.stop]), dim=-1)
            target = torch.tensor(targets[lo : lo + rows_per_slice], device=self.device)
            result.extend(logprobs.gather(1, target[:, None]).squeeze(1).tolist())
            if num_top:
                values, ids = logprobs.topk(num_top, dim=-1)  # [rows, num_top], descending
                tops.extend(list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist()))
        return result, tops

    # -- structured output ---------------------------------------------------------------------

    def _allowed_tokens(self, states: list[CachedRequestState]) -> AllowedTokens | None:
        """The bitmasks of the constrained ones among `states` (one row each, in order), or None."""
        row_ids = [i for i, state in enumerate(states) if state.grammar is not None]
        if not row_ids:
            return None
        bitmask = allocate_bitmask(len(states), self.vocab_size)
        self.mask_filler.fill([(states[i].grammar, i) for i in row_ids], bitmask)
        return AllowedTokens(row_ids, bitmask)

    def _allowed_draft_tokens(self, jobs: list[tuple[CachedRequestState, list[int]]]) -> AllowedTokens | None:
        """For requests verifying drafts (rows: each one's 1 + k, in order): row i of a
        constrained request allows what its grammar allows after drafts 0..i-1. The matcher walks
        the drafts and comes back; a draft it rejects (none should reach here) leaves the rows
        after it all-allowed: that draft has p = 0, so verification never goes past it."""
        row_ids: list[int] = []
        walks: list[tuple[GrammarMatcher, int, list[int]]] = []  # matcher, its first row, its drafts
        first = 0
        for state, drafts in jobs:
            if state.grammar is not None:
                walks.append((state.grammar, first, drafts))
                row_ids.extend(range(first, first + len(drafts) + 1))
            first += len(drafts) + 1
        if not row_ids:
            return None
        bitmask = allocate_bitmask(first, self.vocab_size)
        for grammar, row, drafts in walks:
            walked = 0
            for i in range(len(drafts) + 1):
                grammar.fill(bitmask, row + i)
                if i == len(drafts) or not grammar.accept(drafts[i : i + 1]):
                    break
                walked += 1
            grammar.rollback(walked)
        return AllowedTokens(row_ids, bitmask)

    @staticmethod
    def _append_tokens(state: CachedRequestState, token_ids: list[int]) -> None:
        """Append sampled tokens to the request, advancing its grammar over them."""
        state.token_ids.extend(token_ids)
        if state.grammar is not None and state.grammar.accept(token_ids) != len(token_ids):
            _drop_grammar(state, token_ids)

    @staticmethod
    def _sampling_row(state: CachedRequestState, drafts: Sequence[int] = ()) -> SamplingRow:
        """The request's row; with `drafts`, the row that scores the token after them."""
        output = state.token_ids[state.num_prompt_tokens :]
        return SamplingRow(
            params=state.sampling_params,
            prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
            output_token_ids=output + list(drafts) if drafts else output,
            eos_token_ids=state.eos_token_ids,
        )
