"""Structured output through the engine on the real default model: every output parses and
validates against its schema (sampling at temperature 1, many seeds), regex / choice / grammar
outputs match, n > 1, streaming, speculative decoding (n-gram and draft model) and preemption
keep it valid and greedy-identical, a bad constraint is refused without disturbing anyone (in
the serving engine too), and unconstrained requests in the same batch are unaffected."""

from __future__ import annotations

import asyncio
import json
import re

import pytest

jsonschema = pytest.importorskip("jsonschema")  # a test extra: a machine without it skips, not fails collection

from tokenmill import LLM, SamplingParams  # noqa: E402
from tokenmill.config import EngineConfig  # noqa: E402
from tokenmill.engine.async_llm import AsyncLLM  # noqa: E402
from tokenmill.sampling_params import SamplingParamsError, StructuredOutputParams  # noqa: E402

pytestmark = pytest.mark.slow

# Strings, numbers and arrays are bounded: at temperature 1 the output must still end well
# within max_tokens. Patterns are anchored, so jsonschema (re.search) means what the grammar does.
SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                      "age": {"type": "integer", "minimum": 0, "maximum": 120},
                                      "student": {"type": "boolean"}}, "required": ["name", "age", "student"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                      "shade": {"type": "integer", "minimum": 1, "maximum": 9},
                                      "tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                               "minItems": 1, "maxItems": 3}}, "required": ["color", "tags"]},
    {"type": "object", "properties": {"point": {"type": "object", "required": ["x", "y"], "properties": {
        "x": {"type": "integer", "minimum": -100, "maximum": 100}, "y": {"type": "integer", "minimum": -100, "maximum": 100}}},
        "label": {"type": ["string", "null"], "maxLength": 10}}, "required": ["point", "label"]},
    {"type": "object", "properties": {"event": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "click"}, "button": {"enum": ["left", "right"]}},
         "required": ["kind", "button"]},
        {"type": "object", "properties": {"kind": {"const": "key"}, "code": {"type": "string", "pattern": "^[A-Z][0-9]{2}$"}},
         "required": ["kind", "code"]}]}}, "required": ["event"]},
    {"type": "array", "minItems": 1, "maxItems": 3, "items": {"type": "object", "required": ["id", "ok"], "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999}, "ok": {"type": "boolean"}}}},
    {"type": "object", "properties": {"price": {"type": "number", "minimum": 0, "maximum": 1000},
                                      "currency": {"enum": ["USD", "EUR"]},
                                      "sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}},
     "required": ["price", "currency", "sku"]},
]
SEEDS = range(3)
PROMPT = "Reply with JSON only.\n"
PERSON = SCHEMAS[0]


def constrained(max_tokens=96, temperature=0.0, **kwargs):
    so = {k: kwargs.pop(k) for k in ("json", "json_object", "regex", "choice", "grammar") if k in kwargs}
    return SamplingParams(temperature=temperature, max_tokens=max_tokens,
                          structured_output=StructuredOutputParams(**so), **kwargs)


def assert_valid(completion, schema):
    assert completion.finish_reason == "stop", completion.text
    jsonschema.validate(json.loads(completion.text), schema)


@pytest.fixture(scope="module")
def llm(default_model_path):
    return LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def reference(llm):
    """Greedy constrained outputs without speculation or preemption."""
    # An example in the prompt gives n-gram speculation drafts to propose.
    prompts = [PROMPT + f'Example: {{"name": "Ann", "age": 30, "student": false}}\nPerson number {i}:' for i in range(4)]
    outs = llm.generate(prompts, constrained(json=PERSON, max_tokens=64))
    return prompts, [o.outputs[0].token_ids for o in outs]


def test_sampled_outputs_validate_against_many_schemas(llm):
    jobs = [(schema, seed) for schema in SCHEMAS for seed in SEEDS]
    outs = llm.generate([PROMPT] * len(jobs), [constrained(json=s, temperature=1.0, seed=seed) for s, seed in jobs])
    for (schema, _), out in zip(jobs, outs):
        assert_valid(out.outputs[0], schema)
    assert len({out.outputs[0].text for out in outs}) > len(SCHEMAS)  # the seeds do vary the outputs


def test_json_object_regex_choice_and_grammar(llm):
    regex = r"\(\d{3}\) \d{3}-\d{4}"
    choices = ["yes", "no", "it depends"]
    grammar = 'root ::= "(" num " " op " " num ")"\nnum ::= [1-9] [0-9]?\nop ::= "+" | "-" | "*"'
    lark = 'start: "<" WORD ">"\nWORD: /[a-z]{1,6}/'
    # Any JSON object has no bound on its size: the prompt asks for a small one.
    params = ([constrained(json_object=True, temperature=0.7, seed=s) for s in SEEDS]
              + [constrained(regex=regex, temperature=1.0, seed=s) for s in SEEDS]
              + [constrained(choice=choices, temperature=1.0, seed=s) for s in SEEDS]
              + [constrained(grammar=grammar, temperature=1.0, seed=s) for s in SEEDS]
              + [constrained(grammar=lark, temperature=1.0, seed=s) for s in SEEDS])
    prompts = ['Reply with a JSON object with keys "name" and "age".\n'] * len(SEEDS) + [PROMPT] * (len(params) - len(SEEDS))
    outs = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert all(c.finish_reason == "stop" for c in outs), [c.text for c in outs]
    n = len(SEEDS)
    assert all(isinstance(json.loads(c.text), dict) for c in outs[:n])
    assert all(re.fullmatch(regex, c.text) for c in outs[n : 2 * n])
    assert all(c.text in choices for c in outs[2 * n : 3 * n])
    assert all(re.fullmatch(r"\([1-9][0-9]? [-+*] [1-9][0-9]?\)", c.text) for c in outs[3 * n : 4 * n])
    assert all(re.fullmatch(r"<[a-z]{1,6}>", c.text) for c in outs[4 * n :])


def test_n_samples_each_follow_the_grammar(llm):
    out = llm.generate(PROMPT, constrained(json=SCHEMAS[1], temperature=1.0, seed=7, n=4))[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert_valid(c, SCHEMAS[1])
    assert len({c.text for c in out.outputs}) > 1


def test_streamed_deltas_add_up_to_a_valid_document(llm):
    params = constrained(json=SCHEMAS[2], temperature=1.0, seed=3)
    text, last = "", None
    for last in llm.stream(PROMPT, params):
        text += last.outputs[0].delta_text
    assert last.finished and text == last.outputs[0].text
    assert_valid(last.outputs[0], SCHEMAS[2])


def test_unconstrained_requests_in_the_batch_are_unaffected(llm):
    prompts = ["The capital of France is", "def fib(n):", "Once upon a time"]
    plain = SamplingParams(temperature=0.0, max_tokens=24)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, plain)]
    mixed = llm.generate(prompts + [PROMPT] * 3, [plain] * 3 + [constrained(json=PERSON, max_tokens=64)] * 3)
    assert [o.outputs[0].token_ids for o in mixed[:3]] == alone
    for o in mixed[3:]:
        assert_valid(o.outputs[0], PERSON)


def test_a_bad_constraint_is_refused_and_the_engine_goes_on(llm, reference):
    with pytest.raises(SamplingParamsError) as info:
        llm.generate(PROMPT, constrained(json={"type": "object", "properties": {"a": {"type": "strin"}}}))
    assert info.value.field == "structured_output.json"
    with pytest.raises(SamplingParamsError) as info:
        llm.generate(PROMPT, constrained(regex="[0-9"))
    assert info.value.field == "structured_output.regex"
    assert not llm.engine.has_unfinished_requests()
    prompts, ref = reference
    assert llm.generate(prompts[0], constrained(json=PERSON, max_tokens=64))[0].outputs[0].token_ids == ref[0]


SPEC = dict(speculative_method="ngram", num_speculative_tokens=4, speculative_ngram_min=1, speculative_ngram_max=3,
            speculative_max_running=8)


@pytest.fixture(scope="module", autouse=True)
def _flat_step_cost(flat_step_cost):
    """Speculation here plans its drafts on a fixed bandwidth-bound step cost (tests/conftest.py)."""


def test_ngram_speculation_is_valid_and_greedy_identical(default_model_path, reference):
    spec = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256, **SPEC)
    prompts, ref = reference
    # The prompt's example repeats the schema's keys: n-gram drafts are proposed, some of them valid.
    outs = spec.generate(prompts, constrained(json=PERSON, max_tokens=64))
    assert [o.outputs[0].token_ids for o in outs] == ref
    assert sum(o.outputs[0].num_draft_tokens for o in outs) > 0
    assert sum(o.outputs[0].num_accepted_tokens for o in outs) > 0
    sampled = spec.generate([PROMPT] * 4, [constrained(json=s, temperature=1.0, seed=1) for s in SCHEMAS[:4]])
    for schema, out in zip(SCHEMAS, sampled):
        assert_valid(out.outputs[0], schema)


