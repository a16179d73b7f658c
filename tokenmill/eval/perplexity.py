"""Perplexity with llama.cpp's protocol: non-overlapping windows, only the second half of each
window scored (so every scored token has at least window/2 tokens of context)."""

from __future__ import annotations

import math
from collections.abc import Sequence

from tokenmill.sampling_params import SamplingParams


def perplexity_windows(token_ids: Sequence[int], window: int) -> list[list[int]]:
    """The full `window`-token windows of `token_ids`, in order (a shorter tail is dropped)."""
    return [list(token_ids[i : i + window]) for i in range(0, len(token_ids) - window + 1, window)]


def perplexity(llm, token_ids: Sequence[int], window: int = 512) -> float:
    """exp(mean NLL) of tokens window/2+1 .. window-1 of every window, all windows in one batch."""
    windows = perplexity_windows(token_ids, window)
    if not windows:
        raise ValueError(f"need at least {window} tokens for one window, got {len(token_ids)}")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True)
    nll, count = 0.0, 0
    first = window // 2
    for out in llm.generate(windows, params):
        scored = out.prompt_logprobs[first + 1 :]
        nll -= sum(scored)
        count += len(scored)
    return math.exp(nll / count)
