"""A request's state as the scheduler sees it: token ids, progress, status."""

from __future__ import annotations

import enum
import time
from collections.abc import Sequence

from tokenmill.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    # Everything from here on is finished.
    FINISHED_STOPPED = 3  # eos, a stop token id or a stop string
    FINISHED_LENGTH = 4  # max_tokens or max_model_len
    FINISHED_ABORTED = 5  # cancelled by the caller

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


class Request:
    """One generation request. `all_token_ids` = prompt + output; the scheduler feeds the model
    `all_token_ids[num_computed_tokens:]` (a prefill chunk, or the one newest token in decode)."""

    def __init__(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling_params: SamplingParams,
        eos_token_ids: Sequence[int],
        max_tokens: int,
        arrival_time: float | None = None,
        grammar: object | None = None,
    ):
        self.request_id = request_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.sampling_params = sampling_params
        self.eos_token_ids = frozenset(eos_token_ids)
        self.stop_token_ids = frozenset(sampling_params.stop_token_ids)
        self.max_tokens = max_tokens  # resolved: never None, fits in max_model_len
        # Structured output: the compiled grammar (tokenmill.structured; opaque here) that the
        # runner's matcher for this request follows. None: unconstrained.
        self.grammar = grammar
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.first_scheduled_time: float | None = None  # when it first left the waiting queue
        self.status = RequestStatus.WAITING
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        self.num_preemptions = 0
        self.num_cached_tokens = 0  # prompt tokens found in the prefix cache at admission
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of its full blocks (KVCacheManager)
        # n > 1: the first sample of the same prompt; this one forks from its prompt blocks.
        self.fork_parent: Request | None = None
        self.stop_reason: int | str | None = None  # the stop token id or stop string that ended it
        # Speculative decoding: drafts for the next step (proposed after the last one), how
        # many this request may verify at once (adaptive), its per-draft acceptance so far
        # (draft_plan.AcceptanceEstimate, set by the scheduler) and its counts.
        self.spec_token_ids: list[int] = []
        self.spec_k = 0
        self.spec_acceptance = None
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the newest output token implies, or None to keep going."""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.sampling_params.min_tokens:
            if not self.sampling_params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in self.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, status={self.status.name}, prompt={self.num_prompt_tokens}, "
            f"output={self.num_output_tokens}, computed={self.num_computed_tokens})"
        )
