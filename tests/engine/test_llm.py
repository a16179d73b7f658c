"""The offline API on the real default model: preemption, seeds, stops, n, streaming, logprobs,
and every rejected input (with the engine still serving afterwards)."""

from __future__ import annotations

import pytest

from tokenmill import LLM, SamplingParams
from tokenmill.config import ConfigError
from tokenmill.engine.llm_engine import ContextLengthError, InvalidPromptError
from tokenmill.models.registry import ModelNotFoundError
from tokenmill.sampling_params import SamplingParamsError

pytestmark = pytest.mark.slow

PROMPTS = [
    "The quick brown fox jumps over the lazy dog. Then the dog",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Once upon a time, in a land far away, there lived a king who had three daughters. The youngest",
    "List of prime numbers: 2, 3, 5, 7, 11,",
    "Water boils at 100 degrees Celsius at sea level. At the top of a high mountain, water boils",
    "Paris is the capital of France. Berlin is the capital of Germany. Madrid",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def reference(llm):
    """Each prompt generated alone: the outputs every batched or preempted run must reproduce."""
    return {p: llm.generate(p, GREEDY)[0].outputs[0].token_ids for p in PROMPTS}


def test_inflight_batch_matches_one_at_a_time(llm, reference):
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in PROMPTS]
    assert all(len(o.outputs[0].token_ids) == 24 and o.outputs[0].finish_reason == "length" for o in outs)


def test_preemption_leaves_greedy_and_seeded_outputs_unchanged(default_model_path, llm, reference):
    # 10 blocks of 16 tokens cannot hold six requests of ~40 tokens + 24 outputs (3-4 blocks each).
    small = LLM(str(default_model_path), dtype="float32", quantization="none", num_kv_blocks=10, max_num_batched_tokens=64)
    outs = small.generate(PROMPTS, GREEDY)
    assert small.engine.core.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == [reference[p] for p in PROMPTS]
    assert small.engine.core.kv_cache_manager.num_free_blocks == 10  # everything freed at the end

    seeded = SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=24, ignore_eos=True)
    before = small.engine.core.scheduler.num_preemptions
    preempted = [o.outputs[0].token_ids for o in small.generate(PROMPTS, seeded)]
    assert small.engine.core.scheduler.num_preemptions > before
    assert preempted == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)]


def test_seed_gives_the_same_output_whatever_else_is_in_the_batch(llm):
    params = SamplingParams(temperature=0.9, top_k=50, seed=1234, max_tokens=20, ignore_eos=True)
    alone = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    crowd = [SamplingParams(temperature=1.0, max_tokens=15, ignore_eos=True)] * 3
    batch = llm.generate(PROMPTS[2:5] + [PROMPTS[0]], crowd + [params])
    assert batch[-1].outputs[0].token_ids == alone
    other_seed = llm.generate(PROMPTS[0], SamplingParams(temperature=0.9, top_k=50, seed=99, max_tokens=20, ignore_eos=True))
    assert other_seed[0].outputs[0].token_ids != alone


def test_stop_string_is_never_emitted(llm):
    full = llm.generate(PROMPTS[5], GREEDY)[0].outputs[0].text
    stop = full[6:10]
    assert stop.strip(), f"pick a visible stop string from {full!r}"
    out = llm.generate(PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=24, stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full[: full.index(stop)]
    kept = llm.generate(PROMPTS[5], SamplingParams(temperature=0.0, max_tokens=24, stop=stop, include_stop_str_in_output=True))
    assert kept[0].outputs[0].text == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_max_tokens_and_min_tokens(llm, reference):
    ref = reference[PROMPTS[1]]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=24, stop_token_ids=[ref[4]]))[0].outputs[0]
    first = ref.index(ref[4])
    assert out.token_ids == ref[: first + 1] and out.finish_reason == "stop" and out.stop_reason == ref[4]
    out = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=3))[0].outputs[0]
    assert out.token_ids == ref[:3] and out.finish_reason == "length"
    eos = llm.engine.eos_token_ids[0]
    forced = SamplingParams(temperature=0.0, max_tokens=8, min_tokens=8, logit_bias={eos: 100.0})
    out = llm.generate(PROMPTS[1], forced)[0].outputs[0]
    assert len(out.token_ids) == 8 and eos not in out.token_ids  # eos favoured but masked until min_tokens
    assert llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=8, logit_bias={eos: 100.0}))[0].outputs[0].token_ids == [eos]


