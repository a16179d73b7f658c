"""A GGUF file's quantized tensors kept quantized (`quantization="auto"`, the default):
Q4_0 / Q4_1 / Q4_K repacked into int4 records with the file's own codes and scales, wider
types requantized to int8, float tensors dense (tokenmill/models/gguf_blocks.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.models.test_families_gguf import COMMON, random_model, write_gguf
from tokenmill import LLM, SamplingParams
from tokenmill.layers.embedding import QuantizedEmbedding
from tokenmill.layers.linear import DenseLinear, Int4Linear, Int8Linear
from tokenmill.layers.quantization.formats import dequantize_record
from tokenmill.models import gguf_blocks
from tokenmill.models.loader import load_checkpoint

gguf = pytest.importorskip("gguf")
transformers = pytest.importorskip("transformers")
T = gguf.GGMLQuantizationType


def random_q4_k_blocks(rows: int, k: int, rng) -> np.ndarray:
    """Q4_K rows of random codes and 6-bit factors (gguf-py has no Q4_K quantizer)."""
    blocks = rng.integers(0, 256, (rows, k // 256, 144), dtype=np.uint8)
    for offset in (0, 2):  # d and dmin: finite fp16
        blocks[..., offset : offset + 2] = rng.uniform(1e-3, 5e-2, (rows, k // 256, 1)).astype(np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


@pytest.mark.parametrize("type_name", sorted(gguf_blocks.INT4_REPACKED))
def test_int4_record_is_the_files_weights_exactly(type_name):
    rng = np.random.default_rng(0)
    if type_name == "Q4_K":
        blocks = random_q4_k_blocks(70, 512, rng)
    else:
        blocks = gguf.quants.quantize(rng.standard_normal((70, 512)).astype(np.float32), T[type_name])
    record = gguf_blocks.int4_record(type_name, blocks)
    assert record["codes"].shape == (70, 256) and record["scales"].shape == (70, 16)
    expected = gguf.quants.dequantize(blocks, T[type_name])
    # Q4_0's d * (q - 8) is computed as q * d - 8 d: one rounding more
    np.testing.assert_allclose(dequantize_record("int4", record).numpy(), expected, rtol=0, atol=1e-6)
    if type_name == "Q4_K":  # its factors too, which make the scales and mins exactly
        factors, super_factors = record["factors"], record["super_factors"]
        assert factors.dtype == torch.uint8 and factors.shape == (70, 16, 2) and factors.max() < 64
        assert super_factors.dtype == torch.float16 and super_factors.shape == (70, 2, 2)
        for i, key in enumerate(("scales", "mins")):
            made = super_factors[..., i].float().repeat_interleave(8, 1) * factors[..., i]
            assert torch.equal(made, record[key]), key
    else:
        assert "factors" not in record and "super_factors" not in record


@pytest.mark.parametrize("type_name", ["Q8_0", "Q5_0"])
def test_int8_record_is_quantize_int8_of_the_files_weights(type_name, monkeypatch):
    """The numpy requantization of wider types gives formats.quantize_int8's codes and scales,
    across chunk boundaries (chunks of 7 rows here)."""
    from tokenmill.models.loader import gguf_loader as loader
    from tokenmill.layers.quantization.formats import quantize_int8

    rng = np.random.default_rng(1)
    blocks = gguf.quants.quantize(rng.standard_normal((40, 256)).astype(np.float32), T[type_name])
    blocks[3] = gguf.quants.quantize(np.zeros((1, 256), dtype=np.float32), T[type_name])  # an all-zero row
    monkeypatch.setattr(loader, "_DEQUANTIZE_CHUNK_BYTES", 7 * blocks.shape[1])
    record = loader._int8_record(gguf, T[type_name], blocks)
    codes, scales = quantize_int8(torch.from_numpy(gguf.quants.dequantize(blocks, T[type_name])))
    assert record["codes"].dtype == torch.int8 and torch.equal(record["codes"], codes)
    torch.testing.assert_close(record["scales"], scales, rtol=0, atol=0)


def test_methods_by_stored_type():
    assert [gguf_blocks.stored_method(t) for t in ("F16", "Q4_0", "Q4_K", "Q3_K", "Q5_K", "Q6_K", "Q8_0")] == \
        [None, "int4", "int4", "int4", "int8", "int8", "int8"]
    assert gguf_blocks.linear_method(["Q4_K", "Q4_K", "Q6_K"]) == "int8"  # the most precise of the shards
    assert gguf_blocks.linear_method(["Q4_K", "F32"]) is None
    assert gguf_blocks.linear_method(["Q4_0", "Q4_K"]) == "int4"


def test_default_models_records_dequantize_to_its_weights(default_checkpoint):
    """Every Q4_1 tensor of the default model (q/k rows un-permuted as llama.cpp stored them) as a
    record equals the loader's float32 dequantization of it."""
    names = {n for n, t in default_checkpoint.stored_types.items() if t in gguf_blocks.INT4_REPACKED}
    assert len(names) == 210
    records = dict(default_checkpoint.weights(records=dict.fromkeys(names, "int4")))
    seen = 0
    for name, tensor in default_checkpoint.weights():
        if name in names:
            torch.testing.assert_close(dequantize_record("int4", records[name]), tensor, rtol=0, atol=0)
            seen += 1
    assert seen == len(names)


