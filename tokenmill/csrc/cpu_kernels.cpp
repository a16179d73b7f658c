// CPU kernels that PyTorch has no single op for, compiled at first use by
// tokenmill/layers/cpu_kernels.py (torch.utils.cpp_extension, -O3 -march=native -ffast-math
// -fopenmp: the OpenMP pragmas run on torch's own OpenMP runtime and threads, and -ffast-math
// lets exp and the reductions vectorize; nothing here relies on infinities or NaNs).
//
// paged_decode_attention: one query token per sequence attending to its context in the paged
//   KV cache, read in place through the block table (no gather), GQA-aware: the G query heads
//   of a KV head share every K/V row they read. fp32 accumulation, exact softmax (two passes
//   over K, one over V). Parallel over (sequence, KV head). Reads an int8 cache (codes + one
//   scale per token and KV head) too, with the scales folded into the scores and weights.
// rms_norm: y = x * rsqrt(mean(x^2) + eps) * w in one pass over each row, fp32 accumulation,
//   rounded once to x's dtype. add_rms_norm: the residual add before it in the same pass.
// rope_write_kv: rotary embedding of the queries and keys of a fused qkv projection output, and
//   the store of the rotated keys and the values into the paged KV cache: one call for what
//   takes ~15 PyTorch ops. Rounds as the PyTorch ops do (each product, then the sum, to the
//   dtype), so in bf16 its output is bit-identical to theirs.
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Calls visit(t, row, row_scale) for t = 0 .. len - 1 with row = the token's K (or V) vector of
// `kv_head` as floats, reading the paged cache `cache` through the sequence's block table. An
// int8 cache passes its codes and the token-head's scale (the vector is row * row_scale; the
// visitor folds the scale into its dot product or weight); otherwise row_scale is 1.
template <typename C, typename Visit>
inline void for_each_cached_row(const C* cache, const float* scales, const int32_t* table, int64_t len,
                                int64_t block_size, int64_t block_stride, int64_t token_stride, int64_t num_kv_heads,
                                int64_t kv_head, int64_t head_dim, float* row, Visit&& visit) {
  for (int64_t t0 = 0; t0 < len; t0 += block_size) {
    const int64_t n = std::min(block_size, len - t0);
    const int64_t block_id = table[t0 / block_size];
    const C* block = cache + block_id * block_stride + kv_head * head_dim;
    const float* block_scales = scales ? scales + (block_id * block_size) * num_kv_heads + kv_head : nullptr;
    for (int64_t j = 0; j < n; ++j) {
      load_row(block + j * token_stride, row, head_dim);
      visit(t0 + j, row, block_scales ? block_scales[j * num_kv_heads] : 1.f);
    }
  }
}

