"""Speculative decoding (n-gram prompt lookup, and suffix decoding) on the real default model:
greedy output is token-identical with speculation on and off, with concurrent requests of mixed
lengths and a KV cache too small for them; stops, max_tokens, logprobs and seeds behave as
without it."""

from __future__ import annotations

import os
import random

import pytest

from tokenmill import LLM, SamplingParams

pytestmark = pytest.mark.slow

CODE = "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):\n    return a * b\n"
PROMPTS = [
    "Rewrite these functions with type hints:\n\n" + CODE + "\nAnswer:\n\n",
    "List of prime numbers: 2, 3, 5, 7, 11,",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the lazy dog. The quick",
    CODE + "\n\ndef div(a, b):\n",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid",
]
MAX_TOKENS = [28, 11, 24, 16, 7]
SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, speculative_ngram_min=1, speculative_ngram_max=3)


@pytest.fixture(scope="module", autouse=True)
def _flat_step_cost(flat_step_cost):
    """Speculation here plans its drafts on a fixed bandwidth-bound step cost (tests/conftest.py)."""


def greedy(max_tokens, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def plain(default_model_path):
    return LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def spec(default_model_path):
    return LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256, **SPEC)


@pytest.fixture(scope="module")
def suffix(default_model_path):
    """Suffix decoding in place of the n-gram lookup, for the tests that name it."""
    return LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256,
               **(SPEC | {"speculative_method": "suffix"}))


# The tests that run with both proposers: `engine` names the fixture.
BOTH = pytest.mark.parametrize("engine", ["spec", "suffix"])


@pytest.fixture(scope="module")
def reference(plain):
    """Greedy outputs without speculation (batched: token-identical to one at a time in fp32,
    which tests/engine/test_llm.py checks)."""
    return [o.outputs[0].token_ids for o in plain.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])]


@BOTH
def test_one_request_at_a_time_is_token_identical(engine, reference, request):
    spec = request.getfixturevalue(engine)
    before = spec.engine.core.scheduler.num_spec_accepted_tokens
    for prompt, n, ref in list(zip(PROMPTS, MAX_TOKENS, reference))[:3]:
        out = spec.generate(prompt, greedy(n))[0].outputs[0]
        assert out.token_ids == ref
        assert len(out.token_ids) == n and out.finish_reason == "length"
    assert spec.engine.core.scheduler.num_spec_accepted_tokens > before + 5  # it did speculate


@BOTH
def test_concurrent_mixed_lengths_are_token_identical(engine, reference, request):
    spec = request.getfixturevalue(engine)
    outs = spec.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert sum(o.outputs[0].num_accepted_tokens for o in outs) > 0
    assert all(o.outputs[0].num_accepted_tokens <= o.outputs[0].num_draft_tokens for o in outs)


def test_suffix_decoding_drafts_from_an_earlier_requests_output(default_model_path):
    """A request that continues an earlier request's output (its prompt and the output's first 6
    tokens: the same greedy continuation) is drafted from the store of finished outputs, which
    its own tokens never held: the drafts are accepted."""
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25,
              **(SPEC | {"speculative_method": "suffix"}))
    prompt_ids = llm.tokenizer.encode(PROMPTS[1], add_special_tokens=False)
    first = llm.generate([prompt_ids], greedy(24))[0].outputs[0]
    store = llm.engine.core.runner.proposer.suffix
    again = llm.generate([prompt_ids + first.token_ids[:6]], greedy(12))[0].outputs[0]
    assert store.memory_tokens() >= 24  # (the first request's output, stored when it ended)
    assert again.token_ids == first.token_ids[6:18]
    assert again.num_accepted_tokens >= 6, (again.num_draft_tokens, again.num_accepted_tokens)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_too_small_kv_cache_preempts_and_stays_token_identical(default_model_path, reference, method):
    small = LLM(str(default_model_path), dtype="float32", quantization="none", num_kv_blocks=7, max_num_batched_tokens=64,
                **(SPEC | {"speculative_method": method}))
    outs = small.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    core = small.engine.core
    assert core.scheduler.num_preemptions > 0 and core.scheduler.num_spec_accepted_tokens > 0
    assert [o.outputs[0].token_ids for o in outs] == reference
    assert core.kv_cache_manager.num_free_blocks == 7


