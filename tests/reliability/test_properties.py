"""Properties that must hold for any input, searched by hypothesis.

- Stop strings (the default model's real tokenizer): the output is the text cut where the first
  stop string completes, however the text falls into tokens and tokens into updates (one token
  a step, or several at once as speculative decoding delivers them); no streamed character is
  ever taken back.
- Incremental detokenization: the joined stream deltas equal the whole output decoded at once,
  for emoji and CJK characters split across tokens, and no delta carries a U+FFFD the whole
  text does not have.
- The KV allocator, driven through the real scheduler with a fake model: any sequence of
  admissions (with prefix-cache hits and `n` > 1 forks), steps (chunked prefill, speculative
  drafts accepted or rejected, preemption by swap or recompute, sliding windows), aborts and
  stops keeps every block's ref count equal to the number of block tables holding it (never
  negative), the free queue exactly the unreferenced blocks, and returns every block once the
  requests are gone.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from tokenmill.core.block_pool import BlockPool
from tokenmill.core.kv_cache_manager import WINDOW_GAP, KVCacheManager
from tokenmill.core.outputs import ModelRunnerOutput
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import RequestRejectedError, Scheduler, SchedulerConfig
from tokenmill.engine.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"

# Pieces of text the default model's byte-level BPE splits in different ways: multi-byte
# characters (CJK, accents, emoji, a ZWJ family, a flag, a skin tone) whose bytes land in
# different tokens, words that merge with a leading space, digits, newlines.
FRAGMENTS = ["Hello", " world", ",", " ", "  ", "\n", "\n\n", "ab", "lo", " wor", "12", "3", ".", "é", "ñ", "ü",
             "日本語", "中文", "字", "。", "😀", "🎉", "👩\u200d👩\u200d👧", "🇫🇷", "👍🏽", "\u00a0", "–", "the", " the",
             "<", ">", "x"]

text_strategy = st.one_of(
    st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=14).map("".join),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1, max_size=24),
)


@pytest.fixture(scope="module")
def tokenizer(default_checkpoint):
    """The default model's tokenizer (SmolLM2's byte-level BPE)."""
    return default_checkpoint.tokenizer


@pytest.fixture(scope="module")
def prompt_ids(tokenizer):
    return tokenizer.encode("<|im_start|>user\nSay something<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)


def chunked(ids: list[int], sizes: list[int]) -> list[list[int]]:
    """ids cut into consecutive updates of the given sizes (cycled), the last one what is left."""
    out, i, k = [], 0, 0
    while i < len(ids):
        n = sizes[k % len(sizes)] if sizes else 1
        out.append(ids[i : i + n])
        i, k = i + n, k + 1
    return out


def run(tokenizer, prompt_ids, ids, sizes, **params):
    """Stream ids through a detokenizer as the engine does: update, take_delta, and flush at
    the end. Returns (detokenizer, deltas, stop string)."""
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, SamplingParams(**params))
    deltas, stop = [], None
    for update in chunked(ids, sizes):
        stop = detok.update(update)
        deltas.append(detok.take_delta())
        if stop is not None:
            break
    deltas.append(detok.flush())
    return detok, deltas, stop


def first_stop(text: str, stops: list[str]) -> tuple[int, int] | None:
    """(start, end) of the stop string that completes first in `text`: the smallest end, and of
    those the earliest start."""
    best = None
    for stop in stops:
        i = text.find(stop)
        if i != -1 and (best is None or (i + len(stop), i) < (best[1], best[0])):
            best = (i, i + len(stop))
    return best


PROPERTY_SETTINGS = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY_SETTINGS
@given(text=text_strategy, sizes=st.lists(st.integers(1, 4), max_size=6), skip=st.booleans())
def test_stream_deltas_join_to_the_whole_decode(tokenizer, prompt_ids, text, sizes, skip):
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids, skip_special_tokens=skip)
    detok, deltas, stop = run(tokenizer, prompt_ids, ids, sizes, skip_special_tokens=skip)
    assert stop is None
    assert "".join(deltas) == whole == detok.output_text
    if REPLACEMENT_CHAR not in whole:
        assert not any(REPLACEMENT_CHAR in d for d in deltas)


@PROPERTY_SETTINGS
@given(ids=st.lists(st.integers(0, 49151), min_size=1, max_size=24), byte_ids=st.lists(st.integers(0, 300), max_size=6),
       sizes=st.lists(st.integers(1, 3), max_size=4))
def test_any_token_ids_stream_to_their_decode(tokenizer, prompt_ids, ids, byte_ids, sizes):
    """Arbitrary ids (special tokens, lone bytes of a character, mid-character endings): the
    deltas still join to the whole decode."""
    ids = ids + byte_ids
    _, deltas, _ = run(tokenizer, prompt_ids, ids, sizes)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=True)


@st.composite
def text_and_stops(draw):
    """A text and 1-3 stop strings, most of them cut out of the text at any character offsets
    (so they start and end inside tokens), some not in it at all."""
    text = draw(text_strategy)
    stops = []
    for _ in range(draw(st.integers(1, 3))):
        if text and draw(st.integers(0, 3)):
            start = draw(st.integers(0, len(text) - 1))
            end = draw(st.integers(start + 1, min(len(text), start + 8)))
            stops.append(text[start:end])
        else:
            stops.append(draw(st.sampled_from(FRAGMENTS + ["zz", "not there"])))
    return text, stops


@PROPERTY_SETTINGS
@given(case=text_and_stops(), sizes=st.lists(st.integers(1, 4), max_size=6), include=st.booleans())
def test_stop_strings_cut_at_the_first_stop_and_take_nothing_back(tokenizer, prompt_ids, case, sizes, include):
    text, stops = case
    ids = tokenizer.encode(text, add_special_tokens=False)
    whole = tokenizer.decode(ids)
    assume(REPLACEMENT_CHAR not in whole)
    detok, deltas, stop = run(tokenizer, prompt_ids, ids, sizes, stop=stops, include_stop_str_in_output=include)
    hit = first_stop(whole, stops)
    if hit is None:
        assert stop is None and "".join(deltas) == whole
        return
    start, end = hit
    expected = whole[: end if include else start]
    assert stop == whole[start:end]
    assert detok.output_text == expected
    # Nothing streamed is taken back: every prefix of the deltas is a prefix of the final text.
    sent = ""
    for delta in deltas:
        sent += delta
        assert expected.startswith(sent), (sent, expected)
    assert sent == expected
    if not include:
        assert stop not in sent


@PROPERTY_SETTINGS
@given(case=text_and_stops(), sizes=st.lists(st.integers(1, 4), min_size=1, max_size=6))
# a stop string completed by the first token of an update that ends inside a character
@example(case=("000\U00040000", ["000"]), sizes=[2])
def test_stop_result_does_not_depend_on_how_tokens_arrive(tokenizer, prompt_ids, case, sizes):
    """One token per update (plain decoding) or several (speculative decoding): same stop, same text."""
    text, stops = case
    ids = tokenizer.encode(text, add_special_tokens=False)
    one = run(tokenizer, prompt_ids, ids, [1], stop=stops)
    many = run(tokenizer, prompt_ids, ids, sizes, stop=stops)
    assert (one[0].output_text, one[2]) == (many[0].output_text, many[2])
    assert "".join(one[1]) == "".join(many[1])


# -- the KV allocator under the real scheduler ---------------------------------------------------

EOS = 0


def check_pool(pool: BlockPool, tables: list[list]) -> None:
    """Ref counts equal the number of tables holding each block; the free queue is exactly the
    unreferenced blocks; the prefix cache maps each hash to a block that carries it."""
    refs = Counter(b.block_id for blocks in tables for b in blocks if b is not WINDOW_GAP)
    free = set(pool.free_block_ids())
    for block in pool.blocks:
        assert block.ref_cnt >= 0, block
        assert block.ref_cnt == refs[block.block_id], (block, refs[block.block_id])
        assert (block.block_id in free) == (block.ref_cnt == 0), block
        if block.block_hash is not None:
            assert pool.cached[block.block_hash] is block
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash
    assert len(free) == pool.num_free_blocks


class AllocatorMachine(RuleBasedStateMachine):
    """Random admissions, steps, aborts and stop-string finishes against a small KV cache."""

    @initialize(num_blocks=st.integers(3, 16), block_size=st.sampled_from([1, 2, 4]), host_blocks=st.one_of(st.just(0), st.integers(1, 16)),
                caching=st.booleans(), window=st.one_of(st.none(), st.integers(2, 12)), k=st.integers(0, 3),
                lookahead=st.booleans(), budget=st.integers(2, 24), max_seqs=st.integers(1, 6), chunked=st.booleans())
    def configure(self, num_blocks, block_size, host_blocks, caching, window, k, lookahead, budget, max_seqs, chunked):
        if window is not None:
            lookahead = False  # as the engine: a draft model's layers do not slide, so no early freeing with one
        config = SchedulerConfig(budget, max_seqs, 64, chunked, num_speculative_tokens=k, spec_max_running=3,
                                 spec_lookahead=k if lookahead else 0)
        self.kv = KVCacheManager(num_blocks, block_size, enable_caching=caching, num_host_blocks=host_blocks,
                                 sliding_window=window)
        self.s = Scheduler(config, self.kv)
        self.num_blocks, self.num_host_blocks = num_blocks, host_blocks
        self.next_id = 0

    @rule(prompt=st.lists(st.integers(1, 3), min_size=1, max_size=24), max_tokens=st.integers(1, 16),
          n=st.integers(1, 3))
    def add(self, prompt, max_tokens, n):
        """A request (n samples, the later ones forking the first one's prompt blocks, as the
        engine does). Prompts over a 3-token alphabet share prefixes often."""
        base = f"r{self.next_id}"
        self.next_id += 1
        samples: list[Request] = []
        try:
            for i in range(n):
                r = Request(f"{base}#{i}", prompt, SamplingParams(max_tokens=max_tokens), [EOS], max_tokens)
                if samples:
                    r.fork_parent = samples[0]
                self.s.add_request(r)
                samples.append(r)
        except RequestRejectedError:
            self.s.finish_requests([r.request_id for r in samples], RequestStatus.FINISHED_ABORTED)

    @precondition(lambda self: self.s.num_unfinished)
    @rule(data=st.data(), num_steps=st.integers(1, 4))
    def steps(self, data, num_steps):
        for _ in range(num_steps):
            if self.s.num_unfinished:
                self.step(data)

    def step(self, data):
        sched = self.s.schedule()
        assert sched.total_num_scheduled_tokens <= self.s.config.max_num_batched_tokens
        sampled, proposals = {}, {}
        for req_id, n in sched.num_scheduled_tokens.items():
            req = self.s.requests[req_id]
            drafts = sched.scheduled_spec_tokens.get(req_id, [])
            if req.num_computed_tokens + n - len(drafts) < req.num_tokens:
                continue  # a prefill chunk short of the end: nothing sampled
            accepted = data.draw(st.integers(0, len(drafts)))
            sampled[req_id] = drafts[:accepted] + [data.draw(st.integers(0, 9))]  # 0: eos
            if req_id in sched.num_drafts_to_propose:
                proposals[req_id] = data.draw(st.lists(st.integers(0, 3), max_size=sched.num_drafts_to_propose[req_id]))
        self.s.update(sched, ModelRunnerOutput(sampled_token_ids=sampled,
                                               spec_token_ids=proposals if sched.propose_drafts else {}))

    @precondition(lambda self: self.s.num_unfinished)
    @rule(data=st.data(), status=st.sampled_from([RequestStatus.FINISHED_ABORTED, RequestStatus.FINISHED_STOPPED]))
    def finish_one(self, data, status):
        """A client abort, or a stop string the detokenizer found, between steps."""
        req_id = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.finish_requests([req_id], status)

    @invariant()
    def blocks_are_accounted_for(self):
        if not hasattr(self, "s"):
            return
        check_pool(self.kv.block_pool, list(self.kv.req_to_blocks.values()))
        if self.kv.host_pool is not None:
            check_pool(self.kv.host_pool, list(self.kv.req_to_host_blocks.values()))
        live = set(self.s.requests)
        assert set(self.kv.req_to_blocks) <= live, "a finished request still holds device blocks"
        assert set(self.kv.req_to_host_blocks) <= live, "a finished request still holds host blocks"
        assert {r.request_id for r in self.s.running} | {r.request_id for r in self.s.waiting} == live
        assert len(self.s.running) <= self.s.config.max_num_seqs

    def teardown(self):
        if not hasattr(self, "s"):
            return
        self.s.finish_requests(sorted(self.s.requests), RequestStatus.FINISHED_ABORTED)
        assert self.kv.num_free_blocks == self.num_blocks
        assert self.kv.req_to_blocks == {} and self.kv.req_to_host_blocks == {}
        if self.kv.host_pool is not None:
            assert self.kv.host_pool.num_free_blocks == self.num_host_blocks
        check_pool(self.kv.block_pool, [])


AllocatorMachine.TestCase.settings = settings(max_examples=500, stateful_step_count=50, deadline=None)
TestAllocator = AllocatorMachine.TestCase
