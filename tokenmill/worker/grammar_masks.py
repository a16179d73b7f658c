"""Structured output's share of a step: the allowed-token bitmasks of the sampled rows whose
requests follow a grammar, in the one tensor the sampler applies to those rows only
(`AllowedTokens`).

`allowed_tokens` masks one row per request (plain sampling, and the draft model's proposal
passes); `allowed_draft_tokens` masks the 1 + k rows of each request verifying k drafts, each
row with the grammar's state after the drafts before it.
"""

from __future__ import annotations

from tokenmill.layers.sampler import AllowedTokens
from tokenmill.structured.bitmask import allocate_bitmask
from tokenmill.structured.matcher import GrammarMatcher, MaskFiller
from tokenmill.worker.request_state import CachedRequestState


def allowed_tokens(states: list[CachedRequestState], vocab_size: int, filler: MaskFiller) -> AllowedTokens | None:
    """The bitmasks of the constrained ones among `states` (one row each, in order), or None."""
    row_ids = [i for i, state in enumerate(states) if state.grammar is not None]
    if not row_ids:
        return None
    bitmask = allocate_bitmask(len(states), vocab_size)
    filler.fill([(states[i].grammar, i) for i in row_ids], bitmask)
    return AllowedTokens(row_ids, bitmask)


def allowed_draft_tokens(jobs: list[tuple[CachedRequestState, list[int]]], vocab_size: int) -> AllowedTokens | None:
    """For requests verifying drafts (rows: each one's 1 + k, in order): row i of a
    constrained request allows what its grammar allows after drafts 0..i-1. The matcher walks
    the drafts and comes back; a draft it rejects (none should reach here) leaves the rows
    after it all-allowed: that draft has p = 0, so verification never goes past it."""
    row_ids: list[int] = []
    walks: list[tuple[GrammarMatcher, int, list[int]]] = []  # matcher, its first row, its drafts
    first = 0
    for state, drafts in jobs:
        if state.grammar is not None:
            walks.append((state.grammar, first, drafts))
            row_ids.extend(range(first, first + len(drafts) + 1))
        first += len(drafts) + 1
    if not row_ids:
        return None
    bitmask = allocate_bitmask(first, vocab_size)
    for grammar, row, drafts in walks:
        walked = 0
        for i in range(len(drafts) + 1):
            grammar.fill(bitmask, row + i)
            if i == len(drafts) or not grammar.accept(drafts[i : i + 1]):
                break
            walked += 1
        grammar.rollback(walked)
    return AllowedTokens(row_ids, bitmask)
