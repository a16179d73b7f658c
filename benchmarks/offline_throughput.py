#!/usr/bin/env python
"""Offline throughput: tokenmill's in-flight batching vs Hugging Face `generate` with static batches.

The workload is N requests whose prompt and output lengths are drawn uniformly (inclusive) from
ranges with a fixed seed. Prompts are token ids sliced at random offsets out of real English text
(`/usr/share/common-licenses/GPL-3`, tokenized with the model's tokenizer). Every request ignores
EOS, so each produces exactly its drawn number of output tokens; decoding is greedy.

tokenmill: one `LLM.generate` call over all N requests (after a small warm-up generate), timed
with a wall clock; mean TTFT and mean time per output token come from the request metrics.

Hugging Face: the same requests, in request order (not sorted by length unless
`--hf-sort-by-length`), cut into static batches of `--hf-batch-size`, left-padded (with an
attention mask), each batch generated with `min_new_tokens = max_new_tokens =` the longest
requested output in that batch (HF cannot stop sequences of a static batch at different
lengths). Only the requested output tokens of each request count as useful output tokens; the
raw number of generated tokens (batch size x longest output, per batch) is reported too.

Both engines run in this one process, with the same dtype and the same torch thread count.

    python benchmarks/offline_throughput.py                       # 64 requests, 32:512 in, 32:256 out
    python benchmarks/offline_throughput.py --num-requests 4 --input-len 16:32 --output-len 8:16 --hf-batch-size 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import gc
import json
import logging
import os
import platform
import random
import sys
import time
from pathlib import Path

# Silence the GGUF de-quantization progress bar of transformers (tqdm reads this at import time).
os.environ.setdefault("TQDM_DISABLE", "1")

TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")
DEFAULT_OUTPUT = Path(__file__).resolve().parent / "results" / "offline_throughput.json"


# -- arguments ----------------------------------------------------------------------------------


def length_range(value: str) -> tuple[int, int]:
    """'MIN:MAX' (inclusive) or 'N' (fixed)."""
    parts = value.split(":")
    try:
        if len(parts) == 1:
            lo = hi = int(parts[0])
        elif len(parts) == 2:
            lo, hi = int(parts[0]), int(parts[1])
        else:
            raise ValueError
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN:MAX or N, got {value!r}") from None
    if lo < 1 or hi < lo:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {value!r}")
    return lo, hi


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import EngineConfig

    d = EngineConfig()
    auto_dtype = d.resolved_dtype("cpu")
    p = argparse.ArgumentParser(
        description="Offline throughput of tokenmill (one in-flight batch) vs Hugging Face transformers "
        "generate (static, left-padded batches in request order) on the same greedy, ignore-EOS workload.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="model alias or path (.gguf file or HF directory)")
    p.add_argument("--num-requests", type=int, default=64, help="number of requests N")
    p.add_argument("--input-len", type=length_range, default="32:512", metavar="MIN:MAX",
                   help="prompt length range in tokens, drawn uniformly (inclusive)")
    p.add_argument("--output-len", type=length_range, default="32:256", metavar="MIN:MAX",
                   help="output length range in tokens, drawn uniformly (inclusive); exact, EOS is ignored")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=auto_dtype,
                   help="compute dtype of both engines; the default is what tokenmill's dtype 'auto' resolves to on this CPU")
    p.add_argument("--hf-batch-size", type=int, default=16, help="static batch size for HF generate")
    p.add_argument("--hf-sort-by-length", action="store_true",
                   help="sort requests by prompt length before cutting HF batches, instead of request order")
    p.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                   help="tokenmill: token budget per engine step")
    p.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                   help="tokenmill: most requests running at once")
    p.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb,
                   help="tokenmill: KV cache memory budget")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch intra-op threads for both engines; None = tokenmill's default, the physical core count")
    p.add_argument("--skip-hf", action="store_true", help="run tokenmill only")
    p.add_argument("--seed", type=int, default=0, help="seed of the workload (lengths and prompt offsets)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    if args.num_requests < 1:
        p.error("--num-requests must be >= 1")
    if args.hf_batch_size < 1:
        p.error("--hf-batch-size must be >= 1")
    return args


# -- workload -----------------------------------------------------------------------------------


def make_workload(tokenizer, num_requests: int, input_len: tuple[int, int], output_len: tuple[int, int], seed: int):
    """[(prompt_token_ids, output_len)], prompts sliced from the text at random offsets."""
    text_ids = tokenizer.encode(TEXT_FILE.read_text(), add_special_tokens=False)
    if input_len[1] > len(text_ids):
        raise SystemExit(f"--input-len max {input_len[1]} exceeds the {len(text_ids)} tokens of {TEXT_FILE}")
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        n_in = rng.randint(*input_len)
        n_out = rng.randint(*output_len)
        start = rng.randint(0, len(text_ids) - n_in)
        requests.append((list(text_ids[start : start + n_in]), n_out))
    return requests, len(text_ids)


# -- tokenmill ----------------------------------------------------------------------------------


def run_tokenmill(llm, requests) -> tuple[dict, list[list[int]]]:
    from tokenmill import SamplingParams

    prompts = [p for p, _ in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for _, n in requests]
    scheduler = getattr(getattr(llm.engine, "core", None), "scheduler", None)
    preempt_before = getattr(scheduler, "num_preemptions", None)

    other = OtherLoad()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    seconds = time.perf_counter() - t0
    other_cores = other.cores()

    out_ids = [list(o.outputs[0].token_ids) for o in outs]
    for (prompt, n), o, ids in zip(requests, outs, out_ids):
        if len(ids) != n or list(o.prompt_token_ids) != prompt:
            raise RuntimeError(f"tokenmill request {o.request_id}: {len(ids)} output tokens, expected {n}")
    ttfts = [o.metrics.first_token_time - o.metrics.arrival_time for o in outs]
    tpots = [
        (o.metrics.finished_time - o.metrics.first_token_time) / (len(ids) - 1)
        for o, ids in zip(outs, out_ids)
        if len(ids) > 1
    ]
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(len(ids) for ids in out_ids)
    result = {
        "engine": "tokenmill",
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "generated_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_per_s": output_tokens / seconds,
        "total_tok_per_s": (prompt_tokens + output_tokens) / seconds,
        "mean_ttft_s": sum(ttfts) / len(ttfts),
        "max_ttft_s": max(ttfts),
        "mean_tpot_s": sum(tpots) / len(tpots) if tpots else None,
        "preemptions": (scheduler.num_preemptions - preempt_before) if preempt_before is not None else None,
        "other_processes_cores": other_cores,
    }
    return result, out_ids


# -- Hugging Face -------------------------------------------------------------------------------


def load_hf(model_path: Path, dtype: str):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    kwargs = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    directory = model_path.parent if model_path.suffix == ".gguf" else model_path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=getattr(torch, dtype), **kwargs)
    return model.eval()


def hf_pad_id(model, tokenizer) -> int:
    for cand in (tokenizer.pad_token_id, model.generation_config.pad_token_id, tokenizer.eos_token_id):
        if isinstance(cand, int):
            return cand
    return 0


def hf_generate_batch(model, prompts: list[list[int]], num_new: int, pad_id: int):
    """Left-padded static batch, greedy, exactly `num_new` new tokens per row; returns new tokens."""
    import torch

    width = max(len(p) for p in prompts)
    input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, dtype=torch.long)
        attention_mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        seqs = model.generate(
            input_ids=input_ids,
            attention_mask=attention_mask,
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,  # suppresses EOS, so every row runs to num_new
            pad_token_id=pad_id,
            use_cache=True,
        )
    return seqs[:, width:].tolist()


def run_hf(model, tokenizer, requests, batch_size: int, sort_by_length: bool) -> tuple[dict, list[list[int]]]:
    pad_id = hf_pad_id(model, tokenizer)
    order = list(range(len(requests)))
    if sort_by_length:
        order.sort(key=lambda i: len(requests[i][0]))
    out_ids: list[list[int] | None] = [None] * len(requests)
    generated = 0
    padded_prompt_tokens = 0

    other = OtherLoad()
    t0 = time.perf_counter()
    for b in range(0, len(order), batch_size):
        idx = order[b : b + batch_size]
        prompts = [requests[i][0] for i in idx]
        num_new = max(requests[i][1] for i in idx)
        new = hf_generate_batch(model, prompts, num_new, pad_id)
        generated += len(idx) * num_new
        padded_prompt_tokens += len(idx) * max(len(p) for p in prompts)
        for i, row in zip(idx, new):
            out_ids[i] = row[: requests[i][1]]
    seconds = time.perf_counter() - t0
    other_cores = other.cores()

    for (_, n), ids in zip(requests, out_ids):
        if len(ids) != n:
            raise RuntimeError(f"HF produced {len(ids)} useful tokens for a request of {n}")
    prompt_tokens = sum(len(p) for p, _ in requests)
    output_tokens = sum(n for _, n in requests)
    result = {
        "engine": "hf-transformers",
        "requests": len(requests),
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "generated_tokens": generated,
        "padded_prompt_tokens": padded_prompt_tokens,
        "seconds": seconds,
        "output_tok_per_s": output_tokens / seconds,
        "total_tok_per_s": (prompt_tokens + output_tokens) / seconds,
        "raw_generated_tok_per_s": generated / seconds,
        "batch_size": batch_size,
        "batch_order": "sorted by prompt length" if sort_by_length else "request order",
        "attn_implementation": getattr(model.config, "_attn_implementation", None),
        "other_processes_cores": other_cores,
    }
    return result, out_ids


def greedy_agreement(a: list[list[int]], b: list[list[int]], eos_ids: set[int]) -> dict:
    """Share of output positions on which the two engines agree, counted up to the first
    disagreement of each request (after one, the continuations differ and are not comparable),
    and up to the first EOS (HF's min_new_tokens masks EOS; tokenmill's ignore_eos does not)."""
    matched = compared = identical = 0
    for x, y in zip(a, b):
        limit = len(x)
        for k, t in enumerate(x):
            if t in eos_ids:
                limit = k
                break
        n = 0
        while n < limit and n < len(y) and x[n] == y[n]:
            n += 1
        matched += n
        compared += limit
        identical += n == limit
    return {
        "prefix_match_tokens": matched,
        "compared_tokens": compared,
        "prefix_match_share": matched / compared if compared else None,
        "identical_requests": identical,
    }


# -- other load on the machine ------------------------------------------------------------------


class OtherLoad:
    """CPU time used by every other process while a section runs, in cores on average: numbers
    taken while another process is busy on the same cores are not worth reporting (with one torch
    thread per core, a thread that loses its core stalls every step)."""

    def __init__(self):
        self.start_times = _other_cpu_times()
        self.t0 = time.perf_counter()

    def cores(self) -> float:
        end = _other_cpu_times()
        seconds = time.perf_counter() - self.t0
        used = sum(t - self.start_times.get(pid, 0.0) for pid, t in end.items())
        return max(0.0, used / seconds) if seconds > 0 else 0.0


def _other_cpu_times() -> dict[tuple[int, float], float]:
    import psutil

    me = os.getpid()
    times = {}
    for proc in psutil.process_iter(["pid", "create_time", "cpu_times"]):
        info = proc.info
        if info["pid"] == me or info["cpu_times"] is None:
            continue
        t = info["cpu_times"]
        times[(info["pid"], info["create_time"])] = t.user + t.system + t.children_user + t.children_system
    return times


# -- report -------------------------------------------------------------------------------------


def machine_info() -> dict:
    import torch

    cpu_model = platform.processor() or None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    from tokenmill.config import cpu_has_native_bf16, num_physical_cores

    info = {
        "cpu_model": cpu_model,
        "logical_cpus": os.cpu_count(),
        "physical_cores": num_physical_cores(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        "torch_threads": torch.get_num_threads(),
        "torch_version": torch.__version__,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
    }
    try:
        import transformers

        info["transformers_version"] = transformers.__version__
    except ImportError:
        pass
    try:
        import tokenmill

        info["tokenmill_version"] = tokenmill.__version__
    except (ImportError, AttributeError):
        pass
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def print_table(results: list[dict]) -> None:
    header = ["engine", "requests", "prompt tok", "output tok", "seconds", "output tok/s", "total tok/s"]
    rows = [
        [
            r["engine"],
            str(r["requests"]),
            str(r["prompt_tokens"]),
            str(r["output_tokens"]),
            f"{r['seconds']:.2f}",
            f"{r['output_tok_per_s']:.1f}",
            f"{r['total_tok_per_s']:.1f}",
        ]
        for r in results
    ]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    print(fmt(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    from tokenmill import LLM, SamplingParams

    engine_kwargs = {
        "dtype": args.dtype,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "kv_cache_memory_gb": args.kv_cache_memory_gb,
        "num_threads": args.num_threads,
    }
    t = time.perf_counter()
    llm = LLM(args.model, **engine_kwargs)  # sets torch's thread count for the whole process
    tokenmill_load_s = time.perf_counter() - t
    tokenizer = llm.tokenizer
    model_path = llm.engine.model_path

    requests, text_tokens = make_workload(tokenizer, args.num_requests, args.input_len, args.output_len, args.seed)
    longest = max(len(p) + n for p, n in requests)
    if longest > llm.engine.max_model_len:
        raise SystemExit(f"a request of {longest} tokens exceeds max_model_len {llm.engine.max_model_len}")
    print(
        f"workload: {len(requests)} requests, prompt {args.input_len[0]}:{args.input_len[1]}, "
        f"output {args.output_len[0]}:{args.output_len[1]}, seed {args.seed}; dtype {args.dtype}, "
        f"{torch.get_num_threads()} torch threads; model {model_path.name}",
        flush=True,
    )

    # Warm-up: a couple of short requests through the whole path.
    warm_prompts = [p[:16] for p, _ in requests[:2]]
    llm.generate(warm_prompts, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))

    print("running tokenmill ...", flush=True)
    tm_result, tm_ids = run_tokenmill(llm, requests)
    tm_result["load_seconds"] = tokenmill_load_s
    eos_ids = set(getattr(llm.engine, "eos_token_ids", []) or [])
    results = [tm_result]

    hf_result = agreement = None
    if not args.skip_hf:
        del llm
        gc.collect()
        print("loading Hugging Face model ...", flush=True)
        t = time.perf_counter()
        model = load_hf(model_path, args.dtype)
        hf_load_s = time.perf_counter() - t
        hf_generate_batch(model, warm_prompts, 4, hf_pad_id(model, tokenizer))  # warm-up
        print(f"running HF generate (batch size {args.hf_batch_size}) ...", flush=True)
        hf_result, hf_ids = run_hf(model, tokenizer, requests, args.hf_batch_size, args.hf_sort_by_length)
        hf_result["load_seconds"] = hf_load_s
        results.append(hf_result)
        agreement = greedy_agreement(tm_ids, hf_ids, eos_ids)

    print()
    print_table(results)
    print()
    tm = tm_result
    print(
        f"tokenmill: mean TTFT {tm['mean_ttft_s'] * 1000:.0f} ms (max {tm['max_ttft_s'] * 1000:.0f} ms), "
        f"mean time per output token {tm['mean_tpot_s'] * 1000:.1f} ms"
        if tm["mean_tpot_s"] is not None
        else f"tokenmill: mean TTFT {tm['mean_ttft_s'] * 1000:.0f} ms",
        end="",
    )
    print(f", preemptions {tm['preemptions']}" if tm.get("preemptions") is not None else "")
    ratio = None
    if hf_result is not None:
        ratio = tm["output_tok_per_s"] / hf_result["output_tok_per_s"]
        print(
            f"HF: {hf_result['generated_tokens']} tokens generated for {hf_result['output_tokens']} requested "
            f"({hf_result['raw_generated_tok_per_s']:.1f} raw tok/s), batches of {args.hf_batch_size} in "
            f"{hf_result['batch_order']}, left-padded"
        )
        print(
            f"greedy agreement: {agreement['prefix_match_share']:.1%} of output tokens match HF up to the first "
            f"divergence; {agreement['identical_requests']}/{len(requests)} requests identical"
        )
        print(f"ratio tokenmill / HF, output tok/s: {ratio:.2f}x")
    busy = {r["engine"]: r["other_processes_cores"] for r in results if r["other_processes_cores"] > 0.1}
    if busy:
        print(
            "WARNING: other processes were busy during the timed runs ("
            + ", ".join(f"{e}: {c:.2f} cores on average" for e, c in busy.items())
            + "); these numbers are not representative, rerun on an idle machine"
        )

    report = {
        "benchmark": "offline_throughput",
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "config": {
            "model": args.model,
            "model_file": str(model_path),
            "num_requests": args.num_requests,
            "input_len": list(args.input_len),
            "output_len": list(args.output_len),
            "dtype": args.dtype,
            "seed": args.seed,
            "hf_batch_size": args.hf_batch_size,
            "hf_batch_order": "sorted by prompt length" if args.hf_sort_by_length else "request order",
            "skip_hf": args.skip_hf,
            "tokenmill": engine_kwargs,
            "text_file": str(TEXT_FILE),
            "text_tokens": text_tokens,
            "greedy": True,
            "ignore_eos": True,
        },
        "machine": machine_info(),
        "results": results,
        "ratio_output_tok_per_s_tokenmill_over_hf": ratio,
        "greedy_agreement": agreement,
        "workload": {
            "prompt_lens": [len(p) for p, _ in requests],
            "output_lens": [n for _, n in requests],
        },
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
