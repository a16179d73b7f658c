"""Turns one step's logits into one token per row.

Order of operations per row (each stage runs only when some row in the batch needs it):
  1. logit_bias is added;
  2. while the row has fewer than min_tokens outputs, its stop_token_ids (and its eos ids unless
     ignore_eos) are set to -inf;
  3. repetition penalty over prompt + output tokens, then frequency / presence penalties over
     output tokens;
  4. rows constrained by a grammar (structured output, `AllowedTokens`) set every token their
     bitmask does not allow to -inf;
  5. greedy rows take the argmax;
  6. the other rows divide by temperature, apply top-k, top-p, min-p, and sample.
Logprobs are always those of the raw logits passed in (before any of the above), like OpenAI.

Sampling draws exponential noise E and takes argmax(probs / E), which samples exactly from
probs (the Gumbel-max trick in another form). A row with `params.seed` draws E from a generator
seeded with (seed, number of tokens generated so far) only, so its token does not depend on the
rest of the batch, on row order, or on whether the request was preempted and recomputed.

The small tensors a stage builds from the rows (indices, temperatures, top-k / top-p / min-p,
penalties, token ids) go to the logits' device in one copy per stage, two where it needs both
int64 and float32 values (`layers.uploads.to_device`: on CUDA from pinned memory, without waiting for the
stream).

With the compiled CPU kernels (`Sampler(kernels=...)`, the model runner's on a CPU), logits on
the CPU are sampled by their `sample_rows` instead (csrc/cpu_sampler.cpp): the same Gumbel-max
draw, argmax(logits / T - log(-log U)), in one pass over each row, with U made from a hash of a
per-row key and the token index rather than stored; the key of a seeded row is the same
(seed, position) value, so everything above holds there too. A seed gives the same tokens on
every build of the kernels, and other tokens than on the PyTorch path.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenmill.layers.uploads import to_device
from tokenmill.sampling_params import SamplingParams
from tokenmill.structured.bitmask import apply_bitmask_, masked

_MASK64 = (1 << 64) - 1
# Top-p first looks for its cut-off among this many most likely tokens (see _apply_top_k_top_p).
_TOP_P_CANDIDATES = 1024


@dataclass(slots=True)
class SamplingRow:
    """One row of logits to sample from. The sequences are read, never copied or kept: pass the
    request's own lists (not tensors; they are iterated in Python when penalties apply)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int]
    output_token_ids: Sequence[int]  # tokens generated before this step
    eos_token_ids: Sequence[int]  # the model's eos ids, masked while output < min_tokens


@dataclass(slots=True)
class AllowedTokens:
    """The grammar constraints of some rows of a batch: each row r of `row_ids` may only produce
    the tokens `bitmask[r]` allows (tokenmill/structured/bitmask.py's layout, on the CPU). The
    other rows are unconstrained and cost nothing; their bitmask rows are not read."""

    row_ids: list[int]  # ascending
    bitmask: torch.Tensor  # [num_rows, ceil(vocab_size / 32)] int32


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row
    # Raw logprob of each row's sampled token; None when no row asked for logprobs.
    logprobs: list[float] | None
    # Per row, the top params.logprobs (token_id, logprob) pairs, most likely first; an empty list
    # for rows that did not ask. None when no row asked for logprobs.
    top_logprobs: list[list[tuple[int, float]]] | None


