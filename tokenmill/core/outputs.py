"""The contracts between the scheduler, the model runner and the engine (plain data, no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.sampling_params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has no state for: first scheduled, or resumed after preemption
    (then `token_ids` includes the output so far and its KV is recomputed)."""

    req_id: str
    token_ids: list[int]  # prompt + output so far
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # Structured output: the request's compiled grammar (opaque here); the runner builds a
    # matcher from it and replays the output so far through it.
    grammar: object | None = None


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds; only what changed since its last step."""

    req_id: str
    new_block_ids: list[int]
    num_computed_tokens: int


@dataclass
class TierOps:
    """One step's data movement between the cache tiers, for the worker to run before the
    forward pass, in this order: demotions (device block -> host slot), disk stores (write the
    host slot just filled under the hash, or delete the hash's file where the slot is None, in
    order), promotions (host slot -> device block). Disk reads (hash -> host slot) run in the
    background; their results come back through `KVCacheManager.finish_disk_reads`."""

    demote: list[tuple[int, int]] = field(default_factory=list)
    promote: list[tuple[int, int]] = field(default_factory=list)
    disk_store: list[tuple[bytes, int | None]] = field(default_factory=list)
    disk_read: list[tuple[bytes, int]] = field(default_factory=list)


@dataclass
class SchedulerOutput:
    """Everything the runner needs for one engine step, and the only thing it is told.

    Invariants: every scheduled request appears in exactly one of the two lists and in
    `num_scheduled_tokens`; `total_num_scheduled_tokens` <= the token budget; a request is
    sampled this step iff its computed + scheduled tokens reach its known token count.
    """

    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests that left since the last step: the runner drops their state.
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # KV block copies the runner performs before the forward pass, in this order:
    # (device block, host block) for requests swapped out, (host block, device block) back in,
    # then the copies.
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)
    # (source, destination) device block copies (copy on write), one after another, in order.
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)
    # Prefix-cache tiers: copies between the device, the host tier and the disk, run after the
    # swap-out and before the swap-in.
    tier_ops: TierOps = field(default_factory=TierOps)
    # Speculative decoding: per request, the draft tokens it verifies this step (they follow
    # its known tokens and are counted in num_scheduled_tokens); and whether the runner should
    # propose drafts for the next step, and how many at most for each request it samples (its
    # adaptive draft length, and for a draft model the lookahead slots reserved for their KV).
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    propose_drafts: bool = False
    num_drafts_to_propose: dict[str, int] = field(default_factory=dict)


@dataclass
class ModelRunnerOutput:
    """Per sampled request: the new token ids (one without speculation; with it, the accepted
    drafts and one more) and optional logprobs."""

    sampled_token_ids: dict[str, list[int]]
    # Draft tokens proposed for each request's next step.
    spec_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, list[float]] = field(default_factory=dict)
    # Per request, per new token: the top-N (token_id, logprob) pairs.
    top_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)
    # For requests that asked: logprobs of the prompt tokens this step's chunk predicted.
    prompt_logprobs: dict[str, list[float]] = field(default_factory=dict)
    # ... and, when the request also asked for `logprobs` top-N, the top-N at each of them.
    prompt_top_logprobs: dict[str, list[list[tuple[int, float]]]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """What one step produced for one request."""

    req_id: str
    new_token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort" once finished
    stop_reason: int | str | None = None
    new_logprobs: list[float] | None = None
    new_top_logprobs: list[list[tuple[int, float]]] | None = None
    new_prompt_logprobs: list[float] | None = None
    new_prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Speculative decoding: drafts verified this step, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
