"""From per-request results to the numbers serving is judged by.

- Latencies (ms): mean, std, min, max and the asked percentiles (numpy's linear interpolation)
  of TTFT, TPOT and E2E over successful requests, and of ITL over every ITL sample of every
  successful request (so ITL is token-weighted, TPOT request-weighted).
- Throughput over the run's duration (first send to last completion): successful requests/s and
  per minute, output tokens/s, total (prompt + output) tokens/s.
- SLOs, written `metric[_pNN]=DURATION` (metrics ttft, tpot, itl, e2e; durations like `1s`,
  `50ms`, `0.2` = seconds), comma-separated. A request is *good* when it succeeded and its TTFT,
  TPOT and E2E are within every threshold given for them and each of its ITL samples is within the
  ITL one. **Goodput** = good requests / duration (so goodput <= request throughput). The run
  *meets the SLOs* when, for each SLO, the given percentile over the run (over requests; over all
  samples for ITL) is within the threshold; without `_pNN` every request (every ITL sample) must be.
- Cost, from `--cost-per-hour` (the price of the server for the run's duration, assumed busy with
  this workload only): per successful request and per million output tokens.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass

import numpy as np

from tokenmill.bench.client import RequestResult

SLO_METRICS = ("ttft", "tpot", "itl", "e2e")
DEFAULT_PERCENTILES = (50.0, 90.0, 99.0)


class MetricsError(ValueError):
    """A bad SLO, duration or percentile spec; the message names it."""


def parse_duration(text: str) -> float:
    """Seconds from `1s`, `50ms`, `200us`, `2m` or a bare number of seconds."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*(us|ms|s|m)?\s*", str(text))
    if not m:
        raise MetricsError(f"duration: expected a number with an optional unit us/ms/s/m, got {text!r}")
    scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, None: 1.0}[m.group(2)]
    return float(m.group(1)) * scale


@dataclass(frozen=True)
class SLO:
    metric: str
    threshold: float  # seconds
    percentile: float | None = None  # None: every request (every ITL sample)

    def __post_init__(self) -> None:
        if self.metric not in SLO_METRICS:
            raise MetricsError(f"slo: metric must be one of {SLO_METRICS}, got {self.metric!r}")
        if not self.threshold > 0:
            raise MetricsError(f"slo {self.metric}: threshold must be > 0, got {self.threshold}")
        if self.percentile is not None and not 0 < self.percentile <= 100:
            raise MetricsError(f"slo {self.metric}: percentile must be in (0, 100], got {self.percentile}")

    @property
    def name(self) -> str:
        return self.metric if self.percentile is None else f"{self.metric}_p{self.percentile:g}"

    def __str__(self) -> str:
        return f"{self.name}<={_fmt_seconds(self.threshold)}"


def parse_slos(text: str | None) -> list[SLO]:
    """`ttft_p99=1s,tpot=50ms` -> SLOs."""
    if not text:
        return []
    slos = []
    for item in text.split(","):
        key, sep, value = item.partition("=")
        m = re.fullmatch(r"\s*([a-z0-9]+?)(?:_p([0-9]+(?:\.[0-9]+)?))?\s*", key)
        if not sep or not m:
            raise MetricsError(f"slo: expected metric[_pNN]=DURATION (e.g. ttft_p99=1s), got {item!r}")
        percentile = float(m.group(2)) if m.group(2) else None
        slos.append(SLO(m.group(1), parse_duration(value), percentile))
    return slos


def parse_percentiles(text: str) -> tuple[float, ...]:
    try:
        values = tuple(float(p) for p in str(text).split(",") if p.strip())
    except ValueError:
        raise MetricsError(f"percentiles: expected comma-separated numbers, got {text!r}") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise MetricsError(f"percentiles: each must be in (0, 100], got {text!r}")
    return tuple(sorted(set(values)))


def distribution(values_s: list[float], percentiles: tuple[float, ...]) -> dict:
    """Summary statistics in milliseconds; every value None when there are no samples."""
    keys = ["mean", "std", "min", "max"] + [f"p{p:g}" for p in percentiles]
    if not values_s:
        return {**{k: None for k in keys}, "count": 0}
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    out = {"mean": float(ms.mean()), "std": float(ms.std()), "min": float(ms.min()), "max": float(ms.max())}
    for p, v in zip(percentiles, np.percentile(ms, percentiles)):
        out[f"p{p:g}"] = float(v)
    out["count"] = int(ms.size)
    return out


