"""The one typed config object every knob lives in.

`EngineConfig` is built once (from `LLM(...)` keyword arguments or CLI flags) and passed down at
construction. No module reads environment variables for behaviour. Unknown keys are an error.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from tokenmill.cpu_isa import ISA_LEVELS, host_isa, native_bf16
from tokenmill.faults import FaultPlan

DTYPES = ("auto", "float32", "bfloat16", "float16")
DEVICES = ("auto", "cpu", "cuda")
ATTENTION_BACKENDS = ("auto", "torch", "triton")  # tokenmill.layers.attention.make_backend builds them
QUANTIZATION_METHODS = ("int8", "int4", "w8a8", "fp8")  # tokenmill.layers.linear implements them
QUANTIZATION_CHOICES = ("auto", "none", *QUANTIZATION_METHODS)
LM_HEAD_CHOICES = ("auto", "int8", "int4", "none")  # quantization_lm_head
INT4_GROUP_SIZES = (32, 64, 128)
# How the quantized weights are chosen: round-to-nearest, or calibrated on data (tokenmill.quantization).
QUANTIZATION_ALGORITHMS = {"rtn": QUANTIZATION_METHODS, "awq": ("int4",), "gptq": ("int4",), "smoothquant": ("w8a8",)}
SPECULATIVE_METHODS = ("ngram", "suffix", "draft")
KV_CACHE_DTYPES = ("auto", "float16", "int8", "fp8")  # kv_quant implements int8 / fp8; float16: a float32 model's K/V in half the bytes
MAX_ACTIVATION_SPARSITY = 0.95  # the largest sparsity a thresholds file is calibrated for (sparsity/thresholds.py)
CPU_KV_CACHE_MEMORY_GB = 2.0  # the KV-cache budget on CPU when kv_cache_memory_gb is not given


class ConfigError(ValueError):
    """A config value out of range; the message names the field, the value and what is allowed."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