# Each kind of mapping in one file: repacked int4 (q/k rows permuted by llama.cpp), a fused layer
# of mixed types (int8), int8 from Q8_0, and the LM head from the file's own codes.
MIXED = {"attn_q.weight": T.Q4_0, "attn_k.weight": T.Q4_1, "attn_v.weight": T.Q4_0, "attn_output.weight": T.Q8_0,
         "ffn_gate.weight": T.Q4_1, "ffn_up.weight": T.Q8_0, "ffn_down.weight": T.Q4_0, "token_embd.weight": T.Q8_0,
         "output.weight": T.Q4_1}


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mixed_gguf_runs_as_stored(tmp_path, tied):
    config = transformers.LlamaConfig(**(COMMON | {"hidden_size": 128, "intermediate_size": 128}), tie_word_embeddings=tied)
    path = tmp_path / "mixed.gguf"
    types = MIXED | ({"token_embd.weight": T.Q4_1} if tied else {})
    write_gguf(path, "llama", random_model(config), permute_qk=True, types=types)
    assert set(load_checkpoint(path).stored_types.values()) == {"Q4_0", "Q4_1", "Q8_0"}

    kw = dict(dtype="float32", max_num_batched_tokens=16, kv_cache_memory_gb=0.02)
    auto, dense = LLM(str(path), **kw), LLM(str(path), quantization="none", **kw)
    model = auto.engine.core.runner.model
    layer = model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and layer.self_attn.qkv_proj.group_size == 32
    assert isinstance(layer.self_attn.o_proj, Int8Linear)
    assert isinstance(layer.mlp.gate_up_proj, Int8Linear)  # Q4_1 gate, Q8_0 up: the more precise
    assert isinstance(layer.mlp.down_proj, Int4Linear)
    assert isinstance(model.lm_head, Int4Linear)
    # a Q4_1 embedding stays int4 (its rows dequantized per lookup); a Q8_0 one is dense
    assert isinstance(model.embed_tokens, QuantizedEmbedding) == tied
    ids = torch.tensor([[3, 250], [0, 7]])
    torch.testing.assert_close(model.embed_tokens(ids), dense.engine.core.runner.model.embed_tokens(ids), rtol=0, atol=1e-6)
    assert all(isinstance(m, DenseLinear) for m in dense.engine.core.runner.model.modules()
               if isinstance(m, (DenseLinear, Int4Linear, Int8Linear)))

    assert_prompt_logprobs_close(auto, dense, seed=3)


