"""The engine flags: one per `EngineConfig` field, shared by every command that builds an engine
(`generate`, `serve`, `eval`). It imports only the config, so a command module can take these
flags without importing `tokenmill.cli`, which gathers the commands and imports those modules.
"""

from __future__ import annotations

import argparse
import dataclasses
import os

from tokenmill.config import (
    ATTENTION_BACKENDS, CPU_KV_CACHE_MEMORY_GB, DEVICES, DTYPES, INT4_GROUP_SIZES, KV_CACHE_DTYPES, QUANTIZATION_ALGORITHMS,
    LM_HEAD_CHOICES, MAX_ACTIVATION_SPARSITY, QUANTIZATION_CHOICES, SPECULATIVE_METHODS,
    EngineConfig,
)
from tokenmill.cpu_isa import ISA_LEVELS
from tokenmill.faults import FAULT_ENV
from tokenmill.quantization.cli import add_calibration_args

_DEFAULTS = EngineConfig()


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags for every EngineConfig field (shared by every command that builds an engine)."""
    _add_model_args(parser)
    _add_cpu_kernel_args(parser)
    _add_quantization_args(parser)
    _add_sparsity_args(parser)
    _add_parallel_args(parser)
    _add_kv_cache_args(parser)
    _add_cache_reuse_args(parser)
    _add_scheduling_args(parser)
    _add_speculation_args(parser)


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    """The model, its dtype and device, and how attention runs."""
    d = _DEFAULTS
    parser.add_argument("model", nargs="?", default=d.model,
                        help=f"model alias, .gguf file or Hugging Face directory (default: {d.model})")
    parser.add_argument("--dtype", choices=DTYPES, default=d.dtype,
                        help="compute dtype; auto = bf16 on CPUs with native bf16 and on CUDA, else fp32 (default: auto)")
    parser.add_argument("--device", choices=DEVICES, default=d.device, help="device (default: auto = cuda if available)")
    parser.add_argument("--attention-backend", choices=ATTENTION_BACKENDS, default=d.attention_backend,
                        help="attention over the paged KV cache: torch (PyTorch ops, any device) or triton (Triton "
                             "kernels: split-K paged decode, flash-style prefill; CUDA) (default: auto = triton on "
                             "CUDA when Triton is installed, else torch)")
    parser.add_argument("--enforce-eager", action="store_true",
                        help="CUDA: do not capture CUDA graphs of decode steps (captured by default with the triton "
                             "attention backend, at batch sizes 1, 2, 4, 8, 16, ... up to min(--max-num-seqs, 256))")


def _add_cpu_kernel_args(parser: argparse.ArgumentParser) -> None:
    """CPU: tokenmill's compiled kernels and their instruction-set level."""
    d = _DEFAULTS
    parser.add_argument("--no-cpu-kernels", dest="cpu_kernels", action="store_false",
                        help="CPU: PyTorch ops only, not tokenmill's compiled CPU kernels (paged decode and prefill "
                             "attention, RMSNorm, RoPE + KV store, few-row and quantized matmuls, and the decoder "
                             "layers of a step in one compiled call; built with g++ at first use and cached, ~30 s "
                             "once; default: used when they build, except with --kv-cache-dtype fp8)")
    parser.add_argument("--cpu-isa", choices=("auto", *ISA_LEVELS), default=d.cpu_isa,
                        help="CPU: the instruction-set level of the compiled kernels: generic, avx2 (x86-64-v3: int8 "
                             "activations times int8/int4 weights), avx512 (x86-64-v4), avx512_vnni (the same with "
                             "vpdpbusd byte dot products), avx512_bf16 (bf16 dot products); "
                             "a lower level than the host's runs that level's code. auto = the host's, capped by the "
                             "TOKENMILL_CPU_ISA environment variable (default: auto)")


def _add_quantization_args(parser: argparse.ArgumentParser) -> None:
    """The weights' format, the LM head's, and how the codes are chosen (calibration included)."""
    d = _DEFAULTS
    parser.add_argument("--quantization", choices=QUANTIZATION_CHOICES, default=d.quantization,
                        help="the linear layers' weight format: auto = as the checkpoint stores them (a GGUF file's "
                             "Q4_0/Q4_1/Q4_K tensors as int4 with the file's own scales, Q6_K as int6 with its own (CPU "
                             "kernels, AVX2 and up), other wider types such as Q8_0 as int8, float tensors dense; a Hugging Face checkpoint dense); none = dense in --dtype (a "
                             "GGUF file dequantized); or quantize on load: int8 (weight-only, per output channel), int4 "
                             "(weight-only, groups of --quantization-group-size), w8a8 (int8 weights and per-token int8 "
                             "activations), fp8 (E4M3 weights; on CPU a storage format), the LM head as "
                             "--quantization-lm-head says in these four. A checkpoint from `tokenmill quantize` is already "
                             f"quantized: leave it auto (default: {d.quantization})")
    parser.add_argument("--quantization-group-size", type=int, choices=INT4_GROUP_SIZES, default=d.quantization_group_size,
                        help="input channels per int4 scale/zero group; a layer it does not divide takes the largest of "
                             f"64, 32 that does (default: {d.quantization_group_size})")
    parser.add_argument("--quantization-lm-head", choices=LM_HEAD_CHOICES, default=d.quantization_lm_head,
                        help="the LM head's format: auto = int8 when --quantization quantizes on load, as stored under "
                             "--quantization auto; or, quantizing on load or over a GGUF file's head under auto: int8 "
                             "(weight-only, per output channel), int4 (weight-only, groups of --quantization-group-size: "
                             "fewer bytes a token where the head is a large part of the model, e.g. an untied 150k "
                             "vocabulary; at some cost in perplexity) or none (dense in --dtype) (default: auto)")
    parser.add_argument("--quantization-algorithm", choices=tuple(QUANTIZATION_ALGORITHMS), default=d.quantization_algorithm,
                        help="how --quantization chooses the codes: rtn (round-to-nearest), awq or gptq (int4, calibrated), "
                             "smoothquant (w8a8, calibrated); calibration runs at start-up (default: rtn)")
    add_calibration_args(parser)