@dataclass
class EngineConfig:
    model: str = "smollm2-135m"
    # Compute dtype of weights and activations. "auto": bf16 on a CPU with native bf16
    # (AVX-512 BF16 / AMX), fp32 on other CPUs, bf16 on CUDA. fp16 is refused on CPU.
    dtype: str = "auto"
    device: str = "auto"
    # Attention over the paged KV cache: "torch" (PyTorch ops, the reference, any device) or
    # "triton" (Triton kernels: split-K paged decode, flash-style varlen prefill; needs CUDA,
    # or Triton's CPU interpreter). "auto": triton on CUDA when Triton is installed, else torch.
    attention_backend: str = "auto"
    # CUDA with the Triton backend: decode-only steps replay CUDA graphs captured at start-up at
    # bucketed batch sizes (worker/cuda_graphs.py); True runs every step eagerly instead.
    enforce_eager: bool = False
    # CPU: tokenmill's compiled kernels (layers/cpu_kernels.py: paged decode attention read in
    # place from the cache, RMSNorm, RoPE + KV store, the decoder layers of decode-only steps in
    # one call: csrc/cpu_decoder.cpp), built for this machine at first use; if
    # they cannot be built (no compiler), PyTorch ops with a warning. False: PyTorch ops only.
    # Not used with an fp8 KV cache (its decode stays on the PyTorch path) nor on CUDA.
    cpu_kernels: bool = True
    # CPU: the instruction-set level the kernels are built for and dtype "auto" is chosen by
    # (cpu_isa.py): "generic", "avx2", "avx512", "avx512_vnni", "avx512_bf16", or "auto", the host's
    # (capped by the TOKENMILL_CPU_ISA environment variable when set). A level above the
    # host's is an error, a lower one runs that level's code (to measure it on a bigger CPU).
    cpu_isa: str = "auto"
    # Quantization of the linear layers on load: "auto" (a GGUF file's quantized tensors as
    # stored: Q4_0/Q4_1/Q4_K repacked into int4, Q6_K into int6 where the CPU kernels run it,
    # other wider types int8, models/gguf_blocks.py; any
    # other checkpoint as stored), "none" or None (the dtype's weights, a GGUF file's
    # dequantized), "int8" (weight-only, per output channel), "int4" (weight-only, asymmetric,
    # groups of quantization_group_size input channels), "w8a8" (int8 weights and per-token int8
    # activations, int8 matmul) or "fp8" (E4M3 weights; E4M3 activations on GPUs with FP8 tensor
    # cores). The LM head is quantization_lm_head in the last four. A checkpoint written by
    # `tokenmill quantize` is already quantized (leave this "auto").
    quantization: str | None = "auto"
    quantization_group_size: int = 32
    # The LM head's format: "auto" (int8 when quantizing on load, as stored under quantization
    # "auto"), or, quantizing on load or over a GGUF file's head under "auto": "int8" (weight-only,
    # per output channel), "int4" (weight-only, groups of quantization_group_size: fewer bytes a
    # token where the head is a large part of the model, as an untied 150k vocabulary is) or
    # "none" (dense in dtype).
    quantization_lm_head: str = "auto"
    # How the codes are chosen: "rtn" (round-to-nearest) or calibrated on
    # calibration_samples windows of calibration_seq_len tokens of `calibration` ("gsm8k",
    # "gpl3" or a .txt/.jsonl path): "awq" or "gptq" (int4), "smoothquant" (w8a8, migration
    # strength smoothquant_alpha, None = searched per layer).
    quantization_algorithm: str = "rtn"
    calibration: str = "gsm8k"
    calibration_samples: int = 64
    calibration_seq_len: int = 512
    smoothquant_alpha: float | None = None
    # torch intra-op threads on CPU; None = the number of physical cores.
    num_threads: int | None = None
    # Longest prompt + output a request may have; None = the model's context length.
    max_model_len: int | None = None
    # KV cache: tokens per block, and the memory budget for all blocks of all layers (GiB).
    # None = auto: CPU_KV_CACHE_MEMORY_GB on CPU; on CUDA, what gpu_memory_utilization leaves
    # once the weights are loaded and a worst-case step has been profiled (worker/memory.py).
    block_size: int = 16
    kv_cache_memory_gb: float | None = None
    # CUDA only, with kv_cache_memory_gb and num_kv_blocks unset: the fraction of the GPU's
    # memory, in (0, 1], that may be in use once the KV cache is allocated. Everything already
    # on the device counts against it: weights, the profiled step's peak activations, the CUDA
    # context and workspaces, and other processes' memory; the KV cache gets the rest.
    gpu_memory_utilization: float = 0.9
    # What the KV cache stores: "auto" (the compute dtype) or "int8" / "fp8" (e4m3) codes with
    # one float32 scale per token and KV head, quantized on write: ~1.9x the blocks of bf16.
    kv_cache_dtype: str = "auto"
    # Overrides the block count computed from kv_cache_memory_gb or gpu_memory_utilization (tests
    # use it to force preemption).
    num_kv_blocks: int | None = None
    # Scheduler: token budget per engine step and the most requests running at once.
    # Prefix caching: full KV blocks are shared by hash between requests with the same prefix.
    enable_prefix_caching: bool = True
    # Host memory that preempted requests' KV blocks are swapped out to (0 = always recompute);
    # num_host_kv_blocks overrides the block count computed from it.
    swap_space_gb: float = 1.0
    num_host_kv_blocks: int | None = None
    # Prefix-cache tiers below the device pool (core/cache_tiers.py): host memory (GiB, 0 = off)
    # that evicted prefix blocks are demoted to, separate from the swap space; and with it a
    # directory they are written through to, at most disk_cache_gb of block files, read back
    # after a restart by an engine of the same model, precision and layout.
    host_cache_gb: float = 0.0
    disk_cache_dir: str | None = None
    disk_cache_gb: float = 16.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    enable_chunked_prefill: bool = True
    # Seed of the sampler's shared generator (requests with their own seed ignore it).
    seed: int = 0
    # Speculative decoding: None (off), "ngram" (prompt lookup: drafts copied from earlier in
    # the request's own tokens, matching its last speculative_ngram_min..max tokens), "suffix"
    # (suffix decoding: the most frequent continuation of the longest matching suffix, in the
    # request's own tokens and in a bounded store of earlier requests' outputs; the n-gram
    # lookup's draft where it finds none) or "draft" (a smaller model with the same
    # vocabulary, draft_model, proposes them). A decoding
    # request verifies up to num_speculative_tokens drafts in one step and emits 1 to k + 1
    # tokens; the output distribution is unchanged (greedy output is token-identical).
    speculative_method: str | None = None
    num_speculative_tokens: int = 4
    speculative_ngram_min: int = 2
    speculative_ngram_max: int = 4
    draft_model: str | None = None
    # Adaptive speculation: the engine measures at start what a step of n tokens costs (cached
    # per model, precision and host), and each step every request verifies the number of its
    # drafts (up to num_speculative_tokens) that maximises expected tokens per second, from its
    # recent acceptance; when the step is such that drafts do not pay (many requests running:
    # compute-bound), nobody speculates (core/draft_plan.py). Off: always up to
    # num_speculative_tokens. speculative_max_running, if set, turns speculation off in a step
    # while more requests than that are running or waiting.
    speculative_adaptive: bool = True
    speculative_max_running: int | None = None
    # Activation sparsity (TEAL, training-free; layers/sparsity.py): on decode steps, the entries
    # of each decoder layer's linear inputs below a per-layer threshold in magnitude are set to
    # zero, the thresholds those that zero this share of the entries in calibration (0 = off).
    # They come from activation_sparsity_file, else from the file `tokenmill calibrate-sparsity`
    # wrote for this model (sparsity/thresholds.py says where the engine looks). Prefill stays
    # dense unless activation_sparsity_prefill (accuracy measurements: every scored prompt token
    # sparsified).
    activation_sparsity: float = 0.0
    activation_sparsity_file: str | None = None
    activation_sparsity_prefill: bool = False
    # One model over several ranks (executor/, distributed/): tensor parallelism splits every
    # layer's heads and MLP over tensor_parallel_size ranks (one all-reduce per sublayer),
    # pipeline parallelism its layers into pipeline_parallel_size stages (micro-batches in
    # flight). The ranks are processes: gloo on CPU, NCCL on CUDA. On one machine the engine
    # spawns them; across machines each of nnodes runs the same command with its node_rank, rank 0
    # (node 0) at master_addr:master_port (None: a free port on one machine, 29500 across several).
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    # Testing only: a fault the engine injects into its own step (faults.py:
    # "raise@step=N" or "stall@step=N:seconds=S"). The CLI reads it from the
    # TOKENMILL_FAULT_INJECT environment variable at start-up; there is no flag.
    fault_injection: str | None = None

    def __post_init__(self) -> None:
        # The checks run in this order and raise at the first value out of range.
        self._check_device()
        self._check_quantization()
        self._check_scheduler_limits()
        self._check_kv_cache()
        self._check_speculation()
        self._check_activation_sparsity()
        self._check_parallel()
        if self.block_size & (self.block_size - 1):  # (an integer >= 1 by now: _check_scheduler_limits)
            raise ConfigError("block_size", f"must be a power of two, got {self.block_size}")
        if self.fault_injection is not None:
            try:
                FaultPlan.parse(self.fault_injection)
            except ValueError as e:
                raise ConfigError("fault_injection", str(e)) from None

    def _check_device(self) -> None:
        """Dtype, device, CPU level and attention backend: each one of its choices."""
        if self.dtype not in DTYPES:
            raise ConfigError("dtype", f"must be one of {DTYPES}, got {self.dtype!r}")
        if self.device not in DEVICES:
            raise ConfigError("device", f"must be one of {DEVICES}, got {self.device!r}")
        if self.cpu_isa != "auto" and self.cpu_isa not in ISA_LEVELS:
            raise ConfigError("cpu_isa", f"must be 'auto' or one of {ISA_LEVELS}, got {self.cpu_isa!r}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ConfigError("attention_backend", f"must be one of {ATTENTION_BACKENDS}, got {self.attention_backend!r}")

    def _check_quantization(self) -> None:
        """The weight format, its LM head, group size and algorithm, and the calibration."""
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ConfigError("quantization", f"must be one of {QUANTIZATION_CHOICES} or None, got {self.quantization!r}")
        if self.quantization_lm_head not in LM_HEAD_CHOICES:
            raise ConfigError("quantization_lm_head", f"must be one of {LM_HEAD_CHOICES}, got {self.quantization_lm_head!r}")
        if self.quantization_lm_head != "auto" and self.quantization not in ("auto", *QUANTIZATION_METHODS):
            raise ConfigError("quantization_lm_head", f"applies when quantizing on load (quantization one of "
                              f"{QUANTIZATION_METHODS}) or to a GGUF file's head under 'auto', not with quantization "
                              f"{self.quantization!r}")
        if self.quantization_group_size not in INT4_GROUP_SIZES:
            raise ConfigError("quantization_group_size", f"must be one of {INT4_GROUP_SIZES}, got {self.quantization_group_size!r}")
        if self.quantization_algorithm not in QUANTIZATION_ALGORITHMS:
            raise ConfigError("quantization_algorithm", f"must be one of {tuple(QUANTIZATION_ALGORITHMS)}, got {self.quantization_algorithm!r}")
        if self.quantization_algorithm != "rtn" and self.quantization not in QUANTIZATION_ALGORITHMS[self.quantization_algorithm]:
            raise ConfigError("quantization_algorithm", f"{self.quantization_algorithm} applies to quantization "
                              f"{' or '.join(QUANTIZATION_ALGORITHMS[self.quantization_algorithm])}, not {self.quantization!r}")
        _check_min("calibration_samples", self.calibration_samples, 1)
        _check_min("calibration_seq_len", self.calibration_seq_len, 16)
        if self.smoothquant_alpha is not None and not 0 <= self.smoothquant_alpha <= 1:
            raise ConfigError("smoothquant_alpha", f"must be in [0, 1] or None, got {self.smoothquant_alpha!r}")

    def _check_scheduler_limits(self) -> None:
        """Block size, the step's token budget, running requests, threads and context length."""
        _check_min("block_size", self.block_size, 1)
        _check_min("max_num_batched_tokens", self.max_num_batched_tokens, 1)
        _check_min("max_num_seqs", self.max_num_seqs, 1)
        if self.num_threads is not None:
            _check_min("num_threads", self.num_threads, 1)
        if self.max_model_len is not None:
            _check_min("max_model_len", self.max_model_len, 1)

    def _check_kv_cache(self) -> None:
        """The KV cache's size and dtype, swap space, and the host and disk tiers of the prefix cache."""
        if self.num_kv_blocks is not None:
            _check_min("num_kv_blocks", self.num_kv_blocks, 1)
        if self.num_host_kv_blocks is not None:
            _check_min("num_host_kv_blocks", self.num_host_kv_blocks, 0)
        if not self.swap_space_gb >= 0:
            raise ConfigError("swap_space_gb", f"must be >= 0, got {self.swap_space_gb}")
        if not (_is_number(self.host_cache_gb) and self.host_cache_gb >= 0):
            raise ConfigError("host_cache_gb", f"must be >= 0, got {self.host_cache_gb!r}")
        if not (_is_number(self.disk_cache_gb) and self.disk_cache_gb > 0):
            raise ConfigError("disk_cache_gb", f"must be > 0, got {self.disk_cache_gb!r}")
        if self.disk_cache_dir is not None and not self.host_cache_gb > 0:
            raise ConfigError("disk_cache_dir", "the disk tier is read and written through host memory: "
                              "set host_cache_gb > 0 too")
        if self.kv_cache_memory_gb is not None and not (_is_number(self.kv_cache_memory_gb) and self.kv_cache_memory_gb > 0):
            raise ConfigError("kv_cache_memory_gb", f"must be > 0 or None (auto), got {self.kv_cache_memory_gb!r}")
        if not (_is_number(self.gpu_memory_utilization) and 0 < self.gpu_memory_utilization <= 1):
            raise ConfigError("gpu_memory_utilization", f"must be in (0, 1], got {self.gpu_memory_utilization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ConfigError("kv_cache_dtype", f"must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")

    def _check_speculation(self) -> None:
        """The speculative method, its draft model and how many tokens it drafts and looks up."""
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise ConfigError("speculative_method", f"must be one of {SPECULATIVE_METHODS} or None, got {self.speculative_method!r}")
        if (self.speculative_method == "draft") != (self.draft_model is not None):
            raise ConfigError("draft_model", "a draft model is given exactly when speculative_method is 'draft'")
        _check_min("num_speculative_tokens", self.num_speculative_tokens, 1)
        _check_min("speculative_ngram_min", self.speculative_ngram_min, 1)
        _check_min("speculative_ngram_max", self.speculative_ngram_max, self.speculative_ngram_min)
        if self.speculative_max_running is not None:
            _check_min("speculative_max_running", self.speculative_max_running, 1)

    def _check_activation_sparsity(self) -> None:
        if not (_is_number(self.activation_sparsity) and 0 <= self.activation_sparsity <= MAX_ACTIVATION_SPARSITY):
            raise ConfigError("activation_sparsity", f"must be in [0, {MAX_ACTIVATION_SPARSITY}], got {self.activation_sparsity!r}")

    def _check_parallel(self) -> None:
        """Ranks and nodes, and what a model split over ranks cannot run."""
        _check_min("tensor_parallel_size", self.tensor_parallel_size, 1)
        _check_min("pipeline_parallel_size", self.pipeline_parallel_size, 1)
        _check_min("nnodes", self.nnodes, 1)
        if not (isinstance(self.node_rank, int) and 0 <= self.node_rank < self.nnodes):
            raise ConfigError("node_rank", f"must be in 0..nnodes-1 ({self.nnodes - 1}), got {self.node_rank!r}")
        if self.world_size % self.nnodes:
            raise ConfigError("nnodes", f"{self.nnodes} nodes cannot share {self.world_size} ranks evenly "
                              "(tensor_parallel_size x pipeline_parallel_size)")
        if self.world_size > 1 and self.speculative_method == "draft":
            raise ConfigError("speculative_method", "a draft model does not run split over ranks; use ngram")
        if self.world_size > 1 and self.quantization_algorithm != "rtn":
            raise ConfigError("quantization_algorithm", f"{self.quantization_algorithm} calibrates one process's model; "
                              "a model split over ranks takes rtn")
        if self.world_size > 1 and self.disk_cache_dir is not None:
            raise ConfigError("disk_cache_dir", "the prefix cache's disk tier (--disk-cache-dir) holds one process's "
                              "KV cache; a model split over ranks (--tensor-parallel-size, --pipeline-parallel-size) "
                              "keeps its prefix cache in device and host memory (--host-cache-gb), each rank its own "
                              "heads' and layers' blocks")
        if self.world_size > 1 and self.activation_sparsity > 0:
            raise ConfigError("activation_sparsity", "the thresholds apply to one process's model; a model split over "
                              "ranks runs dense (activation_sparsity 0)")
        if self.master_port is not None and not (isinstance(self.master_port, int) and 0 < self.master_port < 65536):
            raise ConfigError("master_port", f"must be a TCP port 1..65535 or None, got {self.master_port!r}")

    @property
    def world_size(self) -> int:
        """The ranks one model is split over."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @classmethod
    def from_kwargs(cls, **kwargs) -> "EngineConfig":
        """Build from keyword arguments, naming any key that is not a config field."""
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ConfigError(unknown[0], f"unknown config key(s) {unknown}; known keys: {sorted(known)}")
        return cls(**kwargs)

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self, device: str) -> str:
        if self.dtype == "auto":
            if device == "cuda":
                return "bfloat16"
            return "bfloat16" if native_bf16(self.resolved_cpu_isa()) else "float32"
        if device == "cpu" and self.dtype == "float16":
            raise ConfigError("dtype", "float16 is not supported on CPU; use bfloat16 or float32")
        return self.dtype

    def resolved_cpu_isa(self) -> str:
        """The CPU kernels' instruction-set level: the one given (checked to run here), else the
        host's (TOKENMILL_CPU_ISA caps it for the whole process)."""
        try:
            host = host_isa()
        except ValueError as e:
            raise ConfigError("cpu_isa", str(e)) from None
        if self.cpu_isa == "auto":
            return host
        if ISA_LEVELS.index(self.cpu_isa) > ISA_LEVELS.index(host):
            raise ConfigError("cpu_isa", f"{self.cpu_isa} is above this host's level {host} "
                              f"(levels, lowest first: {', '.join(ISA_LEVELS)})")
        return self.cpu_isa

    def resolved_attention_backend(self, device: str) -> str:
        """The backend to build: "auto" resolved for `device`; "triton" checked to be runnable."""
        triton = _triton_mode()
        if self.attention_backend == "auto":
            return "triton" if device == "cuda" and triton is not None else "torch"
        if self.attention_backend == "triton":
            if triton is None:
                raise ConfigError("attention_backend", "triton needs the triton package (pip install 'tokenmill[triton]')")
            if device != "cuda" and triton != "interpreter":
                raise ConfigError("attention_backend", "triton runs on CUDA devices (on a CPU only in Triton's interpreter, "
                                  "TRITON_INTERPRET=1, which is for tests)")
        return self.attention_backend

    def resolved_num_threads(self) -> int:
        return self.num_threads or num_physical_cores()

    def resolved_kv_cache_memory_gb(self, device: str) -> float | None:
        """The KV-cache budget in GiB: the one given, else CPU_KV_CACHE_MEMORY_GB on CPU; None on
        CUDA means "size it from gpu_memory_utilization after profiling" (the model runner does)."""
        if self.kv_cache_memory_gb is not None:
            return self.kv_cache_memory_gb
        return None if device == "cuda" else CPU_KV_CACHE_MEMORY_GB


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _triton_mode() -> str | None:
    """None when Triton is not installed, "interpreter" when it runs kernels on the CPU, else "compiler"."""
    try:
        import triton
    except ImportError:
        return None
    return "interpreter" if triton.knobs.runtime.interpret else "compiler"


def _check_min(field: str, value: int, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(field, f"must be an integer >= {minimum}, got {value!r}")


def cpu_has_native_bf16() -> bool:
    """True when this process's CPU level computes bf16 natively (AVX-512 BF16)."""
    return native_bf16(host_isa())


def num_physical_cores() -> int:
    import psutil

    return psutil.cpu_count(logical=False) or os.cpu_count() or 1
