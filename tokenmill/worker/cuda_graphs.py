"""Decode steps replayed from CUDA graphs captured at bucketed batch sizes.

A decode-only step of n requests is padded to the smallest captured size b >= n and runs as one
graph replay: no per-layer kernel launches from Python, which at small batches cost more than
the kernels themselves. Everything the graph reads lives in static buffers filled before each
replay: token ids, positions, cache slots, block tables (as wide as max_model_len needs) and
lengths. Padding rows carry slot -1 (the KV write skips them) and length 0 (attention returns
zeros), so they touch no request's cache. The split-K decode is captured with the split count
for max_model_len, and each sequence cuts its own keys into that many splits.

Only the Triton attention backend is capturable: its metadata is fixed-shape tensors, while the
PyTorch backend's decode groups change shape with the batch's lengths. Prefill steps, steps
with drafts to verify, and batches above the largest bucket run eagerly.

On a CPU there is nothing to capture: `DecodeGraphs(..., capture=False)` runs the same padded
static-buffer forward eagerly, which is how the padding is tested without a GPU.
"""

from __future__ import annotations

import logging
import time

import torch

from tokenmill.layers.attention import BatchLayout

logger = logging.getLogger(__name__)

MAX_GRAPH_BATCH = 256  # the largest captured decode batch (bounded further by max_num_seqs)


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
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), -1, dtype=torch.long, device=device)
        self.block_tables = torch.zeros((n, width), dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self._empty = torch.zeros((0, width), dtype=torch.int32, device=device)
        self._zero = torch.zeros(1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture_seconds = 0.0
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
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)  # warm-up: Triton compiles, allocator settles
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - t0
        logger.info("captured CUDA graphs of decode steps at batch sizes %s in %.1fs", self.sizes, self.capture_seconds)

    def fits(self, num_decodes: int) -> bool:
        return num_decodes <= self.sizes[-1]

    @torch.inference_mode()
    def run(self, input_ids: list[int], positions: list[int], layout: BatchLayout) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step of n <= max_batch requests."""
        n = len(input_ids)
        size = next(s for s in self.sizes if s >= n)
        width = self.block_tables.shape[1]
        tables = torch.zeros((size, width), dtype=torch.int32)
        for i, table in enumerate(layout.decode_tables):
            tables[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        pad = size - n
        self.input_ids[:size].copy_(torch.tensor(input_ids + [0] * pad), non_blocking=True)
        self.positions[:size].copy_(torch.tensor(positions + [0] * pad), non_blocking=True)
        self.slots[:size].copy_(torch.tensor(layout.slots + [-1] * pad), non_blocking=True)
        self.seq_lens[:size].copy_(torch.tensor(layout.decode_seq_lens + [0] * pad, dtype=torch.int32), non_blocking=True)
        self.block_tables[:size].copy_(tables, non_blocking=True)
        if size in self.graphs:
            self.graphs[size].replay()
            return self.outputs[size][:n]
        return self._forward(size)[:n]