def assert_prompt_logprobs_close(auto: LLM, dense: LLM, seed: int) -> None:
    """Two random prompts' logprobs within 0.02 of the dense engine's: the same weights; the
    quantized kernels round activations (bf16 or int8 per block)."""
    gen = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (9, 24)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=True)
    for a, b in zip(auto.generate(prompts, params), dense.generate(prompts, params)):
        np.testing.assert_allclose(a.prompt_logprobs[1:], b.prompt_logprobs[1:], atol=0.02)


def _int4_weights(layer: Int4Linear) -> list[torch.Tensor]:
    """What an Int4Linear multiplies with, in whichever layout it keeps."""
    return [t for t in (layer.packed, layer.scales_and_zeros, getattr(layer, "kernel_codes", None),
                        getattr(layer, "kernel_pairs", None)) if t is not None]


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_int4_keeps_the_files_4_bit_codes(tmp_path, tied):
    """quantization="int4" takes a linear whose every tensor is Q4_0 / Q4_1 / Q4_K from the file's
    own codes, as "auto" does, where rounding the dequantized values again would give other codes
    (Q4_0's grid is not the 16 levels from a group's min to its max); a linear with a wider tensor
    is rounded, and so is a tied head, from the embedding, which loads dense."""
    from tokenmill.layers.quantization.formats import record_from_rtn

    config = transformers.LlamaConfig(**(COMMON | {"hidden_size": 128, "intermediate_size": 128}), tie_word_embeddings=tied)
    path = tmp_path / "mixed.gguf"
    write_gguf(path, "llama", random_model(config), permute_qk=True,
               types=MIXED | ({"token_embd.weight": T.Q4_1} if tied else {}))
    kw = dict(dtype="float32", max_num_batched_tokens=16, kv_cache_memory_gb=0.02)
    auto = LLM(str(path), quantization_lm_head="auto" if tied else "int4", **kw).engine.core.runner.model
    int4 = LLM(str(path), quantization="int4", quantization_lm_head="int4", **kw).engine.core.runner.model
    for name in ("layers.0.self_attn.qkv_proj", "layers.0.mlp.down_proj") + (() if tied else ("lm_head",)):
        ours, stored = int4.get_submodule(name), auto.get_submodule(name)
        assert isinstance(ours, Int4Linear) and ours.group_size == 32
        assert all(torch.equal(a, b) for a, b in zip(_int4_weights(ours), _int4_weights(stored), strict=True)), name
    assert isinstance(int4.layers[0].mlp.gate_up_proj, Int4Linear)  # Q4_1 + Q8_0: rounded from the dequantized values
    assert isinstance(int4.embed_tokens, torch.nn.Embedding) and isinstance(int4.lm_head, Int4Linear)

    # what rounding the file's Q4_0 values again would have given instead
    checkpoint = load_checkpoint(path)
    name = "model.layers.0.mlp.down_proj.weight"
    file_codes = dict(checkpoint.weights(records={name: "int4"}))[name]["codes"]
    rounded = record_from_rtn("int4", dict(checkpoint.weights())[name], 32)["codes"]
    assert not torch.equal(file_codes, rounded)


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """Q6_K blocks [N, K/256 x 210] of w [N, K] in gguf-py's layout (gguf-py has no Q6_K
    quantizer): per sub-block of 16 the scale that puts its largest magnitude at code -32, as int8
    factors of a super-block d whose largest factor is -128, as llama.cpp's quantizer leaves them."""
    n, k = w.shape
    sub = w.reshape(-1, 16, 16).astype(np.float32)  # [super-block, sub-block, weight]
    big = np.take_along_axis(sub, np.abs(sub).argmax(axis=2)[..., None], axis=2)[..., 0]
    scale = -big / 32  # the largest magnitude at code -32
    top = np.take_along_axis(scale, np.abs(scale).argmax(axis=1)[:, None], axis=1)
    d = (-top / 128).astype(np.float16)
    d = np.where(d == 0, np.float16(1), d)
    sc = np.clip(np.rint(scale / d.astype(np.float32)), -128, 127).astype(np.int8)
    step = d.astype(np.float32) * sc.astype(np.float32)
    q = np.clip(np.rint(sub / np.where(step == 0, 1, step)[..., None]), -32, 31).astype(np.int16) + 32
    q = q.astype(np.uint8).reshape(-1, 2, 4, 32)  # [block, half, row, l]: weight 128 half + 32 row + l
    low, high = q & 0x0F, q >> 4
    ql = np.concatenate([low[:, :, 0] | (low[:, :, 2] << 4), low[:, :, 1] | (low[:, :, 3] << 4)], axis=2)
    qh = high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)
    blocks = np.concatenate([ql.reshape(-1, 128), qh.reshape(-1, 64), sc.view(np.uint8).reshape(-1, 16),
                             d.reshape(-1, 1).view(np.uint8)], axis=1)
    return blocks.reshape(n, -1)


