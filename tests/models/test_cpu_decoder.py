"""The compiled DecoderStack (csrc/cpu_decoder.cpp) against the Python decoder layers it stands
in for: a decode-only step through a model's forward with the stack and without it must give
bit-identical hidden states and KV caches, for every linear format it runs (bf16 oneDNN, fp32
dense, weight-only int8 on both sides of its row threshold, int4 with and without an input
scale), q/k/v biases (Qwen2), and an int8 KV cache. Also: when it is used and when it is not."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_kernels
from tokenmill.layers.attention import BatchLayout

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"CPU kernels not built here: {cpu_kernels.build_error()}")


def decode_step(runner, seq_lens: list[int], seed: int = 0):
    """A decode-only step over random caches: (input_ids, positions, caches, layout). Sequence i
    owns consecutive blocks from a distinct start; its new token sits at position len - 1."""
    gen = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    caches = []
    for layer in runner.kv_caches:  # (key, value), or int8 (codes, codes, scales, scales)
        if len(layer) == 4:
            codes = [torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8) for t in layer[:2]]
            caches.append((*codes, *(torch.rand(t.shape, generator=gen) * 0.02 for t in layer[2:])))
        else:
            caches.append(tuple(torch.randn(t.shape, generator=gen).to(t.dtype) for t in layer))
    tables, slots, next_block = [], [], 1
    for n in seq_lens:
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks) + 1
        tables.append(blocks)
        slots.append(blocks[(n - 1) // bs] * bs + (n - 1) % bs)
    assert next_block <= runner.num_blocks
    layout = BatchLayout(bs, slots, tables, list(seq_lens), [], [], [])
    input_ids = torch.randint(0, runner.model.config.vocab_size, (len(seq_lens),), generator=gen)
    positions = torch.tensor([n - 1 for n in seq_lens])
    return input_ids, positions, caches, layout


def assert_stack_matches_python(runner, seq_lens: list[int]):
    model = runner.model
    stack = model.cpu_decoder
    assert stack is not None
    input_ids, positions, caches, layout = decode_step(runner, seq_lens)
    results = []
    for decoder in (stack, None):
        model.cpu_decoder = decoder
        run_caches = [tuple(t.clone() for t in layer) for layer in caches]
        meta = model.attn_backend.build_metadata(layout, "cpu")
        with torch.inference_mode():
            results.append((model(input_ids, positions, run_caches, meta), run_caches))
    model.cpu_decoder = stack
    (hidden, stack_caches), (expected, python_caches) = results
    assert hidden.dtype == expected.dtype and torch.equal(hidden, expected)
    for a, b in zip(stack_caches, python_caches):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # and the step wrote something: the caches differ from the random ones they started as
    assert not all(torch.equal(x, y) for x, y in zip(stack_caches[0], caches[0]))


@pytest.fixture(scope="module")
def bf16_llm():
    return LLM("smollm2-135m", dtype="bfloat16")


@pytest.fixture(scope="module")
def bf16_runner(bf16_llm):
    return bf16_llm.engine.core.runner


@pytest.mark.parametrize("seq_lens", [[37], [1, 16, 17, 90, 200]])
def test_bf16_onednn_linears(bf16_runner, seq_lens):
    assert bf16_runner.model.layers[0].self_attn.qkv_proj.packed
    assert_stack_matches_python(bf16_runner, seq_lens)


@pytest.mark.parametrize("options,seq_lens", [
    ({"quantization": "int4"}, [5, 40, 33]),  # int4_linear (<= 3 rows)
    ({"quantization": "int4"}, [5, 40, 33, 7, 90, 12]),  # PyTorch's int4 kernel (4-23 rows)
    ({"quantization": "int4"}, list(range(1, 31))),  # int4_gemm (>= 24 rows)
    ({"quantization": "int8"}, [3, 70]),  # the int8 kernel (<= 16 rows)
    ({"quantization": "int8"}, list(range(1, 41))),  # int8_gemm (> 16 rows)
    ({"kv_cache_dtype": "int8"}, [9, 130]),
])
def test_quantized_linears_and_kv_cache(options, seq_lens):
    runner = LLM("smollm2-135m", dtype="bfloat16", **options).engine.core.runner
    assert_stack_matches_python(runner, seq_lens)


def test_qwen2_biases_fp32_and_int4_input_scales(tiny_qwen2_dir):
    runner = LLM(str(tiny_qwen2_dir), dtype="float32").engine.core.runner
    assert runner.model.layers[0].self_attn.qkv_proj.bias is not None
    assert_stack_matches_python(runner, [2, 19, 50])

    runner = LLM(str(tiny_qwen2_dir), dtype="bfloat16", quantization="int4").engine.core.runner
    model = runner.model
    gen = torch.Generator().manual_seed(1)
    for layer in model.layers:  # as AWQ leaves them: x * input_scale before the matmul
        for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            lin.input_scale = (torch.rand(lin.in_features, generator=gen) + 0.5).to(torch.bfloat16)
    assert model.enable_cpu_decoder(kernels)
    assert_stack_matches_python(runner, [2, 19, 50])


def test_used_for_decode_only_steps_only(bf16_llm, monkeypatch):
    model = bf16_llm.engine.core.runner.model
    stack, rows = model.cpu_decoder, []

    class Spy:
        def forward(self, x, *args):
            rows.append(x.shape[0])
            return stack.forward(x, *args)

    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[100, 200, 300] * 4, [7, 8, 9] * 5]
    monkeypatch.setattr(model, "cpu_decoder", Spy())
    out = [o.outputs[0].token_ids for o in bf16_llm.generate(prompts, params)]
    assert rows == [2] * 5  # the prefill step ran the Python layers, each decode step the stack
    monkeypatch.setattr(model, "cpu_decoder", None)
    assert [o.outputs[0].token_ids for o in bf16_llm.generate(prompts, params)] == out


def test_not_built_without_kernels_or_for_w8a8():
    assert LLM("smollm2-135m", dtype="bfloat16", quantization="w8a8").engine.core.runner.model.cpu_decoder is None
    assert LLM("smollm2-135m", dtype="bfloat16", cpu_kernels=False).engine.core.runner.model.cpu_decoder is None
