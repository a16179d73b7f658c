"""Helpers shared by the benchmark scripts in this directory (run them as `python benchmarks/NAME.py`,
which puts this directory on the import path).

- The text prompts are cut from (`TEXT_FILE`), `cut_prompts`.
- tokenmill configs by name (`bf16`, `int8`, `int4`) -> `LLM` keyword arguments.
- The Hugging Face transformers reference: the same GGUF file loaded with `from_pretrained`,
  static left-padded batches through `generate`.
- llama.cpp's `llama-bench`, run and parsed.
- The model a script measures: `--model`, or `--synthetic NAME` (random weights in the shape of a
  real model, written as a Hugging Face directory: for speed measurements where the real file
  cannot be had, e.g. on a GPU machine that reaches no package index).
- The device: its copy bandwidth, the bytes of a model's tensors, optional engine knobs
  (attention backend, CUDA graphs) passed only when this tokenmill's EngineConfig has them.
- Machine info, the CPU time other processes use while a section runs, a plain-text table, and
  the JSON report every script writes.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

# Silence the GGUF de-quantization progress bar of transformers (tqdm reads this at import time).
os.environ.setdefault("TQDM_DISABLE", "1")

TEXT_FILE = Path("/usr/share/common-licenses/GPL-3")
RESULTS_DIR = Path(__file__).resolve().parent / "results"


# -- prompts ------------------------------------------------------------------------------------


def text_token_ids(tokenizer) -> list[int]:
    """The text file as token ids (no special tokens)."""
    return tokenizer.encode(TEXT_FILE.read_text(), add_special_tokens=False)


def cut_prompts(text_ids: list[int], count: int, length: int) -> list[list[int]]:
    """`count` prompts of `length` token ids at distinct offsets of the text: back to back while the
    text suffices, then spread evenly (wrapping around the end). Distinct starts mean distinct first
    blocks, so no prompt hits the prefix cache filled by another."""
    n = len(text_ids)
    if n < 2:
        raise ValueError("the text has fewer than 2 tokens")
    stride = length if count * length <= n else max(1, n // count)
    cyclic = text_ids * (-(-(n + length) // n))  # long enough to read `length` tokens from any offset
    return [list(cyclic[(i * stride) % n : (i * stride) % n + length]) for i in range(count)]


# -- tokenmill configs ----------------------------------------------------------------------------

CONFIG_NAMES = ("bf16", "int8", "int4", "auto")


# A config name with this suffix runs without tokenmill's compiled CPU kernels (cpu_kernels=False).
TORCH_OPS_SUFFIX = "-torchops"
# ... with the kernels, but decode steps through the Python decoder layers instead of the
# compiled DecoderStack (the model's cpu_decoder dropped after load: see python_layers).
PY_LAYERS_SUFFIX = "-pylayers"
SUFFIXES = (TORCH_OPS_SUFFIX, PY_LAYERS_SUFFIX)


def config_base(name: str) -> str:
    """The config name without its suffix."""
    for suffix in SUFFIXES:
        name = name.removesuffix(suffix)
    return name


def parse_configs(text: str) -> list[str]:
    """'bf16,int8,int4' -> the names, checked (each may end in one of SUFFIXES)."""
    names = [c.strip() for c in text.split(",") if c.strip()]
    bad = [c for c in names if config_base(c) not in CONFIG_NAMES]
    if not names or bad:
        raise ValueError(f"configs: expected a comma-separated subset of {','.join(CONFIG_NAMES)} (each optionally "
                         f"with a suffix, {' or '.join(SUFFIXES)}), got {text!r}")
    return names


def config_kwargs(name: str, dtype: str) -> dict:
    """`LLM` keyword arguments of a named config: bf16 -> dense weights in dtype `dtype` (bfloat16
    unless overridden), int8 / int4 -> weight-only quantization of the linears, auto -> the
    checkpoint's weights as stored (a GGUF file's own int4 codes; compute dtype: the engine's
    default); NAME-torchops -> the same with PyTorch ops only (no compiled CPU kernels)."""
    base = config_base(name)
    kwargs = {"dtype": dtype, "quantization": "none"} if base == "bf16" else {"quantization": base}
    if name.endswith(TORCH_OPS_SUFFIX):
        kwargs["cpu_kernels"] = False
    return kwargs


def python_layers(llm, name: str) -> None:
    """For a NAME-pylayers config: decode steps run the model's Python layers (the compiled
    DecoderStack dropped), the kernels otherwise kept, to measure the stack side by side."""
    if name.endswith(PY_LAYERS_SUFFIX):
        llm.engine.core.runner.model.cpu_decoder = None


def config_label(name: str, dtype: str) -> str:
    """The config's name in tables: the bf16 line under another --dtype is named after it."""
    base = config_base(name)
    return ({"float32": "fp32"}.get(dtype, base) if base == "bf16" else base) + name[len(base):]


