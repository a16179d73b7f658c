"""How much GPU memory the KV cache gets: the arithmetic, and the profiled step's schedule, kept free
of torch so they are tested on CPU.

At start-up on CUDA (when neither kv_cache_memory_gb nor num_kv_blocks is given) the model runner
loads the weights, runs the worst step the scheduler can produce once (`worst_case_step`:
`profile_prompt_lens` requests over a scratch KV cache: a full token budget, every request
sampled) and reads the device's memory (`MemoryProfile`). The KV cache then gets what
`gpu_memory_utilization` of the device leaves: `kv_cache_budget_bytes`. When decode steps will
replay CUDA graphs, whose memory pool exists only once they are captured (after the KV cache),
the runner also runs the largest captured decode step eagerly and reserves GRAPH_POOL_MARGIN
times its peak for the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenmill.config import ConfigError, EngineConfig
from tokenmill.core.outputs import NewRequestData, SchedulerOutput
from tokenmill.sampling_params import SamplingParams

GiB = 2**30
# The CUDA graphs' pool against one eager run of the largest captured step: every captured size's
# output stays allocated in the pool while the smaller sizes are captured, and the pool's
# segments are its own (the caching allocator's rounding is not shared with eager steps).
GRAPH_POOL_MARGIN = 2


@dataclass(frozen=True)
class MemoryProfile:
    """The device's memory once the weights are loaded and the worst-case step has run (bytes).

    Read after the step's tensors and its scratch KV cache are released."""

    total: int  # the device's memory (torch.cuda.mem_get_info)
    free: int  # free on the device, as the driver sees it (other processes count as used)
    torch_allocated: int  # live torch tensors of this process: the weights and buffers
    torch_reserved: int  # held by torch's caching allocator (>= torch_allocated)
    peak_activation: int  # the profiled step's peak allocation above what was live before it
    graph_pool: int = 0  # reserved for the CUDA graphs' memory pool (0: no graphs)

    def __post_init__(self) -> None:
        assert 0 <= self.free <= self.total, self
        assert 0 <= self.torch_allocated <= self.torch_reserved, self
        assert self.peak_activation >= 0 and self.graph_pool >= 0, self

    @property
    def non_torch(self) -> int:
        """Used on the device outside torch's allocator: the CUDA context, cuBLAS / NCCL
        workspaces, and other processes' memory."""
        return max(0, self.total - self.free - self.torch_reserved)

    @property
    def in_use(self) -> int:
        """What stays in use while serving, besides the KV cache."""
        return self.torch_allocated + self.peak_activation + self.graph_pool + self.non_torch


def kv_cache_budget_bytes(profile: MemoryProfile, utilization: float, min_bytes: int) -> int:
    """Bytes for the KV cache: `utilization` x the device's memory, less what is in use.

    Raises ConfigError naming gpu_memory_utilization when that leaves less than `min_bytes` (the
    caller passes the KV cache of one request of max_model_len tokens)."""
    if not 0 < utilization <= 1:
        raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {utilization!r}")
    allowed = int(utilization * profile.total)
    budget = allowed - profile.in_use
    if budget < min_bytes:
        graphs = f"the CUDA graph pool {_gib(profile.graph_pool)}, " if profile.graph_pool else ""
        raise ConfigError(
            "gpu_memory_utilization",
            f"{utilization:g} of the GPU's {_gib(profile.total)} is {_gib(allowed)}, which leaves "
            f"{_gib(max(budget, 0))} for the KV cache after weights {_gib(profile.torch_allocated)}, peak "
            f"activations {_gib(profile.peak_activation)}, {graphs}and {_gib(profile.non_torch)} outside torch "
            f"(CUDA context, other processes); one request of max_model_len tokens needs {_gib(min_bytes)}. Raise "
            "gpu_memory_utilization, or lower max_model_len, max_num_batched_tokens or max_num_seqs"
            + (", or turn the graphs off (enforce_eager)" if profile.graph_pool else ""),
        )
    return budget


def profile_prompt_lens(max_num_batched_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the profiled step: the largest one step can be, as many requests as it
    may hold (each sampled: the most logits rows), the first ones as long as max_model_len allows
    (the longest attention). Every request gets at least one token; the sum is the token budget,
    or less when max_num_seqs requests of max_model_len tokens cannot fill it."""
    num_seqs = min(max_num_seqs, max_num_batched_tokens)
    num_tokens = min(max_num_batched_tokens, num_seqs * max_model_len)
    lens = [1] * num_seqs
    extra = num_tokens - num_seqs
    for i in range(num_seqs):
        add = min(extra, max_model_len - 1)
        lens[i] += add
        extra -= add
    assert extra == 0 and sum(lens) == num_tokens
    return lens


def worst_case_step(config: EngineConfig, block_size: int, max_model_len: int) -> tuple[SchedulerOutput, int]:
    """The profiled step as the scheduler would hand it over, and the number of KV blocks its
    requests hold (numbered from 0): `profile_prompt_lens` requests, each new, all scheduled
    whole. Every request is sampled along the sampler's costliest path, so its fp32 [rows, vocab]
    tensors are as large as they get: top-p alone and so close to 1 that no row is settled by its
    top candidates (each is sorted in full), min-p, repetition / frequency / presence penalties
    over an output token (each request is a resumed one whose last token is output), 20 logprobs
    and prompt logprobs; seeded, so the sampler's shared generator is left as it was. With
    speculation each request asks for num_speculative_tokens drafts."""
    params = SamplingParams(temperature=1.0, top_p=1 - 1e-6, min_p=0.01, repetition_penalty=1.1,
                            frequency_penalty=0.1, presence_penalty=0.1, logprobs=20, prompt_logprobs=True,
                            seed=0, max_tokens=1)
    new_reqs = []
    num_blocks = 0
    for i, n in enumerate(profile_prompt_lens(config.max_num_batched_tokens, config.max_num_seqs, max_model_len)):
        blocks = list(range(num_blocks, num_blocks + -(-n // block_size)))
        num_prompt = max(1, n - 1)  # the last token, if there are two, is output
        new_reqs.append(NewRequestData(f"profile-{i}", [0] * n, num_prompt, params, [], blocks, 0))
        num_blocks += len(blocks)
    step = SchedulerOutput(
        scheduled_new_reqs=new_reqs,
        scheduled_cached_reqs=[],
        num_scheduled_tokens={r.req_id: len(r.token_ids) for r in new_reqs},
        total_num_scheduled_tokens=sum(len(r.token_ids) for r in new_reqs),
        propose_drafts=config.speculative_method is not None,
        num_drafts_to_propose={r.req_id: config.num_speculative_tokens for r in new_reqs},
    )
    return step, num_blocks


def _gib(num_bytes: int) -> str:
    return f"{num_bytes / GiB:.2f} GiB"
