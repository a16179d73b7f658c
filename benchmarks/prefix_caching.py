#!/usr/bin/env python
"""Prefix caching on vs off, in one run, on two workloads.

1. Shared prefix: one long system prompt (~`--system-tokens` tokens of real English text)
   followed by `--num-questions` distinct short questions, sent through the chat template and
   kept `--concurrency` in flight (a new one is added as soon as one finishes, the way a
   server sees them). TTFT of each request is measured from the moment it is handed to the
   engine; the table gives p50/p99 TTFT, total time and prompt tokens actually computed.
2. Multi-turn chat: `--conversations` conversations of `--turns` turns; each turn sends the
   whole conversation so far (earlier questions and the model's own answers) plus a new
   question. The table gives the prompt tokens computed per turn.

Both engines are in this process with the same dtype and threads; greedy decoding, EOS ignored.

    python benchmarks/prefix_caching.py
    python benchmarks/prefix_caching.py --system-tokens 200 --num-questions 8 --concurrency 4 --conversations 2 --turns 3
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import sys
import time
from pathlib import Path

import numpy as np
from common import write_report

os.environ.setdefault("TQDM_DISABLE", "1")

TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "prefix_caching.json"
QUESTIONS = [
    "Can I copy this program?", "What is the source code?", "Can I sell copies?", "What about patents?",
    "Must I keep the notices?", "What is a covered work?", "Is there a warranty?", "Who is a licensee?",
]


def parse_args() -> argparse.Namespace:
    from tokenmill.config import EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=d.model, help="model alias or path (default: %(default)s)")
    p.add_argument("--dtype", default="auto", help="compute dtype (default: auto)")
    p.add_argument("--system-tokens", type=int, default=1000, help="length of the shared system prompt (default: 1000)")
    p.add_argument("--num-questions", type=int, default=64, help="requests sharing the system prompt (default: 64)")
    p.add_argument("--concurrency", type=int, default=16, help="requests in flight at once (default: 16)")
    p.add_argument("--max-tokens", type=int, default=16, help="output tokens per request (default: 16)")
    p.add_argument("--conversations", type=int, default=4, help="multi-turn conversations (default: 4)")
    p.add_argument("--turns", type=int, default=4, help="turns per conversation (default: 4)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json", help="where to write the JSON")
    return p.parse_args()


def system_prompt(tokenizer, num_tokens: int) -> str:
    ids = tokenizer.encode(TEXT_FILE.read_text(), add_special_tokens=False)[:num_tokens]
    return "Answer questions about this license.\n\n" + tokenizer.decode(ids)


def run_shared_prefix(llm, system: str, args) -> dict:
    from tokenmill import SamplingParams

    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    questions = [f"{QUESTIONS[i % len(QUESTIONS)]} (#{i})" for i in range(args.num_questions)]
    prompts = [engine.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": q}])
               for q in questions]
    kv = engine.core.kv_cache_manager
    queried0, hits0 = kv.prefix_query_tokens, kv.prefix_hit_tokens
    ttft: list[float] = []
    next_prompt = 0
    in_flight = 0
    prompt_tokens = 0
    start = time.perf_counter()
    while next_prompt < len(prompts) or in_flight:
        while in_flight < args.concurrency and next_prompt < len(prompts):
            engine.add_request(f"q{next_prompt}", prompts[next_prompt], params, chat=True)
            next_prompt += 1
            in_flight += 1
        for out in engine.step():
            if out.finished:
                in_flight -= 1
                m = out.metrics
                ttft.append(m.first_token_time - m.arrival_time)
                prompt_tokens += len(out.prompt_token_ids)
    seconds = time.perf_counter() - start
    hits = kv.prefix_hit_tokens - hits0
    return {
        "requests": len(prompts), "seconds": seconds, "ttft_p50_s": float(np.percentile(ttft, 50)),
        "ttft_p99_s": float(np.percentile(ttft, 99)), "ttft_mean_s": float(np.mean(ttft)),
        "prompt_tokens": prompt_tokens, "prompt_tokens_computed": prompt_tokens - hits,
        "prefix_query_tokens": kv.prefix_query_tokens - queried0, "prefix_hit_tokens": hits,
    }


def run_multi_turn(llm, args) -> dict:
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    kv = llm.engine.core.kv_cache_manager
    conversations = [[{"role": "system", "content": "You are a helpful assistant."}] for _ in range(args.conversations)]
    per_turn = []
    for turn in range(args.turns):
        for i, conv in enumerate(conversations):
            conv.append({"role": "user", "content": QUESTIONS[(i + turn) % len(QUESTIONS)]})
        hits0 = kv.prefix_hit_tokens
        start = time.perf_counter()
        outs = llm.chat(conversations, params)
        seconds = time.perf_counter() - start
        prompt = sum(len(o.prompt_token_ids) for o in outs)
        for conv, out in zip(conversations, outs):
            conv.append({"role": "assistant", "content": out.outputs[0].text})
        per_turn.append({"turn": turn + 1, "prompt_tokens": prompt,
                         "prompt_tokens_computed": prompt - (kv.prefix_hit_tokens - hits0), "seconds": seconds})
    return {"conversations": args.conversations, "turns": per_turn}


def main() -> int:
    args = parse_args()
    logging.basicConfig(level=logging.WARNING)
    from tokenmill import LLM

    results = {}
    for caching in (True, False):
        llm = LLM(args.model, dtype=args.dtype, enable_prefix_caching=caching, kv_cache_memory_gb=1.0)
        system = system_prompt(llm.tokenizer, args.system_tokens)
        llm.generate("warm up", None)
        name = "on" if caching else "off"
        print(f"prefix caching {name}: shared prefix ...", file=sys.stderr)
        shared = run_shared_prefix(llm, system, args)
        print(f"prefix caching {name}: multi-turn ...", file=sys.stderr)
        multi = run_multi_turn(llm, args)
        results[name] = {"shared_prefix": shared, "multi_turn": multi, "dtype": str(llm.engine.core.dtype)}
        del llm
        gc.collect()

    on, off = results["on"]["shared_prefix"], results["off"]["shared_prefix"]
    print(f"\nshared prefix: {args.num_questions} requests, ~{args.system_tokens}-token system prompt, "
          f"{args.concurrency} in flight, {args.max_tokens} output tokens each ({results['on']['dtype']})")
    print(f"{'caching':8} {'TTFT p50':>10} {'TTFT p99':>10} {'total s':>8} {'prompt tok':>11} {'computed':>9}")
    for name, r in (("on", on), ("off", off)):
        print(f"{name:8} {r['ttft_p50_s'] * 1e3:8.0f}ms {r['ttft_p99_s'] * 1e3:8.0f}ms {r['seconds']:8.1f} "
              f"{r['prompt_tokens']:11d} {r['prompt_tokens_computed']:9d}")
    print(f"TTFT p50 on/off = {on['ttft_p50_s'] / off['ttft_p50_s']:.1%}, p99 on/off = "
          f"{on['ttft_p99_s'] / off['ttft_p99_s']:.1%}, total time on/off = {on['seconds'] / off['seconds']:.1%}")
    print(f"\nmulti-turn: {args.conversations} conversations; prompt tokens computed per turn (of prompt tokens)")
    print(f"{'turn':>4} {'on':>16} {'off':>16}")
    for t_on, t_off in zip(results["on"]["multi_turn"]["turns"], results["off"]["multi_turn"]["turns"]):
        print(f"{t_on['turn']:4d} {t_on['prompt_tokens_computed']:7d} of {t_on['prompt_tokens']:5d} "
              f"{t_off['prompt_tokens_computed']:7d} of {t_off['prompt_tokens']:5d}")

    write_report(args.output, "prefix_caching", {k: str(v) for k, v in vars(args).items()}, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
