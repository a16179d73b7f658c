"""What users get back: per-request outputs, with cumulative and per-step (delta) views."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the top-N (token_id, logprob), most likely first


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it
    # What this step added (for streaming); the cumulative fields above include it.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Speculative decoding: draft tokens verified for this sample, how many were accepted, and
    # in how many steps (mean acceptance length = 1 + accepted / verifications).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_verifications: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float  # time.monotonic() when the request was added
    first_scheduled_time: float | None = None  # when it first left the waiting queue
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # With SamplingParams.prompt_logprobs: log p(prompt token i | tokens < i); None for token 0.
    prompt_logprobs: list[float | None] | None = None
    # With prompt_logprobs and logprobs = N > 0: the top-N (token_id, logprob) at each prompt
    # position, most likely first; None for token 0.
    prompt_top_logprobs: list[list[tuple[int, float]] | None] | None = None