def _add_sparsity_args(parser: argparse.ArgumentParser) -> None:
    """Activation sparsity (TEAL) on decode steps."""
    d = _DEFAULTS
    parser.add_argument("--activation-sparsity", type=float, default=d.activation_sparsity, metavar="S",
                        help="on decode steps, set to zero the entries of each decoder layer's linear inputs (q/k/v, "
                             "o, gate/up, down) below a per-layer threshold in magnitude, the thresholds those that "
                             f"zeroed a share S in [0, {MAX_ACTIVATION_SPARSITY}] of the entries in calibration (TEAL, "
                             "training-free); prefill stays dense. Needs the model's thresholds file (`tokenmill "
                             "calibrate-sparsity MODEL`). Changes the output; no speed-up yet: the matmuls still read "
                             "every weight (default: 0 = off)")
    parser.add_argument("--activation-sparsity-file", default=d.activation_sparsity_file, metavar="FILE",
                        help="the thresholds file for --activation-sparsity (default: the one found beside the model "
                             "or under ~/.cache/tokenmill/sparsity/)")
    parser.add_argument("--activation-sparsity-prefill", action="store_true",
                        help="with --activation-sparsity, threshold prefill tokens too (accuracy measurements: every "
                             "scored prompt token of a perplexity is then sparsified)")


def _add_parallel_args(parser: argparse.ArgumentParser) -> None:
    """CPU threads, and the ranks and machines one model is split over."""
    d = _DEFAULTS
    parser.add_argument("--num-threads", type=int, default=d.num_threads,
                        help="CPU threads for torch (default: number of physical cores)")
    parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=d.tensor_parallel_size,
                        help="split every layer's attention heads, MLP and the vocabulary over this many ranks (processes; "
                             "gloo on CPU, NCCL on CUDA), one all-reduce per sublayer; the CPU threads are shared between "
                             f"the ranks of a machine (default: {d.tensor_parallel_size})")
    parser.add_argument("--pipeline-parallel-size", "-pp", type=int, default=d.pipeline_parallel_size,
                        help="split the layers into this many stages (processes), each step's batch cut into micro-batches "
                             f"so the stages overlap (default: {d.pipeline_parallel_size})")
    parser.add_argument("--nnodes", type=int, default=d.nnodes,
                        help="machines the ranks are spread over; every machine runs the same command with its own "
                             f"--node-rank (default: {d.nnodes})")
    parser.add_argument("--node-rank", type=int, default=d.node_rank,
                        help="this machine's index among --nnodes; node 0 runs rank 0 and the server, the others only "
                             f"workers (default: {d.node_rank})")
    parser.add_argument("--master-addr", default=d.master_addr,
                        help=f"address of node 0, where the ranks meet (default: {d.master_addr})")
    parser.add_argument("--master-port", type=int, default=d.master_port,
                        help="TCP port on node 0 where the ranks meet (default: a free port on one machine, 29500 across "
                             "several)")


def _add_kv_cache_args(parser: argparse.ArgumentParser) -> None:
    """The context length and the KV cache: block size, memory budget, dtype, block count."""
    d = _DEFAULTS
    parser.add_argument("--max-model-len", type=int, default=d.max_model_len,
                        help="longest prompt + output per request (default: the model's context length)")
    parser.add_argument("--block-size", type=int, default=d.block_size, help=f"tokens per KV-cache block (default: {d.block_size})")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=d.kv_cache_memory_gb,
                        help=f"memory for the KV cache in GiB (default: auto = {CPU_KV_CACHE_MEMORY_GB:g} GiB on CPU; on "
                             "CUDA what --gpu-memory-utilization leaves after the weights and a profiled worst-case step)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=d.gpu_memory_utilization,
                        help="CUDA, without --kv-cache-memory-gb / --num-kv-blocks: the fraction of the GPU's memory, in "
                             "(0, 1], that may be in use once the KV cache is allocated; weights, peak activations, the "
                             "CUDA context and other processes' memory count against it, the KV cache gets the rest "
                             f"(default: {d.gpu_memory_utilization:g})")
    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype,
                        help="what the KV cache stores: auto = the compute dtype; float16 = a float32 model's keys "
                             "and values rounded to float16 (llama.cpp's default cache; half the bytes, twice the "
                             "blocks; torch attention backend and CPU kernels); int8 / fp8 (e4m3) = codes with one "
                             "float32 scale per token and KV head, quantized on write, ~1.9x the blocks of bf16 for "
                             "the same --kv-cache-memory-gb (default: auto)")
    parser.add_argument("--num-kv-blocks", type=int, default=d.num_kv_blocks,
                        help="number of KV-cache blocks, overriding --kv-cache-memory-gb and --gpu-memory-utilization")