def test_stop_token_and_stop_string_end_it_where_they_would_without_speculation(plain, spec):
    prompt = PROMPTS[2]
    ref = plain.generate(prompt, greedy(24))[0].outputs[0]
    stop_id = ref.token_ids[12]
    # " fox" comes with " is" in one step (an accepted draft and the bonus token): " is" must
    # be dropped, as it is never generated without speculation.
    for params in (greedy(24, stop_token_ids=[stop_id]), greedy(24, stop=[" lazy"]), greedy(24, stop=[" fox"])):
        a = plain.generate(prompt, params)[0].outputs[0]
        b = spec.generate(prompt, params)[0].outputs[0]
        assert (b.text, b.finish_reason, b.stop_reason) == (a.text, a.finish_reason, a.stop_reason)
        assert b.token_ids == a.token_ids  # no token past the stop, though drafts came with it
        if params.stop_token_ids:
            assert b.token_ids[-1] == stop_id


def test_logprobs_of_verified_tokens_match_plain_decoding(plain, spec):
    params = greedy(16, logprobs=2)
    a = plain.generate(PROMPTS[2], params)[0].outputs[0]
    b = spec.generate(PROMPTS[2], params)[0].outputs[0]
    assert b.num_accepted_tokens > 0 and b.token_ids == a.token_ids
    assert len(b.logprobs) == len(b.token_ids)
    for x, y in zip(a.logprobs, b.logprobs):
        assert x.token_id == y.token_id
        assert y.logprob == pytest.approx(x.logprob, abs=1e-3)
        assert [t for t, _ in y.top] == [t for t, _ in x.top]


@BOTH
def test_seeded_sampling_is_reproducible_and_batch_independent(engine, request):
    spec = request.getfixturevalue(engine)
    params = SamplingParams(temperature=0.8, top_p=0.95, seed=11, max_tokens=16, ignore_eos=True)
    alone = spec.generate(PROMPTS[2], params)[0].outputs[0].token_ids
    again = spec.generate(PROMPTS[2], params)[0].outputs[0].token_ids
    batched = spec.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]],
                            [greedy(12), params, greedy(5)])[1].outputs[0].token_ids
    assert alone == again == batched and len(alone) == 16


# -- isolation ---------------------------------------------------------------------------------

# 8 tasks x 4 variants behind one system line: requests share prefixes (prefix-cache hits) and
# repeat themselves (n-gram drafts get accepted).
_SYSTEM = "You are a terse assistant. Continue the text exactly in the style it starts in.\n\n"
_TASKS = ["Count: 1, 2, 3, 4, 5, 6, 7, 8,", "The cat sat on the mat. The cat sat on the mat. The cat",
          "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n", "Monday, Tuesday, Wednesday,",
          "A: red, B: green, C: blue, A: red, B:", "Paris is in France. Rome is in Italy. Madrid",
          "<li>one</li>\n<li>two</li>\n<li>", "x = x + 1\ny = y + 1\nz ="]
ISOLATION_PROMPTS = [f"{_SYSTEM}{task} (variant {v})\n{task}" for v in range(4) for task in _TASKS]


def test_32_prompts_alone_and_together_in_shuffled_order_are_token_identical(spec):
    """A request's greedy output does not depend on what runs beside it (fp32, prefix caching and
    n-gram speculation on): 32 prompts generated one at a time (each speculating at every step,
    later ones adopting the earlier ones' cached prefixes) equal the same 32 submitted together in
    shuffled order (no speculation while more than 8 run, then the shortest finish and the rest
    speculate)."""
    params = {p: greedy(20 if i % 8 == 7 else 6 + 2 * (i % 3)) for i, p in enumerate(ISOLATION_PROMPTS)}
    sched, kv = spec.engine.core.scheduler, spec.engine.core.kv_cache_manager
    alone = {p: spec.generate(p, params[p])[0].outputs[0].token_ids for p in ISOLATION_PROMPTS}
    order = random.Random(0).sample(ISOLATION_PROMPTS, len(ISOLATION_PROMPTS))
    hits, drafts = kv.prefix_hit_tokens, sched.num_spec_drafts
    together = spec.generate(order, [params[p] for p in order])
    assert {p: o.outputs[0].token_ids for p, o in zip(order, together)} == alone
    assert kv.prefix_hit_tokens > hits and sched.num_spec_drafts > drafts  # both paths ran together too
    assert sched.num_spec_accepted_tokens > 0


# -- draft model --------------------------------------------------------------------------------

