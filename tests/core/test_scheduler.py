"""Scheduler with a fake model: chunked prefill, mixed steps, budgets, preemption, freeing."""

import pytest

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.outputs import ModelRunnerOutput, SchedulerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import RequestRejectedError, Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams

EOS = 0


def make_scheduler(num_blocks=100, block_size=4, budget=16, max_seqs=8, max_model_len=256, chunked=True,
                   caching=False, host_blocks=0):
    """Prefix caching and swapping off unless asked: these tests share prompts on purpose."""
    config = SchedulerConfig(budget, max_seqs, max_model_len, chunked)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=caching, num_host_blocks=host_blocks))


def make_request(req_id, num_prompt, max_tokens=4, arrival=None, **params):
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(req_id, [100 + i for i in range(num_prompt)], sp, [EOS], max_tokens, arrival_time=arrival)


class FakeModel:
    """Plays the model runner: samples a deterministic token for every request whose known
    tokens are all computed after this step (token = 1000 + number of tokens so far)."""

    def __init__(self, scheduler: Scheduler):
        self.scheduler = scheduler
        self.steps: list[SchedulerOutput] = []

    def step(self, forced: dict[str, int] | None = None):
        sched = self.scheduler.schedule()
        self.steps.append(sched)
        sampled = {}
        for req_id, n in sched.num_scheduled_tokens.items():
            req = self.scheduler.requests[req_id]
            if req.num_computed_tokens + n == req.num_tokens:
                sampled[req_id] = [(forced or {}).get(req_id, 1000 + req.num_tokens)]
        return sched, self.scheduler.update(sched, ModelRunnerOutput(sampled_token_ids=sampled))


def test_long_prompt_is_prefilled_in_chunks_within_budget():
    s = make_scheduler(budget=16)
    s.add_request(make_request("a", 40, max_tokens=2))
    fake = FakeModel(s)
    chunks = []
    while s.num_unfinished:
        sched, _ = fake.step()
        chunks.append(sched.num_scheduled_tokens["a"])
    assert chunks == [16, 16, 8, 1]  # three prefill chunks, then one decode
    assert s.requests == {}


def test_decode_and_prefill_chunk_share_a_step():
    s = make_scheduler(budget=16)
    fake = FakeModel(s)
    s.add_request(make_request("a", 8, max_tokens=10))
    fake.step()  # a: whole prompt
    s.add_request(make_request("b", 30))
    sched, outs = fake.step()
    assert sched.num_scheduled_tokens == {"a": 1, "b": 15}  # a decodes, b gets the rest of the budget
    assert [o.req_id for o in outs] == ["a"]  # b's chunk did not reach the end of its prompt
    assert [r.req_id for r in sched.scheduled_new_reqs] == ["b"]
    assert [r.req_id for r in sched.scheduled_cached_reqs] == ["a"]


def test_budget_and_max_num_seqs_are_never_exceeded():
    s = make_scheduler(budget=10, max_seqs=3, num_blocks=200)
    fake = FakeModel(s)
    for i in range(7):
        s.add_request(make_request(f"r{i}", 3 + 2 * i, max_tokens=5))
    while s.num_unfinished:
        sched, _ = fake.step()
        assert sched.total_num_scheduled_tokens <= 10
        assert len(sched.num_scheduled_tokens) <= 3
        assert len(s.running) <= 3
    assert s.kv.num_free_blocks == 200


def test_finished_requests_free_every_block_and_report_once():
    s = make_scheduler(num_blocks=20, block_size=4)
    fake = FakeModel(s)
    s.add_request(make_request("a", 5, max_tokens=3))
    s.add_request(make_request("b", 9, max_tokens=1))
    _, outs = fake.step()
    assert {o.req_id: o.finish_reason for o in outs} == {"a": None, "b": "length"}
    assert s.kv.get_block_ids("b") == []
    sched, _ = fake.step()
    assert sched.finished_req_ids == {"b"}
    sched, outs = fake.step()
    assert outs[0].finish_reason == "length" and sched.finished_req_ids == set()
    assert fake.step()[0].finished_req_ids == {"a"}
    assert s.kv.num_free_blocks == 20
    assert all(b.ref_cnt == 0 for b in s.kv.block_pool.blocks)


def test_eos_and_stop_token_ids_finish_after_min_tokens():
    s = make_scheduler()
    fake = FakeModel(s)
    s.add_request(make_request("a", 4, max_tokens=10, min_tokens=2))
    s.add_request(make_request("b", 4, max_tokens=10, stop_token_ids=[7]))
    s.add_request(make_request("c", 4, max_tokens=10, ignore_eos=True))
    _, outs = fake.step(forced={"a": EOS, "b": 7, "c": EOS})
    done = {o.req_id: (o.finish_reason, o.stop_reason) for o in outs}
    assert done == {"a": (None, None), "b": ("stop", 7), "c": (None, None)}  # a: EOS before min_tokens ignored
    _, outs = fake.step(forced={"a": EOS, "c": EOS})
    assert {o.req_id: o.finish_reason for o in outs} == {"a": "stop", "c": None}