def test_int6_record_is_the_files_q6_k_weights_exactly():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((24, 512)).astype(np.float32) * rng.uniform(0.01, 1, (24, 32)).repeat(16, axis=1)
    blocks = quantize_q6_k(w)
    expected = gguf.quants.dequantize(blocks, T.Q6_K)
    assert np.abs(expected - w).max() <= np.abs(w).max() / 40  # a real quantization of w
    record = gguf_blocks.int6_record("Q6_K", blocks)
    assert record["codes"].dtype == torch.uint8 and record["scales"].shape == (24, 32)
    assert (record["scales"] < 0).any()  # llama.cpp's negative factors kept as they are
    np.testing.assert_array_equal(dequantize_record("int6", record).numpy(), expected)
    factors, super_factors = record["factors"], record["super_factors"]
    assert factors.dtype == torch.int8 and factors.shape == (24, 32) and super_factors.shape == (24, 2)
    assert torch.equal(super_factors.float().repeat_interleave(16, 1) * factors, record["scales"])


def test_methods_with_int6():
    assert gguf_blocks.stored_method("Q6_K", int6=True) == "int6" and gguf_blocks.stored_method("Q6_K") == "int8"
    assert gguf_blocks.stored_method("Q5_K", int6=True) == "int8"  # (only Q6_K is repacked)
    assert gguf_blocks.linear_method(["Q6_K", "Q6_K"], int6=True) == "int6"
    assert gguf_blocks.linear_method(["Q4_K", "Q4_K", "Q6_K"], int6=True) == "int8"  # an int6 record is the file's codes
    assert gguf_blocks.linear_method(["Q8_0", "Q6_K"], int6=True) == "int8"
    # ... unless each part runs as stored, side by side (a StackedLinear)
    assert gguf_blocks.stacked_methods(["Q4_K", "Q4_K", "Q6_K"], int6=True) == ["int4", "int4", "int6"]
    assert gguf_blocks.stacked_methods(["Q4_K", "Q4_K", "Q6_K"]) is None  # no int6 kernel: int8
    assert gguf_blocks.stacked_methods(["Q4_K", "Q8_0", "Q6_K"], int6=True) is None
    assert gguf_blocks.stacked_methods(["Q3_K", "Q6_K"], int6=True) is None  # Q3_K's int4 is rounded, not exact
    assert gguf_blocks.stacked_methods(["Q4_K", "Q4_K"], int6=True) is None


