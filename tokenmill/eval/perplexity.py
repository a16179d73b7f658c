"""Perplexity with llama.cpp's protocol: non-overlapping windows, only the second half of each
window scored (so every scored token has at least window/2 tokens of context). The text the
project reports it on is GPL-3 (English prose on every Debian machine, 7,658 tokens with SmolLM2's
tokenizer: 14 windows of 512)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from tokenmill.sampling_params import SamplingParams

GPL3_PATH = Path("/usr/share/common-licenses/GPL-3")


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


def gpl3_token_ids(tokenizer, window: int = 512, max_windows: int | None = None, path: Path = GPL3_PATH) -> list[int]:
    """GPL-3 as `tokenizer.encode` tokenizes it, cut to `max_windows` windows when given.
    Raises FileNotFoundError if the file is missing."""
    if max_windows is not None and max_windows < 1:
        raise ValueError(f"max_windows must be >= 1 or None, got {max_windows}")
    if not path.is_file():
        raise FileNotFoundError(
            f"{path} not found: GPL-3 perplexity scores the GNU GPL v3 text that Debian and Ubuntu "
            "ship in /usr/share/common-licenses (package base-files)"
        )
    token_ids = tokenizer.encode(path.read_text(encoding="utf-8"))
    return token_ids if max_windows is None else token_ids[: window * max_windows]


def gpl3_perplexity(llm, window: int = 512, max_windows: int | None = None, path: Path = GPL3_PATH) -> float:
    """`perplexity` of GPL-3 with the LLM's own tokenizer: all of it (14 windows of 512 for
    SmolLM2), or its first `max_windows` windows."""
    return perplexity(llm, gpl3_token_ids(llm.tokenizer, window, max_windows, path), window)
