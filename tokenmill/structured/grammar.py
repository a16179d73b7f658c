"""Compile StructuredOutputParams into grammars the matcher runs, once per distinct constraint.

The backend is xgrammar: its tokenizer index (every token's bytes, built once per engine, ~0.2 s
for a 49k vocabulary) is made on the first constrained request, and each compiled grammar is
kept in an LRU cache keyed by `StructuredOutputParams.key` = (kind, text), so the requests of a
service that sends the same schema over and over compile it once.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence

from tokenmill.sampling_params import SamplingParamsError, StructuredOutputParams

# JSON is written compactly (", " and ": " between items, no other whitespace): a model sampling at
# temperature 1 could otherwise fill its token budget with whitespace the schema allows.
JSON_SEPARATORS = (", ", ": ")
DEFAULT_CACHE_SIZE = 256
# xgrammar prefixes its errors with "[hh:mm:ss] /path/file.cc:line: ".
_ERROR_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")


class GrammarCompiler:
    """Thread-safe: `compile` may run on any thread (the serving engine compiles on a worker
    thread, off the thread that steps the engine); compiled grammars are immutable and shared by
    every request (and every sample of one) with the same constraint."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids: Sequence[int], cache_size: int = DEFAULT_CACHE_SIZE):
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.cache_size = cache_size
        self._compiler = None  # xgrammar.GrammarCompiler, made on first use
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self.num_compiled = 0  # cache misses that compiled

    def compile(self, params: StructuredOutputParams):
        """The compiled grammar of `params` (an xgrammar CompiledGrammar: opaque to callers, passed
        to `GrammarMatcher`). Raises SamplingParamsError naming `structured_output.<kind>` when the
        backend cannot compile it."""
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
            compiler = self._backend()
        compiled = _compile(compiler, params)  # outside the lock: xgrammar releases the GIL meanwhile
        with self._lock:
            self._cache[key] = compiled
            self._cache.move_to_end(key)
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            self.num_compiled += 1
        return compiled

    def _backend(self):
        if self._compiler is None:
            import xgrammar

            info = xgrammar.TokenizerInfo.from_huggingface(
                self._tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.eos_token_ids
            )
            # Our own cache above keys by constraint; xgrammar's would hold a second copy.
            self._compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)
        return self._compiler


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF for exactly one of `choices` (string literals escaped as JSON strings are)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def _compile(compiler, params: StructuredOutputParams):
    kind = params.kind
    try:
        if kind == "json":
            schema = params.json if isinstance(params.json, str) else json.dumps(params.json)
            return compiler.compile_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
        if kind == "json_object":
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=JSON_SEPARATORS)
        if kind == "regex":
            return compiler.compile_regex(params.regex)
        if kind == "choice":
            return compiler.compile_grammar(choice_grammar(params.choice))
        if "::=" in params.grammar:  # EBNF / GBNF, rules `name ::= ...`, starting at `root`
            return compiler.compile_grammar(params.grammar)
        return compiler.compile_lark(params.grammar)
    except Exception as e:  # the backend's parse / conversion errors (RuntimeError, ValueError)
        message = _ERROR_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
        raise SamplingParamsError(f"structured_output.{kind}", f"structured_output.{kind} cannot be compiled: {message}") from None
