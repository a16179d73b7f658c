"""The `tokenmill` command line."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time

from tokenmill.engine_args import add_engine_args, engine_config_from_args
from tokenmill.entrypoints.openai.args import add_server_args, server_config_from_args
from tokenmill.quantization.cli import add_quantize_parser
from tokenmill.sparsity.cli import add_calibrate_sparsity_parser

__all__ = ["add_engine_args", "build_parser", "engine_config_from_args", "main"]


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--max-tokens", type=int, default=128, help="most new tokens per request (default: 128)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature, 0 = greedy (default: 0)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling threshold (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens, 0 = off (default: 0)")
    parser.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability (default: 0)")
    parser.add_argument("--repetition-penalty", type=float, default=1.0, help="repetition penalty (default: 1.0)")
    parser.add_argument("--sampling-seed", type=int, default=None, help="per-request seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    parser.add_argument("--ignore-eos", action="store_true", help="keep generating after the end-of-sequence token")


def _runs_worker_node(config) -> bool:
    """With the model split over ranks, a process that holds no rank 0 (a node other than the
    first, a torchrun rank other than 0) runs its ranks until rank 0 stops them; True if it did."""
    if config.world_size == 1:
        return False
    from tokenmill.executor import holds_rank_zero, run_node

    if holds_rank_zero(config):
        return False
    run_node(config)
    return True


def _generate(args: argparse.Namespace) -> int:
    from tokenmill import LLM, SamplingParams

    if not args.prompt and not args.chat:
        print("error: give at least one --prompt or --chat", file=sys.stderr)
        return 2
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.sampling_seed,
        stop=args.stop, ignore_eos=args.ignore_eos,
    )
    config = engine_config_from_args(args)
    if _runs_worker_node(config):
        return 0
    llm = LLM(**dataclasses.asdict(config))
    if args.stream and len(args.prompt) == 1 and not args.chat:
        for out in llm.stream(args.prompt, params):
            print(out.outputs[0].delta_text, end="", flush=True)
        print()
        return 0
    results = []
    if args.prompt:
        results += list(zip(args.prompt, llm.generate(args.prompt, params)))
    if args.chat:
        conversations = [[{"role": "user", "content": m}] for m in args.chat]
        results += list(zip(args.chat, llm.chat(conversations, params)))
    for prompt, out in results:
        c = out.outputs[0]
        print(f"### {prompt!r} -> ({len(c.token_ids)} tokens, finish_reason={c.finish_reason})")
        print(c.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    engine_config, server_config = engine_config_from_args(args), server_config_from_args(args)
    if _runs_worker_node(engine_config):
        return 0
    if server_config.data_parallel_size > 1:
        from tokenmill.entrypoints.data_parallel import run_data_parallel

        return run_data_parallel(engine_config, server_config, log_level=args.log_level)
    from tokenmill.entrypoints.openai.api_server import run_server

    return run_server(engine_config, server_config, log_level=args.log_level)


def _build_kernels(args: argparse.Namespace) -> int:
    from tokenmill import cpu_isa
    from tokenmill.layers import cpu_kernels

    levels = args.isa or [cpu_isa.host_isa()]
    for isa in levels:
        t0 = time.perf_counter()
        try:
            path = cpu_kernels.build_prebuilt(isa)
        except RuntimeError as e:
            print(f"warning: {e}; tokenmill runs with PyTorch's ops instead", file=sys.stderr)
            return 1
        print(f"CPU kernels ({isa}) built in {time.perf_counter() - t0:.0f}s: {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenmill", description="tokenmill: LLM inference with in-flight batching")
    parser.add_argument("--log-level", default="INFO", help="logging level (default: INFO)")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text offline for prompts or chat messages")
    add_engine_args(gen)
    add_sampling_args(gen)
    gen.add_argument("--prompt", action="append", default=[], help="a raw text prompt (repeatable)")
    gen.add_argument("--chat", action="append", default=[],
                     help="a user message, sent through the model's chat template (repeatable)")
    gen.add_argument("--stream", action="store_true", help="print tokens as they are generated (one --prompt)")
    gen.set_defaults(func=_generate)
    serve = sub.add_parser("serve", help="serve the model over an OpenAI-compatible HTTP API")
    add_engine_args(serve)
    add_server_args(serve)
    serve.set_defaults(func=_serve)
    from tokenmill.bench.args import add_bench_parsers  # stdlib only; each bench command imports the rest when run

    add_bench_parsers(sub)
    from tokenmill.eval.cli import add_eval_parser  # stdlib only; each eval command imports the engine when run

    add_eval_parser(sub)
    add_quantize_parser(sub)  # config only; the command imports the rest when run
    add_calibrate_sparsity_parser(sub)  # stdlib only; the command imports the rest when run
    kernels = sub.add_parser("build-kernels", help="compile the CPU kernels into the installed package (make setup runs "
                             "it), so that an engine starts without compiling them")
    kernels.add_argument("--isa", action="append", choices=["avx2", "avx512", "avx512_vnni", "avx512_bf16"],
                         help="an instruction-set level to build (repeatable; default: this CPU's, capped by "
                              "TOKENMILL_CPU_ISA); other levels compile at first use")
    kernels.set_defaults(func=_build_kernels)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ValueError as e:  # config, prompt and model errors: one clear line, no traceback
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
