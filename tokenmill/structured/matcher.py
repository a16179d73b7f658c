"""One sequence's place in its grammar."""

from __future__ import annotations

from collections.abc import Sequence

import torch


class GrammarMatcher:
    """Wraps an xgrammar matcher. The runner keeps one per constrained request, in step with the
    request's output tokens: every token it appends goes through `accept`. Once the grammar is
    complete only the stop tokens (the request's eos ids) are allowed; accepting one terminates
    the matcher, after which nothing is accepted and no mask may be filled.

    Speculative decoding: `num_valid_drafts` checks drafts without moving the state;
    `accept` + `rollback` walk drafts and back (xgrammar keeps the history, any depth)."""

    __slots__ = ("_matcher", "num_accepted")

    def __init__(self, compiled, stop_token_ids: Sequence[int]):
        import xgrammar

        self._matcher = xgrammar.GrammarMatcher(compiled, override_stop_tokens=list(stop_token_ids))
        self.num_accepted = 0

    @property
    def is_terminated(self) -> bool:
        return self._matcher.is_terminated()

    def accept(self, token_ids: Sequence[int]) -> int:
        """Advance over `token_ids` in order; stops at the first token the grammar rejects and
        returns how many were accepted."""
        for i, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(token_id):
                return i
            self.num_accepted += 1
        return len(token_ids)

    def rollback(self, num_tokens: int) -> None:
        if num_tokens:
            assert num_tokens <= self.num_accepted, f"rollback of {num_tokens} past {self.num_accepted} tokens"
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def num_valid_drafts(self, draft_token_ids: Sequence[int]) -> int:
        """The longest prefix of the drafts the grammar accepts from here; the state is unchanged."""
        n = self.accept(draft_token_ids)
        self.rollback(n)
        return n

    def fill(self, bitmask: torch.Tensor, row: int) -> None:
        """bitmask[row] (CPU int32, `bitmask.py`'s layout) := the tokens allowed next."""
        if self._matcher.is_terminated():  # a row that will not be used (after an accepted stop token)
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)


def fill_rows(matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
    """bitmask[i] := matchers[i]'s allowed tokens, for every i."""
    for i, matcher in enumerate(matchers):
        matcher.fill(bitmask, i)
