"""Scheduling speculative drafts with a fake model: lookahead slots, rollback of rejected
drafts, max_tokens, budget, the running-count threshold and adaptive draft lengths."""

from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.outputs import ModelRunnerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler, SchedulerConfig
from tokenmill.sampling_params import SamplingParams


def make_scheduler(k=4, budget=64, num_blocks=100, block_size=4, max_running=8, adaptive=True):
    config = SchedulerConfig(budget, 16, 256, True, num_speculative_tokens=k, spec_adaptive=adaptive,
                             spec_max_running=max_running)
    return Scheduler(config, KVCacheManager(num_blocks, block_size, enable_caching=False))


def make_request(req_id, num_prompt=6, max_tokens=20):
    return Request(req_id, list(range(100, 100 + num_prompt)), SamplingParams(max_tokens=max_tokens), [0], max_tokens)


class FakeSpecModel:
    """The target model's next token is 1000 + position; drafts propose that continuation but
    get the token at `wrong_at` (a draft index) wrong, so everything from there is rejected."""

    def __init__(self, scheduler, wrong_at=None, num_drafts=4):
        self.s = scheduler
        self.wrong_at = wrong_at
        self.num_drafts = num_drafts

    def step(self):
        sched = self.s.schedule()
        sampled, proposals = {}, {}
        for req_id, n in sched.num_scheduled_tokens.items():
            req = self.s.requests[req_id]
            drafts = sched.scheduled_spec_tokens.get(req_id, [])
            if req.num_computed_tokens + n - len(drafts) < req.num_tokens:
                continue  # a prefill chunk short of the end
            pos = req.num_tokens  # position of the first new token
            tokens = []
            for i, d in enumerate(drafts):
                if d != 1000 + pos + i:
                    break
                tokens.append(d)
            tokens.append(1000 + pos + len(tokens))
            sampled[req_id] = tokens
            nxt = pos + len(tokens)
            proposals[req_id] = [
                (1 if i == self.wrong_at else 1000) + nxt + i for i in range(self.num_drafts)
            ]
        out = ModelRunnerOutput(sampled_token_ids=sampled, spec_token_ids=proposals if sched.propose_drafts else {})
        return sched, self.s.update(sched, out)


def test_drafts_are_verified_and_rejected_ones_rolled_back():
    s = make_scheduler(k=4)
    s.add_request(make_request("a", max_tokens=20))
    fake = FakeSpecModel(s, wrong_at=2)  # drafts 0 and 1 right, 2 wrong
    sched, outs = fake.step()  # prefill: no drafts yet
    assert sched.num_scheduled_tokens == {"a": 6} and not sched.scheduled_spec_tokens
    req = s.requests["a"]
    sched, outs = fake.step()
    assert sched.scheduled_spec_tokens["a"] == [1007, 1008, 1 + 9, 1010]  # the third is wrong
    assert sched.num_scheduled_tokens["a"] == 5
    assert outs[0].new_token_ids == [1007, 1008, 1009]  # two drafts accepted + the correction
    assert (outs[0].num_draft_tokens, outs[0].num_accepted_tokens) == (4, 2)
    # computed: the 6 prompt tokens, the first output token and the 2 accepted drafts
    assert req.num_computed_tokens == 9 and req.num_tokens == 10
    # the KV slots of the 2 rejected drafts stay allocated and are overwritten next step
    assert len(s.kv.req_to_blocks["a"]) == 3  # cdiv(6 + 5, 4)
    assert s.num_spec_accepted_tokens == 2 and s.spec_accepted_per_position == [1, 1, 0, 0]
    assert req.spec_k == 3  # adaptive: one past what was accepted


def test_output_is_the_same_as_without_speculation_and_never_overshoots_max_tokens():
    outputs = {}
    for k in (0, 3):
        s = make_scheduler(k=k) if k else make_scheduler(k=0)
        s.add_request(make_request("a", max_tokens=11))
        fake = FakeSpecModel(s, wrong_at=None, num_drafts=3)
        tokens, steps = [], 0
        while s.num_unfinished:
            sched, outs = fake.step()
            assert sum(sched.num_scheduled_tokens.values()) <= 64
            for o in outs:
                tokens += o.new_token_ids
            steps += 1
        outputs[k] = (tokens, steps)
    assert outputs[3][0] == outputs[0][0] == [1000 + p for p in range(6, 17)]  # exactly max_tokens
    assert outputs[3][1] < outputs[0][1]  # fewer steps: 1 prefill + ceil(10 / 4) with all accepted


