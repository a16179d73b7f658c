"""The grammar compiler and matcher with the default model's tokenizer (no model weights)."""

from __future__ import annotations

import pytest
import torch

from tokenmill.sampling_params import SamplingParams, SamplingParamsError, StructuredOutputParams
from tokenmill.structured.bitmask import allocate_bitmask, apply_bitmask_
from tokenmill.structured.grammar import GrammarCompiler, close_objects
from tokenmill.structured.matcher import GrammarMatcher, MaskFiller

pytestmark = pytest.mark.slow  # opens the default model's GGUF for its tokenizer


@pytest.fixture(scope="module")
def compiler(default_checkpoint):
    return GrammarCompiler(default_checkpoint.tokenizer, default_checkpoint.config.vocab_size,
                           default_checkpoint.config.eos_token_ids)


@pytest.fixture(scope="module")
def tokenizer(default_checkpoint):
    return default_checkpoint.tokenizer


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("kwargs, field", [
    (dict(json={"type": "strin"}), "structured_output.json"),
    (dict(json={"type": "object", "properties": {"a": {"$ref": "#/defs/missing"}}}), "structured_output.json"),
    (dict(json={"type": "string", "pattern": "[a-"}), "structured_output.json"),
    (dict(regex="(a|b"), "structured_output.regex"),
    (dict(grammar='root ::= "a" | ('), "structured_output.grammar"),
    (dict(grammar='start: "a" | b'), "structured_output.grammar"),  # Lark: rule b is undefined
    (dict(grammar='start ::= "a"'), "structured_output.grammar"),  # EBNF starts at root
])
def test_what_the_backend_cannot_compile_names_the_field(compiler, kwargs, field):
    with pytest.raises(SamplingParamsError) as info:
        compiler.compile(StructuredOutputParams(**kwargs))
    assert info.value.field == field
    assert str(info.value).startswith(f"{field} cannot be compiled: ")
    assert "\n" not in str(info.value)  # one line


def test_shape_errors_are_raised_on_construction():
    for kwargs, field in [({}, "structured_output"), (dict(json="{", regex="a"), "structured_output"),
                          (dict(json="{"), "structured_output.json"), (dict(json="[1]"), "structured_output.json"),
                          (dict(regex=""), "structured_output.regex"), (dict(choice=[]), "structured_output.choice"),
                          (dict(choice=["a", 1]), "structured_output.choice"),
                          (dict(json_object="yes"), "structured_output.json_object")]:
        with pytest.raises(SamplingParamsError) as info:
            StructuredOutputParams(**kwargs)
        assert info.value.field == field, kwargs
    so = StructuredOutputParams(json_object=True)
    for kwargs, field in [(dict(ignore_eos=True), "ignore_eos"), (dict(min_tokens=2), "min_tokens"),
                          (dict(), None)]:
        if field is None:
            SamplingParams(structured_output=so, **kwargs)
            continue
        with pytest.raises(SamplingParamsError) as info:
            SamplingParams(structured_output=so, **kwargs)
        assert info.value.field == field
    with pytest.raises(SamplingParamsError) as info:
        SamplingParams(structured_output={"json_object": True})
    assert info.value.field == "structured_output"


def test_compiled_once_per_constraint(compiler):
    before = compiler.num_compiled
    a = compiler.compile(StructuredOutputParams(json={"type": "object", "properties": {"x": {"type": "integer"}}}))
    b = compiler.compile(StructuredOutputParams(json='{"properties": {"x": {"type": "integer"}}, "type": "object"}'))
    c = compiler.compile(StructuredOutputParams(regex="x+"))
    assert a is b and a is not c
    assert compiler.num_compiled == before + 2


def test_matcher_masks_walks_drafts_and_rolls_back(compiler, tokenizer):
    eos = compiler.eos_token_ids
    m = GrammarMatcher(compiler.compile(StructuredOutputParams(choice=["yes", "no"])))
    bitmask = allocate_bitmask(1, compiler.vocab_size)
    m.fill(bitmask, 0)
    logits = torch.zeros(1, compiler.vocab_size)
    apply_bitmask_(logits, bitmask)
    allowed = set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist())
    yes, no = encode(tokenizer, "yes"), encode(tokenizer, "no")
    assert yes[0] in allowed and no[0] in allowed and not set(eos) & allowed
    assert len(allowed) < 20
    # Drafts: "yes" then eos is valid; anything after the stop token is not.
    drafts = yes + eos[:1] + no
    assert m.num_valid_drafts(drafts) == len(yes) + 1
    assert m.num_accepted == 0 and not m.is_terminated
    assert m.accept(yes) == len(yes)
    m.fill(bitmask, 0)
    logits.zero_()
    apply_bitmask_(logits, bitmask)
    assert set(torch.isfinite(logits[0]).nonzero()[:, 0].tolist()) == set(eos)  # complete: only eos
    assert m.accept(no) == 0
    m.rollback(len(yes))
    assert m.accept(no) == len(no) and m.accept(eos[:1]) == 1 and m.is_terminated


def test_objects_that_list_properties_are_closed_unless_they_say_otherwise():
    schema = {"type": "object", "properties": {"a": {"type": "object", "properties": {"b": {"const": {"properties": 1}}}},
                                               "c": {"type": "object", "additionalProperties": True,
                                                     "properties": {"d": {"type": "integer"}}}},
              "$defs": {"e": {"properties": {}}}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["a"]["additionalProperties"] is False
    assert closed["properties"]["a"]["properties"]["b"] == {"const": {"properties": 1}}  # data is left alone
    assert closed["properties"]["c"]["additionalProperties"] is True
    assert closed["$defs"]["e"]["additionalProperties"] is False
    assert "additionalProperties" not in schema  # a copy


def test_batch_fill_equals_one_by_one(compiler, tokenizer):
    compiled = compiler.compile(StructuredOutputParams(json={"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8}, "n": {"type": "integer"}}, "required": ["name", "n"]}))
    doc = encode(tokenizer, '{"name": "Bo", "n": 12}')
    matchers = []
    for i in range(len(doc) + 1):
        m = GrammarMatcher(compiled)
        assert m.accept(doc[:i]) == i
        matchers.append(m)
    assert matchers[-1].accept(compiler.eos_token_ids[:1]) == 1 and matchers[-1].is_terminated
    one = allocate_bitmask(len(matchers), compiler.vocab_size)
    for i, m in enumerate(matchers):
        m.fill(one, i)
    batch = torch.zeros_like(one)
    MaskFiller(2).fill([(m, i) for i, m in enumerate(matchers)], batch)
    assert torch.equal(one, batch)
    assert bool((batch[-1] == -1).all())  # a terminated matcher's row is not used: all allowed