// kHeadDim: the head size as a compile-time constant (fully unrolled and vectorized inner loops),
// or 0 for any size, read at run time. C: the cache's element type (T, or int8_t with scales).
template <typename T, typename C, int64_t kHeadDim>
void paged_decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, const float* k_scales,
                                 const float* v_scales) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t head_dim = kHeadDim ? kHeadDim : query.size(2);
  const int64_t block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t q_row = query.stride(0), out_row = out.stride(0);
  const int64_t max_blocks = block_tables.size(1);
  const int64_t block_stride = key_cache.stride(0), token_stride = key_cache.stride(1);
  const T* q_ptr = query.data_ptr<T>();
  const C* k_ptr = key_cache.data_ptr<C>();
  const C* v_ptr = value_cache.data_ptr<C>();
  T* o_ptr = out.data_ptr<T>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> q(group * head_dim), acc(group * head_dim), row(head_dim), scores, sums(group);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t seq = item / num_kv_heads, kv_head = item % num_kv_heads;
      const int64_t len = lens[seq];
      const int32_t* table = tables + seq * max_blocks;
      scores.resize(group * len);
      for (int64_t g = 0; g < group; ++g) {
        const T* src = q_ptr + seq * q_row + (kv_head * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = static_cast<float>(src[d]) * fscale;
      }
      // scores[g][t] = q_g . k_t
      for_each_cached_row(k_ptr, k_scales, table, len, block_size, block_stride, token_stride, num_kv_heads, kv_head,
                          head_dim, row.data(), [&](int64_t t, const float* k, float k_scale) {
                            for (int64_t g = 0; g < group; ++g) {
                              const float* qg = q.data() + g * head_dim;
                              float dot = 0.f;
#pragma omp simd reduction(+ : dot)
                              for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
                              scores[g * len + t] = dot * k_scale;
                            }
                          });
      // softmax numerators and sums
      for (int64_t g = 0; g < group; ++g) {
        float* s = scores.data() + g * len;
        float m = s[0];  // len >= 1 (the new token); no infinities (built with -ffast-math)
        for (int64_t t = 1; t < len; ++t) m = std::max(m, s[t]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = std::exp(s[t] - m);
          sum += s[t];
        }
        sums[g] = sum;
      }
      // out_g = sum_t p[g][t] v_t / sum_g
      std::fill(acc.begin(), acc.end(), 0.f);
      for_each_cached_row(v_ptr, v_scales, table, len, block_size, block_stride, token_stride, num_kv_heads, kv_head,
                          head_dim, row.data(), [&](int64_t t, const float* v, float v_scale) {
                            for (int64_t g = 0; g < group; ++g) {
                              const float p = scores[g * len + t] * v_scale;
                              float* a = acc.data() + g * head_dim;
#pragma omp simd
                              for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
                            }
                          });
      for (int64_t g = 0; g < group; ++g) {
        T* dst = o_ptr + seq * out_row + (kv_head * group + g) * head_dim;
        const float inv = 1.f / sums[g];
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[g * head_dim + d] * inv);
      }
    }
  });
}

// With `delta`, each row is first x + delta rounded to T (what PyTorch's add gives), written to
// `sum`, and that rounded sum is normalized.
template <typename T>
void rms_norm_impl(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, double eps,
                   const at::Tensor* delta = nullptr, at::Tensor* sum = nullptr) {
  const int64_t rows = x.size(0), hidden = x.size(1);
  const T* x_ptr = x.data_ptr<T>();
  const T* w_ptr = weight.data_ptr<T>();
  const T* d_ptr = delta ? delta->data_ptr<T>() : nullptr;
  T* s_ptr = sum ? sum->data_ptr<T>() : nullptr;
  T* o_ptr = out.data_ptr<T>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden), w(hidden);
    load_row(w_ptr, w.data(), hidden);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x_ptr + r * hidden, row.data(), hidden);
      if (d_ptr) {
        const T* d = d_ptr + r * hidden;
        T* s = s_ptr + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          s[i] = static_cast<T>(row[i] + static_cast<float>(d[i]));
          row[i] = static_cast<float>(s[i]);
        }
      }
      float ss = 0.f;
#pragma omp simd reduction(+ : ss)
      for (int64_t i = 0; i < hidden; ++i) ss += row[i] * row[i];
      const float inv = 1.f / std::sqrt(ss / static_cast<float>(hidden) + feps);
      T* dst = o_ptr + r * hidden;
      for (int64_t i = 0; i < hidden; ++i) dst[i] = static_cast<T>(row[i] * inv * w[i]);
    }
  });
}

// One head of x * cos + roll(x, half) * signed_sin, each product rounded to T, then the sum, as
// PyTorch's separate ops round. Out of line with contraction off: -ffast-math would otherwise
// fuse a product and the sum into one FMA in fp32 (bf16's explicit roundings prevent it there).
template <typename T>
__attribute__((noinline, optimize("fp-contract=off"))) void rope_head(const T* x, const T* c, const T* s, T* o,
                                                                       int64_t head_dim) {
  const int64_t half = head_dim / 2;
  for (int64_t i = 0; i < head_dim; ++i) {
    const float a = static_cast<float>(static_cast<T>(static_cast<float>(x[i]) * static_cast<float>(c[i])));
    const float b = static_cast<float>(
        static_cast<T>(static_cast<float>(x[i < half ? i + half : i - half]) * static_cast<float>(s[i])));
    o[i] = static_cast<T>(a + b);
  }
}

