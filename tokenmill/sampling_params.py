"""How one request wants its tokens chosen and when it wants to stop (plain data, no torch)."""

from __future__ import annotations

import json as _json
import math
from dataclasses import dataclass, field

# Temperatures below this are treated as 0 (greedy): dividing logits by them overflows fp32.
GREEDY_TEMPERATURE_EPS = 1e-5
MAX_LOGPROBS = 20
MAX_ABS_LOGIT_BIAS = 100.0
MAX_ABS_FREQUENCY_PRESENCE_PENALTY = 2.0


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range. `field` names it (the HTTP layer answers 400 naming
    that parameter); the message names the field, the bad value and the allowed range."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


STRUCTURED_OUTPUT_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputParams:
    """Constrain the output to a grammar (structured output); exactly one field is set.

    json: a JSON schema (a dict, or its JSON text); json_object: any JSON object; regex: a
    regular expression the whole output matches; choice: one of these strings, exactly;
    grammar: an EBNF (GBNF: `root ::= ...`) or Lark grammar. Validated on construction for
    shape only (types, JSON text that parses, a non-empty choice list); whether the backend can
    compile it is checked when the engine admits the request (`tokenmill.structured`), which
    raises SamplingParamsError with field `structured_output.<kind>` too.
    """

    json: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise SamplingParamsError(
                "structured_output",
                f"structured_output must set exactly one of {', '.join(STRUCTURED_OUTPUT_KINDS)}, got "
                f"{', '.join(given) if given else 'none'}",
            )
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = _json.loads(schema)
                except ValueError as e:
                    raise SamplingParamsError("structured_output.json", f"structured_output.json is not valid JSON: {e}") from None
            if not isinstance(schema, dict):
                raise SamplingParamsError(
                    "structured_output.json", f"structured_output.json must be a JSON schema object, got {self.json!r:.100}"
                )
        _check_bool("structured_output.json_object", self.json_object)
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(
                    f"structured_output.{name}", f"structured_output.{name} must be a non-empty string, got {value!r:.100}"
                )
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise SamplingParamsError(
                    "structured_output.choice",
                    f"structured_output.choice must be a non-empty list of non-empty strings, got {self.choice!r:.100}",
                )
            object.__setattr__(self, "choice", list(self.choice))

    @property
    def kind(self) -> str:
        """The field that is set: one of STRUCTURED_OUTPUT_KINDS."""
        return next(k for k in STRUCTURED_OUTPUT_KINDS if getattr(self, k) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, text): equal for equal constraints, the compiled-grammar cache's key. A schema
        given as a dict or as JSON text is keyed by its canonical JSON text."""
        kind = self.kind
        if kind == "json":
            schema = _json.loads(self.json) if isinstance(self.json, str) else self.json
            return kind, _json.dumps(schema, sort_keys=True, separators=(",", ":"))
        if kind == "choice":
            return kind, _json.dumps(self.choice)
        if kind == "json_object":
            return kind, ""
        return kind, getattr(self, kind)


@dataclass(slots=True)
class SamplingParams:
    """Validated on construction; every bad value raises SamplingParamsError.

    Mutating a field after construction skips validation: use `dataclasses.replace` instead.
    """

    n: int = 1  # >= 1
    temperature: float = 1.0  # >= 0; 0 means greedy
    top_p: float = 1.0  # (0, 1]
    top_k: int = 0  # 0 or -1 = disabled, else >= 1
    min_p: float = 0.0  # [0, 1]
    repetition_penalty: float = 1.0  # > 0; HF/CTRL: divides positive logits, multiplies negative
    frequency_penalty: float = 0.0  # [-2, 2]; logit -= frequency_penalty * count in output
    presence_penalty: float = 0.0  # [-2, 2]; logit -= presence_penalty * (count in output > 0)
    logit_bias: dict[int, float] | None = None  # token id (>= 0) -> bias in [-100, 100]
    seed: int | None = None
    max_tokens: int | None = 16  # >= 1; None = until max_model_len
    min_tokens: int = 0  # >= 0, <= max_tokens
    stop: list[str] = field(default_factory=list)  # a str is accepted and becomes [str]
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None = none; k = sampled token's logprob plus the top k (<= 20)
    # Also return log p(prompt token i | prompt tokens < i) for every prompt token but the first.
    prompt_logprobs: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Constrain the output to a grammar; the request then ends where the grammar does (its eos
    # is allowed only there), so min_tokens and ignore_eos cannot be combined with it.
    structured_output: StructuredOutputParams | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, low=1)
        self.temperature = _check_float("temperature", self.temperature, low=0.0)
        self.top_p = _check_float("top_p", self.top_p, low=0.0, low_open=True, high=1.0)
        _check_int("top_k", self.top_k)
        if self.top_k < -1:
            raise SamplingParamsError(
                "top_k", f"top_k must be -1 or 0 (disabled) or >= 1, got {self.top_k}"
            )
        self.min_p = _check_float("min_p", self.min_p, low=0.0, high=1.0)
        self.repetition_penalty = _check_float(
            "repetition_penalty", self.repetition_penalty, low=0.0, low_open=True
        )
        bound = MAX_ABS_FREQUENCY_PRESENCE_PENALTY
        self.frequency_penalty = _check_float(
            "frequency_penalty", self.frequency_penalty, low=-bound, high=bound
        )
        self.presence_penalty = _check_float(
            "presence_penalty", self.presence_penalty, low=-bound, high=bound
        )
        self.logit_bias = _check_logit_bias(self.logit_bias)
        if self.seed is not None:
            _check_int("seed", self.seed)
        if self.max_tokens is not None:
            _check_int("max_tokens", self.max_tokens, low=1)
        _check_int("min_tokens", self.min_tokens, low=0)
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SamplingParamsError(
                "min_tokens",
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
            )
        self.stop = _check_stop(self.stop)
        self.stop_token_ids = _check_token_ids("stop_token_ids", self.stop_token_ids)
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, low=0, high=MAX_LOGPROBS)
        _check_bool("prompt_logprobs", self.prompt_logprobs)
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        _check_bool("include_stop_str_in_output", self.include_stop_str_in_output)
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutputParams):
                raise SamplingParamsError(
                    "structured_output",
                    f"structured_output must be a StructuredOutputParams, got {self.structured_output!r:.100}",
                )
            if self.ignore_eos:
                raise SamplingParamsError(
                    "ignore_eos", "ignore_eos cannot be combined with structured_output: the output ends where "
                    "its grammar does",
                )
            if self.min_tokens:
                raise SamplingParamsError(
                    "min_tokens", f"min_tokens must be 0 with structured_output (the output ends where its grammar "
                    f"does), got {self.min_tokens}",
                )

    @property
    def greedy(self) -> bool:
        """Argmax decoding: no randomness is drawn for this request."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1