# -- Hugging Face transformers --------------------------------------------------------------------


def load_hf(model_path: Path, dtype: str, device: str = "cpu"):
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    kwargs = {"gguf_file": model_path.name} if model_path.suffix == ".gguf" else {}
    directory = model_path.parent if model_path.suffix == ".gguf" else model_path
    model = transformers.AutoModelForCausalLM.from_pretrained(str(directory), dtype=getattr(torch, dtype), **kwargs)
    return model.to(device).eval()


def hf_pad_id(model, tokenizer) -> int:
    for cand in (tokenizer.pad_token_id, model.generation_config.pad_token_id, tokenizer.eos_token_id):
        if isinstance(cand, int):
            return cand
    return 0


def hf_generate_batch(model, prompts: list[list[int]], num_new: int, pad_id: int, **generate_kwargs):
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
            input_ids=input_ids.to(model.device),
            attention_mask=attention_mask.to(model.device),
            do_sample=False,
            max_new_tokens=num_new,
            min_new_tokens=num_new,  # suppresses EOS, so every row runs to num_new
            pad_token_id=pad_id,
            use_cache=True,
            **generate_kwargs,
        )
    return seqs[:, width:].tolist()


def run_hf(model, tokenizer, requests, batch_size: int, sort_by_length: bool) -> tuple[dict, list[list[int]]]:
    """`requests` = [(prompt_token_ids, output_len)] in static batches of `batch_size` (in request
    order unless `sort_by_length`), each generated to its longest requested output."""
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


# -- llama.cpp ----------------------------------------------------------------------------------


def run_llama_bench(path: str, gguf: Path, threads: int, n_prompt: int, n_gen: int, repeats: int) -> dict:
    """`llama-bench -m GGUF -t THREADS -p N_PROMPT -n N_GEN -r REPEATS -o json`; its one test's
    record (avg_ts = tokens/s averaged over the repetitions, model_size in bytes, build, ...)."""
    cmd = [path, "-m", str(gguf), "-t", str(threads), "-p", str(n_prompt), "-n", str(n_gen), "-r", str(repeats),
           "-o", "json"]
    other = OtherLoad()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    other_cores = other.cores()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited with {proc.returncode}:\n{proc.stderr[-2000:]}")
    records = json.loads(proc.stdout)
    if len(records) != 1:
        raise RuntimeError(f"expected one llama-bench test, got {len(records)}")
    return {**records[0], "command": cmd, "other_processes_cores": other_cores}


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


def busy_warning(cores_by_section: dict[str, float], threshold: float = 0.1) -> str | None:
    """A warning naming the sections during which other processes used more than `threshold` cores."""
    busy = {name: c for name, c in cores_by_section.items() if c is not None and c > threshold}
    if not busy:
        return None
    return (
        "WARNING: other processes were busy during the timed runs ("
        + ", ".join(f"{name}: {c:.2f} cores on average" for name, c in busy.items())
        + "); these numbers are not representative, rerun on an idle machine"
    )


# -- the model measured --------------------------------------------------------------------------

