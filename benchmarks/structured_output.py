#!/usr/bin/env python
"""Structured output (constrained decoding): what a grammar's token mask costs on the CPU, per
backend, and what it costs the engine's inter-token latency.

Part 1, mask cost (`--backends xgrammar,llguidance`; the engine's is llguidance, xgrammar is
measured when installed): with the model's tokenizer (the default model: vocab 49152), for each
JSON schema of SCHEMAS (and any JSON object):
  setup     building the backend's tokenizer index, once per engine;
  compile   compiling the schema (each backend's own cache cleared first);
  mask      filling one row of the allowed-token bitmask, per token, and
  advance   accepting the sampled token, per token, over two kinds of token sequence:
            doc    the tokens of a valid document of the schema (what a model usually writes);
            walk   seeded random walks, each token drawn uniformly among the allowed ones
                   (odd states: long strings, rare keys, numbers), up to `--walk-len` tokens;
  batch     one bitmask of `--batch` rows (one matcher per row, each at its own place in the
            document) filled by the backend's batch call, per step;
  apply     setting the disallowed logits of [rows, vocab] fp32 logits to -inf from the bitmask
            (1, 8 and `--batch` rows), the engine's torch ops and xgrammar's C++ kernel.

Part 2, inter-token latency (`--streams 1,64`; `--skip-itl` leaves it out): `LLM.generate`
(offline, the engine's default config), greedy, `--output-len` tokens per request: the same
prompts without a constraint (eos ignored) and with ITL_SCHEMA (which needs more tokens than
that, so both rounds write the same count), each round after a warm-up. ITL = (last token -
first token) / (output tokens - 1) per request, mean and p50 over requests; output tok/s; and
the time the runner spends filling the step's bitmask (timed around `_allowed_tokens`).

    python benchmarks/structured_output.py
    python benchmarks/structured_output.py --skip-itl --walks 2      # mask cost only, quick
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

from common import RESULTS_DIR, OtherLoad, busy_warning, fmt, print_table, write_report

DEFAULT_OUTPUT = RESULTS_DIR / "structured_output.json"
BACKENDS = ("xgrammar", "llguidance")

# (name, schema, a valid document). In the first three strings and arrays are bounded, as a
# client that wants the output to end would bound them; the tool call's are not.
SCHEMAS: list[tuple[str, dict | None, str]] = [
    ("person", {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 24},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "email": {"type": "string", "maxLength": 40},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 4},
        },
        "required": ["name", "age", "tags"],
    }, '{"name": "Ada Lovelace", "age": 36, "email": "ada@example.org", "tags": ["math", "poetry"]}'),
    ("order", {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["pending", "shipped", "delivered", "cancelled"]},
            "items": {"type": "array", "maxItems": 5, "items": {
                "type": "object",
                "properties": {"sku": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
                               "quantity": {"type": "integer", "minimum": 1},
                               "price": {"type": "number"}},
                "required": ["sku", "quantity", "price"]}},
            "gift": {"type": "boolean"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string", "maxLength": 40}, "city": {"type": "string", "maxLength": 24},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}, "required": ["city", "zip"]},
        },
        "required": ["id", "status", "items", "address"],
    }, '{"id": 1042, "status": "shipped", "items": [{"sku": "ABC-1234", "quantity": 2, "price": 9.99}, '
       '{"sku": "XYZ-0001", "quantity": 1, "price": 120.5}], "gift": false, '
       '"address": {"street": "1 Main St", "city": "Springfield", "zip": "12345"}}'),
    ("union", {
        "type": "object",
        "properties": {
            "event": {"anyOf": [
                {"type": "object", "properties": {"kind": {"const": "click"}, "x": {"type": "integer"},
                                                  "y": {"type": "integer"}}, "required": ["kind", "x", "y"]},
                {"type": "object", "properties": {"kind": {"const": "key"}, "key": {"type": "string", "maxLength": 8}},
                 "required": ["kind", "key"]}]},
            "timestamp": {"type": "number"},
            "labels": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["event", "timestamp"],
    }, '{"event": {"kind": "key", "key": "Enter"}, "timestamp": 1717171717.25, "labels": ["a", "c"]}'),
    ("tool_call", {  # an OpenAI-style function's arguments: nothing bounded
        "type": "object",
        "properties": {
            "location": {"type": "string", "description": "City and country"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
            "include_hourly": {"type": "boolean"},
        },
        "required": ["location", "unit"],
    }, '{"location": "San Francisco, USA", "unit": "celsius", "days": 3, "include_hourly": false}'),
    ("json_object", None, '{"answer": 42, "reasons": ["it is the answer", null, true], "nested": {"pi": 3.14}}'),
]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="smollm2-135m", help="model alias or path (its tokenizer; part 2 runs it)")
    p.add_argument("--backends", default=",".join(BACKENDS), help="grammar backends to measure, comma-separated")
    p.add_argument("--walks", type=int, default=8, help="random walks per schema and backend")
    p.add_argument("--walk-len", type=int, default=128, help="most tokens per random walk")
    p.add_argument("--batch", type=int, default=64, help="rows of the batched mask fill and the apply")
    p.add_argument("--repeats", type=int, default=5, help="repeats of each timed document pass (the median is kept)")
    p.add_argument("--streams", default="1,64", help="part 2: concurrent requests, comma-separated")
    p.add_argument("--output-len", type=int, default=96, help="part 2: most output tokens per request")
    p.add_argument("--skip-itl", action="store_true", help="leave out part 2 (the engine's inter-token latency)")
    p.add_argument("--output", type=Path, default=DEFAULT_OUTPUT, metavar="PATH.json",
                   help="where to write the JSON results (its directory is created)")
    args = p.parse_args(argv)
    args.backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in args.backends if b not in BACKENDS]
    if bad or not args.backends:
        p.error(f"--backends: expected a comma-separated subset of {','.join(BACKENDS)}, got {bad}")
    args.streams = [int(s) for s in args.streams.split(",") if s.strip()]
    return args


# -- the two backends behind one small interface -------------------------------------------------


class _Xgrammar:
    """xgrammar with the settings tokenmill would use: compact JSON, strict objects."""

    name = "xgrammar"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        import xgrammar as xgr

        self.xgr = xgr
        t0 = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=eos_ids)
        self.compiler = xgr.GrammarCompiler(self.info, cache_enabled=False)
        self.setup_s = time.perf_counter() - t0
        import torch

        self.batcher = xgr.BatchGrammarMatcher(max_threads=torch.get_num_threads())  # as many as tokenmill's

    def compile(self, schema: dict | None):
        if schema is None:
            return self.compiler.compile_builtin_json_grammar()
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept_token(token_id)

    def batch_fill(self, matchers, bitmask) -> None:
        self.batcher.batch_fill_next_token_bitmask(matchers, bitmask)


class _Llguidance:
    """What the engine runs: tokenmill.structured's compiler, matcher and batch filler."""

    name = "llguidance"

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int]):
        import torch

        from tokenmill.sampling_params import StructuredOutputParams
        from tokenmill.structured.grammar import GrammarCompiler
        from tokenmill.structured.matcher import GrammarMatcher, MaskFiller

        self.params, self.matcher_cls = StructuredOutputParams, GrammarMatcher
        t0 = time.perf_counter()
        self.compiler = GrammarCompiler(tokenizer, vocab_size, eos_ids, cache_size=0)  # every compile timed
        self.compiler._llg_tokenizer()
        self.setup_s = time.perf_counter() - t0
        self.filler = MaskFiller(torch.get_num_threads())

    def compile(self, schema: dict | None):
        return self.compiler.compile(self.params(json=schema) if schema is not None else self.params(json_object=True))

    def matcher(self, compiled):
        return self.matcher_cls(compiled)

    def fill(self, matcher, bitmask, row: int) -> None:
        matcher.fill(bitmask, row)

    def accept(self, matcher, token_id: int) -> bool:
        return matcher.accept([token_id]) == 1

    def batch_fill(self, matchers, bitmask) -> None:
        self.filler.fill([(m, i) for i, m in enumerate(matchers)], bitmask)