def test_drafts_are_cut_to_the_token_budget():
    s = make_scheduler(k=4, budget=3)
    s.add_request(make_request("a", num_prompt=2))
    fake = FakeSpecModel(s)
    fake.step()
    sched, _ = fake.step()
    assert sched.scheduled_spec_tokens["a"] == [1003, 1004]  # 1 + 2 = the budget of 3


def test_no_drafts_while_more_requests_than_the_threshold_run():
    s = make_scheduler(k=4, max_running=1)
    for r in "ab":
        s.add_request(make_request(r, max_tokens=3))
    fake = FakeSpecModel(s)
    while s.num_unfinished:
        sched, _ = fake.step()
        if len(sched.num_scheduled_tokens) > 1:
            assert not sched.scheduled_spec_tokens and not sched.propose_drafts
    assert s.num_spec_drafts == 0


def test_drafts_are_dropped_before_anyone_is_preempted():
    # 4 blocks of 4, two each after the prompts: each request's next token fits in its second
    # block, its drafts would need a third block, and none is free.
    s = make_scheduler(k=4, num_blocks=4)
    s.add_request(make_request("a", num_prompt=6, max_tokens=4))
    s.add_request(make_request("b", num_prompt=7, max_tokens=2))
    fake = FakeSpecModel(s)
    fake.step()
    sched, _ = fake.step()
    assert sched.num_scheduled_tokens == {"a": 1, "b": 1}
    assert not sched.scheduled_spec_tokens and s.num_preemptions == 0


def test_fixed_draft_length_when_not_adaptive():
    s = make_scheduler(k=4, adaptive=False)
    s.add_request(make_request("a", max_tokens=30))
    fake = FakeSpecModel(s, wrong_at=0)  # every draft rejected
    fake.step()
    for _ in range(3):
        sched, _ = fake.step()
        assert len(sched.scheduled_spec_tokens["a"]) == 4


def test_runner_is_asked_for_as_many_drafts_as_the_next_step_can_verify():
    # Adaptive: one past the request's current draft length (it grows by at most one per step),
    # capped at k; a draft model's lookahead slots are reserved for exactly that many.
    for lookahead in (0, 4):
        config = SchedulerConfig(64, 16, 256, True, num_speculative_tokens=4, spec_max_running=8, spec_lookahead=lookahead)
        s = Scheduler(config, KVCacheManager(100, 4, enable_caching=False))
        s.add_request(make_request("a", num_prompt=8, max_tokens=30))
        fake = FakeSpecModel(s, wrong_at=0)  # every draft rejected: spec_k falls to 1
        sched, _ = fake.step()  # prefill of 8 tokens: the first token is sampled
        assert sched.num_drafts_to_propose == {"a": 4}
        assert len(sched.scheduled_new_reqs[0].block_ids) == 2  # no lookahead reserved at admission
        sched, _ = fake.step()  # verifies 4 drafts, all rejected: spec_k = 1
        assert len(sched.scheduled_spec_tokens["a"]) == 4 and s.requests["a"].spec_k == 1
        sched, _ = fake.step()
        assert len(sched.scheduled_spec_tokens["a"]) == 1
        assert sched.num_drafts_to_propose == {"a": 2}  # with a draft model: its 2 lookahead slots


def test_no_drafts_asked_for_a_prefill_chunk_short_of_the_end_or_above_the_threshold():
    s = make_scheduler(k=4, budget=4, max_running=1)
    s.add_request(make_request("a", num_prompt=6))
    fake = FakeSpecModel(s)
    sched, _ = fake.step()  # 4 of 6 prompt tokens: nothing sampled
    assert sched.propose_drafts and sched.num_drafts_to_propose == {}
    s.add_request(make_request("b", num_prompt=2))
    sched, _ = fake.step()
    assert not sched.propose_drafts and sched.num_drafts_to_propose == {}