# Hugging Face config.json fields of real models (from their GGUF metadata, ../shared/MODELS.md),
# for random-weight stand-ins: decode and throughput timings do not depend on the weights' values
# (greedy, EOS ignored, no data-dependent work), only on their shapes.
SYNTHETIC_MODELS: dict[str, dict] = {
    "qwen2.5-1.5b": {  # Qwen2.5-Coder-1.5B-Instruct: untied head, q/k/v biases
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 1536,
        "intermediate_size": 8960, "num_hidden_layers": 28, "num_attention_heads": 12, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False, "use_sliding_window": False,
    },
    "qwen2.5-0.5b": {  # Qwen2.5-Coder-0.5B-Instruct: tied head
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "vocab_size": 151936, "hidden_size": 896,
        "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14, "num_key_value_heads": 2,
        "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True, "use_sliding_window": False,
    },
    "llama-3.1-8b": {  # Llama-3.1-8B-Instruct: GQA 4:1, untied head, llama3 RoPE scaling
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
        "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
    },
    "smollm2-135m": {  # SmolLM2-135M-Instruct, the default model
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3,
        "max_position_embeddings": 8192, "rope_theta": 100000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    },
    "tiny": {  # smoke tests on a CPU
        "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 1024, "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 4096, "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
    },
}
SYNTHETIC_DIR = RESULTS_DIR / "synthetic"


def add_model_args(parser, default: str | None, default_help: str = "") -> None:
    """--model and --synthetic (one of them; `benchmark_model` resolves them)."""
    parser.add_argument("--model", default=default,
                        help="model alias or path (.gguf file or HF directory)" + (f"; {default_help}" if default_help else ""))
    parser.add_argument("--synthetic", choices=tuple(SYNTHETIC_MODELS), default=None,
                        help="instead of --model: random weights in this model's shape, written once as a Hugging "
                             f"Face directory under {SYNTHETIC_DIR} (timings do not depend on the weights' values)")


def benchmark_model(args, device: str) -> str:
    """What to load: the --synthetic directory (written on `device` if missing) or --model."""
    if args.synthetic:
        return str(synthetic_model_dir(args.synthetic, device))
    if not args.model:
        raise SystemExit("no model: pass --model (an alias, .gguf file or HF directory) or --synthetic NAME")
    return args.model


def synthetic_model_dir(name: str, device: str = "cpu", directory: Path | None = None, seed: int = 0) -> Path:
    """A Hugging Face directory (config.json, model.safetensors in bf16, a tokenizer) with random
    weights in the shape of SYNTHETIC_MODELS[name]; reused when one with the same config.json is there.

    The tokenizer is byte-level BPE without merges (one token per byte of UTF-8 text), its vocabulary
    padded to the model's with unused tokens so that every id the model can emit decodes; its last id
    is the end-of-text token."""
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tokenmill.models.loader import arch_config_from_hf, expected_weight_shapes

    fields = SYNTHETIC_MODELS[name]
    vocab_size = fields["vocab_size"]
    config = {**fields, "hidden_act": "silu", "bos_token_id": None, "eos_token_id": vocab_size - 1,
              "torch_dtype": "bfloat16", "synthetic_seed": seed}
    directory = directory or SYNTHETIC_DIR / name
    config_file = directory / "config.json"
    if config_file.is_file() and json.loads(config_file.read_text()) == config:
        return directory
    t0 = time.perf_counter()
    print(f"writing a random-weight {name} to {directory} ...", flush=True)
    directory.mkdir(parents=True, exist_ok=True)
    config_file.unlink(missing_ok=True)  # written last: a directory with it is complete
    arch = arch_config_from_hf(directory, config)  # as the loader will read it (Qwen2's q/k/v biases included)
    gen = torch.Generator(device=device).manual_seed(seed)
    tensors = {}
    for tensor_name, shape in expected_weight_shapes(arch).items():
        if tensor_name.endswith("norm.weight"):
            t = torch.ones(shape, device=device)
        else:  # std 0.02, as transformers initializes
            t = torch.randn(shape, generator=gen, device=device).mul_(0.02)
        tensors[tensor_name] = t.to(torch.bfloat16).cpu()
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    del tensors

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {c: i for i, c in enumerate(byte_chars)}
    vocab |= {f"<unused_{i}>": i for i in range(len(vocab), vocab_size - 1)}
    vocab["<|endoftext|>"] = vocab_size - 1
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(str(directory))
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {directory} in {time.perf_counter() - t0:.1f}s", flush=True)
    return directory