def is_good(r: RequestResult, slos: list[SLO]) -> bool:
    if not r.success:
        return False
    for slo in slos:
        if slo.metric == "itl":
            if any(gap > slo.threshold for gap in r.itl):
                return False
            continue
        value = {"ttft": r.ttft, "tpot": r.tpot, "e2e": r.e2e}[slo.metric]
        if value is not None and value > slo.threshold:  # TPOT of a 1-token request: nothing to check
            return False
    return True


def summarize(results: list[RequestResult], duration: float, percentiles: tuple[float, ...] = DEFAULT_PERCENTILES,
              slos: list[SLO] | None = None, cost_per_hour: float | None = None) -> dict:
    slos = slos or []
    ok = [r for r in results if r.success]
    failed = [r for r in results if not r.success]
    input_tokens = sum(r.prompt_tokens or 0 for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    samples = {
        "ttft": [r.ttft for r in ok],
        "tpot": [r.tpot for r in ok if r.tpot is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok],
    }
    duration = max(duration, 1e-9)
    summary = {
        "num_sent": len(results),
        "completed": len(ok),
        "failed": len(failed),
        "errors": dict(Counter(r.error for r in failed).most_common()),
        "duration_s": duration,
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "usage_reported": all(r.usage_reported for r in ok),
        "request_throughput": len(ok) / duration,
        "requests_per_min": 60.0 * len(ok) / duration,
        "output_throughput": output_tokens / duration,
        "total_token_throughput": (input_tokens + output_tokens) / duration,
        "percentiles": list(percentiles),
        **{f"{name}_ms": distribution(values, percentiles) for name, values in samples.items()},
    }
    good = sum(is_good(r, slos) for r in results)
    checks = []
    for slo in slos:
        values = np.asarray(samples[slo.metric], dtype=np.float64)
        if values.size == 0:
            value = None
        elif slo.percentile is None:
            value = float(values.max())
        else:
            value = float(np.percentile(values, slo.percentile))
        checks.append({"slo": slo.name, "threshold_ms": slo.threshold * 1000.0,
                       "value_ms": None if value is None else value * 1000.0,
                       "met": value is not None and value <= slo.threshold})
    summary["slo"] = {
        "spec": ",".join(str(s) for s in slos),
        "checks": checks,
        # a run with failures does not meet its SLOs: a failed request missed every one of them
        "met": bool(slos) and bool(ok) and not failed and all(c["met"] for c in checks),
        "good_requests": good if slos else len(ok),
        "goodput": (good if slos else len(ok)) / duration,
        "attainment": (good if slos else len(ok)) / max(len(results), 1),
    }
    drafted = [r for r in ok if r.draft_tokens is not None]
    if drafted:
        drafts = sum(r.draft_tokens for r in drafted)
        accepted = sum(r.accepted_tokens or 0 for r in drafted)
        counted = [r.verifications for r in drafted if r.verifications is not None]
        verifications = sum(counted) if len(counted) == len(drafted) else None
        summary["speculative"] = {
            "requests": len(drafted), "draft_tokens": drafts, "accepted_tokens": accepted,
            "verifications": verifications,
            "acceptance_rate": accepted / drafts if drafts else None,
            # tokens emitted per verifying step, as vLLM and llama.cpp define it
            "mean_acceptance_length": 1 + accepted / verifications if verifications else None,
        }
    if cost_per_hour is not None:
        run_cost = cost_per_hour * duration / 3600.0
        summary["cost"] = {
            "cost_per_hour": cost_per_hour,
            "run_cost": run_cost,
            "per_request": run_cost / len(ok) if ok else None,
            "per_million_output_tokens": run_cost / output_tokens * 1e6 if output_tokens else None,
        }
    return summary


def _fmt_seconds(seconds: float) -> str:
    return f"{seconds:g}s" if seconds >= 1 else f"{seconds * 1000:g}ms"
