"""One sequence's place in its grammar."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenmill.structured.grammar import CompiledGrammar


class GrammarMatcher:
    """Wraps an llguidance matcher. The runner keeps one per constrained request, in step with
    the request's output tokens: every token it appends goes through `accept`. Once the grammar
    is complete only the stop tokens (the model's eos ids) are allowed; after one is accepted
    the matcher `is_terminated` and accepts nothing more.

    Speculative decoding: `num_valid_drafts` checks drafts without moving the state;
    `accept` + `rollback` walk drafts and back (any depth)."""

    __slots__ = ("_matcher", "_stop_token_ids", "_tokens")

    def __init__(self, compiled: CompiledGrammar):
        self._matcher = compiled.matcher.deep_copy()
        self._stop_token_ids = frozenset(compiled.stop_token_ids)
        self._tokens: list[int] = []  # accepted so far (rollback needs to know what it undoes)

    @property
    def num_accepted(self) -> int:
        return len(self._tokens)

    @property
    def is_terminated(self) -> bool:
        return bool(self._tokens) and self._tokens[-1] in self._stop_token_ids

    def accept(self, token_ids: Sequence[int]) -> int:
        """Advance over `token_ids` in order; stops at the first token the grammar rejects (the
        state stays valid) and returns how many were accepted."""
        if self.is_terminated:
            return 0
        token_ids = list(token_ids)
        n = self._matcher.try_consume_tokens(token_ids)  # stops before a stop token
        # A stop token ends the output where the grammar may end. llguidance does not keep it
        # in its history: it is held here only (and a rollback over it undoes nothing there).
        if n < len(token_ids) and token_ids[n] in self._stop_token_ids and self._matcher.is_accepting():
            n += 1
        self._tokens.extend(token_ids[:n])
        return n

    def rollback(self, num_tokens: int) -> None:
        if not num_tokens:
            return
        assert num_tokens <= len(self._tokens), f"rollback of {num_tokens} past {len(self._tokens)} tokens"
        in_backend = num_tokens - (1 if self.is_terminated else 0)
        if in_backend and not self._matcher.rollback(in_backend):
            raise RuntimeError(f"grammar rollback of {in_backend} tokens failed: {self._matcher.get_error()[:200]}")
        del self._tokens[-num_tokens:]

    def num_valid_drafts(self, draft_token_ids: Sequence[int]) -> int:
        """The longest prefix of the drafts the grammar accepts from here; the state is unchanged."""
        n = self.accept(draft_token_ids)
        self.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] (CPU int32, `bitmask.py`'s layout) := the tokens allowed next."""
        if self.is_terminated:  # a row that will not be used (after an accepted stop token)
            bitmask[row].fill_(-1)
            return
        row_mask = bitmask[row]
        self._matcher.unsafe_compute_mask_ptr(row_mask.data_ptr(), row_mask.numel() * row_mask.element_size())


class MaskFiller:
    """Fills the rows of many matchers in one call, on llguidance's thread pool (it releases the
    GIL), or one by one when there are few."""

    def __init__(self, num_threads: int):
        self.num_threads = num_threads
        self._executor = None

    def fill(self, rows: Sequence[tuple[GrammarMatcher, int]], bitmask: torch.Tensor) -> None:
        """bitmask[row] := matcher's allowed tokens, for each (matcher, row)."""
        assert bitmask.is_contiguous() and bitmask.dtype == torch.int32 and bitmask.device.type == "cpu"
        live = [(m._matcher, row) for m, row in rows if not m.is_terminated]
        for m, row in rows:
            if m.is_terminated:
                m.fill(bitmask, row)
        if len(live) < 2 or self.num_threads < 2:
            for m, row in live:
                row_mask = bitmask[row]
                m.unsafe_compute_mask_ptr(row_mask.data_ptr(), row_mask.numel() * 4)
            return
        if self._executor is None:
            import llguidance

            self._executor = llguidance.LLExecutor(self.num_threads)
        self._executor.unsafe_compute_mask_ptr(live, bitmask.data_ptr(), bitmask.shape[1] * 4, bitmask.shape[0])
