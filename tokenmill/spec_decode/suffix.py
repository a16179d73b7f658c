"""Suffix decoding drafts: no extra model, only tokens seen before (SuffixDecoding, arXiv 2411.04975).

Two sources are searched for the longest suffix of the request's tokens (at most max_depth) that
occurred before and was followed by something: the request's own prompt and output so far, and a
store of the outputs of requests that have finished (agent loops, tool calls and templated answers
repeat long spans across requests). The tokens that followed each occurrence of that suffix are
counted, and the draft follows the most frequent continuation, token by token, among the
occurrences that still agree with the draft so far. A drafted token's probability is the share of
those occurrences that continued with it; the running product of these shares estimates the
probability that the draft is accepted up to that token. The draft stops when the product falls
below min_token_prob, and the sum of the products is the draft's score: its expected number of
accepted tokens. The source with the higher score wins (ties go to the request's own tokens), and
the score lets a caller weigh the draft against other proposers'.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence

import numpy as np

_SEP = -1  # before a request's own tokens, between stored outputs and past the newest; no token id equals it
_GRAM_MUL = np.uint64(0x9E3779B97F4A7C15)
_BUCKET_MIX = np.uint64(0xBF58476D1CE4E5B9)
_MAX_TABLE_BITS = 22  # a store's hash table has one bucket per token it may hold, up to 4M, per gram order


class SuffixProposer:
    """Draft tokens for speculative decoding from the request's own tokens and from earlier outputs.

    Per-request state is kept between propose() calls for the same req_id (its tokens as an
    array, so that a call costs only the new tokens' copy): every req_id proposed for must end in
    finish() or drop(), or its state stays. A request that is preempted and resumed with the same
    tokens keeps its state and needs neither. Whether a new token_ids extends the last one is
    judged by its length and its token at the last one's end, not by comparing it all: a caller
    that rewrites a request's tokens (other than by appending) calls drop() first.

    All occurrences in the request's own tokens are counted; in the store, only the newest
    max_occurrences occurrences of the context's last few tokens are looked at, which bounds a
    call's cost whatever the store holds.
    """

    def __init__(
        self,
        max_depth: int = 32,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        max_cached_requests: int = 1000,
        max_cached_tokens: int = 1_000_000,
        max_occurrences: int = 256,
    ):
        if not max_depth >= 1:
            raise ValueError(f"max_depth: must be >= 1, got {max_depth!r}")
        if not max_spec_factor > 0:
            raise ValueError(f"max_spec_factor: must be > 0, got {max_spec_factor!r}")
        if not 0 < min_token_prob <= 1:
            raise ValueError(f"min_token_prob: must be in (0, 1], got {min_token_prob!r}")
        if not max_cached_requests >= 0:
            raise ValueError(f"max_cached_requests: must be >= 0, got {max_cached_requests!r}")
        if not max_cached_tokens >= 0:
            raise ValueError(f"max_cached_tokens: must be >= 0, got {max_cached_tokens!r}")
        if not max_occurrences >= 1:
            raise ValueError(f"max_occurrences: must be >= 1, got {max_occurrences!r}")
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._requests: dict[str, _RequestTokens] = {}
        self._store = _OutputStore(max_depth, max_cached_requests, max_cached_tokens, max_occurrences)

    def propose(self, req_id: str, token_ids: Sequence[int] | np.ndarray, k: int, use_store: bool = True) -> list[int]:
        """Up to k draft tokens to follow token_ids (the request's prompt + output so far); [] when
        nothing matches. Between calls for one req_id, token_ids may only grow by appending; a
        sequence that is not an extension of the last one (or a req_id never seen) starts afresh."""
        return self.propose_scored(req_id, token_ids, k, use_store)[0]

    def propose_scored(self, req_id: str, token_ids: Sequence[int] | np.ndarray, k: int,
                       use_store: bool = True) -> tuple[list[int], float]:
        """propose()'s draft and its expected number of accepted tokens (0.0 for no draft).
        use_store=False: from the request's own tokens only (drafts that depend on nothing but
        the request, as a seeded sampled request needs to reproduce its output)."""
        if k <= 0:
            return [], 0.0
        state = self._requests.get(req_id)
        if state is None:
            state = self._requests[req_id] = _RequestTokens(self.max_depth)
        tokens = state.sync(token_ids)
        if state.num_tokens == 0:
            return [], 0.0
        best: tuple[list[int], float] = ([], 0.0)
        own = _match_own(tokens, state.num_tokens, self.max_depth)
        if own is not None:
            ends, match_len = own
            best = self._draft(tokens, ends + 1, match_len, k)
        stored = self._store.match(tokens[-min(self.max_depth, state.num_tokens) :]) if use_store else None
        if stored is not None:
            buf, ends, match_len = stored
            draft = self._draft(buf, ends + 1, match_len, k)
            if draft[1] > best[1]:
                best = draft
        return best

    def finish(self, req_id: str, token_ids: Sequence[int] | np.ndarray, num_prompt_tokens: int) -> None:
        """The request ended: drop its own state and add its output (token_ids[num_prompt_tokens:])
        to the store, evicting the oldest outputs beyond max_cached_requests outputs or
        max_cached_tokens tokens (an output longer than max_cached_tokens keeps its last ones)."""
        self._requests.pop(req_id, None)
        self._store.add(np.asarray(token_ids[num_prompt_tokens:], dtype=np.int64))

    def drop(self, req_id: str) -> None:
        """Forget a request's own state without adding its output to the store (aborted)."""
        self._requests.pop(req_id, None)

    def memory_tokens(self) -> int:
        """Tokens held in the store of finished outputs."""
        return self._store.num_tokens

    def _draft(self, tokens: np.ndarray, cur: np.ndarray, match_len: int, k: int) -> tuple[list[int], float]:
        """Greedy draft along the most frequent continuation. tokens ends with, or holds _SEP after,
        every sequence it contains; cur: ascending positions of the token after each occurrence."""
        limit = min(k, math.ceil(self.max_spec_factor * match_len - 1e-9))  # not 4 for 0.1 * 30
        draft: list[int] = []
        prob = 1.0
        score = 0.0
        n = len(tokens)
        while len(draft) < limit:
            cur = cur[cur < n]
            if cur.size == 0:
                break
            nxt = tokens[cur]
            alive = nxt != _SEP
            if not alive.all():
                cur, nxt = cur[alive], nxt[alive]
                if cur.size == 0:
                    break
            if cur.size == 1:  # one occurrence left: its continuation is certain as far as it goes
                start = int(cur[0])
                run = tokens[start : start + limit - len(draft)]
                seps = np.flatnonzero(run == _SEP)
                if seps.size:
                    run = run[: seps[0]]
                draft.extend(run.tolist())
                score += prob * len(run)
                break
            token, count = _most_frequent(nxt)
            prob *= count / nxt.size
            if prob < self.min_token_prob:
                break
            draft.append(token)
            score += prob
            cur = cur[nxt == token] + 1
        return draft, score


class _RequestTokens:
    """One request's tokens so far, after num_pad _SEP (so that a look back from any token up to
    num_pad tokens stays in the array, and stops at the first token), in an array that grows by
    doubling."""

    __slots__ = ("buf", "num_pad", "num_tokens")

    def __init__(self, num_pad: int):
        self.buf = np.full(num_pad + 64, _SEP, dtype=np.int64)
        self.num_pad = num_pad
        self.num_tokens = 0

    def sync(self, token_ids: Sequence[int] | np.ndarray) -> np.ndarray:
        """Bring the array up to token_ids and return it, pad included; a token_ids that is not an
        extension of what was seen (shorter, or another last-seen token) replaces it."""
        total, n, pad = len(token_ids), self.num_tokens, self.num_pad
        if total < n or (n > 0 and token_ids[n - 1] != self.buf[pad + n - 1]):
            n = 0
        if pad + total > len(self.buf):
            grown = np.empty(max(pad + total, 2 * len(self.buf)), dtype=np.int64)
            grown[: pad + n] = self.buf[: pad + n]
            self.buf = grown
        if total > n:
            self.buf[pad + n : pad + total] = np.asarray(token_ids[n:total], dtype=np.int64)
        self.num_tokens = total
        return self.buf[: pad + total]


def _match_own(tokens: np.ndarray, num_tokens: int, max_depth: int) -> tuple[np.ndarray, int] | None:
    """The longest suffix of the last num_tokens of tokens (at most max_depth long; _SEP before
    them, max_depth at least) that also occurs earlier, followed by at least one token: (ascending
    end positions of its earlier occurrences, its length), or None."""
    n = len(tokens)
    ends = np.flatnonzero(tokens[: n - 1] == tokens[n - 1])
    if ends.size == 0:
        return None
    match_len = 1
    for j in range(1, min(max_depth, num_tokens - 1)):
        ends_j = ends[tokens[ends - j] == tokens[n - 1 - j]]
        if ends_j.size == 0:
            break
        ends, match_len = ends_j, j + 1
    return ends, match_len


def _most_frequent(nxt: np.ndarray) -> tuple[int, int]:
    """The most frequent value of nxt (ordered oldest first; ties go to the most recent) and its count."""
    if (nxt == nxt[0]).all():
        return int(nxt[0]), nxt.size
    _, inverse, counts = np.unique(nxt, return_inverse=True, return_counts=True)
    best = counts.max()
    return int(nxt[counts[inverse] == best][-1]), int(best)


def _gram_hashes(tokens: np.ndarray, order: int) -> np.ndarray:
    """A 64-bit hash of each run of `order` consecutive tokens, one per run (len(tokens) - order + 1)."""
    values = tokens.astype(np.uint64)
    num = len(values) - order + 1
    hashes = values[:num].copy()
    for i in range(1, order):
        hashes = hashes * _GRAM_MUL + values[i : i + num]
    return hashes


class _OutputStore:
    """Outputs of finished requests, oldest first, in one token array, and hash chains that find
    where a run of tokens occurs in them without scanning.

    Layout: each output is stored as [_SEP, its tokens]; buf[i] holds absolute position
    base + i, the live outputs span [start, end), and buf is _SEP from end on. Outputs leave in
    the order they came (the oldest first), so eviction only moves start; the space before start
    is reclaimed when buf is rebuilt for lack of room, which keeps it near twice the live size.

    Index: for each gram order o in 1, 4, 16, ... (up to max_depth), the position p where a run of
    o tokens inside one output ends goes into the chain of the run's hash bucket: head[o][bucket]
    is the newest such position, prev[o][p - base] the next older one, so a chain's positions
    decrease and a walk stops at the first one before start. Buckets may mix different runs
    (hash collisions); a match is always confirmed against the tokens.
    """

    def __init__(self, max_depth: int, max_requests: int, max_tokens: int, max_occurrences: int):
        self.max_depth = max_depth
        self.max_requests = max_requests
        self.max_tokens = max_tokens
        self.max_occurrences = max_occurrences
        self.orders: list[int] = []
        order = 1
        while order <= max_depth:
            self.orders.append(order)
            order *= 4
        self.table_bits = min(_MAX_TABLE_BITS, max(10, (max_tokens - 1).bit_length()))
        self.outputs: deque[tuple[int, int]] = deque()  # (absolute position of its _SEP, num tokens)
        self.num_tokens = 0
        self.base = 0
        self.start = 0
        self.end = 0
        # allocated by the first add()
        self.buf = np.empty(0, dtype=np.int32)
        self.prev: list[np.ndarray] = []
        self.head: list[np.ndarray] = []

    def add(self, output: np.ndarray) -> None:
        if self.max_requests == 0 or self.max_tokens == 0 or output.size == 0:
            return
        output = output[-self.max_tokens :]
        size = len(output)
        while self.outputs and (len(self.outputs) >= self.max_requests or self.num_tokens + size > self.max_tokens):
            self.num_tokens -= self.outputs.popleft()[1]
            self.start = self.outputs[0][0] if self.outputs else self.end
        self._make_room(size + 1)
        sep = self.end
        i = sep - self.base
        self.buf[i] = _SEP
        self.buf[i + 1 : i + 1 + size] = output
        first = sep + 1
        for order, head, prev in zip(self.orders, self.head, self.prev, strict=True):
            if size < order:
                break
            self._link(head, prev, first + order - 1 + np.arange(size - order + 1), _gram_hashes(output, order))
        self.outputs.append((sep, size))
        self.num_tokens += size
        self.end = first + size
        assert self.num_tokens <= self.max_tokens and len(self.outputs) <= self.max_requests

    def match(self, context: np.ndarray) -> tuple[np.ndarray, np.ndarray, int] | None:
        """The longest suffix of context that occurs in the stored outputs followed by at least one
        token, among the newest max_occurrences occurrences of its last o tokens for the largest
        order o it reaches: (buf, the buffer indices where its occurrences end, ascending, its
        length), or None."""
        if not self.outputs:
            return None
        n = len(context)
        buf = self.buf
        for order, head, prev in reversed(list(zip(self.orders, self.head, self.prev, strict=True))):
            if n < order:
                continue
            bucket = self._buckets(_gram_hashes(context[n - order :], order))[0]
            found: list[int] = []
            pos, start, base, prev_of = head.item(bucket), self.start, self.base, prev.item
            for _ in range(self.max_occurrences):
                if pos < start:
                    break
                found.append(pos)
                pos = prev_of(pos - base)
            if not found:
                continue
            ends = np.array(found[::-1], dtype=np.int64) - base
            ends = ends[buf[ends + 1] != _SEP]
            if ends.size == 0:
                continue
            # How far back each occurrence agrees with the context: up to its first mismatch, which
            # comes at the latest at its output's _SEP (no context token equals it), so what lies
            # before that (clipped indices included) never counts.
            depth = min(self.max_depth, n)
            agree = buf[np.maximum(ends[:, None] - np.arange(depth), 0)] == context[::-1][:depth]
            lengths = np.where(agree.all(axis=1), depth, agree.argmin(axis=1))  # [num_ends]
            match_len = int(lengths.max())
            if match_len >= order:
                return buf[: self.end - self.base + 1], ends[lengths == match_len], match_len
        return None

    def _buckets(self, hashes: np.ndarray) -> np.ndarray:
        return ((hashes * _BUCKET_MIX) >> np.uint64(64 - self.table_bits)).astype(np.int64)

    def _link(self, head: np.ndarray, prev: np.ndarray, positions: np.ndarray, hashes: np.ndarray) -> None:
        """Put positions (ascending) at the new end of their buckets' chains."""
        buckets = self._buckets(hashes)
        order = np.argsort(buckets, kind="stable")
        buckets, positions = buckets[order], positions[order]
        first = np.ones(len(buckets), dtype=bool)
        first[1:] = buckets[1:] != buckets[:-1]
        older = np.empty_like(positions)
        older[1:] = positions[:-1]
        older[first] = head[buckets[first]]
        prev[positions - self.base] = older
        last = np.ones(len(buckets), dtype=bool)
        last[:-1] = first[1:]
        head[buckets[last]] = positions[last]

    def _make_room(self, size: int) -> None:
        """Ensure buf holds `size` more tokens after end and a _SEP after them."""
        if self.end - self.base + size + 1 <= len(self.buf):
            return
        if not self.head:
            self.head = [np.full(1 << self.table_bits, -1, dtype=np.int64) for _ in self.orders]
        live = self.end - self.start
        capacity = max(1024, 2 * (live + size + 1))
        buf = np.full(capacity, _SEP, dtype=np.int32)
        buf[:live] = self.buf[self.start - self.base : self.end - self.base]
        prev = []
        for old in self.prev or [np.empty(0, dtype=np.int64)] * len(self.orders):
            new = np.full(capacity, -1, dtype=np.int64)
            new[:live] = old[self.start - self.base : self.end - self.base]
            prev.append(new)
        self.buf, self.prev, self.base = buf, prev, self.start