def make_backend(name: str, tokenizer, vocab_size: int, eos_ids: list[int]):
    return {"xgrammar": _Xgrammar, "llguidance": _Llguidance}[name](tokenizer, vocab_size, eos_ids)


def installed(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None


# -- part 1 --------------------------------------------------------------------------------------


def allowed_ids(bitmask_row, vocab_size: int) -> list[int]:
    import numpy as np

    bits = np.unpackbits(bitmask_row.numpy().view(np.uint8), bitorder="little")[:vocab_size]
    return np.flatnonzero(bits).tolist()


def time_sequence(backend, compiled, token_ids: list[int], bitmask) -> tuple[float, float]:
    """(fill s, accept s) summed over the tokens of one sequence and the mask after its last."""
    m = backend.matcher(compiled)
    fill = accept = 0.0
    for token_id in token_ids:
        t0 = time.perf_counter()
        backend.fill(m, bitmask, 0)
        t1 = time.perf_counter()
        ok = backend.accept(m, token_id)
        t2 = time.perf_counter()
        if not ok:
            raise RuntimeError(f"{backend.name} rejected token {token_id} of a valid sequence")
        fill += t1 - t0
        accept += t2 - t1
    return fill, accept


def random_walk(backend, compiled, bitmask, vocab_size: int, eos_ids: list[int], rng: random.Random,
                max_len: int) -> list[int]:
    """Tokens drawn uniformly among the allowed ones (eos only where nothing else is allowed)."""
    m = backend.matcher(compiled)
    tokens: list[int] = []
    while len(tokens) < max_len:
        backend.fill(m, bitmask, 0)
        allowed = [t for t in allowed_ids(bitmask[0], vocab_size) if t not in eos_ids]
        if not allowed:
            break
        token_id = rng.choice(allowed)
        if not backend.accept(m, token_id):
            raise RuntimeError(f"{backend.name} rejected token {token_id} its own mask allowed")
        tokens.append(token_id)
    return tokens


def measure_masks(args, tokenizer, vocab_size: int, eos_ids: list[int]) -> list[dict]:
    import torch

    from tokenmill.worker.cpu import keep_large_allocations_in_heap

    keep_large_allocations_in_heap()  # as the engine does: no page faults on fresh buffers
    results = []
    missing = [name for name in args.backends if not installed(name)]
    if missing:  # xgrammar is not a tokenmill dependency: `pip install xgrammar` to compare
        print(f"  not installed, left out: {', '.join(missing)}", flush=True)
    backends = [make_backend(name, tokenizer, vocab_size, eos_ids) for name in args.backends if name not in missing]
    bitmask = torch.full((args.batch, -(-vocab_size // 32)), -1, dtype=torch.int32)
    for backend in backends:
        # Warm-up (thread pools, lazily built tables): a schema of its own, one document through it.
        warm = {"type": "object", "properties": {"w": {"type": "integer"}}, "required": ["w"]}
        time_sequence(backend, backend.compile(warm), tokenizer.encode('{"w": 1}', add_special_tokens=False), bitmask)
    # Schema by schema, the backends one after the other: a busy moment of the machine hits both.
    for schema_name, schema, doc in SCHEMAS:
        for backend in backends:
            name = backend.name
            gc.collect()
            t0 = time.perf_counter()
            compiled = backend.compile(schema)
            compile_s = time.perf_counter() - t0
            doc_ids = tokenizer.encode(doc, add_special_tokens=False)
            doc_runs = [time_sequence(backend, compiled, doc_ids, bitmask) for _ in range(args.repeats)]
            doc_fill = statistics.median(f for f, _ in doc_runs) / len(doc_ids)
            doc_accept = statistics.median(a for _, a in doc_runs) / len(doc_ids)
            rng = random.Random(0)
            walks = [random_walk(backend, compiled, bitmask, vocab_size, eos_ids, rng, args.walk_len)
                     for _ in range(args.walks)]
            walk_tokens = sum(len(w) for w in walks)
            walk_fill = walk_accept = 0.0
            for w in walks:
                f, a = time_sequence(backend, compiled, w, bitmask)
                walk_fill += f
                walk_accept += a
            # A batch step: `batch` matchers spread over the document's positions.
            matchers = []
            for i in range(args.batch):
                m = backend.matcher(compiled)
                for token_id in doc_ids[: (i * len(doc_ids)) // args.batch]:
                    backend.accept(m, token_id)
                matchers.append(m)
            batch_runs = []
            for _ in range(args.repeats):
                t0 = time.perf_counter()
                backend.batch_fill(matchers, bitmask)
                batch_runs.append(time.perf_counter() - t0)
            results.append({
                "backend": name, "schema": schema_name, "setup_s": backend.setup_s, "compile_s": compile_s,
                "doc_tokens": len(doc_ids), "doc_mask_us": doc_fill * 1e6, "doc_advance_us": doc_accept * 1e6,
                "walk_tokens": walk_tokens, "walk_mask_us": walk_fill / max(1, walk_tokens) * 1e6,
                "walk_advance_us": walk_accept / max(1, walk_tokens) * 1e6,
                "batch_rows": args.batch, "batch_fill_ms": statistics.median(batch_runs) * 1e3,
            })
            r = results[-1]
            print(f"  {name:10s} {schema_name:12s} compile {r['compile_s'] * 1e3:7.1f} ms  doc mask "
                  f"{r['doc_mask_us']:6.1f} us  walk mask {r['walk_mask_us']:6.1f} us  batch "
                  f"{r['batch_fill_ms']:.2f} ms", flush=True)
    return results


def measure_apply(batch: int, vocab_size: int, repeats: int = 20) -> list[dict]:
    """Cost of applying a [rows, words] bitmask to [rows, vocab] fp32 logits: the engine's torch
    ops, and xgrammar's C++ CPU kernel when xgrammar is installed (for comparison)."""
    import torch

    from tokenmill.structured.bitmask import apply_bitmask_

    methods = {"tokenmill (byte table, torch ops)": apply_bitmask_}
    try:
        from xgrammar.kernels.apply_token_bitmask_inplace_cpu import apply_token_bitmask_inplace_cpu

        methods["xgrammar CPU kernel"] = apply_token_bitmask_inplace_cpu
    except ImportError:
        pass
    gen = torch.Generator().manual_seed(0)
    out = []
    for rows in sorted({1, 8, batch}):
        bitmask = torch.randint(-2**31, 2**31 - 1, (rows, -(-vocab_size // 32)), dtype=torch.int32, generator=gen)
        logits = torch.randn(rows, vocab_size, generator=gen)
        runs = {name: [] for name in methods}
        for _ in range(repeats):  # interleaved, so that a busy moment hits both
            for name, fn in methods.items():
                x = logits.clone()
                t0 = time.perf_counter()
                fn(x, bitmask)
                runs[name].append(time.perf_counter() - t0)
        out.extend({"method": name, "rows": rows, "ms": statistics.median(r) * 1e3} for name, r in runs.items())
    return out


# -- part 2 --------------------------------------------------------------------------------------

# Keeps every request writing past --output-len (at least 16 records of ~15 tokens), so that
# both rounds run the same number of tokens; mostly structure, where masks cost the most.
ITL_SCHEMA = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 24},
        "records": {"type": "array", "minItems": 16, "maxItems": 64, "items": {
            "type": "object",
            "properties": {"name": {"type": "string", "maxLength": 12}, "quantity": {"type": "integer", "minimum": 1,
                                                                                   "maximum": 99},
                           "in_stock": {"type": "boolean"}},
            "required": ["name", "quantity", "in_stock"]}},
    },
    "required": ["city", "records"],
}


def measure_itl(args) -> list[dict]:
    from tokenmill import LLM, SamplingParams
    from tokenmill.sampling_params import StructuredOutputParams

    llm = LLM(args.model)
    runner = llm.engine.core.runner
    mask_times: list[float] = []
    allowed_tokens = runner._allowed_tokens  # timed: filling the step's bitmask (not applying it)

    def timed_allowed_tokens(states):
        t0 = time.perf_counter()
        result = allowed_tokens(states)
        if result is not None:
            mask_times.append(time.perf_counter() - t0)
        return result

    runner._allowed_tokens = timed_allowed_tokens
    results = []
    prompt = "Write the inventory of a shop in a city as JSON: the city, then records of name, quantity, in_stock."
    try:
        for n in args.streams:
            prompts = [f"{prompt} Shop number {i}." for i in range(n)]
            for mode in ("plain", "json_schema"):
                structured = StructuredOutputParams(json=ITL_SCHEMA) if mode == "json_schema" else None
                # Plain requests ignore eos so that both rounds write exactly --output-len tokens.
                params = SamplingParams(temperature=0.0, max_tokens=args.output_len, structured_output=structured,
                                        ignore_eos=structured is None)
                llm.generate(prompts[: min(n, 4)], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=structured is None,
                                                                structured_output=structured))  # warm-up
                mask_times.clear()
                other = OtherLoad()
                t0 = time.perf_counter()
                outs = llm.generate(prompts, params)
                seconds = time.perf_counter() - t0
                itls = []
                tokens = 0
                for o in outs:
                    m, c = o.metrics, o.outputs[0]
                    tokens += len(c.token_ids)
                    if len(c.token_ids) > 1:
                        itls.append((m.last_token_time - m.first_token_time) / (len(c.token_ids) - 1))
                results.append({
                    "streams": n, "mode": mode, "requests": n, "output_tokens": tokens, "seconds": seconds,
                    "output_tok_per_s": tokens / seconds, "itl_mean_ms": statistics.fmean(itls) * 1e3,
                    "itl_p50_ms": statistics.median(itls) * 1e3,
                    "mask_fill_ms_per_step": statistics.fmean(mask_times) * 1e3 if mask_times else None,
                    "finish_reasons": sorted({o.outputs[0].finish_reason for o in outs}),
                    "other_processes_cores": other.cores(),
                })
                r = results[-1]
                print(f"  {n:3d} streams {mode:12s} ITL mean {r['itl_mean_ms']:.2f} ms p50 {r['itl_p50_ms']:.2f} ms, "
                      f"{r['output_tok_per_s']:.1f} tok/s, {tokens} tokens, mask fill "
                      f"{fmt(r['mask_fill_ms_per_step'], '.2f')} ms/step", flush=True)
    finally:
        del runner._allowed_tokens
    return results


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    from tokenmill.models.loader import load_checkpoint
    from tokenmill.models.registry import resolve_model

    checkpoint = load_checkpoint(resolve_model(args.model))
    tokenizer, vocab_size = checkpoint.tokenizer, checkpoint.config.vocab_size
    eos_ids = list(checkpoint.config.eos_token_ids)
    print(f"mask cost, {args.model} tokenizer (vocab {vocab_size})", flush=True)
    other = OtherLoad()
    masks = measure_masks(args, tokenizer, vocab_size, eos_ids)
    apply = measure_apply(args.batch, vocab_size)
    mask_cores = other.cores()
    itl = []
    itl_cores = None
    if not args.skip_itl:
        print("inter-token latency, LLM.generate", flush=True)
        other = OtherLoad()
        itl = measure_itl(args)
        itl_cores = other.cores()

    print()
    print_table(
        ["backend", "schema", "setup ms", "compile ms", "doc mask us/tok", "doc advance us/tok",
         "walk mask us/tok", "walk advance us/tok", f"batch {args.batch} fill ms"],
        [[r["backend"], r["schema"], fmt(r["setup_s"] * 1e3, ".0f"), fmt(r["compile_s"] * 1e3), fmt(r["doc_mask_us"]),
          fmt(r["doc_advance_us"]), fmt(r["walk_mask_us"]), fmt(r["walk_advance_us"]), fmt(r["batch_fill_ms"], ".2f")]
         for r in masks],
        left=2,
    )
    for name in sorted({r["backend"] for r in masks}, key=args.backends.index):
        rows = [r for r in masks if r["backend"] == name]
        print(f"{name}: mean over schemas, mask + advance per token: documents "
              f"{statistics.fmean(r['doc_mask_us'] + r['doc_advance_us'] for r in rows):.1f} us, random walks "
              f"{statistics.fmean(r['walk_mask_us'] + r['walk_advance_us'] for r in rows):.1f} us; compile "
              f"{statistics.fmean(r['compile_s'] for r in rows) * 1e3:.1f} ms; {args.batch}-row batch fill "
              f"{statistics.fmean(r['batch_fill_ms'] for r in rows):.2f} ms")
    print()
    print_table(["apply bitmask", "rows", "ms"], [[a["method"], str(a["rows"]), fmt(a["ms"], ".3f")] for a in apply])
    if itl:
        print()
        print_table(["streams", "mode", "ITL mean ms", "ITL p50 ms", "output tok/s", "tokens", "mask fill ms/step",
                     "finish"],
                    [[str(r["streams"]), r["mode"], fmt(r["itl_mean_ms"], ".2f"), fmt(r["itl_p50_ms"], ".2f"),
                      fmt(r["output_tok_per_s"]), str(r["output_tokens"]), fmt(r["mask_fill_ms_per_step"], ".2f"),
                      ",".join(r["finish_reasons"])]
                     for r in itl], left=2)
        for n in args.streams:
            plain = next(r for r in itl if r["streams"] == n and r["mode"] == "plain")
            js = next(r for r in itl if r["streams"] == n and r["mode"] == "json_schema")
            print(f"{n} streams: json_schema ITL {js['itl_mean_ms'] / plain['itl_mean_ms']:.3f}x plain")
    warning = busy_warning({"mask cost": mask_cores, "ITL": itl_cores})
    if warning:
        print(warning, file=sys.stderr)
    write_report(args.output, "structured_output", {k: v for k, v in vars(args).items() if k != "output"},
                 {"masks": masks, "apply": apply, "itl": itl})


if __name__ == "__main__":
    main()