# -- the device ---------------------------------------------------------------------------------


def resolve_device(device: str) -> str:
    """'auto' -> cuda when torch sees a GPU, else cpu; 'cuda' without one fails here, loudly."""
    import torch

    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (torch.cuda.is_available() is False)")
    return device


def device_name(device: str) -> str:
    import torch

    if device == "cuda":
        return torch.cuda.get_device_name(0)
    info = machine_info()
    return f"{info.get('cpu_model') or 'cpu'} (CPU kernels: {info['cpu_isa']})"


def copy_bandwidth(device: str, num_bytes: int, repeats: int = 10) -> dict:
    """`dst.copy_(src)` of two `num_bytes` tensors on `device`, timed with CUDA events on a GPU
    (wall clock on a CPU), best and median of `repeats` after two warm-ups. Bandwidth counts the
    bytes read and written (2 x num_bytes per copy), as memory-bandwidth figures usually do."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for i in range(repeats + 2):
        if device == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            seconds = start.elapsed_time(end) / 1000
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            seconds = time.perf_counter() - t0
        if i >= 2:
            times.append(seconds)
    if not torch.equal(dst[-1:], src[-1:]):
        raise RuntimeError("the bandwidth copy did not copy")
    del src, dst
    if device == "cuda":
        torch.cuda.empty_cache()
    moved = 2 * (num_bytes // 4) * 4
    return {
        "bytes_copied": moved // 2,
        "device": device,
        "best_seconds": min(times),
        "median_seconds": statistics.median(times),
        "best_bytes_per_s": moved / min(times),
        "median_bytes_per_s": moved / statistics.median(times),
    }


def tensor_bytes(model) -> dict:
    """Bytes of the model's tensors, each byte of memory once (views, tied weights and the one
    buffer the runner gathers the weights into are counted by the memory each tensor spans): all
    of them, and those a batch-1 decode step reads in full (not an nn.Embedding table unless the
    LM head shares it, not rotary cos/sin caches, not the many-row copy of a linear that runs a
    few-row kernel at 1 row: DenseLinear's packed `weight` when it keeps `plain`, Int4Linear's
    `packed` and `scales_and_zeros` when it keeps `kernel_codes`)."""
    from torch import nn

    from tokenmill.layers.embedding import QuantizedEmbedding
    from tokenmill.worker.cpu import held_tensors

    spans: dict[tuple[int, int], bool] = {}  # (first byte, end) -> read in full per token
    for module_name, module in model.named_modules():
        tensors = list(held_tensors(module))
        many_rows_only = set()
        if getattr(module, "kernel", None) is not None:
            many_rows_only = ({"weight"} if hasattr(module, "plain") else
                              {"packed", "scales_and_zeros"} if hasattr(module, "kernel_codes") else set())
        for attr, t in tensors:
            if t.numel() == 0:
                continue
            try:
                first = t.data_ptr()
                span = (1 + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))) * t.element_size()
            except (RuntimeError, NotImplementedError):  # an opaque layout without a plain storage
                first, span = -id(t), t.numel() * t.element_size()
            lookup_only = (isinstance(module, (nn.Embedding, QuantizedEmbedding)) or "rotary" in module_name
                           or attr.endswith(("cos_cache", "sin_cache")) or attr in many_rows_only)
            key = (first, first + span)
            spans[key] = spans.get(key, False) or not lookup_only
    total = _union_bytes(spans)
    read = _union_bytes([k for k, r in spans.items() if r])
    return {"total_bytes": total, "read_per_token_bytes": read, "lookup_only_bytes": total - read}


def _union_bytes(spans) -> int:
    """The bytes that a set of [first, end) address ranges cover, overlaps once."""
    covered, reach = 0, None
    for first, end in sorted(spans):
        if reach is None or first >= reach:
            covered += end - first
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


# -- engine knobs that may not exist yet ----------------------------------------------------------


# -- report -------------------------------------------------------------------------------------


# AMD's core generations by /proc/cpuinfo's (vendor, cpu family, model): a virtual machine's
# model name is often just "AMD EPYC", and Zen 4 and Zen 5 share the AVX-512 BF16 level but not
# its speeds (Zen 5 runs 512-bit operations at full width).
AMD_GENERATIONS = ((25, range(0x00, 0x10), "Zen 3"), (25, range(0x20, 0x60), "Zen 3"), (25, range(0x10, 0x20), "Zen 4"),
                   (25, range(0x60, 0x80), "Zen 4"), (25, range(0xA0, 0xB0), "Zen 4"), (26, range(0x00, 0x100), "Zen 5"))


def first_processor(cpuinfo: str) -> dict[str, str]:
    """The fields of /proc/cpuinfo's first processor block."""
    fields: dict[str, str] = {}
    for line in cpuinfo.splitlines():
        if not line.strip():
            break
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_generation(cpuinfo: str) -> str | None:
    """The core generation of an AMD CPU from /proc/cpuinfo's text (None when unknown)."""
    fields = first_processor(cpuinfo)
    if fields.get("vendor_id") != "AuthenticAMD":
        return None
    try:
        family, model = int(fields["cpu family"]), int(fields["model"])
    except (KeyError, ValueError):
        return None
    return next((name for f, models, name in AMD_GENERATIONS if f == family and model in models), None)


