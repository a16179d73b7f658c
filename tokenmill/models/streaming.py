"""Building a model from a checkpoint one tensor at a time, in the runtime format.

The model is constructed on the meta device (no memory, no random init). Every parameter then
gets uninitialized host memory, which costs nothing until written: the dense ones in the compute
dtype, the weights of linears to be quantized in float32. Checkpoint tensors (float32, one at a
time) are copied into place as they stream in; as soon as every shard of a linear layer has
arrived (q, k and v of a fused qkv_proj, say), it becomes its final layer (a quantized one from
round-to-nearest records, or a DenseLinear) on the target device, and its float32 staging is
freed. Peak host memory is the runtime weights plus a few layers' float32 staging, never a
float32 copy of the whole model.

With quantization "auto" a GGUF file's Q4_0 / Q4_1 / Q4_K tensors arrive as int4 records of the
file's own codes (models/gguf_blocks.py) and are staged as such, row range by row range for a
fused layer; such a token embedding stays int4 (layers/embedding.py: QuantizedEmbedding). A tied
Q6_K embedding, where the kernels run int6, arrives as an int6 record: the head runs on the file's
own codes and factors, and the embedding stays int6 too.

A quantized checkpoint's tensors (written by `tokenmill quantize`, or computed at load for a
calibrated method: quantization/quantize.py: quantized_tensors) come by the model's own names:
each linear's record becomes the layer of its method as it is, every other tensor goes into its
staging in the compute dtype.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from tokenmill.config import ConfigError
from tokenmill.layers.embedding import QuantizedEmbedding
from tokenmill.layers.linear import DenseLinear, StackedLinear, build_linear
from tokenmill.layers.quantization.formats import AUTO, LM_HEAD, ROUTER_SUFFIXES, record_from_rtn
from tokenmill.models import gguf_blocks
from tokenmill.models.loader import LoadedCheckpoint, expected_weight_shapes

_log = logging.getLogger(__name__)

# The method of a fused linear whose tensors are exact int4 and int6 records side by side
# (gguf_blocks.stacked_methods): a StackedLinear of one layer per run of rows of one method.
STACKED = "stacked"
EMBEDDING = "embed_tokens.weight"


@torch.no_grad()
def load_streaming(checkpoint: LoadedCheckpoint, build, device: torch.device, dtype: torch.dtype, qconfig=None,
                   cpu_kernels=None, plan=None, quantized: Mapping[str, torch.Tensor] | None = None) -> nn.Module:
    """`build(device)` constructs the model there (models.build_model); its
    linears end quantized by round-to-nearest where `qconfig` (QuantConfig, algorithm "rtn")
    gives them a method, else DenseLinear in `dtype`; the model ends on `device`, in eval mode.
    With method AUTO each linear is what its GGUF tensors are stored as (`_stored_methods`):
    int4 records of the file's own codes where every tensor of the linear is Q4_0/Q4_1/Q4_K.
    plan: this rank's `distributed.ShardPlan` when the model is split over ranks: each checkpoint
    tensor is renamed into the rank's model and cut to the rows or columns it holds as it arrives.
    quantized: a quantized checkpoint's tensors, read in place of the checkpoint's weights
    (`_quantized_stream`: the records of the linears `qconfig` gives a method, any algorithm, and
    every other parameter by the model's own name); a model split over ranks takes none."""
    model = build("meta")
    local_name = (lambda name: name) if plan is None else plan.local_name
    load = _StreamingLoad(model, checkpoint, local_name, device, dtype, qconfig, cpu_kernels, quantized is not None)
    if quantized is None:
        load.read(checkpoint, local_name, plan)
    else:
        assert plan is None, "a quantized checkpoint loads whole"
        for name, tensor in _quantized_stream(model, load.linears, quantized, load.method_of):
            load.arrived(*load.place_stored(name, tensor))
    load.check_complete()
    load.finish_the_rest()
    _return_freed_memory()
    return model.eval()


def _quantized_stream(model: nn.Module, linears: dict[str, nn.Module], tensors: Mapping[str, torch.Tensor],
                      method_of) -> Iterator[tuple[str, torch.Tensor | dict[str, torch.Tensor]]]:
    """A quantized checkpoint's `tensors` as load_streaming places them: each linear with a
    method once, as its record (every `<linear>.<key>` but its bias) under
    `<linear>.weight`; every other parameter (a bias, a dense linear's weight, a norm with any
    offset in) whole, by the model's own name (quantization/quantize.py: quantized_tensors).
    Checked whole before any is placed: ValueError naming a missing or mis-shaped tensor, a
    linear with no codes, or tensors with no place in the model."""
    records: dict[str, dict[str, torch.Tensor]] = {name: {} for name in linears if method_of(name) is not None}
    for name, tensor in tensors.items():
        linear, _, key = name.rpartition(".")
        if linear in records and key != "bias":
            records[linear][key] = tensor
    dense = set()
    for name, param in model.named_parameters():  # (a tied head's weight is the embedding's)
        if name.endswith(".weight") and name.removesuffix(".weight") in records:
            continue
        if name not in tensors:
            raise ValueError(f"quantized checkpoint is missing {name!r}")
        if tensors[name].shape != param.shape:
            raise ValueError(f"quantized checkpoint tensor {name!r} has shape {tuple(tensors[name].shape)}, "
                             f"expected {tuple(param.shape)}")
        dense.add(name)
    for name, record in records.items():
        if "codes" not in record:
            raise ValueError(f"quantized checkpoint has no codes for linear layer {name!r}")
    unexpected = sorted(set(tensors) - dense - {f"{name}.{key}" for name, record in records.items() for key in record})
    if unexpected:
        raise ValueError(f"quantized checkpoint has tensors with no place in the model: {unexpected[:8]}")
    # The records first: a tied head's is in place before the embedding, whose arrival finishes the head.
    for linear, record in records.items():
        yield f"{linear}.weight", record
    for name, tensor in tensors.items():
        if name in dense:
            yield name, tensor


class _StreamingLoad:
    """One load_streaming's state: the method of each linear, the staging each parameter is
    copied into, the records assembled shard by shard, and the shards each parameter still
    lacks. A linear becomes its final layer as soon as all of its tensors are in (`arrived`)."""

    def __init__(self, model: nn.Module, checkpoint: LoadedCheckpoint, local_name, device: torch.device,
                 dtype: torch.dtype, qconfig, cpu_kernels, stored: bool = False):
        self.model, self.device, self.dtype, self.qconfig, self.cpu_kernels = model, device, dtype, qconfig, cpu_kernels
        self.linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
        self.params = dict(model.named_parameters(remove_duplicate=False))
        self.tied = model.config.tie_word_embeddings
        if stored:  # a quantized checkpoint's tensors (_quantized_stream): each linear with a method as its record
            self.method_of = qconfig.method_of
            self.from_records = {name for name in self.linears if qconfig.method_of(name) is not None}
        else:
            self.method_of, self.from_records = _linear_methods(model, self.params, checkpoint, self.linears,
                                                                local_name, device, qconfig, cpu_kernels)
        self.stacked = {name for name in self.linears if self.method_of(name) == STACKED}
        self.owner = {f"{name}.{kind}": name for name in self.linears for kind in ("weight", "bias")}
        self.staging = self._declare_staging()
        # The record of each linear in from_records, filled shard by shard; "embed_tokens": the embedding's, when it
        # stays quantized (QuantizedEmbedding: an int4 record of a repacked type, or a tied head's int6 one).
        self.records: dict[str, dict[str, torch.Tensor]] = {}
        self.record_methods = {} if stored else self._record_methods(checkpoint, local_name)
        self.expected = {name: model._expected_shards(name, p) for name, p in self.params.items()}
        self.loaded: dict[str, set] = {}
        self.pending = {name: [f"{name}.weight"] + ([f"{name}.bias"] if linear.bias is not None else [])
                        for name, linear in self.linears.items()}
        if self.tied:  # the head is the embedding: finished once that is loaded
            self.pending["lm_head"] = [EMBEDDING]
            self.owner[EMBEDDING] = "lm_head"
            self.expected.pop("lm_head.weight")

    def _declare_staging(self) -> _Staging:
        """Each parameter's staging: float32 for the weights of linears rounded here (and a tied
        embedding the head is rounded from), else the compute dtype."""
        rounded = {name for name in self.linears if self.method_of(name) is not None} - self.from_records
        staging = _Staging()
        for name, p in self.params.items():
            in_fp32 = self.owner.get(name) in rounded or (self.tied and name == EMBEDDING and LM_HEAD in rounded)
            staging.declare(name, p, torch.float32 if in_fp32 else self.dtype)
        return staging

    def _record_methods(self, checkpoint: LoadedCheckpoint, local_name) -> dict[str, str | None]:
        """The checkpoint tensors read as records, each with its method: those of the linears in
        from_records (a stacked linear's by each tensor's own type), and the embedding where it
        stays quantized."""
        methods = {ckpt: gguf_blocks.stored_method(stored, int6=True) if linear in self.stacked
                   else self.method_of(linear)
                   for ckpt, stored in checkpoint.stored_types.items()
                   if (local := local_name(ckpt.removeprefix("model."))) is not None
                   and (place := self.model._placement(self.params, local))
                   and (linear := self.owner.get(place[0])) in self.from_records}
        if self.qconfig is not None and self.qconfig.method == AUTO and \
                checkpoint.stored_types.get(f"model.{EMBEDDING}") in gguf_blocks.INT4_REPACKED:
            methods[f"model.{EMBEDDING}"] = "int4"
        elif self.tied and LM_HEAD in self.from_records and self.method_of(LM_HEAD) == "int6":
            methods[f"model.{EMBEDDING}"] = "int6"
        return methods

    def read(self, checkpoint: LoadedCheckpoint, local_name, plan) -> None:
        """Place the checkpoint's tensors as they stream in (see load_streaming)."""
        for ckpt_name, tensor in checkpoint.weights(records=self.record_methods):
            name = local_name(ckpt_name.removeprefix("model."))
            if name is None:  # another pipeline stage's layer
                continue
            if plan is not None:
                tensor = plan.local_part(name, tensor)
            if isinstance(tensor, dict):  # a record
                placed = _place_record(self.model, self.params, self.records, name, tensor, self.stacked)
            else:
                placed = self.place(ckpt_name, name, tensor)
            del tensor  # (before a finished linear allocates its layer)
            if placed is not None:
                self.arrived(*placed)

    def place(self, ckpt_name: str, name: str, tensor: torch.Tensor) -> tuple[str, object] | None:
        """Copy a checkpoint tensor into its staging: (our parameter, its shard key), or None for
        a tensor to skip."""
        if self.staging.adopt(name, tensor):  # a whole float32 weight that is staged in float32: kept as it came
            ours, shard, target = name, self.model.whole_shard(name), tensor
        else:
            placement = self.model._placement(self.staging, name)
            if placement is None:
                if self.tied and name == "lm_head.weight":
                    return None  # a saved copy of the tied embedding
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has no place in {type(self.model).__name__}")
            ours, shard, target = placement
            if target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
        if self.model.config.norm_offset and ours.endswith("norm.weight"):
            target.add_(self.model.config.norm_offset)
        return ours, shard

    def place_stored(self, name: str, tensor: torch.Tensor | dict[str, torch.Tensor]) -> tuple[str, object]:
        """Put a quantized checkpoint's tensor in place (`_quantized_stream`: a linear's record
        under `<linear>.weight`, else a whole parameter by its own name, copied into its
        staging as it is); returns (our parameter, its shard key: whole)."""
        if isinstance(tensor, dict):
            self.records[name.removesuffix(".weight")] = tensor
        else:
            self.staging[name].copy_(tensor)
        return name, "all"

    def arrived(self, ours: str, shard) -> None:
        """Shard `shard` of parameter `ours` is in place: its linear is finished once every
        tensor of it is."""
        self.loaded.setdefault(ours, set()).add(shard)
        linear = self.owner.get(ours)
        if linear in self.pending and all(self._complete(key) for key in self.pending[linear]):
            self._finish(linear)

    def _complete(self, param: str) -> bool:
        return self.loaded.get(param, set()) in (self.expected[param], {"all"})

    def _finish(self, name: str) -> None:
        """Linear `name` becomes its final layer on the device; its staging is freed (a tied
        embedding's is kept, in the compute dtype)."""
        parent, _, child = name.rpartition(".")
        setattr(self.model.get_submodule(parent) if parent else self.model, child, self._final_layer(name))
        for key in self.pending.pop(name):
            if key != EMBEDDING:
                self.staging.pop(key, None)
            elif (staged := self.staging.allocated(EMBEDDING)) is not None and staged.dtype != self.dtype:
                # staged in float32 for the head: the embedding's own copy now
                self.staging.replace(EMBEDDING, staged.to(self.dtype))

    def _final_layer(self, name: str) -> nn.Module:
        bias = self.staging[f"{name}.bias"] if self.linears[name].bias is not None else None
        bias = None if bias is None else bias.to(device=self.device, dtype=self.dtype)
        method = self.method_of(name)
        if name in self.stacked:
            return _stacked_layer(self.records.pop(name), bias, self.device, self.cpu_kernels)
        if name in self.from_records:
            record = {k: v.to(self.device) for k, v in self.records.pop(name).items()}
            return build_linear(method, record, bias, self.cpu_kernels)
        weight = self.staging[EMBEDDING] if self.tied and name == "lm_head" else self.staging[f"{name}.weight"]
        if method is not None:
            record = {k: v.to(self.device) for k, v in _rtn_by_rows(method, weight, self.qconfig.group_size).items()}
            return build_linear(method, record, bias, self.cpu_kernels)
        weight = weight.to(device=self.device, dtype=self.dtype)
        if self.tied and name == LM_HEAD:  # the embedding becomes this same tensor (finish_the_rest): one copy
            self.staging.replace(EMBEDDING, weight)
        return DenseLinear(weight, bias, self.cpu_kernels)

    def check_complete(self) -> None:
        missing = sorted(n for n in self.expected if not self._complete(n))
        if missing:
            raise ValueError(f"checkpoint is missing tensors for: {missing[:8]}{' …' if len(missing) > 8 else ''}")

    def finish_the_rest(self) -> None:
        """The quantized embedding from its record, and every other parameter from its staging,
        in the compute dtype, on the device."""
        if "embed_tokens" in self.records:
            record = self.records.pop("embed_tokens")
            self.model.embed_tokens = QuantizedEmbedding({k: v.to(self.device) for k, v in record.items()},
                                                         "int4" if "mins" in record else "int6", self.dtype)
        name_of = {id(p): n for n, p in reversed(self.params.items())}  # (a tied one by its first name)
        for module in self.model.modules():
            if isinstance(module, nn.Linear):
                continue
            for key, p in list(module._parameters.items()):
                if p is not None and p.is_meta:
                    staged = self.staging[name_of[id(p)]]
                    module._parameters[key] = nn.Parameter(staged.to(device=self.device, dtype=self.dtype),
                                                           requires_grad=False)
            for key, b in list(module._buffers.items()):
                if b is not None and not b.is_meta:
                    module._buffers[key] = b.to(self.device)


def _linear_methods(model: nn.Module, params: dict, checkpoint: LoadedCheckpoint, linears: dict[str, nn.Module],
                    local_name, device: torch.device, qconfig,
                    cpu_kernels) -> tuple[Callable[[str], str | None], set[str]]:
    """Each linear's method (a function of its name; None: dense) and the linears whose every
    checkpoint tensor arrives as a record of their method (AUTO: the file's int4 codes, or int8
    requantized from its blocks as they are read)."""
    if qconfig is None:
        return (lambda name: None), set()
    if qconfig.method != AUTO:
        return qconfig.method_of, _file_codes_for_int4(model, params, checkpoint, linears, local_name, qconfig)
    # int6 where the kernels run it (every level from avx2): the file's 6.56 bits a weight in
    # place of int8's 8 (at avx512_bf16 its many-row steps widen the codes to bf16: int6_gemm)
    int6 = device.type == "cpu" and cpu_kernels is not None and cpu_kernels.gemv_supported()
    methods, from_records = _stored_methods(model, params, checkpoint, linears, local_name, int6)
    if qconfig.lm_head != AUTO:  # the head requantized (round-to-nearest) from the file's, or dense
        tied = model.config.tie_word_embeddings
        if tied and checkpoint.stored_types.get(f"model.{EMBEDDING}") in gguf_blocks.INT4_REPACKED:
            raise ConfigError("quantization_lm_head", "the head is the file's int4 embedding, loaded as stored; "
                              "leave quantization_lm_head auto")
        methods[LM_HEAD] = qconfig.lm_head
        from_records.discard(LM_HEAD)
    return methods.get, from_records


def _linear_types(model: nn.Module, params: dict, checkpoint: LoadedCheckpoint, linears: dict[str, nn.Module],
                  local_name) -> dict[str, list[str]]:
    """The GGUF types ("Q4_K", "F32", ...) of each linear's checkpoint tensors. local_name: a
    checkpoint name's in this rank's model, None for another pipeline stage's layer."""
    stored = checkpoint.stored_types
    types: dict[str, list[str]] = {name: [] for name in linears}
    for hf_name in expected_weight_shapes(checkpoint.config):
        local = local_name(hf_name.removeprefix("model.")) if hf_name.endswith(".weight") else None
        placement = model._placement(params, local) if local is not None else None
        if placement is not None and (linear := placement[0].removesuffix(".weight")) in types:
            types[linear].append(stored.get(hf_name, "F32"))
    if model.config.tie_word_embeddings:
        types[LM_HEAD] = [stored.get("model.embed_tokens.weight", "F32")]
    return types


def _file_codes_for_int4(model: nn.Module, params: dict, checkpoint: LoadedCheckpoint, linears: dict[str, nn.Module],
                         local_name, qconfig) -> set[str]:
    """The linears that round-to-nearest int4 takes from a GGUF file's own codes: those whose every
    tensor is of a type repacked exactly into int4 at the group size asked for (Q4_0 / Q4_1 / Q4_K,
    32). Rounding their dequantized values again would put them on a second grid: each weight moved
    by up to half a step more, for the same bytes. A tied head stays rounded from the embedding,
    which loads dense."""
    if not checkpoint.stored_types or qconfig.algorithm != "rtn" or qconfig.group_size != gguf_blocks.GROUP_SIZE:
        return set()
    types = _linear_types(model, params, checkpoint, linears, local_name)
    return {name for name, t in types.items() if qconfig.method_of(name) == "int4" and t
            and all(x in gguf_blocks.INT4_REPACKED for x in t) and not (model.config.tie_word_embeddings and name == LM_HEAD)}


def _stored_methods(model: nn.Module, params: dict, checkpoint: LoadedCheckpoint, linears: dict[str, nn.Module],
                    local_name, int6: bool) -> tuple[dict[str, str | None], set[str]]:
    """Each linear's method as its checkpoint tensors are stored (gguf_blocks.linear_method, with
    int6 where the kernels run it; a mixture of experts' router and shared-expert gate stay dense),
    STACKED where a fused linear's tensors are int4 and int6 records side by side,
    and the linears loaded from records (int8, int6 and stacked ones, int4 ones whose every tensor is of a
    repacked type; a tied head from the embedding's record where that is int4 or int6). local_name: a checkpoint name's in this rank's model, None for another
    pipeline stage's layer."""
    types = _linear_types(model, params, checkpoint, linears, local_name)
    methods = {name: None if name.endswith(ROUTER_SUFFIXES) else gguf_blocks.linear_method(t, int6)
               for name, t in types.items()}
    for name, t in types.items():
        if methods[name] == "int8" and gguf_blocks.stacked_methods(t, int6):
            methods[name] = STACKED
    from_records = {name for name, t in types.items() if methods[name] in ("int8", "int6", STACKED) or (
        methods[name] == "int4" and all(x in gguf_blocks.INT4_REPACKED for x in t))}
    if model.config.tie_word_embeddings and methods[LM_HEAD] == "int8":
        from_records.discard(LM_HEAD)  # the embedding is read whole, dense; the head is made from it
    counts = Counter(methods[name] or "dense" for name in linears)
    _log.info("%s: linear layers as stored: %s (GGUF types %s)", checkpoint.source.name,
              ", ".join(f"{n} {m}" for m, n in sorted(counts.items())), ", ".join(sorted(set(checkpoint.stored_types.values()))))
    return methods, from_records


def _place_record(model: nn.Module, params: dict, records: dict, name: str,
                  record: dict[str, torch.Tensor], stacked: set[str] = frozenset()) -> tuple[str, object]:
    """Put the record of checkpoint tensor `name` where its linear's record is assembled, row range
    by row range (an int4 embedding's: its own, and the head's when tied; a linear in `stacked`:
    each range's record by its first row); returns (our parameter, its shard key)."""
    if name == "embed_tokens.weight":
        records["embed_tokens"] = record
        if model.config.tie_word_embeddings:
            records[LM_HEAD] = record
        return name, 0
    placement = model._placement(params, name)
    if placement is None:
        raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
    ours, shard, target = placement  # target: a meta view of the rows this tensor fills
    n, k = params[ours].shape
    codes = record["codes"]
    shape = (codes.shape[0], codes.shape[1] * (2 if "mins" in record else 1))  # int4 codes: two a byte
    if shape != tuple(target.shape):
        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, expected {tuple(target.shape)}")
    linear = ours.removesuffix(".weight")
    if linear in stacked:
        records.setdefault(linear, {})[target.storage_offset() // k] = record
    elif codes.shape[0] == n:
        records[linear] = record
    else:
        whole = records.setdefault(linear, {key: torch.empty((n, *v.shape[1:]), dtype=v.dtype) for key, v in record.items()})
        # Keys not in every part (a Q4_K part's factors beside a Q4_0 part) leave the whole record.
        for key in [key for key in whole if key not in record]:
            del whole[key]
        start = target.storage_offset() // k
        for key in whole:
            whole[key][start : start + record[key].shape[0]] = record[key]
    return ours, shard


def _stacked_layer(parts: dict[int, dict[str, torch.Tensor]], bias: torch.Tensor | None, device: torch.device,
                   cpu_kernels) -> StackedLinear:
    """A StackedLinear from its row ranges' records (first row -> record): consecutive records
    of one method (int4: with mins; int6) joined into one layer, each with its rows of the bias."""
    runs: list[tuple[str, list[dict[str, torch.Tensor]]]] = []
    for start in sorted(parts):
        method = "int4" if "mins" in parts[start] else "int6"
        if runs and runs[-1][0] == method:
            runs[-1][1].append(parts[start])
        else:
            runs.append((method, [parts[start]]))
    layers, row = [], 0
    for method, records in runs:
        keys = set.intersection(*(set(r) for r in records))  # a Q4_K part's factors only beside other Q4_K parts
        record = {key: torch.cat([r[key] for r in records]).to(device) for key in keys}
        rows = record["codes"].shape[0]
        layers.append(build_linear(method, record, None if bias is None else bias[row : row + rows], cpu_kernels))
        row += rows
    return StackedLinear(layers)


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

    def allocated(self, name: str) -> torch.Tensor | None:
        """The staging of `name` if it has been allocated (without allocating it)."""
        return dict.get(self, name)

    def replace(self, name: str, tensor: torch.Tensor) -> None:
        """Stage `tensor` for `name` (and the parameters tied to it) in place of what was."""
        key = self.specs[name][0]
        self.by_id[key] = self[name] = tensor

    def pop(self, name, default=None):
        key = self.specs[name][0]
        self.by_id.pop(key, None)
        return super().pop(name, default)
