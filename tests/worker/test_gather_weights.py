"""gather_weights: a model's CPU weights moved into one buffer in module order, views and tied
weights still sharing, the embedding table left where it is; and the model runner doing it."""

from __future__ import annotations

import torch
from torch import nn

from tokenmill.worker.cpu import HUGE_PAGE, gather_weights, held_tensors
from tokenmill.worker.model_runner import ModelRunner


class Projection(nn.Module):
    """Holds a parameter, a buffer, and plain tensor attributes the way the quantized linears do
    (a kernel layout beside the record, one of them a view of another)."""

    def __init__(self, out_features: int, in_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(out_features, in_features), requires_grad=False)
        self.register_buffer("bias", torch.randn(out_features))
        self.codes = torch.randint(-128, 128, (out_features, in_features), dtype=torch.int8)
        self.rows = self.codes[1::2]  # a strided view of codes: must stay one
        self.scales = torch.rand(out_features).bfloat16()


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(50, 16)
        self.first = Projection(32, 16)
        self.second = Projection(16, 32)
        self.head = nn.Linear(16, 50, bias=False)
        self.head.weight = self.embed.weight  # tied


def snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    return {f"{name}.{k}": v.clone() for name, m in model.named_modules()
            for k, v in [*m._parameters.items(), *m._buffers.items(), *m.__dict__.items()] if isinstance(v, torch.Tensor)}


def test_gather_weights_moves_them_back_to_back_in_module_order():
    torch.manual_seed(0)
    model = Tiny()
    before = snapshot(model)
    weight = model.first.weight
    embedding = model.embed.weight.data_ptr()
    sizes = [t.untyped_storage().nbytes() for m in (model.first, model.second)
             for t in (m.weight, m.bias, m.codes, m.scales)]
    moved = gather_weights(model, skip=(nn.Embedding,))
    assert moved == sum((s + 63) // 64 * 64 for s in sizes)
    # same values, same dtypes and strides; the Parameter object kept
    after = snapshot(model)
    assert after.keys() == before.keys()
    for name, t in before.items():
        assert torch.equal(after[name], t) and after[name].dtype == t.dtype, name
    assert model.first.weight is weight and isinstance(model.first.weight, nn.Parameter)
    # the embedding and the head tied to it stay put
    assert model.embed.weight.data_ptr() == embedding and model.head.weight is model.embed.weight
    # in module order, back to back from a huge-page boundary, each storage on a cache line
    ptrs = [model.first.weight, model.first.bias, model.first.codes, model.first.scales,
            model.second.weight, model.second.bias, model.second.codes, model.second.scales]
    start = ptrs[0].data_ptr()
    assert start % HUGE_PAGE == 0
    offsets = [t.data_ptr() - start for t in ptrs]
    assert offsets == sorted(offsets) and all(o % 64 == 0 for o in offsets)
    assert offsets[-1] + sizes[-1] <= moved
    # a view still shares its base's memory
    assert model.first.rows.untyped_storage().data_ptr() == model.first.codes.untyped_storage().data_ptr()
    assert model.first.rows.stride() == (32, 1)
    model.first.codes[1, 0] = 7
    assert model.first.rows[0, 0] == 7


def test_gather_weights_of_a_model_without_cpu_tensors_moves_nothing():
    assert gather_weights(nn.Embedding(4, 4), skip=(nn.Embedding,)) == 0


def test_the_runner_gathers_the_default_models_weights(default_checkpoint):
    """The layers' weights of a loaded model lie in one buffer, back to back in layer order."""
    from tokenmill.config import EngineConfig

    config = EngineConfig(model="unused", dtype="float32", max_num_batched_tokens=64, max_num_seqs=4, swap_space_gb=0,
                          kv_cache_memory_gb=0.05)
    runner = ModelRunner(config, default_checkpoint, "cpu", "float32", max_model_len=64)
    model = runner.model
    starts, total = [], 0
    for layer in model.layers:
        own = (layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.post_attention_layernorm,
               layer.mlp.gate_up_proj, layer.mlp.down_proj)  # (the rotary tables are shared by the layers)
        tensors = {t.data_ptr(): t.numel() * t.element_size() for m in own for _, t in held_tensors(m) if t.numel()}
        starts.append(min(tensors))
        size = sum(tensors.values())
        assert max(p + n for p, n in tensors.items()) - min(tensors) < size + 64 * len(tensors)
        total += size
    assert starts == sorted(starts)
    assert starts[-1] - starts[0] < total  # back to back, not scattered over the heap
    assert not starts[0] <= model.embed_tokens.weight.data_ptr() < starts[-1]
