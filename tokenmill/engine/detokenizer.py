"""Turns one request's generated tokens into text as they arrive, and finds its stop strings."""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams

# Prompt tokens decoded ahead of the output, so that the first output token's text (a leading
# space, a word joined to the prompt) comes out as it would inside the whole sequence.
NUM_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"  # what an incomplete UTF-8 sequence decodes to


class IncrementalDetokenizer:
    """One per request (per sequence when n > 1).

    Contract: feed every generated token once, in order, with `update`; stream with
    `take_delta`; call `flush` once the request has finished. Then
        concatenated take_delta() results + flush() == tokenizer.decode(output_token_ids)
    when no stop string was hit; when one was, the text ends right before it (right after it
    with include_stop_str_in_output) and `update` must not be called again.
    A delta never ends in a partial UTF-8 character nor in a prefix of a stop string that could
    still complete; such text is held back until it resolves or `flush` is called.

    The tokenizer is a `transformers` fast tokenizer or a `tokenizers.Tokenizer`. With a slow
    (pure Python) tokenizer every update re-decodes the whole output: correct but O(n) a token.
    """

    def __init__(self, tokenizer, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._tokenizer = tokenizer
        backend = tokenizer
        if not isinstance(tokenizer, Tokenizer):  # a transformers fast tokenizer wraps one
            backend = getattr(tokenizer, "_tokenizer", None)
        self._backend: Tokenizer | None = backend if isinstance(backend, Tokenizer) else None
        self._skip_special_tokens = params.skip_special_tokens
        self._stop: list[str] = list(params.stop)
        self._include_stop = params.include_stop_str_in_output

        context_ids = list(prompt_token_ids[-NUM_CONTEXT_TOKENS:])
        context_text = self._decode(context_ids) if context_ids else ""
        if context_text.endswith(_REPLACEMENT_CHAR):
            # The prompt ends mid-character: its bytes cannot be told apart from the output's.
            context_ids, context_text = [], ""
        self._context_ids = context_ids
        self._context_text = context_text
        self._stream: DecodeStream | None = None
        if self._backend is not None:
            self._stream = DecodeStream(
                ids=context_ids, skip_special_tokens=self._skip_special_tokens
            )
        self._maybe_holding = False  # the stream may hold tokens it has not turned into text

        self.output_token_ids: list[int] = []
        # Everything decoded so far; cut at the stop string once one is found.
        self.output_text = ""
        self.stop_str: str | None = None  # the stop string that finished the request
        self._num_sent_chars = 0  # output_text[:this] has been handed out

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Feed newly generated tokens. Returns the stop string if one now appears in the text
        (the request must finish), else None."""
        if self.stop_str is not None:
            raise RuntimeError(f"update() after stop string {self.stop_str!r} ended the request")
        if not new_token_ids:
            return None
        self.output_token_ids.extend(new_token_ids)
        text = self._decode_step(new_token_ids)
        return self._append(text) if text else None

    def take_delta(self) -> str:
        """Text not handed out yet that is safe to stream now."""
        end = len(self.output_text)
        if self.stop_str is None and self._stop:
            end -= self._num_chars_to_hold()
        if end <= self._num_sent_chars:
            return ""
        delta = self.output_text[self._num_sent_chars : end]
        self._num_sent_chars = end
        return delta

    def flush(self) -> str:
        """At the end of the request: all text not handed out yet (never past a stop string)."""
        if self.stop_str is None and self._maybe_holding:
            full = self._decode_output()
            if len(full) > len(self.output_text) and full.startswith(self.output_text):
                self._append(full[len(self.output_text) :])
            self._maybe_holding = False
        delta = self.output_text[self._num_sent_chars :]
        self._num_sent_chars = len(self.output_text)
        return delta

    # -- internals -------------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=self._skip_special_tokens)
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_output(self) -> str:
        """The whole output's text, decoded after the prompt context (O(output length))."""
        if not self._context_ids:
            return self._decode(self.output_token_ids)
        text = self._decode(self._context_ids + self.output_token_ids)
        if text.startswith(self._context_text):
            return text[len(self._context_text) :]
        return self._decode(self.output_token_ids)

    def _decode_step(self, new_token_ids: Sequence[int]) -> str:
        """The text the new tokens complete ("" while a character is still incomplete)."""
        if self._stream is not None:
            # One token a step, as single tokens arrive: a step of several tokens that ends inside
            # a character would hold back the whole step's text, complete characters (and the
            # stop strings in them) included, where single tokens would have let them through.
            try:
                chunks = [self._stream.step(self._backend, token_id) for token_id in new_token_ids]
            except Exception:
                # The decoder rewrote text it had already produced (DecodeStream's InvalidPrefix);
                # finish this request on the slow path.
                self._stream = None
            else:
                self._maybe_holding = chunks[-1] is None
                return "".join(chunk for chunk in chunks if chunk)
        full = self._decode_output()
        if full.endswith(_REPLACEMENT_CHAR) or not full.startswith(self.output_text):
            self._maybe_holding = True
            return ""
        self._maybe_holding = False
        return full[len(self.output_text) :]

    def _append(self, text: str) -> str | None:
        old_len = len(self.output_text)
        self.output_text += text
        if not self._stop:
            return None
        # A stop string can only be new if it ends inside the appended text. The one that
        # completes first wins (the smallest end, then the earliest start), as it would had the
        # text come one character at a time: several tokens at once (speculative decoding) or a
        # many-character token end the request exactly where single tokens would.
        hit_at, hit = -1, None
        for stop in self._stop:
            i = self.output_text.find(stop, max(0, old_len - len(stop) + 1))
            if i != -1 and (hit is None or (i + len(stop), i) < (hit_at + len(hit), hit_at)):
                hit_at, hit = i, stop
        if hit is None:
            return None
        end = hit_at + len(hit) if self._include_stop else hit_at
        assert end >= self._num_sent_chars, "a streamed delta overlapped a stop string"
        self.output_text = self.output_text[:end]
        self.stop_str = hit
        return hit

    def _num_chars_to_hold(self) -> int:
        """Length of the longest suffix of output_text that is a proper prefix of a stop string."""
        text = self.output_text
        hold = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return hold