@pytest.mark.parametrize("level", ["avx2", "avx512_bf16"])
def test_q6_k_runs_as_int6(tmp_path, monkeypatch, level):
    """A Q4_K_M-like file: Q6_K down projection and LM head as int6 records of the file's own
    codes (with the CPU kernels at every level; at avx512_bf16 many rows through int6_gemm), a
    qkv mixing Q4 and Q6_K as an int4 and an int6 layer side by side, the logits those of the
    dequantized weights within the kernels' activation rounding."""
    from tokenmill.layers.linear import Int6Linear, StackedLinear

    config = transformers.LlamaConfig(**(COMMON | {"hidden_size": 256, "intermediate_size": 256}), tie_word_embeddings=False)
    types = {"attn_q.weight": T.Q4_0, "attn_k.weight": T.Q4_0, "attn_v.weight": T.Q6_K, "attn_output.weight": T.Q4_0,
             "ffn_gate.weight": T.Q4_1, "ffn_up.weight": T.Q4_1, "ffn_down.weight": T.Q6_K, "output.weight": T.Q6_K}
    auto, dense = engines_at(tmp_path, monkeypatch, config, types, level=level)
    model = auto.engine.core.runner.model
    assert isinstance(model.layers[0].mlp.down_proj, Int6Linear) and model.layers[0].mlp.down_proj.kernel is not None
    assert isinstance(model.lm_head, Int6Linear)
    qkv = model.layers[0].self_attn.qkv_proj  # Q4_0 q, k and Q6_K v: each part as stored
    assert isinstance(qkv, StackedLinear) and [type(p) for p in qkv.parts] == [Int4Linear, Int6Linear]
    # the layer's weight is the file's: dequantized, the dense model's
    down = model.layers[0].mlp.down_proj
    ref = dense.engine.core.runner.model.layers[0].mlp.down_proj
    for rows in (3, 20):  # (at avx512_bf16 int6_linear, then int6_gemm)
        x = torch.randn(rows, 256)
        torch.testing.assert_close(down(x), ref(x), atol=0.05 * ref(x).abs().max().item(), rtol=0)
    assert_prompt_logprobs_close(auto, dense, seed=5)


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """Q4_K blocks [N, K/256 x 144] of w [N, K] in gguf-py's layout (gguf-py has no Q4_K
    quantizer): per sub-block of 32 its range over 15 and its minimum (at most 0) as 6-bit factors
    of the super-block's d and dmin, the codes rounded onto the grid they make."""
    n, _ = w.shape
    sub = w.reshape(-1, 8, 32).astype(np.float32)  # [super-block, sub-block, weight]
    low, high = np.minimum(sub.min(axis=2), 0), sub.max(axis=2)
    d = (((high - low) / 15).max(axis=1, keepdims=True) / 63).astype(np.float16)
    dmin = (-low.min(axis=1, keepdims=True) / 63).astype(np.float16)
    d, dmin = np.where(d == 0, np.float16(1), d), np.where(dmin == 0, np.float16(1), dmin)
    sc = np.clip(np.rint((high - low) / 15 / d.astype(np.float32)), 1, 63).astype(np.uint8)
    mn = np.clip(np.rint(-low / dmin.astype(np.float32)), 0, 63).astype(np.uint8)
    step, floor = d.astype(np.float32) * sc, -dmin.astype(np.float32) * mn
    q = np.clip(np.rint((sub - floor[..., None]) / step[..., None]), 0, 15).astype(np.uint8)
    factors = np.concatenate([(sc[:, :4] & 63) | (sc[:, 4:] >> 4 << 6), (mn[:, :4] & 63) | (mn[:, 4:] >> 4 << 6),
                              (sc[:, 4:] & 15) | (mn[:, 4:] << 4)], axis=1)
    qs = (q[:, 0::2] | (q[:, 1::2] << 4)).reshape(-1, 128)  # 32 bytes: sub-block 2j low, 2j + 1 high
    return np.concatenate([d.view(np.uint8), dmin.view(np.uint8), factors, qs], axis=1).reshape(n, -1)


