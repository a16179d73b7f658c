// DecoderStack: the decoder layers of a Llama-family model (models/llama.py) for a step on the
// CPU, in one call from Python: decode-only steps, and steps with prefill chunks where
// paged_prefill_attention takes them (fp32 or bf16). The Python forward costs ~20 dispatched ops and ~10
// module calls per layer, ~1.5 ms per step at batch 1 for the default model (a quarter of the
// step with int4 weights); here the same ops run back to back from C++, with the GIL released.
//
// It runs exactly the ops the Python path runs, in the same order and dtypes (each linear's
// kernel for the row count, chosen by the same rule as layers/linear.py: PyTorch's, or the
// few-row and many-row kernels of cpu_gemv.cpp; the CPU kernels of cpu_kernels.cpp; silu and
// mul), so its hidden states are bit-identical to LlamaForCausalLM's layer loop; the one fusion,
// each residual add with the RMSNorm after it (add_rms_norm), rounds the sum first as
// `x + delta` does. Python keeps the embedding lookup and the final norm. With activation
// sparsity, each linear's input is thresholded as layers/sparsity.py's sparsify does, with the
// same ops; without it no op is added.
#include "cpu_kernels.h"

#include <ATen/TensorOperators.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <ATen/ops/_weight_int8pack_mm.h>
#include <ATen/ops/abs.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/linear.h>
#include <ATen/ops/silu.h>
#include <torch/csrc/utils/pybind.h>  // the DecoderStack's specs are Python tuples

#include <string>
#include <string_view>
#include <tuple>
#include <vector>

namespace {

namespace py = pybind11;

// One linear of models/llama.py in a format of layers/linear.py, as its `cpu_decoder_spec()` gives it:
// (kind, weight, scales, bias, input_scale, group_size_or_max_rows, kernel_codes, kernel_pairs,
// kernel_max_rows): the layer decides its own row rule, the stack follows it. A StackedLinear's is
// ("stacked", (its parts' specs), ...): each part runs on x and the outputs are concatenated.
struct Linear {
  enum class Kind { kDense, kOneDnn, kInt8, kInt8Tiled, kInt4, kInt6, kStacked };
  Kind kind;
  std::vector<Linear> parts;  // stacked (StackedLinear): the row ranges' layers, outputs concatenated
  at::Tensor weight;  // dense: [out, in]; onednn: the packed weight; int8: codes (int8_tiled: in tiles); int4: packed
                      // codes; int6: the codes' low bits in tiles
  at::Tensor scales;  // int8: per-channel bf16 scales; int4: [groups, out, 2] scales and zeros; int6: tile scales
  c10::optional<at::Tensor> bias, input_scale;
  int64_t param = 0;  // int4: group size; int8: the most rows for the int8 kernel; int6: for int6_linear (0: all)
  // The few-row kernel's weight: int4_linear's codes and pairs, int8_linear's codes,
  // bf16_linear's plain weight, or (int6) int6_linear's top bits.
  c10::optional<at::Tensor> kernel_codes, kernel_pairs;
  int64_t kernel_max_rows = 0;  // the most rows for them (0: none; layers/linear.py kernel_rows)

