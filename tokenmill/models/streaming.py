"""Building a model from a checkpoint one tensor at a time, in the runtime format.

The model is constructed on the meta device (no memory, no random init). Every parameter then
gets uninitialized host memory, which costs nothing until written: the dense ones in the compute
dtype, the weights of linears to be quantized in float32. Checkpoint tensors (float32, one at a
time) are copied into place as they stream in; as soon as every shard of a linear layer has
arrived (q, k and v of a fused qkv_proj, say), it becomes its final layer (a quantized one from
round-to-nearest records, or a DenseLinear) on the target device, and its float32 staging is
freed. Peak host memory is the runtime weights plus a few layers' float32 staging, never a
float32 copy of the whole model.
"""

from __future__ import annotations

import ctypes

import torch
from torch import nn

from tokenmill.layers.linear import DenseLinear, build_linear
from tokenmill.models.loader import LoadedCheckpoint
from tokenmill.quantization.formats import record_from_rtn


@torch.no_grad()
def load_streaming(checkpoint: LoadedCheckpoint, build, device: torch.device, dtype: torch.dtype, qconfig=None,
                   cpu_kernels=None) -> nn.Module:
    """`build(device)` constructs the model there (models.build_model); its
    linears end quantized by round-to-nearest where `qconfig` (QuantConfig, algorithm "rtn")
    gives them a method, else DenseLinear in `dtype`; the model ends on `device`, in eval mode."""
    model = build("meta")
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    method_of = (lambda name: None) if qconfig is None else qconfig.method_of
    quantized = {name for name in linears if method_of(name) is not None}
    owner = {f"{name}.{kind}": name for name in linears for kind in ("weight", "bias")}
    params = dict(model.named_parameters(remove_duplicate=False))
    embedding = "embed_tokens.weight"
    tied = model.config.tie_word_embeddings
    staging = _Staging()
    for name, p in params.items():
        in_fp32 = owner.get(name) in quantized or (tied and name == embedding and "lm_head" in quantized)
        staging.declare(name, p, torch.float32 if in_fp32 else dtype)
    expected = {name: model._expected_shards(name, p) for name, p in params.items()}
    loaded: dict[str, set] = {}
    pending = {name: [f"{name}.weight"] + ([f"{name}.bias"] if linears[name].bias is not None else [])
               for name in linears}
    if tied:  # the head is the embedding: finished once that is loaded
        pending["lm_head"] = [embedding]
        owner[embedding] = "lm_head"
        expected.pop("lm_head.weight")

    def complete(param: str) -> bool:
        return loaded.get(param, set()) in (expected[param], {"all"})

    def finish(name: str) -> None:
        weight = staging[embedding] if tied and name == "lm_head" else staging[f"{name}.weight"]
        bias = staging[f"{name}.bias"] if linears[name].bias is not None else None
        bias = None if bias is None else bias.to(device=device, dtype=dtype)
        method = method_of(name)
        if method is not None:
            record = {k: v.to(device) for k, v in _rtn_by_rows(method, weight, qconfig.group_size).items()}
            layer = build_linear(method, record, bias, cpu_kernels)
        else:
            layer = DenseLinear(weight.to(device=device, dtype=dtype), bias, cpu_kernels)
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
        for key in pending.pop(name):
            if key != embedding:
                staging.pop(key, None)

    offset = model.config.norm_offset
    for ckpt_name, tensor in checkpoint.weights():
        name = ckpt_name.removeprefix("model.")
        if staging.adopt(name, tensor):  # a whole float32 weight that is staged in float32: kept as it came
            ours, shard = name, model.whole_shard(name)
            target = tensor
        else:
            place = model._placement(staging, name)
            if place is None:
                if tied and name == "lm_head.weight":
                    continue  # a saved copy of the tied embedding
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {type(model).__name__}")
            ours, shard, target = place
            if target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
        del tensor
        if offset and ours.endswith("norm.weight"):
            target.add_(offset)
        del target
        loaded.setdefault(ours, set()).add(shard)
        linear = owner.get(ours)
        if linear in pending and all(complete(key) for key in pending[linear]):
            finish(linear)
    missing = sorted(n for n in expected if not complete(n))
    if missing:
        raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' …' if len(missing) > 8 else ''}")
    # Every other parameter: its staging, in the compute dtype, on the device.
    name_of = {id(p): n for n, p in reversed(params.items())}  # (a tied one by its first name)
    for module in model.modules():
        if isinstance(module, nn.Linear):
            continue
        for key, p in list(module._parameters.items()):
            if p is not None and p.is_meta:
                module._parameters[key] = nn.Parameter(staging[name_of[id(p)]].to(device=device, dtype=dtype), requires_grad=False)
        for key, b in list(module._buffers.items()):
            if b is not None and not b.is_meta:
                module._buffers[key] = b.to(device)
    _return_freed_memory()
    return model.eval()


def _rtn_by_rows(method: str, weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """record_from_rtn, a block of rows at a time (every format's record is per output row), so its
    temporaries stay small beside a large weight such as a 150k-token LM head."""
    rows = max(1, (64 << 20) // (weight.shape[1] * weight.element_size()))
    if weight.shape[0] <= rows:
        return record_from_rtn(method, weight, group_size)
    parts = [record_from_rtn(method, weight[i : i + rows], group_size) for i in range(0, weight.shape[0], rows)]
    return {key: torch.cat([p[key] for p in parts]) for key in parts[0]}


def _return_freed_memory() -> None:
    """Give the staging freed on glibc's heap back to the system (it would stay resident)."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass


class _Staging(dict):
    """The memory each parameter is loaded into, allocated when its first shard arrives (so a
    finished layer's freed staging is reused by the next), tied parameters sharing theirs."""

    def __init__(self):
        super().__init__()
        self.specs: dict[str, tuple[int, torch.Size, torch.dtype]] = {}
        self.by_id: dict[int, torch.Tensor] = {}

    def declare(self, name: str, param: torch.Tensor, dtype: torch.dtype) -> None:
        self.specs[name] = (id(param), param.shape, dtype)

    def __contains__(self, name) -> bool:
        return name in self.specs

    def __missing__(self, name: str) -> torch.Tensor:
        key, shape, dtype = self.specs[name]
        if key not in self.by_id:
            self.by_id[key] = torch.empty(shape, dtype=dtype)
        self[name] = tensor = self.by_id[key]
        return tensor

    def adopt(self, name: str, tensor: torch.Tensor) -> bool:
        """Take `tensor` itself as the staging of parameter `name` when it is all of it, in the
        staging's dtype, and nothing was staged for it yet."""
        if name not in self.specs:
            return False
        key, shape, dtype = self.specs[name]
        if key in self.by_id or tensor.shape != shape or tensor.dtype != dtype or not tensor.is_contiguous():
            return False
        self.by_id[key] = self[name] = tensor
        return True

    def pop(self, name, default=None):
        key = self.specs[name][0]
        self.by_id.pop(key, None)
        return super().pop(name, default)
