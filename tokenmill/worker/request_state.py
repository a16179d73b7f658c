"""A request as the model runner keeps it between steps: `CachedRequestState` (its tokens, block
table and progress, with its draft-model and grammar state), and the two things done with one
every step: `sampling_row` (the sampler's view of it) and `append_tokens` (the tokens it keeps,
followed by its grammar).

The scheduler sends a request's data once (`NewRequestData`, again after a preemption) and then
only what changed; the runner's state is what the step's flat batch is built from
(`worker/inputs.py`) and what spec_decode's draft model reads and updates.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.core.outputs import NewRequestData
from tokenmill.layers.sampler import SamplingRow
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.matcher import GrammarMatcher

logger = logging.getLogger(__name__)


@dataclass
class CachedRequestState:
    """A scheduled request between steps: every token known so far, its blocks, and how many of
    its tokens have their K/V in the cache."""

    req_id: str
    token_ids: list[int]  # prompt + every sampled token
    num_prompt_tokens: int
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    # Draft-model speculation: the draft's distribution for each proposed token; and how many
    # of the request's first tokens have their draft K/V in the cache (steps run while nobody
    # speculates skip the draft model; its K/V is caught up when speculation resumes). K/V
    # adopted from the prefix cache or kept through a swap is counted as present.
    draft_probs: torch.Tensor | None = None
    draft_num_computed: int = 0
    # Structured output: where the output so far leaves the request in its grammar.
    grammar: GrammarMatcher | None = None

    @classmethod
    def from_new(cls, data: NewRequestData) -> "CachedRequestState":
        state = cls(
            data.req_id,
            list(data.token_ids),
            data.num_prompt_tokens,
            data.sampling_params,
            data.eos_token_ids,
            list(data.block_ids),
            data.num_computed_tokens,
            draft_num_computed=data.num_computed_tokens,
        )
        if data.grammar is not None:  # new, or resumed after preemption: replay the output so far
            state.grammar = GrammarMatcher(data.grammar)
            output = state.token_ids[state.num_prompt_tokens :]
            if state.grammar.accept(output) != len(output):
                drop_grammar(state, output)
        return state


def drop_grammar(state: CachedRequestState, token_ids: list[int]) -> None:
    """A token the grammar rejects reached a constrained request: the masks allow only tokens
    it accepts, so this is a backend bug. The request goes on unconstrained rather than stop
    the engine."""
    logger.error("%s: tokens %s are outside its grammar; it continues without the constraint", state.req_id, token_ids)
    state.grammar = None


def append_tokens(state: CachedRequestState, token_ids: list[int]) -> None:
    """Append sampled tokens to the request, advancing its grammar over them."""
    state.token_ids.extend(token_ids)
    if state.grammar is not None and state.grammar.accept(token_ids) != len(token_ids):
        drop_grammar(state, token_ids)


def sampling_row(state: CachedRequestState, drafts: Sequence[int] = ()) -> SamplingRow:
    """The request's row; with `drafts`, the row that scores the token after them."""
    output = state.token_ids[state.num_prompt_tokens :]
    return SamplingRow(
        params=state.sampling_params,
        prompt_token_ids=state.token_ids[: state.num_prompt_tokens],
        output_token_ids=output + list(drafts) if drafts else output,
        eos_token_ids=state.eos_token_ids,
    )