def _add_cache_reuse_args(parser: argparse.ArgumentParser) -> None:
    """Blocks kept for reuse: prefix sharing, swapping preempted requests out, the host and disk tiers."""
    d = _DEFAULTS
    parser.add_argument("--no-prefix-caching", dest="enable_prefix_caching", action="store_false",
                        help="do not share KV blocks of equal prompt prefixes between requests")
    parser.add_argument("--swap-space", dest="swap_space_gb", type=float, default=d.swap_space_gb,
                        help="host memory in GiB for swapping out preempted requests' KV blocks, 0 = always "
                             f"recompute (default: {d.swap_space_gb:g})")
    parser.add_argument("--num-host-kv-blocks", type=int, default=d.num_host_kv_blocks,
                        help="number of host KV blocks, overriding --swap-space")
    parser.add_argument("--host-cache-gb", type=float, default=d.host_cache_gb,
                        help="host memory in GiB that prefix-cache blocks evicted from the KV cache are kept in (LRU), "
                             "promoted back when a prompt starts with them; separate from --swap-space "
                             f"(default: {d.host_cache_gb:g} = off)")
    parser.add_argument("--disk-cache-dir", default=d.disk_cache_dir,
                        help="directory the host cache's blocks are written through to and read back from, also by a "
                             "later server on the same model, precision and KV layout (a clean shutdown writes the "
                             "blocks still cached too); needs --host-cache-gb, refused with --tensor-parallel-size or "
                             "--pipeline-parallel-size above 1 (default: none)")
    parser.add_argument("--disk-cache-gb", type=float, default=d.disk_cache_gb,
                        help=f"most GiB of block files in --disk-cache-dir, least recently used deleted first "
                             f"(default: {d.disk_cache_gb:g})")


def _add_scheduling_args(parser: argparse.ArgumentParser) -> None:
    """The step's token budget, running requests, chunked prefill and the sampler's seed."""
    d = _DEFAULTS
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens,
                        help=f"token budget of one engine step (default: {d.max_num_batched_tokens})")
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs,
                        help=f"most requests running at once (default: {d.max_num_seqs})")
    parser.add_argument("--no-chunked-prefill", dest="enable_chunked_prefill", action="store_false",
                        help="schedule each prompt whole instead of in chunks")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed of the shared sampler generator (default: {d.seed})")


def _add_speculation_args(parser: argparse.ArgumentParser) -> None:
    """Speculative decoding: the method, its draft model and how many tokens it drafts."""
    d = _DEFAULTS
    parser.add_argument("--speculative-method", choices=SPECULATIVE_METHODS, default=d.speculative_method,
                        help="speculative decoding: ngram = prompt lookup, drafts copied from earlier in the request's "
                             "own tokens; suffix = suffix decoding, the most frequent continuation of the longest "
                             "matching suffix in the request's own tokens and in earlier requests' outputs (repeated "
                             "structure across requests: agent loops, tool calls); draft = a small model "
                             "(--draft-model) proposes them; the output distribution is unchanged (default: off)")
    parser.add_argument("--draft-model", default=d.draft_model,
                        help="with --speculative-method draft: the draft model (alias, .gguf or HF directory), same "
                             "vocabulary as MODEL")
    parser.add_argument("--num-speculative-tokens", type=int, default=d.num_speculative_tokens,
                        help=f"most draft tokens a request verifies per step (default: {d.num_speculative_tokens})")
    parser.add_argument("--speculative-ngram-min", type=int, default=d.speculative_ngram_min,
                        help=f"ngram: shortest suffix to look up (default: {d.speculative_ngram_min})")
    parser.add_argument("--speculative-ngram-max", type=int, default=d.speculative_ngram_max,
                        help=f"ngram: longest suffix to look up; the longest match wins (default: {d.speculative_ngram_max})")
    parser.add_argument("--no-speculative-adaptive", dest="speculative_adaptive", action="store_false",
                        help="always verify up to --num-speculative-tokens drafts instead of choosing each step's "
                             "drafts from the step cost measured at start and each request's recent acceptance")
    parser.add_argument("--speculative-max-running", type=int, default=d.speculative_max_running,
                        help="no speculation in a step while more requests than this are running or waiting "
                             "(default: no such limit; the measured step cost decides when drafts stop paying)")


def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in dataclasses.fields(EngineConfig)}
    # Fault injection (tests only) comes from the environment, read once here at start-up.
    return EngineConfig(**{k: v for k, v in vars(args).items() if k in names},
                        fault_injection=os.environ.get(FAULT_ENV) or None)
