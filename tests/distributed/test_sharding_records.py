"""A row-parallel rank's input columns of a quantized record (distributed/sharding.py): every
per-group part sliced on the groups, and a GGUF Q4_K / Q6_K record's super-block factors kept only
where the rank's columns fall on super-blocks of 256."""

from __future__ import annotations

import torch

from tokenmill.distributed.sharding import _columns
from tokenmill.layers.quantization.formats import dequantize_record


def q4_k_record(rows: int, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    factors = torch.randint(0, 64, (rows, k // 32, 2), generator=g).to(torch.uint8)
    super_factors = torch.rand(rows, k // 256, 2, generator=g).half()
    scales, mins = (super_factors[..., i].float().repeat_interleave(8, 1) * factors[..., i] for i in (0, 1))
    return {"codes": torch.randint(0, 256, (rows, k // 2), generator=g).to(torch.uint8), "scales": scales,
            "mins": mins, "factors": factors, "super_factors": super_factors}


def test_a_share_on_super_blocks_keeps_the_factors():
    record = q4_k_record(8, 1024)
    part = _columns(record, range(256, 768))
    assert part["factors"].shape == (8, 16, 2) and part["super_factors"].shape == (8, 2, 2)
    assert torch.equal(part["super_factors"], record["super_factors"][:, 1:3])
    made = part["super_factors"][..., 0].float().repeat_interleave(8, 1) * part["factors"][..., 0]
    assert torch.equal(made, part["scales"])
    whole = dequantize_record("int4", record)
    assert torch.equal(dequantize_record("int4", part), whole[:, 256:768])


def test_a_share_that_splits_a_super_block_keeps_scales_and_mins_alone():
    record = q4_k_record(8, 1024)
    part = _columns(record, range(0, 640))  # 2.5 super-blocks
    assert set(part) == {"codes", "scales", "mins"}
    assert torch.equal(dequantize_record("int4", part), dequantize_record("int4", record)[:, :640])


def test_a_q6_k_records_factors_follow_its_groups_of_16():
    g = torch.Generator().manual_seed(1)
    factors = torch.randint(-128, 128, (8, 32), generator=g).to(torch.int8)
    super_factors = torch.rand(8, 2, generator=g).half()
    record = {"codes": torch.randint(0, 64, (8, 512), generator=g).to(torch.uint8),
              "scales": super_factors.float().repeat_interleave(16, 1) * factors, "factors": factors,
              "super_factors": super_factors}
    part = _columns(record, range(256, 512))
    assert torch.equal(part["factors"], factors[:, 16:]) and torch.equal(part["super_factors"], super_factors[:, 1:])
    assert set(_columns(record, range(0, 128))) == {"codes", "scales"}