def test_preemption_takes_the_newest_and_resumes_with_unchanged_output():
    # 6 blocks of 4 tokens. a and b each need 3 blocks for prompt 8 + 4 outputs.
    s = make_scheduler(num_blocks=5, block_size=4, budget=64)
    fake = FakeModel(s)
    a = make_request("a", 8, max_tokens=4, arrival=1.0)
    b = make_request("b", 8, max_tokens=4, arrival=2.0)
    s.add_request(a)
    s.add_request(b)
    sched, _ = fake.step()  # both prefill: 2 + 2 blocks, 1 free
    assert sched.num_scheduled_tokens == {"a": 8, "b": 8}
    sched, _ = fake.step()  # both decode token 9: a takes the last free block, b must preempt
    assert sched.num_scheduled_tokens == {"a": 1}
    assert sched.preempted_req_ids == {"b"}
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert s.kv.get_block_ids("b") == [] and list(s.waiting) == [b]
    outputs = {}
    while s.num_unfinished:
        sched, outs = fake.step()
        assert sched.total_num_scheduled_tokens <= 64
        for o in outs:
            outputs.setdefault(o.req_id, []).extend(o.new_token_ids)
    # b resumed: recomputed prompt + its 1 output (9 tokens) in one chunk, then went on.
    resumed = [st for st in fake.steps if any(r.req_id == "b" for r in st.scheduled_new_reqs)]
    assert len(resumed) == 2 and resumed[1].num_scheduled_tokens["b"] == 9
    assert resumed[1].scheduled_new_reqs[0].token_ids == b.prompt_token_ids + [1008]
    # The fake model's tokens depend only on position, so outputs are what they would be unpreempted.
    assert a.output_token_ids == [1008, 1009, 1010, 1011]
    assert b.output_token_ids == [1008, 1009, 1010, 1011]
    assert b.num_preemptions == 1 and s.num_preemptions == 1
    assert s.kv.num_free_blocks == 5


def test_preempting_itself_when_it_is_the_newest():
    s = make_scheduler(num_blocks=3, block_size=4, budget=64)
    fake = FakeModel(s)
    s.add_request(make_request("a", 4, max_tokens=8, arrival=1.0))
    s.add_request(make_request("b", 4, max_tokens=8, arrival=2.0))
    fake.step()  # a: block 0, b: block 1
    fake.step()  # a: token 5 -> block 2; b: token 5 needs a block -> b preempts itself
    assert s.requests["b"].status == RequestStatus.PREEMPTED
    assert s.requests["a"].status == RequestStatus.RUNNING
    while s.num_unfinished:
        fake.step()
    assert s.kv.num_free_blocks == 3


def test_requests_that_can_never_fit_are_rejected_at_admission():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=32)
    with pytest.raises(RequestRejectedError, match="exceeds max_model_len 32"):
        s.add_request(make_request("long", 30, max_tokens=8))
    with pytest.raises(RequestRejectedError, match="needs 5 KV blocks, the cache has 4"):
        s.add_request(make_request("big", 16, max_tokens=4))
    with pytest.raises(RequestRejectedError, match="empty"):
        s.add_request(make_request("empty", 0))
    s.add_request(make_request("ok", 8, max_tokens=8))
    with pytest.raises(RequestRejectedError, match="already in use"):
        s.add_request(make_request("ok", 8))
    assert s.num_unfinished == 1


def test_without_chunked_prefill_a_prompt_waits_for_a_whole_budget():
    s = make_scheduler(budget=16, chunked=False)
    fake = FakeModel(s)
    s.add_request(make_request("a", 10, max_tokens=5))
    s.add_request(make_request("b", 10, max_tokens=5))
    sched, _ = fake.step()
    assert sched.num_scheduled_tokens == {"a": 10}
    sched, _ = fake.step()
    assert sched.num_scheduled_tokens == {"a": 1, "b": 10}


def test_abort_frees_blocks_of_running_and_waiting_requests():
    s = make_scheduler(num_blocks=10, block_size=4, budget=8)
    fake = FakeModel(s)
    s.add_request(make_request("a", 8))
    s.add_request(make_request("b", 8))
    fake.step()  # a prefilled, b waits (budget)
    s.finish_requests(["a", "b"], RequestStatus.FINISHED_ABORTED)
    assert s.num_unfinished == 0 and s.kv.num_free_blocks == 10
    assert fake.step()[0].finished_req_ids == {"a", "b"}
