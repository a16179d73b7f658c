"""The Triton attention backend: the kernels of `triton_kernels` behind the backend interface.

Its metadata is the step as flat tensors - block tables padded to a common width, int32
lengths, prefix offsets of the prefill chunks - which is what the kernels index, and what a
captured CUDA graph's static buffers hold. Each layer then costs four kernel launches: the KV
write, the split-K decode and its combine, and the varlen prefill.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenmill.layers.attention.backend import BatchLayout
from tokenmill.layers.attention.triton_kernels import MAX_DECODE_SPLITS, paged_decode, paged_prefill, write_kv
from tokenmill.layers.step_inputs import StepInputs

# Split-K decode: enough programs to fill the GPU (ideally ~2 per SM), but never splits shorter
# than MIN_SPLIT_TOKENS keys (each split is a partial output to write and combine), and at most
# MAX_DECODE_SPLITS.
MIN_SPLIT_TOKENS = 128


def decode_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """How many splits each decode's keys are cut into: as many as it takes for num_seqs x
    num_kv_heads x splits programs to give every SM two, bounded by the longest sequence's
    length in MIN_SPLIT_TOKENS and by MAX_DECODE_SPLITS."""
    wanted = -(-2 * num_sms // max(1, num_seqs * num_kv_heads))
    by_length = max(1, -(-max_seq_len // MIN_SPLIT_TOKENS))
    return max(1, min(wanted, by_length, MAX_DECODE_SPLITS))


@dataclass
class PagedAttentionMetadata:
    num_decodes: int
    slot_mapping: torch.Tensor  # [num_tokens] int64
    decode_block_tables: torch.Tensor  # [num_decodes, width] int32, padded with block 0
    decode_seq_lens: torch.Tensor  # [num_decodes] int32, the new token included
    decode_max_seq_len: int  # bounds the split count (decode_num_splits)
    num_prefills: int
    prefill_block_tables: torch.Tensor  # [num_prefills, width] int32
    prefill_query_start: torch.Tensor  # [num_prefills + 1] int32, offsets within the prefill tokens
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, the chunk included
    prefill_max_query_len: int


class TritonAttentionBackend:
    """Paged attention in Triton kernels: CUDA, or Triton's CPU interpreter (tests)."""

    def __init__(self, num_sms: int | None = None):
        if num_sms is None:
            # The device the engine runs on is CUDA's current one (`--device cuda`).
            num_sms = (torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
                       if torch.cuda.is_available() else 4)
        self.num_sms = num_sms

    def build_metadata(self, layout: BatchLayout, device, inputs: StepInputs | None = None) -> PagedAttentionMetadata:
        """The step's metadata. With `inputs` its tensors are views of that step's upload, valid
        once the caller has called `inputs.upload()` (with the token ids and positions it
        staged there too); without, this call uploads them itself."""
        staged = inputs if inputs is not None else StepInputs(device, pin=False)
        query_start = [0]
        for n in layout.prefill_query_lens:
            query_start.append(query_start[-1] + n)
        meta = PagedAttentionMetadata(
            num_decodes=len(layout.decode_tables),
            slot_mapping=staged.longs(layout.slots),
            decode_block_tables=staged.table(layout.decode_tables),  # padded with block 0
            decode_seq_lens=staged.ints(layout.decode_seq_lens),
            decode_max_seq_len=max(layout.decode_seq_lens, default=0),
            num_prefills=len(layout.prefill_query_lens),
            prefill_block_tables=staged.table(layout.prefill_tables),
            prefill_query_start=staged.ints(query_start),
            prefill_seq_lens=staged.ints(layout.prefill_seq_lens),
            prefill_max_query_len=max(layout.prefill_query_lens, default=0),
        )
        if inputs is None:
            staged.upload()
        return meta

    def forward(self, query, key, value, kv_cache, meta: PagedAttentionMetadata, scale: float,
                kv_written: bool = False, window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """`window`: each query sees only the `window` latest keys, itself included (a sliding
        layer; a decode reads just those); `softcap`: scores become softcap * tanh(scores /
        softcap) before the mask. As `TorchAttentionBackend.forward`."""
        if not kv_written:
            write_kv(key, value, meta.slot_mapping, kv_cache)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        nd = meta.num_decodes
        if nd:
            # The keys a decode reads: its window at most (a constant per layer, so a captured
            # graph's split count stays the one it was captured with).
            max_keys = meta.decode_max_seq_len if window is None else min(window, meta.decode_max_seq_len)
            splits = decode_num_splits(nd, kv_cache[0].shape[2], max_keys, self.num_sms)
            paged_decode(query[:nd], kv_cache, meta.decode_block_tables, meta.decode_seq_lens, scale, splits, out[:nd],
                         window=window, softcap=softcap)
        if meta.num_prefills:
            paged_prefill(query[nd:], kv_cache, meta.prefill_block_tables, meta.prefill_query_start,
                          meta.prefill_seq_lens, meta.prefill_max_query_len, scale, out[nd:],
                          window=window, softcap=softcap)
        return out