def _range_text(low, high, low_open: bool) -> str:
    low, high = _fmt(low), _fmt(high)
    if high is None:
        return f"{'>' if low_open else '>='} {low}"
    if low is None:
        return f"<= {high}"
    return f"in {'(' if low_open else '['}{low}, {high}]"


def _fmt(x):
    return f"{x:g}" if isinstance(x, float) else x


def _check_int(name: str, value, low: int | None = None, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"{name} must be an integer, got {value!r}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise SamplingParamsError(
            name, f"{name} must be {_range_text(low, high, False)}, got {value}"
        )


def _check_float(
    name: str,
    value,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SamplingParamsError(name, f"{name} must be a number, got {value!r}")
    value = float(value)
    too_low = low is not None and (value <= low if low_open else value < low)
    too_high = high is not None and value > high
    if not math.isfinite(value) or too_low or too_high:
        raise SamplingParamsError(
            name, f"{name} must be {_range_text(low, high, low_open)}, got {value}"
        )
    return value


def _check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise SamplingParamsError(name, f"{name} must be true or false, got {value!r}")


def _check_stop(stop) -> list[str]:
    if stop is None:
        return []
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, (list, tuple)):
        raise SamplingParamsError(
            "stop", f"stop must be a string or a list of strings, got {stop!r}"
        )
    for s in stop:
        if not isinstance(s, str) or not s:
            raise SamplingParamsError(
                "stop", f"stop must contain only non-empty strings, got {s!r}"
            )
    return list(stop)


def _check_token_ids(name: str, ids) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, (list, tuple)):
        raise SamplingParamsError(name, f"{name} must be a list of token ids, got {ids!r}")
    for token_id in ids:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise SamplingParamsError(
                name, f"{name} must contain integer token ids >= 0, got {token_id!r}"
            )
    return list(ids)


def _check_logit_bias(bias) -> dict[int, float] | None:
    """Keys may be ints or decimal strings (JSON object keys); values are floats in [-100, 100]."""
    if bias is None:
        return None
    if not isinstance(bias, dict):
        raise SamplingParamsError(
            "logit_bias", f"logit_bias must map token ids to numbers, got {bias!r}"
        )
    checked: dict[int, float] = {}
    for key, value in bias.items():
        token_id = key
        if isinstance(key, str):
            try:
                token_id = int(key)
            except ValueError:
                token_id = None
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise SamplingParamsError(
                "logit_bias", f"logit_bias keys must be token ids >= 0, got {key!r}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise SamplingParamsError(
                "logit_bias", f"logit_bias[{token_id}] must be a number, got {value!r}"
            )
        if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:  # False for NaN too
            raise SamplingParamsError(
                "logit_bias",
                f"logit_bias[{token_id}] must be in [-100, 100], got {value}",
            )
        checked[token_id] = float(value)
    return checked