def engines_at(tmp_path, monkeypatch, config, types: dict, permute_qk: bool = False,
               level: str = "avx2") -> tuple[LLM, LLM]:
    """A random `config` model written as a GGUF file with `types` (Q4_K and Q6_K by the
    quantizers above), loaded with the avx2 kernels as stored and dequantized (quantization
    "none"); skips where the avx2 kernels cannot be built."""
    from tokenmill import cpu_isa
    from tokenmill.layers import cpu_kernels

    if not cpu_isa.runs_here(level) or cpu_kernels.load(level) is None:
        pytest.skip(f"no {level} CPU kernels here")
    monkeypatch.setenv("TOKENMILL_CPU_ISA", level)
    quantize = gguf.quants.quantize
    ours = {T.Q4_K: quantize_q4_k, T.Q6_K: quantize_q6_k}
    monkeypatch.setattr(gguf.quants, "quantize", lambda w, t: ours[t](w) if t in ours else quantize(w, t))
    path = tmp_path / "model.gguf"
    write_gguf(path, "llama", random_model(config), permute_qk=permute_qk, types=types)
    kw = dict(dtype="float32", max_num_batched_tokens=16, kv_cache_memory_gb=0.02)
    return LLM(str(path), **kw), LLM(str(path), quantization="none", **kw)


def test_q4_k_quantizer_is_gguf_pys_layout():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((16, 512)).astype(np.float32) * rng.uniform(0.01, 1, (16, 16)).repeat(32, axis=1)
    blocks = quantize_q4_k(w)
    assert blocks.shape == (16, 2 * 144)
    assert np.abs(gguf.quants.dequantize(blocks, T.Q4_K) - w).max() <= np.abs(w).max() / 12


def test_q4_k_and_q6_k_run_on_their_own_factors(tmp_path, monkeypatch):
    """At avx2 a Q4_K_M-like file's Q4_K linears run on the file's factors (the kernels'
    super-block tables), its Q6_K ones too; a fused qkv of Q4_K and Q4_0 parts keeps bf16 pairs
    (the factors are not in every part); the logits are the dequantized weights' within the
    kernels' activation rounding."""
    from tokenmill.layers.linear import Int6Linear

    config = transformers.LlamaConfig(**(COMMON | {"hidden_size": 256, "intermediate_size": 512}), tie_word_embeddings=False)
    types = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_0, "attn_v.weight": T.Q4_K, "attn_output.weight": T.Q4_K,
             "ffn_gate.weight": T.Q4_K, "ffn_up.weight": T.Q4_K, "ffn_down.weight": T.Q6_K, "output.weight": T.Q4_K}
    auto, dense = engines_at(tmp_path, monkeypatch, config, types, permute_qk=True)
    model = auto.engine.core.runner.model
    layer = model.layers[0]
    for linear in (layer.self_attn.o_proj, layer.mlp.gate_up_proj):
        assert isinstance(linear, Int4Linear) and linear.kernel_pairs.dtype == torch.uint8
    assert isinstance(model.lm_head, Int4Linear) and model.lm_head.kernel is None  # 260 outputs: no tiles of 8
    assert isinstance(layer.self_attn.qkv_proj, Int4Linear) and layer.self_attn.qkv_proj.kernel_pairs.dtype == torch.bfloat16
    assert isinstance(layer.mlp.down_proj, Int6Linear) and layer.mlp.down_proj.tile_scales.dtype == torch.uint8
    # each layer is the file's weight: the dense model's, dequantized
    ref_layer = dense.engine.core.runner.model.layers[0]
    for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
        ours, ref = layer.get_submodule(name), ref_layer.get_submodule(name)
        x = torch.randn(3, ref.in_features)
        torch.testing.assert_close(ours(x), ref(x), atol=0.03 * ref(x).abs().max().item(), rtol=0)
    assert_prompt_logprobs_close(auto, dense, seed=6)


