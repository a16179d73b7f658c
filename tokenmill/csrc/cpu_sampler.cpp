// sample_rows: one token per row of a step's logits, drawn from softmax(logits * inv_temperature)
// (and min-p), by the Gumbel-max trick: argmax_i of logits_i * inv_t - log(-log U_i), with U_i
// uniform in (0, 1). The uniforms are made inside the loop from a counter-based hash of the row's
// 64-bit key and i, so nothing of vocabulary size is written or read twice (PyTorch's path takes
// ~8 passes: scale, softmax, uniform_, log, neg, divide, argmax), and a row's token depends on
// its key and logits only: not on the rest of the batch, the row order or the thread.
//
// Plain C++ (every level, the generic build included): the compiler vectorizes the loop, log
// through the C library's vector math (-ffast-math). Masked logits (-inf) are excluded by a
// comparison, not by arithmetic on infinities, which -ffast-math does not keep.
#include "cpu_common.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

namespace {

constexpr int64_t kChunk = 1024;  // scores kept on the stack between the vector pass and the argmax
constexpr float kLowest = -std::numeric_limits<float>::max();

// murmur3's 32-bit finalizer: a bijection whose output bits each depend on every input bit.
inline uint32_t mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

// The uniform of element i under key (k0, k1): 24 random bits, centred in their interval, so
// never 0 or 1 (log(-log U) is finite).
inline float uniform(uint32_t i, uint32_t k0, uint32_t k1) {
  return (static_cast<float>(mix32(mix32(i ^ k0) + k1) >> 8) + 0.5f) * 0x1p-24f;
}

// The sampled index of one row: logits x[0, n), tokens below `floor` excluded.
int64_t sample_row(const float* x, int64_t n, float inv_t, float floor, uint64_t key) {
  const auto k0 = static_cast<uint32_t>(key), k1 = static_cast<uint32_t>(key >> 32);
  alignas(64) float s[kChunk];
  float best = kLowest;
  int64_t best_i = 0;
  for (int64_t c0 = 0; c0 < n; c0 += kChunk) {
    const int64_t len = std::min(kChunk, n - c0);
    float chunk_max = kLowest;
#pragma omp simd reduction(max : chunk_max)
    for (int64_t j = 0; j < len; ++j) {
      const float v = x[c0 + j];
      const float g = -std::log(-std::log(uniform(static_cast<uint32_t>(c0 + j), k0, k1)));
      const float score = v >= floor ? v * inv_t + g : kLowest;
      s[j] = score;
      chunk_max = std::max(chunk_max, score);
    }
    if (chunk_max > best) {
      best = chunk_max;
      best_i = c0 + (std::find(s, s + len, chunk_max) - s);
    }
  }
  return best_i;
}

}  // namespace

at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& min_p,
                       const at::Tensor& keys) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "logits: [rows, vocab] float32 with contiguous rows");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  TORCH_CHECK(vocab < (int64_t{1} << 32), "logits: vocabulary too large");
  for (const auto* t : {&inv_temperature, &min_p}) {
    TORCH_CHECK(t->dim() == 1 && t->size(0) == rows && t->scalar_type() == at::kFloat && t->is_contiguous(),
                "inv_temperature, min_p: [rows] float32");
  }
  TORCH_CHECK(keys.dim() == 1 && keys.size(0) == rows && keys.scalar_type() == at::kLong && keys.is_contiguous(),
              "keys: [rows] int64");
  at::Tensor out = at::empty({rows}, keys.options());
  const float* x = logits.data_ptr<float>();
  const float* inv_t = inv_temperature.data_ptr<float>();
  const float* mp = min_p.data_ptr<float>();
  const int64_t* k = keys.data_ptr<int64_t>();
  int64_t* o = out.data_ptr<int64_t>();
  const int64_t row_stride = logits.stride(0);
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* xr = x + r * row_stride;
      // min-p keeps p_i >= min_p * p_max, i.e. (x_i - x_max) * inv_t >= log(min_p).
      float floor = kLowest;
      if (mp[r] > 0.f) {
        float x_max = kLowest;
#pragma omp simd reduction(max : x_max)
        for (int64_t i = 0; i < vocab; ++i) x_max = std::max(x_max, xr[i]);
        floor = x_max + std::log(mp[r]) / inv_t[r];
      }
      o[r] = sample_row(xr, vocab, inv_t[r], floor, static_cast<uint64_t>(k[r]));
    }
  });
  return out;
}