  static Linear from_spec(const py::tuple& spec) {
    TORCH_CHECK(spec.size() == 9, "a linear spec is (kind, weight, scales, bias, input_scale, param, kernel codes, "
                "pairs, kernel_max_rows)");
    Linear l;
    const auto kind = spec[0].cast<std::string>();
    if (kind == "stacked") {
      l.kind = Kind::kStacked;
      for (const auto& part : spec[1].cast<py::tuple>()) l.parts.push_back(from_spec(part.cast<py::tuple>()));
      return l;
    }
    if (kind == "dense") {
      l.kind = Kind::kDense;
    } else if (kind == "onednn") {
      l.kind = Kind::kOneDnn;
    } else if (kind == "int8") {
      l.kind = Kind::kInt8;
    } else if (kind == "int8_tiled") {
      l.kind = Kind::kInt8Tiled;
    } else if (kind == "int4") {
      l.kind = Kind::kInt4;
    } else if (kind == "int6") {
      l.kind = Kind::kInt6;
    } else {
      TORCH_CHECK(false, "unknown linear kind ", kind);
    }
    l.weight = spec[1].cast<at::Tensor>();
    if (!spec[2].is_none()) l.scales = spec[2].cast<at::Tensor>();
    if (!spec[3].is_none()) l.bias = spec[3].cast<at::Tensor>();
    if (!spec[4].is_none()) l.input_scale = spec[4].cast<at::Tensor>();
    l.param = spec[5].cast<int64_t>();
    l.kernel_max_rows = spec[8].cast<int64_t>();
    if (!spec[6].is_none()) l.kernel_codes = spec[6].cast<at::Tensor>();
    if (!spec[7].is_none()) l.kernel_pairs = spec[7].cast<at::Tensor>();
    return l;
  }

  at::Tensor operator()(const at::Tensor& x) const {
    switch (kind) {
      case Kind::kDense:  // DenseLinear, F.linear
        return at::linear(x, weight, bias);
      case Kind::kStacked: {  // StackedLinear
        std::vector<at::Tensor> ys;
        ys.reserve(parts.size());
        for (const Linear& part : parts) ys.push_back(part(x));
        return at::cat(ys, 1);
      }
      case Kind::kOneDnn:  // DenseLinear, packed bf16
        if (kernel_codes && x.size(0) <= kernel_max_rows && x.scalar_type() == at::kBFloat16) {
          return bf16_linear(x.contiguous(), *kernel_codes, bias);
        }
        return onednn_linear().call(x, weight, bias, "none", c10::List<c10::optional<at::Scalar>>(), c10::nullopt);
      default:
        break;
    }
    // QuantizedLinear.forward: the kernels take x in its dtype, PyTorch's int4/int8 kernels in bf16
    const at::Tensor xs = input_scale ? x * *input_scale : x;
    const int64_t rows = xs.size(0);
    const auto bf16 = [&] { return xs.scalar_type() == at::kBFloat16 ? xs : xs.to(at::kBFloat16); };
    at::Tensor y;
    if (kind == Kind::kInt8Tiled) {
      y = int8_tiled_linear(xs.contiguous(), weight, scales);
    } else if (kind == Kind::kInt6 && param > 0 && rows > param) {  // Int6Linear above max_rows
      y = int6_gemm(xs.contiguous(), weight, *kernel_codes, scales, c10::nullopt);
    } else if (kind == Kind::kInt6) {
      y = int6_linear(xs.contiguous(), weight, *kernel_codes, scales);
    } else if (kind == Kind::kInt4 && kernel_codes && rows <= kernel_max_rows) {
      y = int4_linear(xs.contiguous(), *kernel_codes, *kernel_pairs, param);
    } else if (kind == Kind::kInt4) {
      y = at::_weight_int4pack_mm_for_cpu(bf16(), weight, param, scales);
    } else if (kernel_codes && rows <= kernel_max_rows) {  // int8
      y = int8_linear(xs.contiguous(), *kernel_codes, scales);
    } else if (kernel_codes && rows > param) {  // Int8Linear above max_rows, with the kernels
      y = int8_gemm(xs.contiguous(), *kernel_codes, scales, c10::nullopt);
    } else if (rows <= param) {
      y = at::_weight_int8pack_mm(bf16(), weight, scales);
    } else {  // Int8Linear above max_rows: its dequantized weight in a bf16 matmul
      y = at::linear(bf16(), weight.to(at::kBFloat16) * scales.unsqueeze(1));
    }
    if (bias) y = y + *bias;
    return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
  }

  using OneDnnLinear = at::Tensor(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                  std::string_view, c10::List<c10::optional<at::Scalar>>,
                                  c10::optional<std::string_view>);
  static const c10::TypedOperatorHandle<OneDnnLinear>& onednn_linear() {
    static const auto op =
        c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "").typed<OneDnnLinear>();
    return op;
  }
};

