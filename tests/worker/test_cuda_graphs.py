"""Whether decode steps replay CUDA graphs: the one rule, checked on plain config objects (the
capture itself needs a GPU; tests/engine/test_triton_backend.py runs the padded steps eagerly)."""

from __future__ import annotations

import dataclasses

import pytest

from tokenmill.config import EngineConfig
from tokenmill.models.loader import load_checkpoint
from tokenmill.worker.cuda_graphs import decode_graphs_unavailable


@pytest.fixture(scope="module")
def arch(tiny_qwen2_dir):
    return load_checkpoint(tiny_qwen2_dir).config


def test_graphs_on_cuda_with_the_triton_backend(arch):
    pytest.importorskip("triton")
    assert decode_graphs_unavailable(EngineConfig(), arch, "cuda") is None
    assert decode_graphs_unavailable(EngineConfig(attention_backend="triton"), arch, "cuda") is None


@pytest.mark.parametrize(
    "kw, device, reason",
    [
        ({}, "cpu", "not on CUDA"),
        ({"enforce_eager": True}, "cuda", "enforce_eager"),
        ({"attention_backend": "torch"}, "cuda", "torch attention backend"),
        ({"speculative_method": "draft", "draft_model": "unused"}, "cuda", "draft model"),
        ({"tensor_parallel_size": 2}, "cuda", "split over ranks"),
        ({"pipeline_parallel_size": 2}, "cuda", "split over ranks"),
    ],
)
def test_graphs_off_and_why(arch, kw, device, reason):
    pytest.importorskip("triton")
    assert reason in decode_graphs_unavailable(EngineConfig(**kw), arch, device)


def test_experts_run_eagerly(arch):
    """MoEMLP reads its per-expert token counts on the host and loops over the experts with
    tokens: not capturable, so a model with experts decodes eagerly."""
    pytest.importorskip("triton")
    moe = dataclasses.replace(arch, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    assert "experts" in decode_graphs_unavailable(EngineConfig(), moe, "cuda")
    assert decode_graphs_unavailable(EngineConfig(enforce_eager=True), moe, "cuda") == "enforce_eager"
