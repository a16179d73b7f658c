"""Decode steps replayed from CUDA graphs captured at bucketed batch sizes.

A decode-only step of n requests is padded to the smallest captured size b >= n and runs as one
graph replay: no per-layer kernel launches from Python, which at small batches cost more than
the kernels themselves. Everything the graph reads lives in static buffers filled before each
replay: token ids, positions, cache slots, block tables (as wide as max_model_len needs) and
lengths. Padding rows carry slot -1 (the KV write skips them) and length 0 (attention returns
zeros), so they touch no request's cache.

The split-K decode is captured with the split count for max_model_len (`decode_num_splits`),
whatever the step's contexts: a known cost, and a small one. The count is bounded by the GPU's
SM count (about two programs per SM over the bucket's sequences and KV heads: one split from
2 x SMs / KV heads sequences up) and each split covers whole 64-key tiles, so a short context
fills its first few splits and the rest are programs that read no key and leave an empty
partial; what is paid is those programs and the combine kernel's read of every split's partial.

`decode_graphs_unavailable` decides whether graphs are captured at all: on CUDA, with the Triton
attention backend (its metadata is fixed-shape tensors, while the PyTorch backend's decode
groups change shape with the batch's lengths), without enforce_eager, a draft model, ranks or
experts. Prefill steps, steps with drafts to verify, and batches above the largest bucket run
eagerly.

The graphs' memory pool is not there when the KV cache is sized: the runner reserves twice the
peak of one eager run of the largest size's padded step (`run_largest`) for it.

On a CPU there is nothing to capture: `DecodeGraphs(..., capture=False)` runs the same padded
static-buffer forward eagerly, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.config import EngineConfig
from tokenmill.layers.attention import BatchLayout
from tokenmill.models.loader.arch import ModelArchConfig

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # the largest captured decode batch (bounded further by max_num_seqs)


def decode_graphs_unavailable(config: EngineConfig, arch: ModelArchConfig, device_type: str) -> str | None:
    """Why decode steps run eagerly rather than from CUDA graphs, or None when graphs are
    captured. The one place this is decided."""
    if device_type != "cuda":
        return "not on CUDA"
    if config.enforce_eager:
        return "enforce_eager"
    if config.resolved_attention_backend(device_type) != "triton":
        return "the torch attention backend's decode groups change shape with the batch's lengths"
    if config.speculative_method == "draft":
        return "a draft model (its forward in the step reuses the eager step's inputs)"
    if config.world_size > 1:
        return "the model is split over ranks"
    if arch.num_experts:
        return ("experts: each MoE layer reads its experts' token counts on the host (a sync) and runs a matmul "
                "per expert with tokens, which a graph cannot replay")
    return None


def graph_batch_sizes(max_batch: int) -> list[int]:
    """Captured sizes: 1, 2, 4, 8, then every 8 up to 64, every 32 up to 256, capped at max_batch
    (which is always included)."""
    sizes = [1, 2, 4] + list(range(8, 65, 8)) + list(range(96, 257, 32))
    return sorted({s for s in sizes if s < max_batch} | {max_batch})


class DecodeGraphs:
    def __init__(self, model, kv_caches, max_batch: int, block_size: int, max_model_len: int, device: torch.device,
                 capture: bool = True):
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = device
        self.sizes = graph_batch_sizes(max_batch)
        width = -(-max_model_len // block_size)
        n = self.sizes[-1]
        # The static inputs, as views of two device buffers: (ids, positions, slots) as int64
        # rows, and lengths then tables as int32, so a step uploads them in three copies, each
        # from a contiguous stretch of a pinned host buffer (filled through numpy, no tensor per row).
        self._dev_long = torch.zeros((3, n), dtype=torch.long, device=device)
        self._dev_int = torch.zeros(n + n * width, dtype=torch.int32, device=device)
        self.input_ids, self.positions, self.slots = self._dev_long
        self.slots.fill_(-1)
        self.seq_lens = self._dev_int[:n]
        self.block_tables = self._dev_int[n:].view(n, width)
        pin = torch.device(device).type == "cuda"
        self._host_long = torch.zeros(3 * n, dtype=torch.long, pin_memory=pin)
        self._host_int = torch.zeros(n + n * width, dtype=torch.int32, pin_memory=pin)
        self._host_long_np, self._host_int_np = self._host_long.numpy(), self._host_int.numpy()
        self._uploaded = torch.cuda.Event() if pin else None  # the last step's copies have read the host buffers
        self._empty = torch.zeros((0, width), dtype=torch.int32, device=device)
        self._zero = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
        self.pool_bytes = 0
        if capture:
            self._capture()

    def _forward(self, size: int) -> torch.Tensor:
        from tokenmill.layers.attention.triton_backend import PagedAttentionMetadata  # imports Triton

        meta = PagedAttentionMetadata(
            num_decodes=size,
            slot_mapping=self.slots[:size],
            decode_block_tables=self.block_tables[:size],
            decode_seq_lens=self.seq_lens[:size],
            decode_max_seq_len=self.max_model_len,
            num_prefills=0,
            prefill_block_tables=self._empty,
            prefill_query_start=self._zero,
            prefill_seq_lens=self._zero[:0],
            prefill_max_query_len=0,
        )
        return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, meta)

    @torch.inference_mode()
    def _capture(self) -> None:
        """Capture every size, largest first, all in one memory pool (each replay's activations
        reuse the same memory). Static buffers hold padding (slot -1, length 0) while capturing,
        so the warm-up runs write nothing to the cache."""
        t0 = time.perf_counter()
        reserved_before = torch.cuda.memory_reserved(self.device)
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: CUDA calls of other threads (the server's) during the capture do not
            # invalidate it (the engine captures on its own thread when serving).
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        # Not in the start-up memory profile (the graphs need the real KV cache): the pool is the
        # activations of one decode step of the largest size, held from here on.
        self.pool_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        logger.info("captured CUDA graphs of decode steps at batch sizes %s in %.1fs (memory pool %.0f MiB)",
                    self.sizes, self.capture_seconds, self.pool_bytes / 2**20)

    @torch.inference_mode()
    def run_largest(self) -> torch.Tensor:
        """The largest size's step with every row padding, eagerly: the forward its graph
        captures (the memory profile runs it)."""
        return self._forward(self.sizes[-1])

    def fits(self, num_decodes: int) -> bool:
        return num_decodes <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], layout: BatchLayout) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n <= max_batch requests."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        total = self.sizes[-1]
        if self._uploaded is not None:
            self._uploaded.synchronize()  # (the step's sampling has synced already: returns at once)
        host, host_int = self._host_long_np[: 3 * size].reshape(3, size), self._host_int_np
        host[0, :n], host[1, :n], host[2, :n] = input_ids, positions, layout.slots
        host[:2, n:], host[2, n:] = 0, -1  # padding rows: token 0 at 0, no cache slot
        host_int[:n] = layout.decode_seq_lens
        host_int[n:size] = 0
        # Table columns up to the longest table: the kernels read no block past a row's length,
        # so a shorter row's stale tail is never used.
        cols = max(len(t) for t in layout.decode_tables)
        tables = host_int[total : total + size * cols].reshape(size, cols)
        for i, table in enumerate(layout.decode_tables):
            tables[i, : len(table)] = table
        self._dev_long[:, :size].copy_(self._host_long[: 3 * size].view(3, size), non_blocking=True)
        self.seq_lens[:size].copy_(self._host_int[:size], non_blocking=True)
        self.block_tables[:size, :cols].copy_(self._host_int[total : total + size * cols].view(size, cols),
                                              non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