class Sampler:
    """Stateless apart from the generator of unseeded rows. Never modifies the logits passed in.

    The common batch (all greedy, no bias / penalties / min_tokens / logprobs) costs one argmax
    in the logits' own dtype; everything else works in fp32.
    """

    def __init__(self, seed: int | None = None, kernels=None):
        """`kernels`: the compiled CPU kernels (layers.cpu_kernels), whose `sample_rows` then
        draws the non-greedy rows of CPU logits in one pass each (see _sample_kernel)."""
        self._seed = seed
        self._kernels = kernels
        self._shared_generators: dict[torch.device, torch.Generator] = {}  # unseeded rows
        self._row_generators: dict[torch.device, torch.Generator] = {}  # re-seeded per row

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow],
                 allowed: AllowedTokens | None = None) -> SamplerOutput:
        check_rows(logits, rows)
        need = _Needs.of(rows)
        if need.all_greedy and not (need.processing or need.logprobs):
            # bf16/fp16 -> fp32 is exact and monotonic, so no conversion is needed (a grammar's
            # -inf masks are exact in any dtype).
            if allowed is not None and allowed.row_ids:
                logits = masked(logits, allowed.bitmask, _subset(allowed, logits))
            return SamplerOutput(logits.argmax(dim=-1).tolist(), None, None)

        raw = logits.float()  # [num_rows, vocab_size]; the caller's tensor when already fp32
        # A converted copy nobody reads afterwards (no logprobs) may be masked in place.
        scratch = raw.data_ptr() != logits.data_ptr() and not need.logprobs
        x = _process(raw, rows, need, allowed, scratch)
        if need.all_greedy:
            token_ids = x.argmax(dim=-1)
        else:
            token_ids = self._sample_mixed(x, rows)

        if not need.logprobs:
            return SamplerOutput(token_ids.tolist(), None, None)
        logprobs, top_logprobs = gather_logprobs(raw, token_ids, rows)
        return SamplerOutput(token_ids.tolist(), logprobs, top_logprobs)

    def probs(self, logits: torch.Tensor, rows: list[SamplingRow], allowed: AllowedTokens | None = None) -> torch.Tensor:
        """[num_rows, vocab_size] fp32: the distribution each row's token is drawn from, after
        every stage above, normalized. A greedy row is one-hot at its argmax (the token the
        sampler would pick), so exact tests on it give greedy decoding."""
        check_rows(logits, rows)
        need = _Needs.of(rows)
        raw = logits.float()
        x = _process(raw, rows, need, allowed, scratch=raw.data_ptr() != logits.data_ptr())
        probs = torch.zeros_like(x)
        random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
        greedy_idx = [i for i, row in enumerate(rows) if row.params.greedy]
        both = to_device(greedy_idx + random_idx, torch.long, x.device)
        if greedy_idx:
            idx = both[: len(greedy_idx)]
            probs[idx, x[idx].argmax(dim=-1)] = 1.0
        if random_idx:
            idx = both[len(greedy_idx) :]
            p = self._random_probs(x[idx], [rows[i] for i in random_idx])
            probs[idx] = p / p.sum(dim=-1, keepdim=True)
        return probs

    def sample_from(self, probs: torch.Tensor, rows: list[SamplingRow]) -> list[int]:
        """One token per row of `probs` ([n, vocab_size], e.g. from `probs`): a draft model's
        proposals. Seeded rows draw from (seed, output position) on their own stream."""
        noise = self._exponential_noise(probs, [row.params for row in rows], rows, stream=_DRAFT_STREAM)
        return (probs / noise).argmax(dim=-1).tolist()

    def _sample_mixed(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """x: [num_rows, vocab_size] processed logits, at least one row non-greedy."""
        random_idx = [i for i, row in enumerate(rows) if not row.params.greedy]
        if len(random_idx) == len(rows):
            return self._sample_random(x, rows)
        token_ids = x.argmax(dim=-1)
        idx = to_device(random_idx, torch.long, x.device)
        token_ids[idx] = self._sample_random(x[idx], [rows[i] for i in random_idx])
        return token_ids

    def _sample_random(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """x: [n, vocab_size] processed logits of non-greedy rows -> [n] sampled token ids."""
        if self._kernels is not None and x.device.type == "cpu":
            return self._sample_kernel(x, rows)
        probs = self._random_probs(x, rows)
        # probs need not be renormalised: argmax(probs / E) samples proportionally to probs.
        noise = self._exponential_noise(probs, [row.params for row in rows], rows)
        return (probs / noise).argmax(dim=-1)

    def _sample_kernel(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """`_sample_random` by the CPU kernels' `sample_rows`: temperature, min-p and the
        Gumbel-max draw in one pass over each row (top-k and top-p, where a row asks, first here
        on x / temperature). A row's noise comes from a 64-bit key: (seed, output position)
        through splitmix64 for a seeded row, as its generator seed is elsewhere; a draw of the
        shared generator for the others."""
        params = [row.params for row in rows]
        if _needs_top_k_top_p(params, x.shape[1]):
            x = _top_k_top_p_logits(x, params)
            inv_temperature = torch.ones(len(params))
        else:
            inv_temperature = torch.tensor([1.0 / p.temperature for p in params])
        # (seeded rows leave the shared generator where it was, as on the PyTorch path)
        num_unseeded = sum(p.seed is None for p in params)
        draws = iter(torch.randint(-(2**63), 2**63 - 1, (num_unseeded,), dtype=torch.int64,
                                   generator=self.shared_generator(x.device)).tolist()
                     if num_unseeded else ())
        keys = torch.tensor([next(draws) if p.seed is None else _signed64(_row_seed(p.seed, len(row.output_token_ids)))
                             for p, row in zip(params, rows)], dtype=torch.int64)
        min_p = torch.tensor([p.min_p for p in params])
        return self._kernels.sample_rows(x.contiguous(), inv_temperature, min_p, keys)

    def _random_probs(self, x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
        """x: [n, vocab_size] processed logits of non-greedy rows -> [n, vocab_size] probabilities
        after temperature, top-k, top-p and min-p (not renormalised after min-p)."""
        params = [row.params for row in rows]
        table = _row_table(params, x.shape[1], x.device)
        probs = _top_k_top_p_logits(x, params, table).softmax(dim=-1)
        if any(p.min_p for p in params):
            min_p = table[3].unsqueeze(1)
            p_max = probs.amax(dim=-1, keepdim=True)
            probs = probs.masked_fill(probs < min_p * p_max, 0.0)  # p_max itself always stays
        return probs

    def _exponential_noise(
        self, probs: torch.Tensor, params: list[SamplingParams], rows: list[SamplingRow], stream: int = 0
    ) -> torch.Tensor:
        """[n, vocab_size] Exp(1) noise, as -log(U) with U uniform in [0, 1): never 0 (no inf or
        nan in probs / E), and several times faster than `exponential_` on CPU. A seeded row's
        generator is seeded from (seed, output position) xor `stream` (0: the plain sampler's)."""
        device = probs.device
        noise = torch.empty_like(probs)
        seeded = [i for i, p in enumerate(params) if p.seed is not None]
        if len(seeded) < len(params):
            noise.uniform_(generator=self.shared_generator(device))
        for i in seeded:
            noise[i].uniform_(generator=self.row_generator(device, params[i].seed, len(rows[i].output_token_ids), stream))
        return noise.log_().neg_()

    def shared_generator(self, device: torch.device) -> torch.Generator:
        """The generator unseeded rows draw from (seeded from the sampler's seed, or at random)."""
        return self._generator(self._shared_generators, device)

    def row_generator(self, device: torch.device, seed: int, position: int, stream: int) -> torch.Generator:
        """The per-row generator, seeded from (request seed, output position) xor `stream` only:
        a seeded request's draws for another purpose than plain sampling (verification) use their
        own `stream`, so they are not the numbers `__call__` draws at that position."""
        gen = self._generator(self._row_generators, device)
        gen.manual_seed(_row_seed(seed, position) ^ stream)
        return gen

    def _generator(
        self, cache: dict[torch.device, torch.Generator], device: torch.device
    ) -> torch.Generator:
        gen = cache.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            cache[device] = gen
        return gen


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _signed64(value: int) -> int:
    """A 64-bit unsigned value as the int64 with the same bits."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _row_seed(seed: int, step: int) -> int:
    """A generator seed from (request seed, output position) only: same pair, same draw."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


# Mixed into a seeded row's generator seed for a draft model's proposals, so its draws are not
# the same numbers __call__ would draw at that position.
_DRAFT_STREAM = 0xD8AF7


def check_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    if logits.dim() != 2 or logits.shape[0] != len(rows):
        raise ValueError(f"logits must be [num_rows={len(rows)}, vocab_size], got {tuple(logits.shape)}")


@dataclass(slots=True)
class _Needs:
    """Which stages some row of the batch needs."""

    all_greedy: bool
    bias: bool
    min_tokens: bool
    repetition: bool
    frequency: bool
    logprobs: bool

    @property
    def processing(self) -> bool:
        return self.bias or self.min_tokens or self.repetition or self.frequency

    @classmethod
    def of(cls, rows: list[SamplingRow]) -> "_Needs":
        need = cls(True, False, False, False, False, False)
        for row in rows:
            p = row.params
            if not p.greedy:
                need.all_greedy = False
            if p.logit_bias:
                need.bias = True
            if p.min_tokens and len(row.output_token_ids) < p.min_tokens:
                need.min_tokens = True
            if p.repetition_penalty != 1.0:
                need.repetition = True
            if p.frequency_penalty or p.presence_penalty:
                need.frequency = True
            if p.logprobs is not None:
                need.logprobs = True
        return need


def _process(raw: torch.Tensor, rows: list[SamplingRow], need: _Needs, allowed: AllowedTokens | None = None,
             scratch: bool = False) -> torch.Tensor:
    """Stages 1-4 on fp32 logits; returns `raw` itself when no row needs any of them. Stage 4
    edits `raw` in place when it is `scratch` (the caller's own copy), else a copy of it."""
    x = raw.clone() if (need.bias or need.min_tokens) else raw  # edited in place below
    if need.bias:
        _add_logit_bias(x, rows)
    if need.min_tokens:
        _mask_stop_tokens(x, rows)
    if need.repetition:
        x = _apply_repetition_penalty(x, rows)
    if need.frequency:
        x = _apply_frequency_presence_penalties(x, rows)
    if allowed is not None and allowed.row_ids:
        x = _apply_allowed(x, allowed, copy=x is raw and not scratch)
    return x


def _apply_allowed(x: torch.Tensor, allowed: AllowedTokens, copy: bool) -> torch.Tensor:
    """Stage 4: the constrained rows keep only their allowed tokens (in place unless `copy`)."""
    if copy:
        return masked(x, allowed.bitmask, _subset(allowed, x))
    apply_bitmask_(x, allowed.bitmask, _subset(allowed, x))
    return x


def _subset(allowed: AllowedTokens, x: torch.Tensor) -> list[int] | None:
    """The constrained rows, or None when they are all of x's."""
    return None if len(allowed.row_ids) == x.shape[0] else allowed.row_ids


def _add_logit_bias(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    vocab_size = x.shape[1]
    row_idx: list[int] = []
    token_ids: list[int] = []
    biases: list[float] = []
    for i, row in enumerate(rows):
        bias = row.params.logit_bias
        if bias:
            row_idx.extend([i] * len(bias))
            token_ids.extend(bias.keys())
            biases.extend(bias.values())
    if max(token_ids) >= vocab_size:
        raise ValueError(
            f"logit_bias token id must be < vocab_size ({vocab_size}), got {max(token_ids)}"
        )
    device = x.device
    x.index_put_(tuple(to_device([row_idx, token_ids], torch.long, device)),
                 to_device(biases, torch.float32, device), accumulate=True)


def _mask_stop_tokens(x: torch.Tensor, rows: list[SamplingRow]) -> None:
    """min_tokens: the row may not end yet, so nothing that would end it may be sampled.
    Ids outside the vocab cannot be sampled anyway and are skipped."""
    vocab_size = x.shape[1]
    row_idx: list[int] = []
    token_ids: list[int] = []
    for i, row in enumerate(rows):
        p = row.params
        if len(row.output_token_ids) >= p.min_tokens:
            continue
        ids = list(p.stop_token_ids)
        if not p.ignore_eos:
            ids.extend(row.eos_token_ids)
        ids = [t for t in ids if t < vocab_size]
        row_idx.extend([i] * len(ids))
        token_ids.extend(ids)
    if token_ids:
        x[tuple(to_device([row_idx, token_ids], torch.long, x.device))] = float("-inf")


def _token_rows(
    rows: list[SamplingRow], row_idx: list[int], with_prompt: bool, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs for every prompt (optional) and output token of those rows."""
    flat: list[int] = []
    row_of: list[int] = []
    for i in row_idx:
        row = rows[i]
        n = len(flat)
        if with_prompt:
            flat.extend(row.prompt_token_ids)
        flat.extend(row.output_token_ids)
        row_of.extend([i] * (len(flat) - n))
    rows_t, token_ids = to_device([row_of, flat], torch.long, device)
    return rows_t, token_ids


def _apply_repetition_penalty(x: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    num_rows, vocab_size = x.shape
    device = x.device
    row_idx = [i for i, row in enumerate(rows) if row.params.repetition_penalty != 1.0]
    rows_t, token_ids = _token_rows(rows, row_idx, with_prompt=True, device=device)
    seen = torch.zeros(num_rows, vocab_size, dtype=torch.bool, device=device)
    seen[rows_t, token_ids] = True
    # (1.0 for the rows outside row_idx)
    penalty = to_device([row.params.repetition_penalty for row in rows], torch.float32, device).unsqueeze(1)
    return torch.where(seen, torch.where(x > 0, x / penalty, x * penalty), x)


def _apply_frequency_presence_penalties(
    x: torch.Tensor, rows: list[SamplingRow]
) -> torch.Tensor:
    num_rows, vocab_size = x.shape
    device = x.device
    row_idx = [
        i
        for i, row in enumerate(rows)
        if (row.params.frequency_penalty or row.params.presence_penalty)
        and len(row.output_token_ids)
    ]
    if not row_idx:
        return x
    rows_t, token_ids = _token_rows(rows, row_idx, with_prompt=False, device=device)
    counts = torch.zeros(num_rows, vocab_size, device=device)  # [num_rows, vocab_size]
    ones = torch.ones_like(token_ids, dtype=x.dtype)
    counts.index_put_((rows_t, token_ids), ones, accumulate=True)
    selected = set(row_idx)  # the other rows' penalties are 0
    params = [rows[i].params if i in selected else None for i in range(num_rows)]
    penalties = to_device([[p.frequency_penalty if p is not None else 0.0 for p in params],
                            [p.presence_penalty if p is not None else 0.0 for p in params]], torch.float32, device)
    frequency, presence = penalties[0].unsqueeze(1), penalties[1].unsqueeze(1)  # [num_rows, 1] each
    return x - frequency * counts - presence * (counts > 0)


def _top_k_threshold(values: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """values: [n, >= max k] sorted descending; k: [n, 1] int64 (0: off) -> [n, 1] the k-th
    largest logit (-inf when off). Ties with the k-th logit are kept."""
    threshold = values.gather(1, (k - 1).clamp(min=0))
    return threshold.masked_fill(k == 0, float("-inf"))


def _top_ks(params: list[SamplingParams], vocab_size: int) -> list[int]:
    return [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]  # 0 = off


def _needs_top_k_top_p(params: list[SamplingParams], vocab_size: int) -> bool:
    return any(p.top_p < 1.0 for p in params) or any(_top_ks(params, vocab_size))


def _row_table(params: list[SamplingParams], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[4, n] float32 on `device`, in one copy: each row's temperature, top-p, top-k (0: off;
    exact in float32, being below the vocabulary size and so below 2**24) and min-p."""
    return to_device([[p.temperature for p in params], [p.top_p for p in params], _top_ks(params, vocab_size),
                       [p.min_p for p in params]], torch.float32, device)


def _top_k_top_p_logits(x: torch.Tensor, params: list[SamplingParams],
                        table: torch.Tensor | None = None) -> torch.Tensor:
    """x / temperature per row, tokens outside each row's top-k and top-p set to -inf. `table`:
    the rows' `_row_table`, when the caller has it."""
    if table is None:
        table = _row_table(params, x.shape[1], x.device)
    x = x / table[0].unsqueeze(1)
    top_ks = _top_ks(params, x.shape[1])
    top_ps = [p.top_p for p in params]
    k, top_p = table[2].long().unsqueeze(1), table[1].unsqueeze(1)
    if any(p < 1.0 for p in top_ps):
        return _apply_top_k_top_p(x, top_ks, top_ps, k, top_p)
    if any(top_ks):
        return _apply_top_k(x, top_ks, k)
    return x


def _apply_top_k(x: torch.Tensor, top_ks: list[int], k: torch.Tensor) -> torch.Tensor:
    """k: top_ks as [n, 1] int64 on x's device."""
    values = x.topk(max(top_ks), dim=-1).values  # [n, max_k], descending
    return x.masked_fill(x < _top_k_threshold(values, k), float("-inf"))


def _apply_top_k_top_p(x: torch.Tensor, top_ks: list[int], top_ps: list[float], k: torch.Tensor | None = None,
                       top_p: torch.Tensor | None = None) -> torch.Tensor:
    """Top-k, then top-p: keep the smallest most-likely set whose probability reaches top_p
    (a token stays iff the mass of the tokens ranked above it is < top_p; the top one always).
    k, top_p: top_ks and top_ps as [n, 1] int64 and float32 on x's device (built when not given).

    A full sort of the vocab is the slow part, so rows are first cut using only their most
    likely _TOP_P_CANDIDATES tokens; the rare row whose candidates do not reach top_p is sorted
    in full. Either way each row gets one logit threshold; ties with it are kept."""
    vocab_size = x.shape[1]
    if k is None or top_p is None:
        k = to_device(top_ks, torch.long, x.device).unsqueeze(1)
        top_p = to_device(top_ps, torch.float32, x.device).unsqueeze(1)
    # A top-k row needs only its k best; a top-p-only row needs the wide candidate set.
    top_p_only = any(tk == 0 and p < 1.0 for tk, p in zip(top_ks, top_ps))
    num_candidates = min(vocab_size, max(_TOP_P_CANDIDATES if top_p_only else 1, max(top_ks)))
    candidates = x.topk(num_candidates, dim=-1).values  # [n, num_candidates], descending
    threshold, resolved = _top_k_top_p_threshold(x, candidates, k, top_p)
    if num_candidates < vocab_size and not bool(resolved.all()):
        idx = (~resolved).nonzero()[:, 0]
        sub = x[idx]
        threshold[idx], _ = _top_k_top_p_threshold(sub, sub.sort(dim=-1, descending=True).values, k[idx], top_p[idx])
    return x.masked_fill(x < threshold, float("-inf"))


def _top_k_top_p_threshold(
    x: torch.Tensor, values: torch.Tensor, k: torch.Tensor, top_p: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [n, vocab_size]; values: [n, m] the m largest of each row, descending (m >= max k);
    k, top_p: [n, 1] each row's top-k (int64, 0: off) and top-p (float32).
    Returns the [n, 1] logit threshold, and [n] whether it is exact, which it is unless top-p
    needs more than the m tokens given."""
    k_threshold = _top_k_threshold(values, k)
    values = values.masked_fill(values < k_threshold, float("-inf"))
    # Probabilities after top-k: all of a top-k row's tokens are among `values`.
    log_norm = torch.where(
        k > 0,
        torch.logsumexp(values, dim=-1, keepdim=True),
        torch.logsumexp(x, dim=-1, keepdim=True),
    )
    cum_probs = (values - log_norm).exp().cumsum(dim=-1)  # non-decreasing: kept set is a prefix
    # Token i > 0 stays iff cum_probs[i - 1] < top_p.
    num_kept = 1 + (cum_probs[:, :-1] < top_p).sum(dim=-1, keepdim=True)
    p_off = top_p >= 1.0
    p_threshold = values.gather(1, num_kept - 1).masked_fill(p_off, float("-inf"))
    resolved = (k > 0) | p_off | (cum_probs[:, -1:] >= top_p)
    return torch.maximum(k_threshold, p_threshold), resolved[:, 0]


def gather_logprobs(
    raw: torch.Tensor, token_ids: torch.Tensor, rows: list[SamplingRow]
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """raw: [num_rows, vocab_size] fp32 logits as passed in. logprob = logit - logsumexp, which
    equals log_softmax without materialising a second [num_rows, vocab_size] tensor."""
    lse = torch.logsumexp(raw, dim=-1)  # [num_rows]
    logprobs = (raw.gather(1, token_ids.unsqueeze(1)).squeeze(1) - lse).tolist()
    top_logprobs: list[list[tuple[int, float]]] = [[] for _ in rows]
    ks = [row.params.logprobs or 0 for row in rows]
    asking = [i for i, k in enumerate(ks) if k > 0]
    if asking:
        idx = to_device(asking, torch.long, raw.device)
        values, ids = raw[idx].topk(min(max(ks), raw.shape[1]), dim=-1)
        values = (values - lse[idx].unsqueeze(1)).tolist()
        ids = ids.tolist()
        for j, i in enumerate(asking):
            k = ks[i]
            top_logprobs[i] = list(zip(ids[j][:k], values[j][:k]))
    return logprobs, top_logprobs