def test_draft_model_self_draft_is_token_identical_and_always_accepted(default_model_path, reference):
    """The default model as its own draft: q == p, so every draft must be accepted."""
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256,
              speculative_method="draft", draft_model=str(default_model_path), num_speculative_tokens=3, speculative_max_running=8)
    outs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == reference
    sched = llm.engine.core.scheduler
    assert sched.num_spec_draft_tokens > 10 and sched.num_spec_accepted_tokens == sched.num_spec_draft_tokens
    # sampling with q == p: still every draft accepted, and a seed reproduces the output
    params = SamplingParams(temperature=0.8, top_k=40, seed=5, max_tokens=10, ignore_eos=True)
    a, b = llm.generate([PROMPTS[1], PROMPTS[1]], params)
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].num_accepted_tokens == a.outputs[0].num_draft_tokens > 0


def test_draft_model_catches_up_when_speculation_resumes(default_model_path, reference):
    """Above the threshold (5 requests running, speculative_max_running=2) the draft model is
    skipped; once three have finished, the two left catch up on the draft K/V they missed and
    speculate for the rest of their output, every self-draft accepted and the output unchanged."""
    llm = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256,
              speculative_method="draft", draft_model=str(default_model_path), num_speculative_tokens=3,
              speculative_max_running=2)
    outs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == reference
    for i in (0, 2):  # the two longest (28 and 24 tokens) run alone at the end
        out = outs[i].outputs[0]
        assert out.num_draft_tokens > 0 and out.num_accepted_tokens == out.num_draft_tokens
    for i in (1, 4):  # the two shortest finish while all five run: never speculated
        assert outs[i].outputs[0].num_draft_tokens == 0


def test_unrelated_draft_model_with_a_small_kv_cache_is_token_identical(default_model_path, tiny_qwen2_dir):
    """A tiny random Qwen2 with the same tokenizer drafts badly: most drafts are rejected and
    rolled back, in both KV caches, while requests are preempted; the output must not change."""
    kw = dict(dtype="float32", quantization="none", max_model_len=512, max_num_batched_tokens=64)
    plain = LLM(str(default_model_path), num_kv_blocks=64, **kw)
    refs = [o.outputs[0].token_ids for o in plain.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])]
    del plain
    llm = LLM(str(default_model_path), num_kv_blocks=7, speculative_method="draft", draft_model=str(tiny_qwen2_dir),
              num_speculative_tokens=2, speculative_max_running=8, **kw)
    outs = llm.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])
    assert [o.outputs[0].token_ids for o in outs] == refs
    sched = llm.engine.core.scheduler
    assert sched.num_preemptions > 0
    assert 0 <= sched.num_spec_accepted_tokens < sched.num_spec_draft_tokens
    assert llm.engine.core.kv_cache_manager.num_free_blocks == 7


def test_draft_model_with_another_vocabulary_is_refused(default_model_path, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    from tokenmill.config import ConfigError
    from tokenmill.models.loader import load_checkpoint

    tokenizer = load_checkpoint(default_model_path).tokenizer
    config = LlamaConfig(vocab_size=len(tokenizer) + 64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=8192)
    LlamaForCausalLM(config).save_pretrained(tmp_path, safe_serialization=True)
    tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="draft_model.*vocabulary"):
        LLM(str(default_model_path), dtype="float32", quantization="none", speculative_method="draft", draft_model=str(tmp_path))


@pytest.mark.skipif(not (os.environ.get("TOKENMILL_QWEN_DRAFT") and os.environ.get("TOKENMILL_QWEN_TARGET")),
                    reason="opt-in: set TOKENMILL_QWEN_DRAFT / TOKENMILL_QWEN_TARGET to the assembled "
                           "Qwen2.5-Coder-0.5B / 1.5B-Instruct GGUF files (see ../shared/MODELS.md)")
def test_qwen_coder_draft_target_pair_is_token_identical():
    draft, target = os.environ["TOKENMILL_QWEN_DRAFT"], os.environ["TOKENMILL_QWEN_TARGET"]
    prompts = [PROMPTS[0], PROMPTS[3], "Write a Python function that reverses a string.\n"]
    params = [greedy(n) for n in (32, 24, 16)]
    plain = LLM(target, dtype="float32", quantization="none", max_model_len=2048)
    refs = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    del plain
    spec = LLM(target, dtype="float32", quantization="none", max_model_len=2048, num_kv_blocks=24, speculative_method="draft",
               draft_model=draft, num_speculative_tokens=4, speculative_max_running=8)
    assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == refs
    assert spec.engine.core.scheduler.num_spec_accepted_tokens > 0
