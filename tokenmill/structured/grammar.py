"""Compile StructuredOutputParams into grammars the matcher runs, once per distinct constraint.

The backend is llguidance. Its tokenizer index (every token's bytes; ~0.5 s for a 49k
vocabulary) is built on the first constrained request. A constraint becomes an llguidance
grammar (JSON schemas through its JSON compiler, regexes, choices and GBNF as Lark), which is
checked by building a matcher for it; that fresh matcher is kept in an LRU cache keyed by
`StructuredOutputParams.key` = (kind, text), and every request with the same constraint
starts from a copy of it (a copy costs ~1 us, building one ~1 ms for a small schema).
"""

from __future__ import annotations

import copy
import json
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from tokenmill.sampling_params import SamplingParamsError, StructuredOutputParams

# JSON is written compactly (", " and ": " between items, no other whitespace): a model sampling
# at temperature 1 could otherwise fill its token budget with whitespace the schema allows.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
DEFAULT_CACHE_SIZE = 256
# Schema keywords whose values are data, not subschemas (left alone by _close_objects).
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples", "example", "description", "title"})


@dataclass(frozen=True)
class CompiledGrammar:
    """A checked constraint: what `GrammarMatcher` starts from. Shared by every request (and
    every sample of one) with the same constraint; never advanced itself."""

    key: tuple[str, str]
    matcher: object  # a fresh llguidance.LLMatcher, copied for each request
    stop_token_ids: tuple[int, ...]


class GrammarCompiler:
    """Thread-safe: `compile` may run on any thread (the serving engine compiles on a worker
    thread, off the thread that steps the engine)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = DEFAULT_CACHE_SIZE):
        self._hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._tokenizer = None  # llguidance.LLTokenizer, built on first use
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses that compiled

    def compile(self, params: StructuredOutputParams) -> CompiledGrammar:
        """The compiled grammar of `params`. Raises SamplingParamsError naming
        `structured_output.<kind>` when the backend cannot compile it."""
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            tokenizer = self._llg_tokenizer()
        compiled = CompiledGrammar(key, _compile(tokenizer, params), tuple(self.eos_token_ids))
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _llg_tokenizer(self):
        if self._tokenizer is None:
            import llguidance.hf

            self._tokenizer = llguidance.hf.from_tokenizer(
                self._hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids
            )
        return self._tokenizer


def choice_grammar(choices: Sequence[str]) -> str:
    """Lark for exactly one of `choices` (string literals escaped as JSON strings are)."""
    return "start: " + " | ".join(json.dumps(c) for c in choices)


def close_objects(schema):
    """A copy of `schema` in which every object schema that lists `properties` and says nothing
    about others gets `additionalProperties: false`: the model writes the keys the schema names
    (as OpenAI's strict structured outputs do), not keys of its own until max_tokens."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (v if k in _DATA_KEYWORDS else close_objects(v)) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out and "unevaluatedProperties" not in out:
        out["additionalProperties"] = False
    return out


def _grammar_text(params: StructuredOutputParams) -> str:
    import llguidance

    kind = params.kind
    if kind == "json":
        schema = json.loads(params.json) if isinstance(params.json, str) else copy.deepcopy(params.json)
        return llguidance.LLMatcher.grammar_from_json_schema(close_objects(schema), defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        return llguidance.LLMatcher.grammar_from_lark(choice_grammar(params.choice))
    return llguidance.grammar_from("grammar", params.grammar)  # Lark, or GBNF (`root ::= ...`) converted


def _compile(tokenizer, params: StructuredOutputParams):
    import llguidance

    field = f"structured_output.{params.kind}"
    try:
        matcher = llguidance.LLMatcher(tokenizer, _grammar_text(params), log_level=0)
    except (ValueError, TypeError, RuntimeError) as e:
        raise SamplingParamsError(field, f"{field} cannot be compiled: {_first_line(str(e))}") from None
    if matcher.is_error():
        raise SamplingParamsError(field, f"{field} cannot be compiled: {_first_line(matcher.get_error())}")
    return matcher


def _first_line(message: str) -> str:
    lines = [ln.strip() for ln in message.strip().splitlines() if ln.strip()]
    return " ".join(lines[:3])[:300] if lines else "invalid"
