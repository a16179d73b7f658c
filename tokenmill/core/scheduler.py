"""Iteration-level scheduler: which requests run in the next engine step, and how many tokens each.

One policy covers prefill and decode: every running request wants
`num_tokens - num_computed_tokens` more tokens computed (the whole rest of its prompt, or the one
token it just sampled). Running requests are served first, oldest first, then waiting ones are
admitted FCFS while the token budget, `max_num_seqs` and free KV blocks allow. A prompt longer
than the remaining budget is cut into chunks (chunked prefill), so decode tokens and prefill
chunks of different requests share a step. A request admitted from scratch first adopts the
longest cached prefix of its tokens (prefix caching; with cache tiers, from host memory too, and
once its blocks on disk have been read) and computes only the rest. When blocks run
out, the newest running request is preempted: its blocks are copied to the host pool when it
has room (swap; the request resumes where it was), else freed and recomputed later from its
prompt + output so far (most of it usually comes back from the prefix cache).

Speculative decoding: a decoding request that has draft tokens (proposed by the runner after
its last step) is scheduled for 1 + k tokens, its last token and k drafts, with KV slots for all
of them; `update` keeps the accepted drafts and the target's token, and counts only the accepted
positions as computed, so rejected drafts' slots are simply overwritten by the next step.
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from tokenmill.core.draft_plan import (
    MAX_PLANNED_DRAFTS, AcceptanceEstimate, StepCost, StepOverhead, plan_drafts, worth_drafting,
)
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.outputs import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from tokenmill.core.request import Request, RequestStatus


class RequestRejectedError(ValueError):
    """A request that can never be served (too long for the model or the KV cache)."""


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    enable_chunked_prefill: bool = True
    # Speculative decoding: the most drafts a request verifies per step (0 = off); adaptive
    # draft lengths (with step_cost, the measured step time by tokens computed: each step's
    # drafts maximise expected tokens per second, core/draft_plan.py; without it, one more
    # than the last verification accepted); no drafts while more than spec_max_running
    # requests run (None: no such limit).
    num_speculative_tokens: int = 0
    spec_adaptive: bool = True
    spec_max_running: int | None = None
    step_cost: StepCost | None = None
    # KV slots reserved past a sampled request's scheduled tokens, where a draft model writes
    # the KV of the drafts it proposes after the step (0 for n-gram drafts).
    spec_lookahead: int = 0


@dataclass(slots=True)
class _Step:
    """What `Scheduler.schedule` has put in the step so far."""

    budget: int  # tokens still free in the step
    speculate: bool  # whether requests verify and propose drafts this step
    num_scheduled: dict[str, int] = field(default_factory=dict)  # req id -> tokens, drafts included
    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)  # req id -> drafts it verifies
    drafts_to_propose: dict[str, int] = field(default_factory=dict)
    preempted: bool = False  # someone was preempted: nobody waiting is admitted

    def add(self, req: Request, num_tokens: int) -> None:
        self.num_scheduled[req.request_id] = num_tokens
        self.budget -= num_tokens


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager):
        self.config = config
        self.kv = kv_cache_manager
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # kept in arrival order: the newest is last
        # Requests that left since the last schedule(); reported to the runner once.
        self._finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()
        self.num_preemptions = 0
        self.num_swap_preemptions = 0  # of which the request was swapped out, not recomputed
        # Speculative decoding counters (cumulative): verifications (a request verifying >= 1
        # draft in a step), draft tokens, accepted drafts, and accepted drafts by position.
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.spec_accepted_per_position = [0] * config.num_speculative_tokens
        # every request's verifications: the acceptance a new request starts from
        self.spec_acceptance = AcceptanceEstimate()
        # the engine's own time per step besides the forward pass (EngineCore measures it)
        self.step_overhead = StepOverhead()

    # -- admission -------------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise RequestRejectedError if it can never fit."""
        total = request.num_prompt_tokens + request.max_tokens
        if request.num_prompt_tokens == 0:
            raise RequestRejectedError("prompt is empty")
        if total > self.config.max_model_len:
            raise RequestRejectedError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = {total} "
                f"exceeds max_model_len {self.config.max_model_len}"
            )
        num_blocks = self.kv.num_blocks_for(total)
        if num_blocks > self.kv.block_pool.num_blocks:
            raise RequestRejectedError(
                f"prompt + max_tokens = {total} tokens needs {num_blocks} KV blocks, "
                f"the cache has {self.kv.block_pool.num_blocks}"
            )
        if request.request_id in self.requests:
            raise RequestRejectedError(f"request id {request.request_id!r} is already in use")
        request.spec_k = self.config.num_speculative_tokens
        if self.config.num_speculative_tokens:
            # a seeded sampled request's draws follow its drafts: nothing about its drafts may
            # depend on other requests, not even the prior
            request.spec_acceptance = AcceptanceEstimate(None if _seeded(request) else self.spec_acceptance.value)
        self.requests[request.request_id] = request
        self.waiting.append(request)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- one step ----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        """The next step: the running requests first, then waiting ones admitted FCFS, within
        the token budget; with them go the requests finished or preempted since the last call."""
        speculate = self._speculation_on()
        if speculate and self.config.spec_adaptive and self.config.step_cost is not None:
            speculate = self._plan_drafts()
        step = _Step(budget=self.config.max_num_batched_tokens, speculate=speculate)
        self._schedule_running(step)
        self._schedule_waiting(step)
        return self._scheduler_output(step)

    def _schedule_running(self, step: _Step) -> None:
        """Running requests, oldest first: the rest of each one's tokens (and its drafts), as far
        as the budget goes. When blocks run out, the newest running requests are preempted."""
        i = 0
        while i < len(self.running) and step.budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
            drafts = self._drafts_to_verify(req, num_new, step.budget) if step.speculate else []
            lookahead = self._lookahead(req, num_new) if step.speculate else 0
            new_block_ids = self.kv.allocate_slots(req, num_new + len(drafts) + lookahead)
            if new_block_ids is None and (drafts or lookahead):  # no room to speculate: plain decode
                drafts, lookahead = [], 0
                new_block_ids = self.kv.allocate_slots(req, num_new)
            if new_block_ids is None:
                new_block_ids = self._preempt_for(req, num_new, step)
            if new_block_ids is None:
                break  # req itself was preempted: it was the newest
            if step.speculate and self._samples(req, num_new):
                num_drafts = lookahead if self.config.spec_lookahead else self._next_num_drafts(req)
                step.drafts_to_propose[req.request_id] = num_drafts
            if drafts:
                step.spec_tokens[req.request_id] = drafts
                num_new += len(drafts)
            step.cached_reqs.append(CachedRequestData(req.request_id, new_block_ids, req.num_computed_tokens))
            step.add(req, num_new)
            i += 1

    def _preempt_for(self, req: Request, num_new: int, step: _Step) -> list[int] | None:
        """Preempt the newest running requests, never one scheduled earlier this step, until
        num_new of req's tokens get slots: their new block ids, or None once req itself went."""
        while True:
            victim = self.running.pop()
            self._preempt(victim, step.swap_out)
            step.preempted = True
            if victim is req:
                return None
            new_block_ids = self.kv.allocate_slots(req, num_new)
            if new_block_ids is not None:
                return new_block_ids

    def _schedule_waiting(self, step: _Step) -> None:
        """Waiting requests, first come first served, while the budget, max_num_seqs and the
        blocks allow; none in a step that preempts. The first that cannot start stops the rest."""
        while self.waiting and step.budget > 0 and not step.preempted and len(self.running) < self.config.max_num_seqs:
            req = self.waiting[0]
            num_new = self._admit(req, step)
            if num_new is None:
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            bisect.insort(self.running, req, key=lambda r: r.arrival_time)
            if step.speculate and self._samples(req, num_new):
                # No lookahead slots reserved at admission: a draft model uses what is free in
                # the request's last block.
                step.drafts_to_propose[req.request_id] = self._next_num_drafts(req)
            step.new_reqs.append(self._new_request_data(req))
            step.add(req, num_new)

    def _admit(self, req: Request, step: _Step) -> int | None:
        """Give a waiting request its blocks for this step: the number of its tokens it computes
        now, or None when it cannot start yet (it stays first in the queue)."""
        if self.kv.is_swapped_out(req):
            return self._admit_swapped(req, step)
        if (parent := self._fork_parent(req)) is not None:
            return self._admit_fork(req, parent)
        return self._admit_from_prefix(req, step.budget)

    def _admit_swapped(self, req: Request, step: _Step) -> int | None:
        """A request swapped out to the host pool: its blocks back, and slots for what is left."""
        num_new = min(req.num_tokens - req.num_computed_tokens, step.budget)
        if not self.kv.can_swap_in(req, num_new):
            return None
        step.swap_in.extend(self.kv.swap_in(req))
        new_block_ids = self.kv.allocate_slots(req, num_new)
        assert new_block_ids is not None
        return num_new

    def _admit_fork(self, req: Request, parent: Request) -> int | None:
        """n > 1: share the prompt's blocks with the sample that computed them, and compute only
        the last prompt token again, for this sample's own first token."""
        if parent.num_computed_tokens < parent.num_prompt_tokens:
            return None  # FCFS: wait for the first sample's prompt rather than compute it twice
        if not self.kv.num_free_blocks:
            return None
        self.kv.fork(req, parent, req.num_prompt_tokens)
        req.num_computed_tokens = req.num_prompt_tokens - 1
        new_block_ids = self.kv.allocate_slots(req, 1)
        assert new_block_ids is not None
        req.num_cached_tokens = req.num_prompt_tokens - 1
        return 1

    def _admit_from_prefix(self, req: Request, budget: int) -> int | None:
        """Any other request: one from scratch first adopts the longest cached prefix of its
        tokens; the rest is computed, cut to the budget with chunked prefill."""
        computed = self.kv.get_computed_blocks(req) if req.num_computed_tokens == 0 else None
        if computed is not None and self.kv.waits_for_disk(req, len(computed)):
            return None  # FCFS: its prefix is on its way from disk; running requests step meanwhile
        num_cached = len(computed or ()) * self.kv.block_size
        num_new = req.num_tokens - req.num_computed_tokens - num_cached
        if num_new > budget and not self.config.enable_chunked_prefill:
            return None
        num_new = min(num_new, budget)
        if self.kv.allocate_slots(req, num_new, computed) is None:
            return None
        req.num_computed_tokens += num_cached
        req.num_cached_tokens = max(req.num_cached_tokens, num_cached)
        return num_new

    def _new_request_data(self, req: Request) -> NewRequestData:
        return NewRequestData(
            req_id=req.request_id,
            token_ids=list(req.all_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            sampling_params=req.sampling_params,
            eos_token_ids=sorted(req.eos_token_ids),
            block_ids=self.kv.get_block_ids(req.request_id),
            num_computed_tokens=req.num_computed_tokens,
            grammar=req.grammar,
        )

    def _scheduler_output(self, step: _Step) -> SchedulerOutput:
        """The step for the runner, with the block copies and tier operations queued for it; the
        finished and preempted ids go out once."""
        total = self.config.max_num_batched_tokens - step.budget
        assert total == sum(step.num_scheduled.values()) <= self.config.max_num_batched_tokens
        out = SchedulerOutput(
            scheduled_new_reqs=step.new_reqs,
            scheduled_cached_reqs=step.cached_reqs,
            num_scheduled_tokens=step.num_scheduled,
            total_num_scheduled_tokens=total,
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=self._preempted_req_ids,
            blocks_to_swap_out=step.swap_out,
            blocks_to_swap_in=step.swap_in,
            blocks_to_copy=self.kv.take_copies(),
            tier_ops=self.kv.take_tier_ops(),
            scheduled_spec_tokens=step.spec_tokens,
            propose_drafts=step.speculate,
            num_drafts_to_propose=step.drafts_to_propose,
        )
        self._finished_req_ids = set()
        self._preempted_req_ids = set()
        return out

    # -- speculative decoding --------------------------------------------------------------------

    def _speculation_on(self) -> bool:
        c = self.config
        return c.num_speculative_tokens > 0 and (
            c.spec_max_running is None or len(self.running) + len(self.waiting) <= c.spec_max_running)

    def _plan_drafts(self) -> bool:
        """Set each running request's draft count for this step from the measured step cost
        (`draft_plan.plan_drafts`). False when the step is such that not even a draft sure
        to be accepted would pay: then nobody verifies or proposes drafts."""
        c = self.config
        budget = c.max_num_batched_tokens
        num_tokens = num_sampled = 0
        candidates: list[tuple[float, int]] = []
        planned: list[Request] = []
        seeded = False
        decode_only = True  # every token a one-token decode: the decode path, until a draft joins
        for req in self.running:
            remaining = req.num_tokens - req.num_computed_tokens
            num_new = min(remaining, budget - num_tokens)
            if num_new <= 0:
                break
            num_tokens += num_new
            num_sampled += num_new == remaining
            decoding = remaining == 1 and req.num_computed_tokens >= req.num_prompt_tokens
            decode_only = decode_only and decoding
            req.spec_k = 0
            if decoding and req.spec_token_ids:
                candidate = (req.spec_acceptance.value, min(len(req.spec_token_ids), c.num_speculative_tokens))
                if _seeded(req):  # planned as if alone (no measured overhead either): the same in any batch
                    req.spec_k = plan_drafts(c.step_cost, 1, 1, [candidate], decode_only=True)[0]
                else:
                    candidates.append(candidate)
                    planned.append(req)
            seeded = seeded or _seeded(req)
        overhead = self.step_overhead.seconds
        max_drafts = min(c.num_speculative_tokens * max(num_sampled, 1), MAX_PLANNED_DRAFTS)
        if not worth_drafting(c.step_cost, max(num_tokens, 1), max(num_sampled, 1), max_drafts, overhead, decode_only):
            return seeded  # (a seeded request keeps proposing and verifying as if alone)
        plan = plan_drafts(c.step_cost, num_tokens, num_sampled, candidates, overhead, decode_only)
        for req, k in zip(planned, plan):
            req.spec_k = k
        return True

    def _drafts_to_verify(self, req: Request, num_new: int, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step: its proposed ones, cut to its
        adaptive length, the step's budget, and what max_tokens and max_model_len leave (all
        k + 1 emitted tokens must fit, so speculation never overshoots)."""
        if not req.spec_token_ids or num_new != 1 or req.num_computed_tokens < req.num_prompt_tokens:
            return []
        k = min(
            len(req.spec_token_ids),
            req.spec_k,
            budget - 1,
            req.max_tokens - req.num_output_tokens - 1,
            self.config.max_model_len - req.num_tokens - 1,
        )
        return req.spec_token_ids[:k] if k > 0 else []

    @staticmethod
    def _samples(req: Request, num_new: int) -> bool:
        """Whether scheduling num_new of req's tokens (drafts not counted) reaches its last known
        token, so that the step samples it."""
        return req.num_computed_tokens + num_new >= req.num_tokens

    def _next_num_drafts(self, req: Request) -> int:
        """The most drafts `req` can verify next step: its adaptive length after this step's
        verification, which grows by at most one (`_record_verification`)."""
        c = self.config
        if not c.spec_adaptive or (c.step_cost is not None and not c.spec_lookahead):
            return c.num_speculative_tokens  # proposals without a model cost little: the plan picks
        return min(c.num_speculative_tokens, req.spec_k + 1)

    def _lookahead(self, req: Request, num_new: int) -> int:
        """Slots for a draft model's proposals after this step, if the step samples the request:
        as many as it may verify next step."""
        if not self.config.spec_lookahead or not self._samples(req, num_new):
            return 0
        return min(self.config.spec_lookahead, self._next_num_drafts(req), self.config.max_model_len - req.num_tokens)

    def _record_verification(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        req.num_draft_tokens += num_drafts
        req.num_accepted_tokens += num_accepted
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += num_drafts
        self.num_spec_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.spec_accepted_per_position[i] += 1
        self._record_acceptance(req, num_drafts, num_accepted)
        if self.config.spec_adaptive and self.config.step_cost is None:
            # All accepted: try one more next time; else aim just past what was accepted.
            limit = self.config.num_speculative_tokens
            req.spec_k = min(limit, num_drafts + 1) if num_accepted == num_drafts else max(1, num_accepted + 1)

    def _record_acceptance(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """The request's acceptance estimate, and every request's (a new one's prior)."""
        req.spec_acceptance.update(num_drafts, num_accepted)
        self.spec_acceptance.update(num_drafts, num_accepted)

    @staticmethod
    def _fork_parent(req: Request) -> Request | None:
        """The sibling whose prompt blocks a fresh `req` can share: one that is running (so it
        holds its blocks; its prompt may still be being computed)."""
        parent = req.fork_parent
        if parent is None or req.num_computed_tokens or req.num_output_tokens or parent.status != RequestStatus.RUNNING:
            return None
        return parent

    def _preempt(self, req: Request, swap_out: list[tuple[int, int]]) -> None:
        """Swap the request's blocks out to the host pool if it has room (it resumes where it
        stopped), else recompute preemption: free its blocks and later recompute prompt +
        output so far, so its output is unchanged. Either way it waits at the front of the queue."""
        req.spec_token_ids = []
        copies = self.kv.swap_out(req)
        if copies is not None:
            swap_out.extend(copies)
            self.num_swap_preemptions += 1
        else:
            self.kv.free(req)
            req.num_computed_tokens = 0
        req.status = RequestStatus.PREEMPTED
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        self._preempted_req_ids.add(req.request_id)

    def update(self, sched: SchedulerOutput, result: ModelRunnerOutput) -> list[EngineCoreOutput]:
        """Advance every scheduled request by what was computed, append sampled tokens,
        finish the ones that hit a stop condition and free their blocks."""
        outputs: list[EngineCoreOutput] = []
        for req_id, num_tokens in sched.num_scheduled_tokens.items():
            req = self.requests.get(req_id)
            if req is None or req.is_finished:
                continue  # aborted while its step ran
            new_token_ids = result.sampled_token_ids.get(req_id, [])
            drafts = sched.scheduled_spec_tokens.get(req_id)
            num_accepted = 0
            if drafts:
                # Accepted drafts come first in new_token_ids, then the target's own token; the
                # KV written for rejected drafts is garbage and gets overwritten.
                num_accepted = len(new_token_ids) - 1
                assert new_token_ids[:num_accepted] == drafts[:num_accepted]
                num_tokens -= len(drafts) - num_accepted
                self._record_verification(req, len(drafts), num_accepted)
            elif req.spec_token_ids and new_token_ids and req.spec_acceptance is not None:
                # Drafts proposed but not verified (not worth it at the estimate): the token the
                # step produced says whether the first would have been accepted, so a request
                # whose drafts start to match again is seen to.
                self._record_acceptance(req, 1, int(new_token_ids[0] == req.spec_token_ids[0]))
            req.num_computed_tokens += num_tokens
            req.spec_token_ids = result.spec_token_ids.get(req_id, [])
            prompt_logprobs = result.prompt_logprobs.get(req_id)
            prompt_tops = result.prompt_top_logprobs.get(req_id)
            if not new_token_ids:  # a prefill chunk that did not reach the end of the prompt
                if prompt_logprobs:
                    outputs.append(EngineCoreOutput(req_id, [], new_prompt_logprobs=prompt_logprobs,
                                                    new_prompt_top_logprobs=prompt_tops))
                continue
            status = None
            accepted: list[int] = []
            for token_id in new_token_ids:
                req.append_output_token(token_id)
                accepted.append(token_id)
                status = req.check_stop(self.config.max_model_len)
                if status is not None:
                    break
            out = EngineCoreOutput(req_id, accepted, new_prompt_logprobs=prompt_logprobs, new_prompt_top_logprobs=prompt_tops,
                                   num_draft_tokens=len(drafts or ()), num_accepted_tokens=num_accepted)
            if req_id in result.logprobs:
                out.new_logprobs = result.logprobs[req_id][: len(accepted)]
            if req_id in result.top_logprobs:
                out.new_top_logprobs = result.top_logprobs[req_id][: len(accepted)]
            if status is not None:
                self._finish(req, status)
                out.finish_reason = status.finish_reason
                out.stop_reason = req.stop_reason
            outputs.append(out)
        return outputs

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string found by the detokenizer)."""
        assert status.is_finished
        for req_id in request_ids:
            req = self.requests.get(req_id)
            if req is not None and not req.is_finished:
                self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        if req.status == RequestStatus.RUNNING:
            self.running.remove(req)
        else:
            self.waiting.remove(req)
        req.status = status
        self.kv.free(req)
        del self.requests[req.request_id]
        self._finished_req_ids.add(req.request_id)


def _seeded(req: Request) -> bool:
    """A sampled request with its own seed: its draws follow its drafts."""
    params = req.sampling_params
    return params.seed is not None and not params.greedy