def test_a_tied_q6_k_embedding_stays_int6_and_is_the_heads_record(tmp_path, monkeypatch):
    """A tied Q6_K token embedding where the kernels run int6 (avx2): the head is an int6 layer of
    the file's own codes, and the embedding stays int6 (its rows dequantized per lookup, the
    file's values exactly) instead of a dense copy."""
    from tokenmill.layers.embedding import QuantizedEmbedding
    from tokenmill.layers.linear import Int6Linear

    config = transformers.LlamaConfig(**(COMMON | {"hidden_size": 256, "intermediate_size": 256}), tie_word_embeddings=True)
    auto, dense = engines_at(tmp_path, monkeypatch, config, {"token_embd.weight": T.Q6_K})
    model, ref = auto.engine.core.runner.model, dense.engine.core.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding) and model.embed_tokens.method == "int6"
    assert isinstance(model.lm_head, Int6Linear)
    ids = torch.tensor([[3, 250], [0, 7]])
    torch.testing.assert_close(model.embed_tokens(ids), ref.embed_tokens(ids), rtol=0, atol=0)
    x = torch.randn(3, 256)
    torch.testing.assert_close(model.lm_head(x), ref.lm_head(x), atol=0.03 * ref.lm_head(x).abs().max().item(), rtol=0)
    assert_prompt_logprobs_close(auto, dense, seed=7)


def test_activation_sparsity_takes_a_model_whose_embedding_stays_quantized(tmp_path, monkeypatch):
    """A quantized token embedding (a Q6_K one stays int6, without a weight tensor) does not stop
    activation sparsity from being turned on: its thresholds go where the model's weights are."""
    from tokenmill.layers.embedding import QuantizedEmbedding

    config = transformers.LlamaConfig(**(COMMON | {"hidden_size": 256, "intermediate_size": 256}), tie_word_embeddings=True)
    auto, _ = engines_at(tmp_path, monkeypatch, config, {"token_embd.weight": T.Q6_K})
    model = auto.engine.core.runner.model
    assert isinstance(model.embed_tokens, QuantizedEmbedding)
    thresholds = torch.full((len(model.layers), 4), 0.5)
    model.enable_activation_sparsity(thresholds)
    assert torch.equal(model.sparsity_thresholds, thresholds)


def test_a_fused_qkv_of_q4_k_and_q6_k_runs_each_part_as_stored(tmp_path, monkeypatch):
    """A Q4_K_M file's qkv (q, k Q4_K, v Q6_K) at avx2: a StackedLinear of an int4 layer (q and k
    rows, on the file's factors) and an int6 one (v rows) instead of all of it in int8, in the
    Python layers and in the compiled DecoderStack alike; the file's weights within the kernels'
    activation rounding."""
    from tests.models.test_cpu_decoder import assert_stack_matches_python
    from tokenmill.layers.linear import Int6Linear, StackedLinear

    config = transformers.LlamaConfig(**(COMMON | {"hidden_size": 256, "intermediate_size": 256}), tie_word_embeddings=False)
    types = {"attn_q.weight": T.Q4_K, "attn_k.weight": T.Q4_K, "attn_v.weight": T.Q6_K}
    auto, dense = engines_at(tmp_path, monkeypatch, config, types, permute_qk=True)
    model = auto.engine.core.runner.model
    qkv = model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, StackedLinear) and [type(p) for p in qkv.parts] == [Int4Linear, Int6Linear]
    q_k_rows = (config.num_attention_heads + config.num_key_value_heads) * (256 // config.num_attention_heads)
    assert [p.out_features for p in qkv.parts] == [q_k_rows, qkv.out_features - q_k_rows]
    assert qkv.parts[0].kernel_pairs.dtype == torch.uint8 and qkv.parts[1].tile_scales.dtype == torch.uint8
    ref = dense.engine.core.runner.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, 256)
    torch.testing.assert_close(qkv(x), ref(x), atol=0.03 * ref(x).abs().max().item(), rtol=0)
    assert_stack_matches_python(auto.engine.core.runner, [5, 9])
    assert_prompt_logprobs_close(auto, dense, seed=8)