def machine_info() -> dict:
    import torch

    cpu_model, generation = platform.processor() or None, None
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        cpu_model = first_processor(cpuinfo).get("model name", cpu_model)
        generation = cpu_generation(cpuinfo)
    except OSError:
        pass
    from tokenmill.config import cpu_has_native_bf16, num_physical_cores
    from tokenmill.cpu_isa import detected_isa, host_isa

    info = {
        "cpu_model": cpu_model,
        "cpu_generation": generation,
        "logical_cpus": os.cpu_count(),
        "physical_cores": num_physical_cores(),
        "cpu_native_bf16": cpu_has_native_bf16(),
        # the kernels' instruction-set level (TOKENMILL_CPU_ISA caps the CPU's own)
        "cpu_isa": host_isa(),
        "cpu_isa_detected": detected_isa(),
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
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info["gpu"] = {"name": props.name, "memory_bytes": props.total_memory,
                       "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    return info


def print_ratios(results: list[dict], references: tuple[str, ...], key: str, what: str) -> None:
    """One line per reference engine present in `results`: each tokenmill config's `key` over
    the reference's, e.g. `tokenmill decode tok/s / hf-transformers: bf16 1.83x, int8 2.04x`."""
    for ref in references:
        base = next((r for r in results if r["engine"] == ref), None)
        if base and base[key]:
            ratios = ", ".join(f"{r['config']} {r[key] / base[key]:.2f}x" for r in results if r.get("config"))
            if ratios:
                print(f"tokenmill {what} / {ref}: {ratios}")


def print_table(header: list[str], rows: list[list[str]], left: int = 1) -> None:
    """Columns padded to width; the first `left` columns left-aligned, the others right-aligned."""
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(header)]
    fmt = lambda cells: "  ".join(c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))  # noqa: E731
    print(fmt(header))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))


def fmt(value: float | None, spec: str = ".1f") -> str:
    """A number for a table cell; '-' for None."""
    return "-" if value is None else format(value, spec)


def code_version() -> dict | None:
    """The commit the measured code is at, and whether the package or its kernels differ from it."""
    repo = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=repo, capture_output=True, text=True,
                                check=True).stdout.strip()
        changed = subprocess.run(["git", "status", "--porcelain", "--", "tokenmill", "csrc"],
                                 cwd=repo, capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return {"commit": commit, "modified": bool(changed)}


def write_report(path: Path, benchmark: str, config: dict, results, **extra) -> None:
    """The JSON every script writes: name, date, command line, code version, config, machine info, results."""
    report = {
        "benchmark": benchmark,
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),  # (as a shell takes it back)
        "code": code_version(),
        "config": config,
        "machine": machine_info(),
        "results": results,
        **extra,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2, default=str) + "\n")
    print(f"wrote {path}")