def test_draft_model_speculation_is_valid_and_greedy_identical(default_model_path, reference):
    spec = LLM(str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25, max_num_batched_tokens=256,
               speculative_method="draft", draft_model=str(default_model_path), num_speculative_tokens=3,
               speculative_max_running=8)
    prompts, ref = reference
    outs = spec.generate(prompts, constrained(json=PERSON, max_tokens=64))
    assert [o.outputs[0].token_ids for o in outs] == ref
    # Self-drafting: every draft the masked draft distribution proposes is accepted.
    assert all(o.outputs[0].num_accepted_tokens == o.outputs[0].num_draft_tokens > 0 for o in outs)
    sampled = spec.generate(PROMPT, constrained(json=SCHEMAS[4], temperature=1.0, seed=2, n=2))[0]
    for c in sampled.outputs:
        assert_valid(c, SCHEMAS[4])


@pytest.mark.parametrize("swap", [False, True], ids=["recompute", "swap"])
def test_preemption_keeps_outputs_valid_and_greedy_identical(default_model_path, reference, swap):
    small = LLM(str(default_model_path), dtype="float32", quantization="none", num_kv_blocks=7, max_num_batched_tokens=64,
                num_host_kv_blocks=16 if swap else 0)
    prompts, ref = reference
    outs = small.generate(prompts, constrained(json=PERSON, max_tokens=64))
    scheduler = small.engine.core.scheduler
    assert scheduler.num_preemptions > 0
    assert (scheduler.num_swap_preemptions > 0) == swap
    assert [o.outputs[0].token_ids for o in outs] == ref
    for o in outs:
        assert_valid(o.outputs[0], PERSON)


def test_serving_engine_compiles_off_the_loop_and_refuses_a_bad_constraint(default_model_path, reference):
    prompts, ref = reference
    config = EngineConfig(model=str(default_model_path), dtype="float32", quantization="none", kv_cache_memory_gb=0.25,
                          max_num_batched_tokens=256)

    async def serve():
        llm = AsyncLLM(config, log_stats_interval=0)
        llm.start()
        await llm.wait_ready()
        try:
            with pytest.raises(SamplingParamsError) as info:
                await llm.add_request("bad", PROMPT, constrained(json={"type": "strin"}))
            assert info.value.field == "structured_output.json"

            async def one(i):
                final = None
                async for out in await llm.add_request(f"r{i}", prompts[i], constrained(json=PERSON, max_tokens=64)):
                    final = out
                return final.outputs[0].token_ids

            return await asyncio.gather(*(one(i) for i in range(2)))
        finally:
            llm.shutdown()

    assert asyncio.run(serve()) == ref[:2]