// layers/sparsity.py's sparsify: x's first `rows` rows with the entries whose magnitude is below
// `threshold` (0-dim) set to zero.
at::Tensor sparsify(const at::Tensor& x, const at::Tensor& threshold, int64_t rows) {
  if (rows >= x.size(0)) return x.masked_fill(at::abs(x) < threshold, 0);
  const at::Tensor head = x.narrow(0, 0, rows);
  return at::cat({head.masked_fill(at::abs(head) < threshold, 0), x.narrow(0, rows, x.size(0) - rows)});
}

struct Layer {
  at::Tensor input_norm, post_norm;  // RMSNorm weights
  Linear qkv, o, gate_up, down;
};

class DecoderStack {
 public:
  // layers: per decoder layer (input_norm_weight, post_norm_weight, qkv, o, gate_up, down specs).
  DecoderStack(const py::list& layers, double eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim,
               int64_t intermediate_size, double scale)
      : eps_(eps),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        intermediate_(intermediate_size),
        scale_(scale) {
    for (const auto& item : layers) {
      const auto t = item.cast<py::tuple>();
      TORCH_CHECK(t.size() == 6, "a layer is (input_norm, post_norm, qkv, o, gate_up, down)");
      const auto linear = [&](int i) { return Linear::from_spec(t[i]); };
      layers_.push_back(Layer{t[0].cast<at::Tensor>(), t[1].cast<at::Tensor>(), linear(2), linear(3), linear(4), linear(5)});
    }
  }

