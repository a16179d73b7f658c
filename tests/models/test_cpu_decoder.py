"""The compiled DecoderStack (csrc/cpu_decoder.cpp) against the Python decoder layers it stands
in for: a step through a model's forward with the stack and without it must give bit-identical
hidden states and KV caches, for decode-only steps and steps with prefill chunks, for every
linear format it runs (bf16 oneDNN, fp32 dense, weight-only int8 on both sides of its row
threshold, int4 with and without an input scale), q/k/v biases (Qwen2), and an int8 KV cache.
Also: when it is used and when it is not."""

from __future__ import annotations

import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.layers import cpu_kernels
from tokenmill.layers.attention import BatchLayout

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason=f"CPU kernels not built here: {cpu_kernels.build_error()}")
# The dtype the host's kernels compute in (dtype "auto"): bf16 with native bf16, fp32 below.
NATIVE_BF16 = kernels is not None and kernels.native_bf16()
DTYPE = "bfloat16" if NATIVE_BF16 else "float32"
needs_prefill_kernel = pytest.mark.skipif(kernels is None or torch.bfloat16 not in kernels.prefill_attention_dtypes(),
                                          reason="steps with prefill chunks run in the stack with the bf16 prefill "
                                                 "kernel (AVX-512 BF16)")


def model_step(runner, seq_lens: list[int], seed: int = 0, prefill: list[tuple[int, int]] = ()):
    """A step over random caches: (input_ids, positions, caches, layout). Decodes of `seq_lens`
    (sequence i's new token at position len - 1), then prefill chunks of (chunk length, context
    length incl. the chunk). Each sequence owns consecutive blocks from a distinct start."""
    gen = torch.Generator().manual_seed(seed)
    bs = runner.block_size
    caches = []
    for layer in runner.kv_caches:  # (key, value), or int8 (codes, codes, scales, scales)
        if len(layer) == 4:
            codes = [torch.randint(-127, 128, t.shape, generator=gen, dtype=torch.int8) for t in layer[:2]]
            caches.append((*codes, *(torch.rand(t.shape, generator=gen) * 0.02 for t in layer[2:])))
        else:
            caches.append(tuple(torch.randn(t.shape, generator=gen).to(t.dtype) for t in layer))
    tables, slots, positions, next_block = [], [], [], 1
    for q_len, n in [(1, n) for n in seq_lens] + list(prefill):
        blocks = list(range(next_block, next_block + -(-n // bs)))
        next_block += len(blocks) + 1
        tables.append(blocks)
        positions += range(n - q_len, n)
        slots += [blocks[p // bs] * bs + p % bs for p in range(n - q_len, n)]
    assert next_block <= runner.num_blocks
    d = len(seq_lens)
    layout = BatchLayout(bs, slots, tables[:d], list(seq_lens), [q for q, _ in prefill], [n for _, n in prefill],
                         tables[d:])
    input_ids = torch.randint(0, runner.model.config.vocab_size, (len(positions),), generator=gen)
    return input_ids, torch.tensor(positions), caches, layout


class CountingStack:
    """The DecoderStack, recording the rows of each step it runs and how many had prefill chunks."""

    def __init__(self, stack):
        self.stack, self.rows, self.prefill_steps = stack, [], 0

    def forward(self, x, *args):
        self.rows.append(x.shape[0])
        self.prefill_steps += args[-1] is not None  # (the prefill chunks' kernel arguments)
        return self.stack.forward(x, *args)


def assert_stack_matches_python(runner, seq_lens: list[int], prefill: list[tuple[int, int]] = ()):
    model = runner.model
    stack = model.cpu_decoder
    assert stack is not None
    input_ids, positions, caches, layout = model_step(runner, seq_lens, prefill=prefill)
    results = []
    spy = CountingStack(stack)
    for decoder in (spy, None):
        model.cpu_decoder = decoder
        run_caches = [tuple(t.clone() for t in layer) for layer in caches]
        meta = model.attn_backend.build_metadata(layout, "cpu")
        with torch.inference_mode():
            results.append((model(input_ids, positions, run_caches, meta), run_caches))
    model.cpu_decoder = stack
    assert spy.rows == [len(positions)]  # the stack ran the step
    (hidden, stack_caches), (expected, python_caches) = results
    assert hidden.dtype == expected.dtype and torch.equal(hidden, expected)
    for a, b in zip(stack_caches, python_caches):
        assert all(torch.equal(x, y) for x, y in zip(a, b))
    # and the step wrote something: the caches differ from the random ones they started as
    assert not all(torch.equal(x, y) for x, y in zip(stack_caches[0], caches[0]))


# Blocks of the engines' KV caches: far more than any step here uses (model_step asserts it),
# but not the 2 GiB default, which model_step would fill with random values and each step clone
# twice (most of a step's time; the tiny Qwen2's default is over 100k blocks).
NUM_KV_BLOCKS = 256


def cpu_llm(model: str, **kwargs) -> LLM:
    """An engine on the CPU (the DecoderStack's only device), whatever device the machine has."""
    return LLM(model, device="cpu", num_kv_blocks=NUM_KV_BLOCKS, **kwargs)


@pytest.fixture(scope="module")
def bf16_llm():
    return cpu_llm("smollm2-135m", dtype="bfloat16", quantization="none")


@pytest.fixture(scope="module")
def bf16_runner(bf16_llm):
    return bf16_llm.engine.core.runner


@pytest.mark.parametrize("seq_lens", [[37], [1, 16, 17, 90, 200]])
def test_bf16_onednn_linears(bf16_runner, seq_lens):
    """bf16 works at every level: oneDNN's packed weights where it has bf16 (AVX-512), F.linear below."""
    from tokenmill.cpu_isa import host_isa, onednn_bf16

    assert bf16_runner.model.layers[0].self_attn.qkv_proj.packed == onednn_bf16(host_isa())
    assert_stack_matches_python(bf16_runner, seq_lens)


# Steps with prefill chunks (through paged_prefill_attention): a fresh prompt alone, and decodes
# next to a fresh prompt, a chunk after earlier context and a 1-token chunk.
PREFILL_STEPS = [([], [(40, 40)]), ([5, 70], [(33, 33), (20, 90), (1, 17)])]


@needs_prefill_kernel
@pytest.mark.parametrize("seq_lens,prefill", PREFILL_STEPS)
def test_bf16_steps_with_prefill_chunks(bf16_runner, seq_lens, prefill):
    assert_stack_matches_python(bf16_runner, seq_lens, prefill)


# Each engine (one per option set: loading and quantizing the model is most of the time) runs
# every step listed for it, then a step with prefill chunks (many rows: the gemm kernels; bf16
# or fp32 prefill kernel).
@pytest.mark.parametrize("options,steps", [
    ({"quantization": "int4"}, [[5, 40, 33],  # int4_linear (one kernel for every row count)
                                list(range(1, 31))]),
    ({"quantization": "int8"}, [[3, 70],  # the int8 few-row kernel
                                [3, 70, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14],  # bf16: PyTorch's, then int8_gemm; else int8_gemm
                                list(range(1, 41))]),  # int8_gemm
    ({"kv_cache_dtype": "int8", "quantization": "none"}, [[9, 130]]),
], ids=["int4", "int8", "int8_kv_cache"])
def test_quantized_linears_and_kv_cache(options, steps):
    """In the host's dtype: bf16 kernels with native bf16, else the int8-activation (few rows) and
    fp32 panel (many rows) kernels."""
    runner = cpu_llm("smollm2-135m", dtype=DTYPE, **options).engine.core.runner
    for seq_lens in steps:
        assert_stack_matches_python(runner, seq_lens)
    assert_stack_matches_python(runner, *PREFILL_STEPS[1])


def test_qwen2_biases_fp32_and_int4_input_scales(tiny_qwen2_dir):
    runner = cpu_llm(str(tiny_qwen2_dir), dtype="float32").engine.core.runner
    assert runner.model.layers[0].self_attn.qkv_proj.bias is not None
    assert_stack_matches_python(runner, [2, 19, 50])

    runner = cpu_llm(str(tiny_qwen2_dir), dtype=DTYPE, quantization="int4").engine.core.runner
    model = runner.model
    gen = torch.Generator().manual_seed(1)
    for layer in model.layers:  # as AWQ leaves them: x * input_scale before the matmul
        for lin in (layer.self_attn.qkv_proj, layer.mlp.down_proj):
            lin.input_scale = (torch.rand(lin.in_features, generator=gen) + 0.5).to(getattr(torch, DTYPE))
    assert model.enable_cpu_decoder(kernels)
    assert_stack_matches_python(runner, [2, 19, 50])


def step_hidden(runner, seq_lens, prefill=()):
    """The final hidden states of a model_step through the runner's model as it is configured."""
    model = runner.model
    input_ids, positions, caches, layout = model_step(runner, seq_lens, prefill=prefill)
    with torch.inference_mode():
        return model(input_ids, positions, [tuple(t.clone() for t in layer) for layer in caches],
                     model.attn_backend.build_metadata(layout, "cpu"))


@needs_prefill_kernel
@pytest.mark.parametrize("prefill_too", [False, True], ids=["decodes", "every_row"])
def test_activation_sparsity(bf16_runner, monkeypatch, prefill_too):
    """With activation-sparsity thresholds the stack still matches the Python layers bit for bit,
    on decode-only steps and on steps with prefill chunks; the thresholds change the decodes'
    hidden states and, unless prefill is sparsified too, nothing else."""
    model = bf16_runner.model
    monkeypatch.setattr(model, "sparsity_thresholds", None)
    monkeypatch.setattr(model, "sparsify_prefill", False)
    seq_lens, prefill = PREFILL_STEPS[1]
    dense = step_hidden(bf16_runner, seq_lens, prefill)
    thresholds = torch.tensor([0.05, 0.02, 0.1, 0.02]).repeat(len(model.layers), 1)
    model.enable_activation_sparsity(thresholds, prefill=prefill_too)
    assert_stack_matches_python(bf16_runner, [1, 16, 17, 90, 200])
    assert_stack_matches_python(bf16_runner, seq_lens, prefill)
    sparse = step_hidden(bf16_runner, seq_lens, prefill)
    decodes = len(seq_lens)
    assert not torch.equal(sparse[:decodes], dense[:decodes])
    assert torch.equal(sparse[decodes:], dense[decodes:]) != prefill_too


@needs_prefill_kernel
def test_used_for_every_step_in_bf16(bf16_llm, monkeypatch):
    model = bf16_llm.engine.core.runner.model
    spy = CountingStack(model.cpu_decoder)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompts = [[100, 200, 300] * 4, [7, 8, 9] * 5]
    monkeypatch.setattr(model, "cpu_decoder", spy)
    out = [o.outputs[0].token_ids for o in bf16_llm.generate(prompts, params)]
    assert spy.rows == [27] + [2] * 5  # the prefill step, then each decode step
    monkeypatch.setattr(model, "cpu_decoder", None)
    assert [o.outputs[0].token_ids for o in bf16_llm.generate(prompts, params)] == out


def test_fp32_prefills_run_in_the_stack_with_the_fp32_prefill_kernel(monkeypatch):
    """fp32 steps with prefill chunks (chunked: 32 tokens a step, so chunks after earlier context
    too) run in the stack, their attention through the fp32 prefill kernel; greedy output
    token-identical to the same engine with SDPA for its prefills (and the Python layers for
    those steps; no prefix cache, so the second run computes every K/V again)."""
    llm = cpu_llm("smollm2-135m", dtype="float32", quantization="none", max_num_batched_tokens=32,
                  enable_prefix_caching=False)
    model = llm.engine.core.runner.model
    backend = model.attn_backend
    assert torch.float32 in backend.prefill_dtypes
    prompts = [[100, 200, 300] * 4, list(range(1000, 1070)), [7, 8, 9] * 33]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    spy = CountingStack(model.cpu_decoder)
    monkeypatch.setattr(model, "cpu_decoder", spy)
    with_kernel = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert spy.prefill_steps >= 6  # 181 prompt tokens, 32 a step
    monkeypatch.setattr(backend, "prefill_dtypes", frozenset())
    steps = spy.prefill_steps
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == with_kernel
    assert spy.prefill_steps == steps  # the second run's prefills: the Python layers and SDPA


def test_not_built_without_kernels_or_for_w8a8():
    assert cpu_llm("smollm2-135m", dtype="bfloat16", quantization="w8a8").engine.core.runner.model.cpu_decoder is None
    assert cpu_llm("smollm2-135m", dtype="bfloat16", cpu_kernels=False).engine.core.runner.model.cpu_decoder is None
