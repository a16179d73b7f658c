"""The engine's draft proposers without a model, behind one interface (model_runner.py calls it
for every request that speculates): propose(req_id, token_ids, k) for the request's next drafts,
finish() when a request ends (what it generated may feed later drafts), drop() when it is
aborted. `make_proposer` builds the one a config asks for; the draft model's proposals are the
runner's own (they need its forward passes)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tokenmill.config import EngineConfig
from tokenmill.spec_decode.ngram import NgramProposer
from tokenmill.spec_decode.suffix import SuffixProposer


class DraftProposer(Protocol):
    def propose(self, req_id: str, token_ids: Sequence[int], k: int, shared: bool = True) -> list[int]:
        """Up to k draft tokens to follow token_ids (the request's prompt and output so far);
        shared=False: drafts from nothing but the request's own tokens (a seeded sampled
        request's draws follow its drafts, and its output must not depend on other requests)."""

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        """The request ended with these tokens."""

    def drop(self, req_id: str) -> None:
        """The request is gone without an output worth keeping (aborted)."""


class PromptLookup:
    """speculative_method "ngram": NgramProposer over the request's own tokens; no state."""

    def __init__(self, ngram: NgramProposer):
        self.ngram = ngram

    def propose(self, req_id: str, token_ids: Sequence[int], k: int, shared: bool = True) -> list[int]:
        return self.ngram.propose(token_ids, k)

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        pass

    def drop(self, req_id: str) -> None:
        pass


class SuffixDecoding:
    """speculative_method "suffix": SuffixProposer's draft (the request's own tokens and earlier
    requests' outputs; its own tokens only where `shared` is False), the n-gram lookup's where
    it has none (its probability floor stops it where continuations disagree; the lookup still
    guesses the most recent one)."""

    def __init__(self, suffix: SuffixProposer, ngram: NgramProposer):
        self.suffix = suffix
        self.ngram = ngram

    def propose(self, req_id: str, token_ids: Sequence[int], k: int, shared: bool = True) -> list[int]:
        return self.suffix.propose(req_id, token_ids, k, use_store=shared) or self.ngram.propose(token_ids, k)

    def finish(self, req_id: str, token_ids: Sequence[int], num_prompt_tokens: int) -> None:
        self.suffix.finish(req_id, token_ids, num_prompt_tokens)

    def drop(self, req_id: str) -> None:
        self.suffix.drop(req_id)


def make_proposer(config: EngineConfig) -> DraftProposer | None:
    """The model-free proposer of config.speculative_method (None for "draft" and for off)."""
    ngram = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    if config.speculative_method == "ngram":
        return PromptLookup(ngram)
    if config.speculative_method == "suffix":
        return SuffixDecoding(SuffixProposer(), ngram)
    return None