def test_n_samples_and_streaming(llm, reference):
    out = llm.generate(PROMPTS[2], SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=10, ignore_eos=True))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    chunks = list(llm.stream(PROMPTS[:2], GREEDY))
    request_ids = list(dict.fromkeys(c.request_id for c in chunks))  # in order of first output
    assert len(request_ids) == 2
    for request_id in request_ids:
        mine = [c for c in chunks if c.request_id == request_id]
        prompt = mine[0].prompt
        assert mine[-1].finished and not any(c.finished for c in mine[:-1])
        assert "".join(c.outputs[0].delta_text for c in mine) == mine[-1].outputs[0].text
        assert sum((c.outputs[0].delta_token_ids for c in mine), []) == reference[prompt]


def test_logprobs_and_chat(llm):
    out = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=3))[0].outputs[0]
    assert len(out.logprobs) == 4
    for entry in out.logprobs:
        assert len(entry.top) == 3 and entry.top[0][0] == entry.token_id  # greedy takes the top token
        assert entry.logprob == pytest.approx(entry.top[0][1]) and entry.logprob <= 0
    assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs))
    reply = llm.chat([{"role": "user", "content": "What is the capital of France?"}], SamplingParams(temperature=0.0, max_tokens=20))
    assert "Paris" in reply[0].outputs[0].text
    assert reply[0].outputs[0].finish_reason in ("stop", "length")


def test_rejected_inputs_name_the_problem_and_leave_the_engine_serving(llm, reference):
    with pytest.raises(SamplingParamsError, match="temperature") as e:
        SamplingParams(temperature=-1.0)
    assert e.value.field == "temperature"
    with pytest.raises(SamplingParamsError, match="top_p"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InvalidPromptError, match="empty"):
        llm.generate("", GREEDY)
    with pytest.raises(InvalidPromptError, match="empty"):
        llm.generate([[]], GREEDY)
    with pytest.raises(InvalidPromptError, match="token ids"):
        llm.generate([[1, 2, 10**9]], GREEDY)
    with pytest.raises(SamplingParamsError, match="logit_bias"):
        llm.generate("hi", SamplingParams(logit_bias={10**9: 1.0}))
    with pytest.raises(ContextLengthError, match="maximum context length is 8192 tokens") as e:
        llm.generate("word " * 5000, SamplingParams(max_tokens=5000))
    assert e.value.field == "max_tokens"
    with pytest.raises(ContextLengthError, match="in the prompt") as e:
        llm.generate("word " * 9000, SamplingParams(max_tokens=1))
    assert e.value.field == "prompt"
    with pytest.raises(InvalidPromptError, match="messages"):
        llm.chat([], GREEDY)
    # A bad prompt in a batch rejects the batch without leaving its good requests queued.
    with pytest.raises(InvalidPromptError):
        llm.generate([PROMPTS[0], ""], GREEDY)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.scheduler.num_unfinished == 0
    assert llm.generate(PROMPTS[0], GREEDY)[0].outputs[0].token_ids == reference[PROMPTS[0]]


def test_unknown_model_and_unknown_config_key():
    with pytest.raises(ModelNotFoundError, match="no-such-model"):
        LLM("no-such-model")
    with pytest.raises(ConfigError, match="max_batch"):
        LLM("smollm2-135m", max_batch=3)
    with pytest.raises(ConfigError, match="float16 is not supported on CPU"):
        LLM("smollm2-135m", dtype="float16", device="cpu")
