#!/usr/bin/env python
"""Batch-1 decode speed: tokenmill (bf16 / int8 / int4 weights) vs Hugging Face `generate` (and
llama.cpp's `llama-bench` with `--llama-bench PATH`), against the memory-bandwidth ceiling.

tokenmill, per config of `--configs` (bf16 -> `LLM(model, dtype="bfloat16", quantization="none")`,
int8 / int4 -> `LLM(model, quantization=...)`, auto -> a GGUF file's own codes), loaded one at a time (each deleted before the next): a warm-up
request, then `--repeats` single requests of a `--prompt-len`-token prompt (token ids cut from
GPL-3, a different slice each time, so none hits the prefix cache), `--output-len` tokens, greedy,
EOS ignored. Decode tok/s = (n_out - 1) / (last_token_time - first_token_time) from the request
metrics; TTFT = first token - arrival; wall tok/s = n_out / the generate call's wall time; the
median over the repeats of each.

Hugging Face: the same GGUF in `--hf-dtype` (bf16), `generate(max_new_tokens=N,
min_new_tokens=N, do_sample=False)` at batch 1 on the same prompts, each token's time taken by a
stopping criterion (called once per generated token), so decode tok/s is measured the same way.

llama.cpp: `llama-bench -m GGUF -t THREADS -p 0 -n OUTPUT_LEN -r REPEATS -o json`, its avg_ts.

Ceiling: a decode step at batch 1 reads every weight once, so tok/s <= memory read bandwidth /
bytes read per token. Bandwidth is measured here (`t.sum()` over a 512 MiB fp32 tensor, best of
several, same threads); bytes per token = the model's tensors (parameters, buffers and the packed
int8/int4 weights the linears keep as plain attributes), less the tensors only indexed per token
(an embedding table not shared with the LM head, rotary cos/sin caches); for llama.cpp the GGUF
file's tensors less its token embedding where the file has its own output.weight (llama-bench's
model_size counts the whole file). KV cache reads are not counted (small at batch 1 with short
contexts).

    python benchmarks/decode_latency.py --llama-bench /tmp/lcpp/build/bin/llama-bench
    python benchmarks/decode_latency.py --configs int8 --output-len 8 --repeats 1   # smoke test
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
import time
from pathlib import Path

from common import (
    CONFIG_NAMES, PY_LAYERS_SUFFIX, RESULTS_DIR, TEXT_FILE, TORCH_OPS_SUFFIX, OtherLoad, busy_warning, config_base,
    config_kwargs, config_label, cut_prompts, device_name, fmt, hf_generate_batch, hf_pad_id, load_hf, parse_configs, print_ratios,
    print_table, python_layers, run_llama_bench, tensor_bytes, text_token_ids, write_report,
)

DEFAULT_OUTPUT = RESULTS_DIR / "decode_latency.json"
BANDWIDTH_BYTES = 512 * 2**20


def gguf_bytes_per_token(path: Path) -> int:
    """The bytes of a GGUF file's tensors that llama.cpp reads in full for a batch-1 token: all of
    them but the token embedding when the file has its own output.weight (then a token reads one
    row of the embedding; llama-bench's model_size counts the whole table)."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_bytes) for t in GGUFReader(path).tensors}
    untied = "output.weight" in tensors
    return sum(n for name, n in tensors.items() if not (untied and name == "token_embd.weight"))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    from tokenmill.config import LM_HEAD_CHOICES, EngineConfig

    d = EngineConfig()
    p = argparse.ArgumentParser(
        description="Batch-1 decode speed of tokenmill configs vs Hugging Face generate (and llama.cpp's llama-bench), "
        "with the memory-bandwidth ceiling of each.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--model", default=d.model, help="model alias or path (.gguf file or HF directory)")
    p.add_argument("--configs", default="bf16,int8,int4",
                   help=f"tokenmill configs, comma-separated, from {','.join(CONFIG_NAMES)}: bf16 = dtype --dtype, "
                        "int8/int4 = weight-only quantized linears, auto = the checkpoint's weights as stored (a GGUF "
                        "file's Q4 codes as int4; the engine's default compute dtype); a name ending "
                        f"in {TORCH_OPS_SUFFIX} (e.g. int4{TORCH_OPS_SUFFIX}) runs without tokenmill's compiled CPU kernels, "
                        f"one in {PY_LAYERS_SUFFIX} with them but its decode steps through the Python decoder layers "
                        "instead of the compiled DecoderStack")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="compute dtype of the bf16 config line (float32 to measure fp32 instead)")
    p.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (cut from the GPL-3 text)")
    p.add_argument("--output-len", type=int, default=256, help="output tokens per request (exact: EOS is ignored)")
    p.add_argument("--repeats", type=int, default=3,
                   help="measured requests per engine (median reported); also llama-bench's -r")
    p.add_argument("--quantization-lm-head", choices=LM_HEAD_CHOICES, default=d.quantization_lm_head,
                   help="the LM head's format in the int8/int4/auto configs (the engine's --quantization-lm-head)")
    p.add_argument("--num-threads", type=int, default=None,
                   help="torch threads (and llama-bench -t); None = tokenmill's default, the physical core count")
    p.add_argument("--skip-hf", action="store_true", help="leave out the Hugging Face transformers reference")
    p.add_argument("--hf-dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype the Hugging Face model is loaded in")
    p.add_argument("--llama-bench", metavar="PATH", default=None,
                   help="path of llama.cpp's llama-bench binary (e.g. /tmp/lcpp/build/bin/llama-bench) to measure "
                        "llama.cpp on the same GGUF file; left out if not given")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    try:
        args.configs = parse_configs(args.configs)
    except ValueError as e:
        p.error(str(e))
    for name in ("prompt_len", "output_len", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


# -- the ceiling ----------------------------------------------------------------------------------


def measure_bandwidth(repeats: int = 7) -> dict:
    """Memory read bandwidth: `t.sum()` over a 512 MiB fp32 tensor (with glibc keeping large
    allocations in the heap, as the engine does), best and median of `repeats` after a warm-up."""
    import torch

    from tokenmill.worker.cpu import keep_large_allocations_in_heap

    keep_large_allocations_in_heap()
    t = torch.ones(BANDWIDTH_BYTES // 4, dtype=torch.float32)
    t.sum()
    t.sum()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    del t
    gc.collect()
    return {
        "bytes": BANDWIDTH_BYTES,
        "threads": torch.get_num_threads(),
        "best_seconds": min(times),
        "median_seconds": statistics.median(times),
        "best_bytes_per_s": BANDWIDTH_BYTES / min(times),
        "median_bytes_per_s": BANDWIDTH_BYTES / statistics.median(times),
    }


# -- tokenmill ----------------------------------------------------------------------------------


def run_tokenmill(llm, prompts: list[list[int]], output_len: int) -> dict:
    """prompts[0] warms up; each of the others is one measured request."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=output_len, ignore_eos=True)
    llm.generate([prompts[0]], SamplingParams(temperature=0.0, max_tokens=min(output_len, 32), ignore_eos=True))
    runs = []
    other = OtherLoad()
    for prompt in prompts[1:]:
        t0 = time.perf_counter()
        out = llm.generate([prompt], params)[0]
        wall = time.perf_counter() - t0
        m = out.metrics
        n = len(out.outputs[0].token_ids)
        if n != output_len:
            raise RuntimeError(f"tokenmill produced {n} tokens, expected {output_len}")
        runs.append({
            "output_tokens": n,
            "ttft_s": m.first_token_time - m.arrival_time,
            "decode_tok_per_s": (n - 1) / (m.last_token_time - m.first_token_time) if n > 1 else None,
            "wall_s": wall,
            "wall_tok_per_s": n / wall,
        })
    return summarize_runs(runs, other.cores())


def summarize_runs(runs: list[dict], other_cores: float) -> dict:
    def med(key):
        values = [r[key] for r in runs if r[key] is not None]
        return statistics.median(values) if values else None

    return {
        "ttft_s": med("ttft_s"),
        "decode_tok_per_s": med("decode_tok_per_s"),
        "wall_tok_per_s": med("wall_tok_per_s"),
        "runs": runs,
        "other_processes_cores": other_cores,
    }


# -- Hugging Face -------------------------------------------------------------------------------


def run_hf(model, tokenizer, prompts: list[list[int]], output_len: int) -> dict:
    """Same protocol as run_tokenmill, through `generate` at batch 1; a stopping criterion that never
    stops takes each generated token's time."""
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    class TokenTimes(StoppingCriteria):
        def __init__(self):
            self.times: list[float] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    pad_id = hf_pad_id(model, tokenizer)
    hf_generate_batch(model, [prompts[0]], min(output_len, 32), pad_id)  # warm-up
    runs = []
    other = OtherLoad()
    for prompt in prompts[1:]:
        timer = TokenTimes()
        t0 = time.perf_counter()
        new = hf_generate_batch(model, [prompt], output_len, pad_id, stopping_criteria=StoppingCriteriaList([timer]))[0]
        wall = time.perf_counter() - t0
        n = len(new)
        if n != output_len or len(timer.times) < n:
            raise RuntimeError(f"HF produced {n} tokens ({len(timer.times)} timed), expected {output_len}")
        first, last = timer.times[0], timer.times[n - 1]
        runs.append({
            "output_tokens": n,
            "ttft_s": first - t0,
            "decode_tok_per_s": (n - 1) / (last - first) if n > 1 else None,
            "wall_s": wall,
            "wall_tok_per_s": n / wall,
        })
    return summarize_runs(runs, other.cores())


# -- report -------------------------------------------------------------------------------------


def print_results(results: list[dict], bandwidth: float) -> None:
    header = ["engine", "weights", "MiB read/token", "TTFT ms", "decode tok/s", "wall tok/s", "ceiling tok/s",
              "of ceiling"]
    rows = []
    for r in results:
        read = r.get("read_per_token_bytes")
        ceiling = bandwidth / read if read else None
        r["ceiling_tok_per_s"] = ceiling
        r["fraction_of_ceiling"] = r["decode_tok_per_s"] / ceiling if ceiling and r["decode_tok_per_s"] else None
        rows.append([
            r["engine"],
            r["weights"],
            fmt(read / 2**20 if read else None),
            fmt(r["ttft_s"] * 1000 if r.get("ttft_s") is not None else None),
            fmt(r["decode_tok_per_s"]),
            fmt(r.get("wall_tok_per_s")),
            fmt(ceiling),
            f"{r['fraction_of_ceiling']:.0%}" if r["fraction_of_ceiling"] else "-",
        ])
    print_table(header, rows, left=2)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")

    import torch

    from tokenmill import LLM
    from tokenmill.config import EngineConfig
    from tokenmill.models.registry import resolve_model

    threads = EngineConfig(num_threads=args.num_threads).resolved_num_threads()
    torch.set_num_threads(threads)
    model_path = resolve_model(args.model)
    bw = measure_bandwidth()
    bandwidth = bw["best_bytes_per_s"]
    print(
        f"memory read bandwidth: {bandwidth / 1e9:.1f} GB/s best, {bw['median_bytes_per_s'] / 1e9:.1f} GB/s median "
        f"(t.sum() over 512 MiB fp32, {threads} threads); model {model_path.name}; prompt {args.prompt_len} tokens, "
        f"{args.output_len} output tokens, batch 1, {args.repeats} repeats; {device_name('cpu')}",
        flush=True,
    )

    results = []
    tokenizer = prompts = None
    for name in args.configs:
        kwargs = {**config_kwargs(name, args.dtype), "num_threads": args.num_threads}
        if kwargs["quantization"] in ("int8", "int4", "auto") and args.quantization_lm_head != "auto":
            kwargs["quantization_lm_head"] = args.quantization_lm_head
        print(f"tokenmill {name}: loading ({kwargs}) ...", flush=True)
        t = time.perf_counter()
        llm = LLM(args.model, **kwargs)
        load_s = time.perf_counter() - t
        python_layers(llm, name)
        if prompts is None:
            tokenizer = llm.tokenizer
            prompts = cut_prompts(text_token_ids(tokenizer), args.repeats + 1, args.prompt_len)
        dtype = str(llm.engine.core.dtype)
        base = config_base(name)
        weights = dtype if base == "bf16" else f"{base} ({dtype} compute)"
        if "quantization_lm_head" in kwargs:
            weights += f", {kwargs['quantization_lm_head']} LM head"
        r = run_tokenmill(llm, prompts, args.output_len)
        label = config_label(name, args.dtype)
        results.append({"engine": f"tokenmill {label}", "config": label, "llm_kwargs": kwargs, "weights": weights,
                        "load_seconds": load_s, **tensor_bytes(llm.engine.core.runner.model), **r})
        del llm
        gc.collect()

    if not args.skip_hf:
        if tokenizer is None:
            from tokenmill.models.loader import load_checkpoint

            tokenizer = load_checkpoint(model_path).tokenizer
            prompts = cut_prompts(text_token_ids(tokenizer), args.repeats + 1, args.prompt_len)
        print(f"hf-transformers: loading ({args.hf_dtype}) ...", flush=True)
        t = time.perf_counter()
        model = load_hf(model_path, args.hf_dtype)
        load_s = time.perf_counter() - t
        r = run_hf(model, tokenizer, prompts, args.output_len)
        results.append({"engine": "hf-transformers", "weights": args.hf_dtype, "load_seconds": load_s,
                        "attn_implementation": getattr(model.config, "_attn_implementation", None),
                        **tensor_bytes(model), **r})
        del model
        gc.collect()

    if args.llama_bench:
        if model_path.suffix != ".gguf":
            raise SystemExit(f"--llama-bench needs a .gguf model, got {model_path}")
        print("llama.cpp: llama-bench ...", flush=True)
        rec = run_llama_bench(args.llama_bench, model_path, threads, 0, args.output_len, args.repeats)
        results.append({"engine": "llama.cpp (llama-bench)", "weights": rec.get("model_type", "gguf"),
                        "read_per_token_bytes": gguf_bytes_per_token(model_path), "model_size": rec.get("model_size"),
                        "ttft_s": None,
                        "decode_tok_per_s": rec["avg_ts"], "wall_tok_per_s": None,
                        "decode_tok_per_s_stddev": rec.get("stddev_ts"),
                        "other_processes_cores": rec["other_processes_cores"], "llama_bench": rec})

    print()
    print_results(results, bandwidth)
    print()
    print("decode tok/s = (n - 1) / (last token - first token); ceiling = bandwidth / bytes read per token "
          "(weights only)" + ("; llama-bench decodes from an empty context, the others after the prompt"
                              if args.llama_bench else ""))
    print_ratios(results, ("hf-transformers", "llama.cpp (llama-bench)"), "decode_tok_per_s", "decode tok/s")
    warning = busy_warning({r["engine"]: r["other_processes_cores"] for r in results})
    if warning:
        print(warning)

    write_report(
        args.output,
        "decode_latency",
        config={
            "model": args.model,
            "model_file": str(model_path),
            "configs": args.configs,
            "dtype_bf16_line": args.dtype,
            "hf_dtype": None if args.skip_hf else args.hf_dtype,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "repeats": args.repeats,
            "threads": threads,
            "llama_bench": args.llama_bench,
            "text_file": str(TEXT_FILE),
            "batch_size": 1,
            "greedy": True,
            "ignore_eos": True,
        },
        results=results,
        bandwidth=bw,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
