"""One step's forward pass through a pipeline of stages, in micro-batches so the stages overlap.

The step's flat batch (decodes, then prefill chunks) is cut between sequences into up to
`pp_size` micro-batches of about equal tokens. Stage s runs its layers over micro-batch i while
stage s + 1 runs micro-batch i - 1: the first stage embeds and sends each micro-batch on as soon
as its layers are done, middle stages receive, run and send, the last stage applies the final
norm. The last stage's hidden states then go to every rank, which computes the same logits.

Cutting keeps the batch's order, so a sequence admitted in the same step as the one that fills a
shared prefix block reads that block after it was written, as in one pass (each stage runs its
micro-batches in order).
"""

from __future__ import annotations

import torch

from tokenmill.distributed.group import ParallelGroup
from tokenmill.layers.attention import BatchLayout


def split_layout(layout: BatchLayout, parts: int) -> list[tuple[int, int, BatchLayout]]:
    """The batch cut between sequences into at most `parts` runs of about equal tokens:
    (first token, end token, the run's layout) each."""
    num_decodes = len(layout.decode_seq_lens)
    sizes = [1] * num_decodes + list(layout.prefill_query_lens)
    total = sum(sizes)
    cuts, done, start = [], 0, 0
    for i, size in enumerate(sizes):
        done += size
        if done * parts >= total * (len(cuts) + 1) or i == len(sizes) - 1:
            cuts.append((start, i + 1))
            start = i + 1
    runs = []
    for first, end in cuts:  # sequences [first, end)
        t0, t1 = sum(sizes[:first]), sum(sizes[:end])
        d0, d1 = min(first, num_decodes), min(end, num_decodes)
        p0, p1 = max(first - num_decodes, 0), max(end - num_decodes, 0)
        runs.append((t0, t1, BatchLayout(
            layout.block_size, layout.slots[t0:t1], layout.decode_tables[d0:d1], layout.decode_seq_lens[d0:d1],
            layout.prefill_query_lens[p0:p1], layout.prefill_seq_lens[p0:p1], layout.prefill_tables[p0:p1])))
    return runs


def pipeline_forward(model, group: ParallelGroup, input_ids: list[int], positions: list[int], layout: BatchLayout,
                     kv_caches: list) -> torch.Tensor:
    """This stage's part of the forward pass over the step's batch; returns the final hidden
    states [num_tokens, hidden] (the last stage's, on every rank)."""
    dev, dtype = group.device, model.norm.weight.dtype
    hidden_size = model.config.hidden_size
    outputs, sends = [], []
    for t0, t1, run in split_layout(layout, group.pp_size):
        meta = model.attn_backend.build_metadata(run, dev)
        if group.is_first_stage:
            x = model.embed(torch.tensor(input_ids[t0:t1], dtype=torch.long, device=dev))
        else:
            x = group.recv_prev((t1 - t0, hidden_size), dtype)
        x = model.run_layers(x, torch.tensor(positions[t0:t1], dtype=torch.long, device=dev), kv_caches, meta)
        if group.is_last_stage:
            outputs.append(model.norm(x))
        else:
            sends.append((group.send_next(x), x))  # x lives until its send completes
    for work, _ in sends:
        work.wait()
    hidden = torch.cat(outputs) if outputs else None
    return group.broadcast_from_last_stage(hidden, (len(input_ids), hidden_size), dtype)
