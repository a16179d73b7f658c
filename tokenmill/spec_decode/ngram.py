"""Prompt-lookup (n-gram) drafts: no extra model, only the request's own tokens.

If the request's last n tokens occurred earlier in its prompt or output, the tokens that
followed that occurrence are a good guess for what follows now (code edits, summaries and
answers that quote their input repeat long spans). The longest n in [min_n, max_n] with a
match wins, and among its matches the most recent one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


class NgramProposer:
    def __init__(self, min_n: int, max_n: int):
        if not 1 <= min_n <= max_n:
            raise ValueError(f"need 1 <= min_n <= max_n, got {min_n}, {max_n}")
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: Sequence[int] | np.ndarray, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest
        matching suffix; [] when no suffix of at least min_n tokens occurred before."""
        tokens = np.asarray(token_ids)
        length = len(tokens)
        if k <= 0 or length <= self.min_n:
            return []
        last = tokens[-1]
        # Candidate ends of an earlier occurrence: positions before the last one holding the
        # last token (with room for min_n - 1 tokens before them).
        ends = np.flatnonzero(tokens[self.min_n - 1 : -1] == last) + (self.min_n - 1)
        if len(ends) == 0:
            return []
        # How far back each candidate keeps matching the suffix, up to max_n tokens.
        matched = np.ones(len(ends), dtype=np.int64)
        alive = np.ones(len(ends), dtype=bool)
        for j in range(1, self.max_n):
            if j >= length:
                break
            ok = alive & (ends >= j)
            ok[ok] = tokens[ends[ok] - j] == tokens[-1 - j]
            alive = ok
            if not alive.any():
                break
            matched += alive
        best = matched.max()
        if best < self.min_n:
            return []
        end = ends[np.flatnonzero(matched == best)[-1]]  # the most recent of the longest
        return tokens[end + 1 : end + 1 + k].tolist()
