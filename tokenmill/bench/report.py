"""The terminal table of one run, the compact table of a sweep, and the JSON files."""

from __future__ import annotations

import json
from pathlib import Path

ROWS = (("TTFT", "ttft_ms"), ("ITL", "itl_ms"), ("TPOT", "tpot_ms"), ("E2E", "e2e_ms"))


def format_run(result: dict) -> str:
    s = result["summary"]
    cfg = result["config"]
    header = [
        f"tokenmill bench serve: {result['label']}",
        f"{cfg['api']} · {cfg['dataset']} · {result['load']} · {cfg['base_url']} (model {cfg['model']})",
    ]
    return "\n".join(header + format_summary(s))


def format_summary(s: dict) -> list[str]:
    """The lines of a run's summary (`metrics.summarize`) below its header, ruled above and below."""
    rule = "-" * 72
    lines = [
        rule,
        _kv("requests", f"{s['num_sent']} sent, {s['completed']} ok, {s['failed']} failed"),
        _kv("duration", f"{s['duration_s']:.2f} s"),
        _kv("throughput", f"{s['request_throughput']:.2f} req/s ({s['requests_per_min']:.1f} req/min)"),
        _kv("", f"{s['output_throughput']:.1f} output tok/s, {s['total_token_throughput']:.1f} total tok/s"),
        _kv("tokens", f"{s['total_input_tokens']} prompt, {s['total_output_tokens']} output"
                      + ("" if s["usage_reported"] else " (no usage from the server: output counted from events)")),
    ]
    if s.get("speculative"):
        sp = s["speculative"]
        rate = "-" if sp["acceptance_rate"] is None else f"{sp['acceptance_rate']:.1%}"
        mean = "" if sp["mean_acceptance_length"] is None else f", mean acceptance length {sp['mean_acceptance_length']:.2f}"
        lines.append(_kv("speculation", f"{sp['accepted_tokens']} of {sp['draft_tokens']} drafts accepted ({rate}){mean}"))
    slo = s["slo"]
    if slo["spec"]:
        lines.append(_kv("goodput", f"{slo['goodput']:.2f} req/s ({slo['good_requests']} of {s['num_sent']} "
                                    f"requests within {slo['spec']})"))
        checks = ", ".join(f"{c['slo']} {_ms(c['value_ms'])}{' ok' if c['met'] else ' MISSED'}" for c in slo["checks"])
        lines.append(_kv("SLOs met", f"{'yes' if slo['met'] else 'no'} ({checks})"))
    if "cost" in s:
        c = s["cost"]
        lines.append(_kv("cost", f"${_money(c['per_request'])} per request, ${_money(c['per_million_output_tokens'])} "
                                 f"per 1M output tokens (at ${c['cost_per_hour']:g}/h; run ${_money(c['run_cost'])})"))
    names = [f"p{p:g}" for p in s["percentiles"]]
    lines += [rule, f"{'latency (ms)':<14}" + "".join(f"{h:>10}" for h in ["mean", *names, "max"]) + f"{'samples':>10}"]
    for label, key in ROWS:
        d = s[key]
        lines.append(f"{label:<14}" + "".join(f"{_ms(d[k]):>10}" for k in ["mean", *names, "max"]) + f"{d['count']:>10}")
    if s["errors"]:
        lines.append(rule)
        lines += [f"error x{n}: {message}" for message, n in list(s["errors"].items())[:10]]
    lines.append(rule)
    return lines


def format_sweep(sweep: dict) -> str:
    pct = "p99" if any("p99" in r["summary"]["ttft_ms"] for r in sweep["runs"]) else None
    header = (f"{sweep['load_kind']:>13}{'ok/sent':>9}{'req/s':>8}{'out tok/s':>11}"
              f"{'TTFT ' + (pct or 'max'):>11}{'TPOT ' + (pct or 'max'):>11}{'E2E ' + (pct or 'max'):>11}"
              f"{'goodput':>9}{'SLOs':>6}")
    lines = [f"tokenmill bench sweep: {sweep['label']}", header]
    for run in sweep["runs"]:
        s = run["summary"]
        key = pct or "max"
        lines.append(f"{run['load_value']:>13g}{str(s['completed']) + '/' + str(s['num_sent']):>9}"
                     f"{s['request_throughput']:>8.2f}{s['output_throughput']:>11.1f}"
                     f"{_ms(s['ttft_ms'][key]):>11}{_ms(s['tpot_ms'][key]):>11}{_ms(s['e2e_ms'][key]):>11}"
                     f"{s['slo']['goodput']:>9.2f}{('yes' if s['slo']['met'] else 'no') if s['slo']['spec'] else '-':>6}")
    best = sweep.get("best_load_meeting_slos")
    if sweep["runs"] and sweep["runs"][0]["summary"]["slo"]["spec"]:
        lines.append(f"highest {sweep['load_kind']} meeting the SLOs: {best if best is not None else 'none'}")
    return "\n".join(lines)


def write_json(path: str | Path, data: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def _kv(key: str, value: str) -> str:
    return f"{key:<14}{value}"


def _ms(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if value < 10_000 else f"{value:.0f}"


def _money(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value:.6f}" if value < 0.01 else f"{value:.4f}"