// int8 codes and scale of one K or V vector as quantize_kv (layers/attention/kv_quant.py) makes
// them: scale = amax / 127, codes = round-half-even(x / scale) (an all-zero vector: codes 0 over
// the smallest normal). Exact IEEE division (no -ffast-math reciprocal), so the codes are
// bit-identical to PyTorch's.
template <typename T>
__attribute__((noinline, optimize("no-fast-math"))) void quantize_row_int8(const T* x, int8_t* codes, float* scale,
                                                                           int64_t n) {
  float amax = 0.f;
  for (int64_t i = 0; i < n; ++i) amax = std::max(amax, std::fabs(static_cast<float>(x[i])));
  const float s = amax / 127.f;
  const float divisor = std::max(s, std::numeric_limits<float>::min());
  for (int64_t i = 0; i < n; ++i) codes[i] = static_cast<int8_t>(std::nearbyint(static_cast<float>(x[i]) / divisor));
  *scale = s;
}

template <typename T>
void rope_write_kv_impl(at::Tensor& out, const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                        const at::Tensor& slot_mapping, at::Tensor& key_cache, at::Tensor& value_cache,
                        int64_t num_heads, int64_t num_kv_heads, float* k_scales, float* v_scales) {
  const int64_t n = qkv.size(0), head_dim = key_cache.size(3);
  const int64_t rotated = num_heads + num_kv_heads, kv_row = num_kv_heads * head_dim;
  const T* qkv_ptr = qkv.data_ptr<T>();
  const T* cos_ptr = cos.data_ptr<T>();
  const T* sin_ptr = sin.data_ptr<T>();
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  T* o_ptr = out.data_ptr<T>();
  // The cache holds T, or int8 codes when scales are given.
  void* k_base = key_cache.data_ptr();
  void* v_base = value_cache.data_ptr();
  const auto store = [&](const T* x, void* base, float* scales, int64_t slot) {
    if (scales) {
      int8_t* codes = static_cast<int8_t*>(base) + slot * kv_row;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        quantize_row_int8(x + h * head_dim, codes + h * head_dim, scales + slot * num_kv_heads + h, head_dim);
      }
    } else {
      std::copy(x, x + kv_row, static_cast<T*>(base) + slot * kv_row);
    }
  };
  at::parallel_for(0, n, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* x_row = qkv_ptr + t * qkv.stride(0);
      const T* c = cos_ptr + t * cos.stride(0);
      const T* s = sin_ptr + t * sin.stride(0);
      T* o_row = o_ptr + t * rotated * head_dim;
      for (int64_t h = 0; h < rotated; ++h) rope_head(x_row + h * head_dim, c, s, o_row + h * head_dim, head_dim);
      if (slots[t] < 0) continue;  // a padding row of a fixed-size batch (slot -1): nothing stored
      store(o_row + num_heads * head_dim, k_base, k_scales, slots[t]);
      store(x_row + rotated * head_dim, v_base, v_scales, slots[t]);
    }
  });
}

void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// The cache holds `compute` (no scales), or int8 codes with float32 scales [num_blocks,
// block_size, num_kv_heads] for both K and V. Returns whether it is int8.
bool check_cache_dtype(at::ScalarType compute, const at::Tensor& key_cache, const at::Tensor& value_cache,
                       const c10::optional<at::Tensor>& key_scales, const c10::optional<at::Tensor>& value_scales) {
  const bool quantized = key_scales.has_value();
  TORCH_CHECK(quantized == value_scales.has_value(), "key_scales and value_scales: both or neither");
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                  key_cache.scalar_type() == (quantized ? at::kChar : compute),
              "the cache must hold the compute dtype (without scales) or int8 codes (with scales)");
  if (quantized) {
    for (const at::Tensor* t : {&*key_scales, &*value_scales}) {
      check_cpu(*t, "every tensor");
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == key_cache.sizes().slice(0, 3),
                  "key_scales and value_scales: contiguous float32 [num_blocks, block_size, num_kv_heads]");
    }
  }
  return quantized;
}