  // x: [n, hidden], the embeddings of a step's n tokens, decodes first, then prefill chunks (as
  // TorchAttentionBackend orders them); cos, sin: their rotary rows; slot_mapping [n] int64;
  // block_tables [num_decodes, width] int32 and seq_lens [num_decodes] int32 (none: no decodes);
  // kv_caches: per layer (key, value) or (key codes, value codes, key scales, value scales);
  // prefill: the chunks' (block_tables, seq_lens, query_lens) as paged_prefill_attention takes
  // them (none: no chunks); thresholds: activation sparsity's [layers, 4] float32 thresholds (q/k/v,
  // o, gate/up, down inputs) applied to the first sparse_rows tokens (none or 0: dense). Returns
  // the last layer's output (before the final norm).
  at::Tensor forward(const at::Tensor& x_in, const at::Tensor& cos, const at::Tensor& sin,
                     const at::Tensor& slot_mapping, const c10::optional<at::Tensor>& block_tables,
                     const c10::optional<at::Tensor>& seq_lens, const std::vector<std::vector<at::Tensor>>& kv_caches,
                     const c10::optional<std::tuple<at::Tensor, at::Tensor, at::Tensor>>& prefill,
                     const c10::optional<at::Tensor>& thresholds, int64_t sparse_rows) const {
    TORCH_CHECK(kv_caches.size() == layers_.size(), "one KV cache per layer");
    TORCH_CHECK(block_tables.has_value() == seq_lens.has_value(), "block_tables and seq_lens: both or neither");
    const int64_t n = x_in.size(0), decodes = block_tables ? block_tables->size(0) : 0;
    TORCH_CHECK(prefill || decodes == n, "tokens past the decodes need the prefill chunks' tables");
    const bool sparse = thresholds.has_value() && sparse_rows > 0;
    TORCH_CHECK(!sparse || (thresholds->dim() == 2 && thresholds->size(0) == static_cast<int64_t>(layers_.size()) &&
                            thresholds->size(1) == 4 && sparse_rows <= n),
                "thresholds are [layers, 4] and sparse_rows at most the step's tokens");
    at::Tensor x = x_in, h, delta;
    for (size_t i = 0; i < layers_.size(); ++i) {
      const Layer& layer = layers_[i];
      const std::vector<at::Tensor>& cache = kv_caches[i];
      TORCH_CHECK(cache.size() == 2 || cache.size() == 4, "a KV cache is 2 tensors, or 4 when quantized");
      const auto ks = cache.size() == 4 ? c10::optional<at::Tensor>(cache[2]) : c10::nullopt;
      const auto vs = cache.size() == 4 ? c10::optional<at::Tensor>(cache[3]) : c10::nullopt;
      if (i == 0) {
        h = rms_norm(x, layer.input_norm, eps_);
      } else {
        std::tie(x, h) = add_rms_norm(x, delta, layer.input_norm, eps_);
      }
      // LlamaAttention.forward, through TorchAttentionBackend's kernels
      // layers/sparsity.py's input order: q/k/v, o, gate/up, down
      const auto in = [&](const at::Tensor& t, int64_t which) {
        return sparse ? sparsify(t, (*thresholds)[static_cast<int64_t>(i)][which], sparse_rows) : t;
      };
      const at::Tensor qkv = layer.qkv(in(h, 0));
      const at::Tensor qk = rope_write_kv(qkv, cos, sin, slot_mapping, cache[0], cache[1], num_heads_, num_kv_heads_,
                                          ks, vs);
      at::Tensor attn = at::empty({n, num_heads_, head_dim_}, x.options());
      if (decodes) {
        paged_decode_attention(attn.narrow(0, 0, decodes), qk.narrow(0, 0, decodes).narrow(1, 0, num_heads_), cache[0],
                               cache[1], *block_tables, *seq_lens, scale_, ks, vs);
      }
      if (prefill) {  // the chunks' own keys and values: the rotated keys, the values of qkv
        const int64_t rows = n - decodes, kv_size = num_kv_heads_ * head_dim_;
        const at::Tensor chunk_qk = qk.narrow(0, decodes, rows);
        const at::Tensor values =
            qkv.narrow(0, decodes, rows).narrow(1, (num_heads_ + num_kv_heads_) * head_dim_, kv_size).view(
                {rows, num_kv_heads_, head_dim_});
        const auto& [tables, lens, query_lens] = *prefill;
        paged_prefill_attention(attn.narrow(0, decodes, rows), chunk_qk.narrow(1, 0, num_heads_), cache[0], cache[1],
                                tables, lens, query_lens, scale_, ks, vs, chunk_qk.narrow(1, num_heads_, num_kv_heads_),
                                values);
      }
      const at::Tensor o = layer.o(in(attn.view({n, num_heads_ * head_dim_}), 1));
      std::tie(x, h) = add_rms_norm(x, o, layer.post_norm, eps_);
      // LlamaMLP.forward
      const at::Tensor gate_up = layer.gate_up(in(h, 2));
      delta = layer.down(
          in(at::silu(gate_up.narrow(1, 0, intermediate_)) * gate_up.narrow(1, intermediate_, intermediate_), 3));
    }
    return layers_.empty() ? x : x + delta;
  }

 private:
  std::vector<Layer> layers_;
  double eps_;
  int64_t num_heads_, num_kv_heads_, head_dim_, intermediate_;
  double scale_;
};

}  // namespace

void bind_decoder_stack(py::module& m) {
  py::class_<DecoderStack>(m, "DecoderStack", "a Llama-family decoder's layers for a step's tokens (CPU)")
      .def(py::init<const py::list&, double, int64_t, int64_t, int64_t, int64_t, double>(), py::arg("layers"),
           py::arg("eps"), py::arg("num_heads"), py::arg("num_kv_heads"), py::arg("head_dim"),
           py::arg("intermediate_size"), py::arg("scale"))
      .def("forward", &DecoderStack::forward, py::arg("x"), py::arg("cos"), py::arg("sin"), py::arg("slot_mapping"),
           py::arg("block_tables"), py::arg("seq_lens"), py::arg("kv_caches"), py::arg("prefill") = py::none(),
           py::arg("thresholds") = py::none(), py::arg("sparse_rows") = 0, py::call_guard<py::gil_scoped_release>());
}