// paged_decode_attention_impl with the head sizes 64 and 128 as compile-time constants.
template <typename T, typename C>
void dispatch_head_dim(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                       const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                       double scale, const float* k_scales, const float* v_scales) {
  switch (query.size(2)) {
    case 64:
      paged_decode_attention_impl<T, C, 64>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scales,
                                            v_scales);
      break;
    case 128:
      paged_decode_attention_impl<T, C, 128>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                             k_scales, v_scales);
      break;
    default:
      paged_decode_attention_impl<T, C, 0>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, k_scales,
                                           v_scales);
  }
}

}  // namespace

// out [num_seqs, num_heads, head_dim] (rows may be strided), query likewise; key_cache,
// value_cache [num_blocks, block_size, num_kv_heads, head_dim] contiguous; block_tables
// [num_seqs, max_blocks] int32; seq_lens [num_seqs] int32 (context length, new token included).
// An int8 cache (kv_cache_dtype int8) comes with key_scales, value_scales [num_blocks,
// block_size, num_kv_heads] float32 contiguous: a vector is its codes times its scale.
void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, const c10::optional<at::Tensor>& key_scales,
                            const c10::optional<at::Tensor>& value_scales) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &key_cache, &value_cache,
                                                                      &block_tables, &seq_lens}) {
    check_cpu(*t, "every tensor");
  }
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out: [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query rows must be [num_heads, head_dim] contiguous");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out rows must be [num_heads, head_dim] contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache: contiguous, same shape");
  TORCH_CHECK(key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  const bool quantized = check_cache_dtype(query.scalar_type(), key_cache, value_cache, key_scales, value_scales);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() && block_tables.size(0) == query.size(0) &&
                  seq_lens.size(0) == query.size(0),
              "block_tables [num_seqs, max_blocks] and seq_lens [num_seqs]: contiguous int32");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.numel(); ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= block_tables.size(1) * key_cache.size(1),
                "every seq_len must be >= 1 and fit in its block table row");
  }
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, query.scalar_type(), "paged_decode_attention", [&] {
    if (quantized) {
      dispatch_head_dim<scalar_t, int8_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                          key_scales->data_ptr<float>(), value_scales->data_ptr<float>());
    } else {
      dispatch_head_dim<scalar_t, scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, nullptr,
                                            nullptr);
    }
  });
}

namespace {

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  check_cpu(x, "x");
  check_cpu(weight, "weight");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x: contiguous [rows, hidden]");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.scalar_type() == x.scalar_type() &&
                  weight.is_contiguous(),
              "weight: contiguous [hidden] of x's dtype");
}

}  // namespace

// x [rows, hidden] contiguous, weight [hidden] of x's dtype; returns a new tensor.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  check_norm_args(x, weight);
  at::Tensor out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, weight, eps);
  });
  return out;
}

// The residual add and the next RMSNorm in one pass: returns (x + delta, rms_norm(x + delta)),
// the sum rounded to x's dtype first, as `x + delta` then `rms_norm` give. delta: like x.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_norm_args(x, weight);
  check_cpu(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() && delta.is_contiguous(),
              "delta: contiguous, x's shape and dtype");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, x.scalar_type(), "add_rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, weight, eps, &delta, &sum);
  });
  return {sum, out};
}

// qkv [n, (num_heads + 2 num_kv_heads) * head_dim] (rows may be strided); cos, sin [n, 1 or
// absent, head_dim] of qkv's dtype (rows may be strided; sin's first half negated, as
// RotaryEmbedding keeps it); slot_mapping [n] int64; key_cache, value_cache [num_blocks,
// block_size, num_kv_heads, head_dim] contiguous. Returns the rotated queries and keys,
// [n, num_heads + num_kv_heads, head_dim]; the rotated keys and the values are stored at
// their slots (slot -1: a padding row, not stored, as the Triton backend's write_kv does).
// An int8 cache (codes) comes with key_scales, value_scales [num_blocks, block_size,
// num_kv_heads] float32: each vector is quantized as quantize_kv does, bit-identically.
at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, at::Tensor key_cache, at::Tensor value_cache,
                         int64_t num_heads, int64_t num_kv_heads, const c10::optional<at::Tensor>& key_scales,
                         const c10::optional<at::Tensor>& value_scales) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&qkv, &cos, &sin, &slot_mapping, &key_cache,
                                                                      &value_cache}) {
    check_cpu(*t, "every tensor");
  }
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes() && key_cache.size(2) == num_kv_heads,
              "key_cache and value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim]");
  const int64_t head_dim = key_cache.size(3), n = qkv.size(0);
  TORCH_CHECK(head_dim % 2 == 0 && num_heads % num_kv_heads == 0, "head_dim must be even, num_heads a multiple of num_kv_heads");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1 && qkv.size(1) == (num_heads + 2 * num_kv_heads) * head_dim,
              "qkv: [n, (num_heads + 2 num_kv_heads) * head_dim] with contiguous rows");
  const at::Tensor cos2 = cos.reshape({cos.size(0), -1}), sin2 = sin.reshape({sin.size(0), -1});
  TORCH_CHECK(cos2.size(0) == n && sin2.size(0) == n && cos2.size(1) == head_dim && sin2.size(1) == head_dim &&
                  cos2.stride(1) == 1 && sin2.stride(1) == 1,
              "cos and sin: [n, head_dim] rows (a middle axis of 1 allowed)");
  TORCH_CHECK(cos.scalar_type() == qkv.scalar_type() && sin.scalar_type() == qkv.scalar_type(),
              "qkv, cos and sin must share a dtype");
  const bool quantized = check_cache_dtype(qkv.scalar_type(), key_cache, value_cache, key_scales, value_scales);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == n &&
                  slot_mapping.is_contiguous(),
              "slot_mapping: contiguous [n] int64");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slots[i] >= -1 && slots[i] < num_slots, "slot out of the cache's range");
  at::Tensor out = at::empty({n, num_heads + num_kv_heads, head_dim}, qkv.options());
  AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_kv_impl<scalar_t>(out, qkv, cos2, sin2, slot_mapping, key_cache, value_cache, num_heads, num_kv_heads,
                                 quantized ? key_scales->data_ptr<float>() : nullptr,
                                 quantized ? value_scales->data_ptr<float>() : nullptr);
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_write_kv", &rope_write_kv, "rotary embedding of q and k + paged KV cache store (CPU)",
        pybind11::arg("qkv"), pybind11::arg("cos"), pybind11::arg("sin"), pybind11::arg("slot_mapping"),
        pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("num_heads"),
        pybind11::arg("num_kv_heads"), pybind11::arg("key_scales") = pybind11::none(),
        pybind11::arg("value_scales") = pybind11::none());
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (CPU)", pybind11::arg("out"),
        pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"), pybind11::arg("block_tables"),
        pybind11::arg("seq_lens"), pybind11::arg("scale"), pybind11::arg("key_scales") = pybind11::none(),
        pybind11::arg("value_scales") = pybind11::none());
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (CPU): (x + delta, rms_norm(x + delta))");
  m.def("int4_linear", &int4_linear, "weight-only int4 linear at 1-4 rows (CPU, AVX-512 BF16)", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("pairs"), pybind11::arg("group_size"));
  m.def("bf16_linear", &bf16_linear, "bf16 linear at 1-4 rows (CPU, AVX-512 BF16)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("int8_linear", &int8_linear, "weight-only int8 linear at 1-4 rows (CPU, AVX-512 BF16)", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"));
  m.def("gemv_supported", &gemv_supported, "whether int4_linear, int8_linear and bf16_linear were built (AVX-512 BF16)");
  bind_decoder_stack(m);
}
