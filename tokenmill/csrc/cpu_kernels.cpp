// CPU kernels that PyTorch has no single op for, compiled at first use by
// tokenmill/layers/cpu_kernels.py (torch.utils.cpp_extension, -O3 -march=native -ffast-math
// -fopenmp: the OpenMP pragmas run on torch's own OpenMP runtime and threads, and -ffast-math
// lets exp and the reductions vectorize; nothing here relies on infinities or NaNs).
//
// paged_decode_attention: one query token per sequence attending to its context in the paged
//   KV cache, read in place through the block table (no gather), GQA-aware: the G query heads
//   of a KV head share every K/V row they read. fp32 accumulation, exact softmax (scores, then
//   weights, then one pass over V). Work items are (sequence, KV head), taken longest first by
//   whichever thread is free; with too few of them for the threads (one long request) each
//   context is split into parts whose softmax partial results are combined (split-K, "flash
//   decoding"). bf16 with a bf16 cache and head size a multiple of 32, on AVX-512 BF16: q . k
//   by vdpbf16ps (exact products, fp32 sums) and V widened to fp32 by a shift and a mask.
//   Reads an int8 cache (codes + one scale per token and KV head) too, with the scales folded
//   into the scores and weights; with bf16 queries on AVX-512 BF16 the same way as a bf16 cache
//   (codes widened to bf16, exactly).
// rms_norm: y = x * rsqrt(mean(x^2) + eps) * w in one pass over each row, fp32 accumulation,
//   rounded once to x's dtype. add_rms_norm: the residual add before it in the same pass.
// rope_write_kv: rotary embedding of the queries and keys of a fused qkv projection output, and
//   the store of the rotated keys and the values into the paged KV cache: one call for what
//   takes ~15 PyTorch ops. Rounds as the PyTorch ops do (each product, then the sum, to the
//   dtype), so in bf16 its output is bit-identical to theirs.
// Longer than 600 lines on purpose: decode attention's dtypes and cache formats, norms and
// rotary embedding share the vector helpers and the work split over threads defined here.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <ATen/ops/empty_like.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <memory>
#include <string>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

// Split-K: a sequence's context is cut into items of at least kMinSplitTokens tokens when there
// are fewer than kItemsPerThread (sequence, KV head) pairs per thread.
constexpr int64_t kItemsPerThread = 4;
constexpr int64_t kMinSplitTokens = 64;

#ifdef TOKENMILL_AVX512_BF16
// Lane t of the result: the sum of the 16 lanes of v[t]. A tree of 128-bit chunk and lane
// shuffles (15 merges of two vectors) instead of 16 horizontal sums.
inline __m512 sum_each_of_16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i) {  // chunks: [v2i(0+2), v2i(1+3), v2i+1(0+2), v2i+1(1+3)]
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
  }
  for (int i = 0; i < 4; ++i) {  // chunk k: 4 partial sums of token 4i + k
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], 0xDD));
  }
  for (int i = 0; i < 2; ++i) {  // chunk k: 2 partial sums of token 8i + k, then 2 of 8i + 4 + k
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44), _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  }
  // lane 4k + j: token k + 4j
  const __m512 r = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], 0x88), _mm512_shuffle_ps(c[0], c[1], 0xDD));
  const __m512i order = _mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15);
  return _mm512_permutexvar_ps(order, r);
}
#endif

// One work item of paged decode attention: the G query heads of one KV head of one sequence
// over tokens [begin, end) of its context. For each query head g it leaves
//   acc[g] = sum_t exp(s_gt - m_g) v_t,  m[g] = max_t s_gt,  l[g] = sum_t exp(s_gt - m_g)
// (s_gt = scale * q_g . k_t), to be divided by l (one item per sequence) or combined with the
// other items of the sequence first (split-K: flash decoding). The SIMD path (bf16 queries over a
// bf16 or int8 cache) keeps acc's 32-dim chunks as [even dims, odd dims] (the order its widening
// of pairs gives); `store` undoes it. With an int8 cache it takes codes as bf16 (exact: |code|
// <= 127), so q . codes is exact products in fp32 sums, then times the token's K scale; each
// softmax weight is multiplied by the token's V scale before the pass over V.
template <typename T, typename C, int64_t kHeadDim>
struct DecodeAttention : tokenmill::PagedLayout {
  static constexpr bool kInt8 = std::is_same_v<C, int8_t>;
  static constexpr bool kSimd =
#ifdef TOKENMILL_AVX512_BF16
      std::is_same_v<T, c10::BFloat16> && (std::is_same_v<C, c10::BFloat16> || kInt8) && kHeadDim > 0 &&
      kHeadDim % 32 == 0;
#else
      false;
#endif
  // fp32 queries (compute dtype fp32, the default below avx512_bf16) over an fp32, float16 or
  // int8 cache: AVX2 + FMA, float16 widened by F16C and int8 codes to fp32 (both exactly), an int8
  // token's scales applied to its score and its softmax weight.
  static constexpr bool kFp32Simd =
#ifdef TOKENMILL_AVX2
      std::is_same_v<T, float> && (std::is_same_v<C, float> || std::is_same_v<C, at::Half> || kInt8) &&
      kHeadDim > 0 && kHeadDim % 8 == 0;
#else
      false;
#endif

  int64_t head_dim;
  const T* q_ptr;
  const C* k_ptr;
  const C* v_ptr;
  T* o_ptr;
  const int32_t* tables;
  const int32_t* lens;
  const float* k_scales;  // int8 cache: one scale per token-head (else null)
  const float* v_scales;
  float scale;

  // Per thread: token offsets, scores [G, chunk], the query heads as floats (generic path) and
  // one K/V row as floats.
  struct Scratch {
    std::vector<int64_t> offsets;
    std::vector<float> scores, q, row;
  };

  void attend(int64_t seq, int64_t kv_head, int64_t begin, int64_t end, Scratch& w, float* acc, float* m,
              float* l) const {
    const int64_t n = end - begin;
    w.offsets.resize(n);
    w.scores.resize(group * n);
    tokenmill::cached_row_offsets(tables + seq * max_blocks, begin, end, block_size, block_stride, token_stride,
                                  kv_head * head_dim, w.offsets.data());
    const T* q = q_ptr + seq * q_row + kv_head * group * head_dim;
    if constexpr (kSimd) {
      simd_scores(q, w.offsets.data(), n, w.scores.data());
    } else if constexpr (kFp32Simd) {
      fp32_scores(q, w.offsets.data(), n, w.scores.data());
    } else {
      generic_scores(q, w, n);
    }
    for (int64_t g = 0; g < group; ++g) {
      float* s = w.scores.data() + g * n;
      float mx = s[0];  // n >= 1; no infinities (built with -ffast-math)
      for (int64_t t = 1; t < n; ++t) mx = std::max(mx, s[t]);
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = 0; t < n; ++t) {
        s[t] = std::exp(s[t] - mx);
        sum += s[t];
      }
      m[g] = mx;
      l[g] = sum;
    }
    if constexpr (kSimd || kFp32Simd) {
      if constexpr (kInt8) {  // the V scales into the weights (l above is their unscaled sum)
        for (int64_t t = 0; t < n; ++t) {
          const float v_scale = v_scales[w.offsets[t] / head_dim];
          for (int64_t g = 0; g < group; ++g) w.scores[g * n + t] *= v_scale;
        }
      }
      if constexpr (kSimd) {
        simd_values(w.offsets.data(), n, w.scores.data(), acc);
      } else {
        fp32_values(w.offsets.data(), n, w.scores.data(), acc);
      }
    } else {
      generic_values(w, n, acc);
    }
  }

  // out row of query head g = acc / l, written in T (and in natural dim order).
  void store(int64_t seq, int64_t head, const float* acc, float l) const {
    T* dst = o_ptr + seq * out_row + head * head_dim;
    const float inv = 1.f / l;
    if constexpr (kSimd) {
      for (int64_t c = 0; c < head_dim; c += 32) {
        for (int64_t j = 0; j < 16; ++j) {
          dst[c + 2 * j] = static_cast<T>(acc[c + j] * inv);
          dst[c + 2 * j + 1] = static_cast<T>(acc[c + 16 + j] * inv);
        }
      }
    } else {
      for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
    }
  }

 private:
  void generic_scores(const T* q, Scratch& w, int64_t n) const {
    w.q.resize(group * head_dim);
    w.row.resize(head_dim);
    for (int64_t i = 0; i < group * head_dim; ++i) w.q[i] = static_cast<float>(q[i]) * scale;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t off = w.offsets[t];
      load_row(k_ptr + off, w.row.data(), head_dim);
      const float k_scale = k_scales ? k_scales[off / head_dim] : 1.f;
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = w.q.data() + g * head_dim;
        const float* k = w.row.data();
        float dot = 0.f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * k[d];
        w.scores[g * n + t] = dot * k_scale;
      }
    }
  }

  void generic_values(Scratch& w, int64_t n, float* acc) const {
    std::fill(acc, acc + group * head_dim, 0.f);
    for (int64_t t = 0; t < n; ++t) {
      const int64_t off = w.offsets[t];
      load_row(v_ptr + off, w.row.data(), head_dim);
      const float v_scale = v_scales ? v_scales[off / head_dim] : 1.f;
      const float* v = w.row.data();
      for (int64_t g = 0; g < group; ++g) {
        const float p = w.scores[g * n + t] * v_scale;
        float* a = acc + g * head_dim;
#pragma omp simd
        for (int64_t d = 0; d < head_dim; ++d) a[d] += p * v[d];
      }
    }
  }

#ifdef TOKENMILL_AVX2
  static constexpr int64_t kF32Vecs = kHeadDim > 0 ? kHeadDim / 8 : 1;  // 8 fp32 per vector
  // vectors of head dims a pass over V keeps in registers, for up to kF32Heads query heads
  static constexpr int kF32PassVecs = kF32Vecs % 4 == 0 ? 4 : kF32Vecs % 2 == 0 ? 2 : 1;
  static constexpr int kF32Heads = 3;

  // 8 cached K or V elements as fp32 (float16 and int8 codes exactly, int8 without its scale).
  static __m256 load8(const C* p) {
    if constexpr (kInt8) {
      return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
    } else if constexpr (std::is_same_v<C, at::Half>) {
      return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    } else {
      return _mm256_loadu_ps(p);
    }
  }

  // Bytes of one cached K or V row of a head, and how many tokens ahead the fp32 passes fetch
  // rows: the rows of a sequence lie in blocks scattered over the cache, so the hardware
  // prefetcher does not see them coming, and without this the passes waited on memory for most
  // of their time (64 decodes of ~100 tokens: ~40% of the kernel on two V loads).
  static constexpr int64_t kRowBytes = kHeadDim * static_cast<int64_t>(sizeof(C));
  static constexpr int64_t kF32PrefetchTokens = 8;

  // (always inlined: GCC takes a function of nothing but prefetches for one without effects and
  // drops calls to it)
  __attribute__((always_inline)) static void prefetch_row(const C* row) {
    for (int64_t b = 0; b < kRowBytes; b += 64) _mm_prefetch(reinterpret_cast<const char*>(row) + b, _MM_HINT_T0);
  }

  // The K and V rows of the tokens kF32PrefetchTokens past the 8 from t0 (from 0 at t0 = 0).
  __attribute__((always_inline)) void prefetch_ahead(const int64_t* offsets, int64_t n, int64_t t0) const {
    const int64_t end = std::min(n, t0 + 8 + kF32PrefetchTokens);
    for (int64_t t = t0 ? t0 + kF32PrefetchTokens : 0; t < end; ++t) {
      prefetch_row(k_ptr + offsets[t]);
      prefetch_row(v_ptr + offsets[t]);
    }
  }

  // scores[g * n + t] = scale * q_g . k_t, 8 tokens at a time: each token's products summed in
  // two vectors, then the 8 sums reduced into one vector together. An fp32 cache is read in
  // place, one query head's pass over all tokens after another. A float16 or int8 row is widened
  // once, into registers, and taken by every query head in turn, with the heads' sums kept aside
  // (64 decodes of ~100 tokens, 9 query / 3 KV heads: float16 9.1 -> 8.8 ms a step, int8 12.3 ->
  // 12.1; for fp32 the head-by-head order stays ahead). The first pass over each 8 tokens fetches
  // the K and V rows of the tokens kF32PrefetchTokens ahead (V for fp32_values).
  void fp32_scores(const float* q, const int64_t* offsets, int64_t n, float* scores) const {
    if constexpr (std::is_same_v<C, float>) {
      for (int64_t g = 0; g < group; ++g) {
        const float* qg = q + g * kHeadDim;
        for (int64_t t0 = 0; t0 < n; t0 += 8) {
          const int64_t count = std::min<int64_t>(8, n - t0);
          if (g == 0) prefetch_ahead(offsets, n, t0);
          __m256 part[8];
          for (int64_t i = 0; i < 8; ++i) {
            if (i >= count) {
              part[i] = _mm256_setzero_ps();
              continue;
            }
            const float* k = k_ptr + offsets[t0 + i];
            part[i] = row_products(qg, [&](int64_t c) { return _mm256_loadu_ps(k + 8 * c); });
          }
          store_scores(part, offsets + t0, count, scores + g * n + t0);
        }
      }
    } else {
      // part[g * 8 + i]: token t0 + i's products with query head g, summed into one vector
      auto* part = static_cast<__m256*>(__builtin_alloca_with_align(group * 8 * sizeof(__m256), 256));
      for (int64_t t0 = 0; t0 < n; t0 += 8) {
        const int64_t count = std::min<int64_t>(8, n - t0);
        prefetch_ahead(offsets, n, t0);
        for (int64_t i = 0; i < 8; ++i) {
          if (i >= count) {
            for (int64_t g = 0; g < group; ++g) part[g * 8 + i] = _mm256_setzero_ps();
            continue;
          }
          const C* k_row = k_ptr + offsets[t0 + i];
          __m256 k[kF32Vecs];
          for (int64_t c = 0; c < kF32Vecs; ++c) k[c] = load8(k_row + 8 * c);
          for (int64_t g = 0; g < group; ++g) {
            part[g * 8 + i] = row_products(q + g * kHeadDim, [&](int64_t c) { return k[c]; });
          }
        }
        for (int64_t g = 0; g < group; ++g) store_scores(part + g * 8, offsets + t0, count, scores + g * n + t0);
      }
    }
  }

  // The products of query head qg with one K row (vector c of it: row(c)), summed into one vector
  // through two accumulators (two chains of dependent FMAs).
  template <typename Row>
  __attribute__((always_inline)) static __m256 row_products(const float* qg, const Row& row) {
    __m256 a0 = _mm256_mul_ps(_mm256_loadu_ps(qg), row(0)), a1 = _mm256_setzero_ps();
    for (int64_t c = 1; c < kF32Vecs; ++c) {
      __m256& a = c % 2 ? a1 : a0;
      a = _mm256_fmadd_ps(_mm256_loadu_ps(qg + 8 * c), row(c), a);
    }
    return _mm256_add_ps(a0, a1);
  }

  // out[i] = scale * (the sum of part[i]'s lanes) (times the token's K scale for int8), i < count.
  void store_scores(const __m256* part, const int64_t* offsets, int64_t count, float* out) const {
    __m256 sums = _mm256_mul_ps(tokenmill::sum_each_of_8(part), _mm256_set1_ps(scale));
    if constexpr (kInt8) {
      alignas(32) float k_scale[8] = {};
      for (int64_t i = 0; i < count; ++i) k_scale[i] = k_scales[offsets[i] / kHeadDim];
      sums = _mm256_mul_ps(sums, _mm256_load_ps(k_scale));
    }
    if (count == 8) {
      _mm256_storeu_ps(out, sums);
    } else {
      alignas(32) float tail[8];
      _mm256_store_ps(tail, sums);
      std::copy(tail, tail + count, out);
    }
  }

  // acc[g] = sum_t p[g * n + t] v_t: passes of up to kF32Heads query heads x kF32PassVecs vectors
  // of head dims, accumulated in registers over every token.
  template <int kHeads>
  void fp32_values_pass(const int64_t* offsets, int64_t n, const float* p, int64_t c0, float* acc) const {
    __m256 a[kHeads][kF32PassVecs];
    for (int h = 0; h < kHeads; ++h) {
      for (int j = 0; j < kF32PassVecs; ++j) a[h][j] = _mm256_setzero_ps();
    }
    for (int64_t t = 0; t < n; ++t) {
      const C* v = v_ptr + offsets[t] + 8 * c0;
      __m256 vv[kF32PassVecs];
      for (int j = 0; j < kF32PassVecs; ++j) vv[j] = load8(v + 8 * j);
      for (int h = 0; h < kHeads; ++h) {
        const __m256 w = _mm256_broadcast_ss(p + h * n + t);
        for (int j = 0; j < kF32PassVecs; ++j) a[h][j] = _mm256_fmadd_ps(w, vv[j], a[h][j]);
      }
    }
    for (int h = 0; h < kHeads; ++h) {
      for (int j = 0; j < kF32PassVecs; ++j) _mm256_storeu_ps(acc + h * kHeadDim + 8 * (c0 + j), a[h][j]);
    }
  }

  void fp32_values(const int64_t* offsets, int64_t n, const float* p, float* acc) const {
    for (int64_t g = 0; g < group; g += kF32Heads) {
      for (int64_t c0 = 0; c0 < kF32Vecs; c0 += kF32PassVecs) {
        switch (std::min<int64_t>(kF32Heads, group - g)) {
          case 1: fp32_values_pass<1>(offsets, n, p + g * n, c0, acc + g * kHeadDim); break;
          case 2: fp32_values_pass<2>(offsets, n, p + g * n, c0, acc + g * kHeadDim); break;
          default: fp32_values_pass<kF32Heads>(offsets, n, p + g * n, c0, acc + g * kHeadDim);
        }
      }
    }
  }
#else
  void fp32_scores(const float*, const int64_t*, int64_t, float*) const {}
  void fp32_values(const int64_t*, int64_t, const float*, float*) const {}
#endif

#ifdef TOKENMILL_AVX512_BF16
  static constexpr int64_t kVecs = kHeadDim > 0 ? kHeadDim / 32 : 1;  // 32 bf16 (one cache line pair) per vector
  static constexpr int64_t kPrefetchTokens = 8;
  // Query heads whose fp32 accumulators stay in registers through one pass over V.
  static constexpr int kMaxHeadsPerPass = kVecs <= 2 ? 6 : 2;

  // 32 K (or V) elements of a cached row from element `off`: bf16 as they are, int8 codes as
  // bf16 (through fp32; exact).
  static __m512i row_bf16(const C* base, int64_t off) {
    if constexpr (kInt8) {
      return (__m512i)_mm512_cvtne2ps_pbh(tokenmill::int8x16_to_fp32(base + off + 16),
                                          tokenmill::int8x16_to_fp32(base + off));
    } else {
      return _mm512_loadu_si512(base + off);
    }
  }

  // scores[g, t] = scale * q_g . k_t (int8: times the token's K scale): vdpbf16ps on the bf16
  // rows (exact products, fp32 sums); the partial-sum vectors of 16 tokens are reduced together.
  // Prefetches the K and V rows ahead.
  void simd_scores(const T* q, const int64_t* offsets, int64_t n, float* scores) const {
    const C* k_base = k_ptr;
    const C* v_base = v_ptr;
    const __m512 vscale = _mm512_set1_ps(scale);
    alignas(64) float token_scales[16];  // int8: the 16 tokens' K scales
    std::fill(token_scales, token_scales + 16, 1.f);
    // part[g * 16 + i]: token t0 + i's products with query head g, summed pairwise
    __m512* part = static_cast<__m512*>(__builtin_alloca_with_align(group * 16 * sizeof(__m512), 512));
    const auto* qbits = reinterpret_cast<const uint16_t*>(q);
    for (int64_t t0 = 0; t0 < n; t0 += 16) {
      const int64_t count = std::min<int64_t>(16, n - t0);
      for (int64_t i = 0; i < count; ++i) {
        if (t0 + i + kPrefetchTokens < n) {
          const int64_t ahead = offsets[t0 + i + kPrefetchTokens];
          for (int64_t c = 0; c < kVecs; ++c) {
            _mm_prefetch(reinterpret_cast<const char*>(k_base + ahead + 32 * c), _MM_HINT_T0);
            _mm_prefetch(reinterpret_cast<const char*>(v_base + ahead + 32 * c), _MM_HINT_T0);
          }
        }
        __m512bh kv[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) kv[c] = (__m512bh)row_bf16(k_base, offsets[t0 + i] + 32 * c);
        if constexpr (kInt8) token_scales[i] = k_scales[offsets[t0 + i] / kHeadDim];
        for (int64_t g = 0; g < group; ++g) {
          __m512 a = _mm512_setzero_ps();
          for (int64_t c = 0; c < kVecs; ++c) {
            a = _mm512_dpbf16_ps(a, kv[c], (__m512bh)_mm512_loadu_si512(qbits + g * kHeadDim + 32 * c));
          }
          part[g * 16 + i] = a;
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        for (int64_t i = count; i < 16; ++i) part[g * 16 + i] = _mm512_setzero_ps();
        const __m512 factor = kInt8 ? _mm512_mul_ps(vscale, _mm512_load_ps(token_scales)) : vscale;
        _mm512_mask_storeu_ps(scores + g * n + t0, static_cast<__mmask16>((1u << count) - 1),
                              _mm512_mul_ps(sum_each_of_16(part + g * 16), factor));
      }
    }
  }

  // acc[g] = sum_t p[g, t] v_t with p in fp32: each bf16 pair of a V row widens to its even and
  // odd elements (a shift and a mask), fp32 FMAs into [even, odd] accumulators per 32 dims, up to
  // kMaxHeadsPerPass query heads per pass over the rows.
  void simd_values(const int64_t* offsets, int64_t n, const float* p, float* acc) const {
    for (int64_t g = 0; g < group; g += kMaxHeadsPerPass) {
      switch (std::min<int64_t>(kMaxHeadsPerPass, group - g)) {
        case 1: values_pass<1>(offsets, n, p + g * n, acc + g * kHeadDim); break;
        case 2: values_pass<2>(offsets, n, p + g * n, acc + g * kHeadDim); break;
        case 3: values_pass<3>(offsets, n, p + g * n, acc + g * kHeadDim); break;
        case 4: values_pass<4>(offsets, n, p + g * n, acc + g * kHeadDim); break;
        case 5: values_pass<5>(offsets, n, p + g * n, acc + g * kHeadDim); break;
        default: values_pass<kMaxHeadsPerPass>(offsets, n, p + g * n, acc + g * kHeadDim);
      }
    }
  }

  template <int kHeads>
  void values_pass(const int64_t* offsets, int64_t n, const float* p, float* acc) const {
    const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
    __m512 even[kHeads][kVecs], odd[kHeads][kVecs];
    for (int h = 0; h < kHeads; ++h) {
      for (int64_t c = 0; c < kVecs; ++c) even[h][c] = odd[h][c] = _mm512_setzero_ps();
    }
    for (int64_t t = 0; t < n; ++t) {
      __m512 ve[kVecs], vo[kVecs];
      for (int64_t c = 0; c < kVecs; ++c) {
        if constexpr (kInt8) {  // 32 codes as 16-bit pairs; each pair's low and high half sign-extended
          const auto* codes = reinterpret_cast<const __m256i*>(v_ptr + offsets[t] + 32 * c);
          const __m512i x = _mm512_cvtepi8_epi16(_mm256_loadu_si256(codes));
          ve[c] = _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(x, 16), 16));
          vo[c] = _mm512_cvtepi32_ps(_mm512_srai_epi32(x, 16));
        } else {
          const __m512i x = _mm512_loadu_si512(v_ptr + offsets[t] + 32 * c);
          ve[c] = _mm512_castsi512_ps(_mm512_slli_epi32(x, 16));
          vo[c] = _mm512_castsi512_ps(_mm512_and_si512(x, high));
        }
      }
      for (int h = 0; h < kHeads; ++h) {
        const __m512 w = _mm512_set1_ps(p[h * n + t]);
        for (int64_t c = 0; c < kVecs; ++c) {
          even[h][c] = _mm512_fmadd_ps(w, ve[c], even[h][c]);
          odd[h][c] = _mm512_fmadd_ps(w, vo[c], odd[h][c]);
        }
      }
    }
    for (int h = 0; h < kHeads; ++h) {
      for (int64_t c = 0; c < kVecs; ++c) {
        _mm512_storeu_ps(acc + h * kHeadDim + 32 * c, even[h][c]);
        _mm512_storeu_ps(acc + h * kHeadDim + 32 * c + 16, odd[h][c]);
      }
    }
  }
#else
  void simd_scores(const T*, const int64_t*, int64_t, float*) const {}
  void simd_values(const int64_t*, int64_t, const float*, float*) const {}
#endif
};

// Splits each sequence's context into items of at most `chunk` tokens when there are too few
// (sequence, KV head) pairs to give every thread several, runs the items on all threads (each
// takes the next longest left, so uneven contexts balance), and combines a split sequence's
// partial results in the thread that finishes its last item.
template <typename T, typename C, int64_t kHeadDim>
void paged_decode_attention_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
                                 const at::Tensor& value_cache, const at::Tensor& block_tables,
                                 const at::Tensor& seq_lens, double scale, const float* k_scales,
                                 const float* v_scales) {
  const int64_t num_seqs = query.size(0);
  if (num_seqs == 0) return;
  DecodeAttention<T, C, kHeadDim> attn;
  attn.head_dim = kHeadDim ? kHeadDim : query.size(2);
  attn.set(query, out, key_cache, block_tables);
  attn.q_ptr = query.data_ptr<T>();
  attn.k_ptr = key_cache.data_ptr<C>();
  attn.v_ptr = value_cache.data_ptr<C>();
  attn.o_ptr = out.data_ptr<T>();
  attn.tables = block_tables.data_ptr<int32_t>();
  attn.lens = seq_lens.data_ptr<int32_t>();
  attn.k_scales = k_scales;
  attn.v_scales = v_scales;
  attn.scale = static_cast<float>(scale);
  const int64_t group = attn.group, head_dim = attn.head_dim, kv_heads = attn.num_kv_heads;

  const int64_t threads = at::get_num_threads();
  const int64_t pairs = num_seqs * kv_heads;
  int64_t chunk = *std::max_element(attn.lens, attn.lens + num_seqs);
  if (threads > 1 && pairs < kItemsPerThread * threads) {
    const int64_t splits = (kItemsPerThread * threads + pairs - 1) / pairs;
    chunk = std::max<int64_t>(kMinSplitTokens, ((chunk + splits - 1) / splits + 15) / 16 * 16);
  }
  struct Item {
    int64_t seq, kv_head, begin, end, slot;  // slot: row of the partial results (-1: not split)
  };
  std::vector<Item> items;
  std::vector<int64_t> splits(num_seqs), first_slot(num_seqs, -1);  // per sequence
  int64_t num_slots = 0;
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t len = attn.lens[seq];
    splits[seq] = (len + chunk - 1) / chunk;
    if (splits[seq] > 1) first_slot[seq] = num_slots;
    for (int64_t h = 0; h < kv_heads; ++h) {
      for (int64_t s = 0; s < splits[seq]; ++s) {
        items.push_back({seq, h, s * chunk, std::min(len, (s + 1) * chunk), splits[seq] > 1 ? num_slots++ : -1});
      }
    }
  }
  std::stable_sort(items.begin(), items.end(),
                   [](const Item& a, const Item& b) { return a.end - a.begin > b.end - b.begin; });
  // A split item's partial results: m [G], l [G], acc [G, head_dim].
  const int64_t slot_size = group * (head_dim + 2);
  std::vector<float> partials(num_slots * slot_size);
  // Parts of each split (sequence, KV head) still to finish (only when something is split).
  std::unique_ptr<std::atomic<int64_t>[]> left(num_slots ? new std::atomic<int64_t>[pairs] : nullptr);
  for (int64_t seq = 0; num_slots && seq < num_seqs; ++seq) {
    for (int64_t h = 0; h < kv_heads; ++h) left[seq * kv_heads + h].store(splits[seq]);
  }
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min(threads, num_items), 1, [&](int64_t, int64_t) {
    typename DecodeAttention<T, C, kHeadDim>::Scratch w;
    std::vector<float> own(group * (head_dim + 2));
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& it = items[i];
      float* slot = it.slot < 0 ? own.data() : partials.data() + it.slot * slot_size;
      float *m = slot, *l = slot + group, *acc = slot + 2 * group;
      attn.attend(it.seq, it.kv_head, it.begin, it.end, w, acc, m, l);
      if (it.slot < 0) {
        for (int64_t g = 0; g < group; ++g) attn.store(it.seq, it.kv_head * group + g, acc + g * head_dim, l[g]);
        continue;
      }
      // The last item of a split (sequence, KV head) to finish combines its parts.
      if (left[it.seq * kv_heads + it.kv_head].fetch_sub(1, std::memory_order_acq_rel) != 1) continue;
      const int64_t parts = splits[it.seq];
      const int64_t first = first_slot[it.seq] + it.kv_head * parts;
      for (int64_t g = 0; g < group; ++g) {
        float mx = partials[first * slot_size + g];
        for (int64_t s = 1; s < parts; ++s) mx = std::max(mx, partials[(first + s) * slot_size + g]);
        float total = 0.f;
        float* out_acc = own.data();
        std::fill(out_acc, out_acc + head_dim, 0.f);
        for (int64_t s = 0; s < parts; ++s) {
          const float* part = partials.data() + (first + s) * slot_size;
          const float weight = std::exp(part[g] - mx);
          total += weight * part[group + g];
          const float* a = part + 2 * group + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) out_acc[d] += weight * a[d];
        }
        attn.store(it.seq, it.kv_head * group + g, out_acc, total);
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
  // The cache holds T, float16 (T float), or int8 codes when scales are given.
  void* k_base = key_cache.data_ptr();
  void* v_base = value_cache.data_ptr();
  const bool half = key_cache.scalar_type() == at::kHalf;
  const auto store = [&](const T* x, void* base, float* scales, int64_t slot) {
    if (scales) {
      int8_t* codes = static_cast<int8_t*>(base) + slot * kv_row;
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        quantize_row_int8(x + h * head_dim, codes + h * head_dim, scales + slot * num_kv_heads + h, head_dim);
      }
    } else if (half) {  // rounded to nearest, as torch's .half()
      at::Half* dst = static_cast<at::Half*>(base) + slot * kv_row;
      for (int64_t i = 0; i < kv_row; ++i) dst[i] = static_cast<at::Half>(static_cast<float>(x[i]));
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
    tokenmill::check_cpu(*t, "every tensor");
  }
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out: [num_seqs, num_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2), "query rows must be [num_heads, head_dim] contiguous");
  TORCH_CHECK(out.stride(2) == 1 && out.stride(1) == out.size(2), "out rows must be [num_heads, head_dim] contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous() && key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache: contiguous, same shape");
  TORCH_CHECK(key_cache.size(3) == query.size(2) && query.size(1) % key_cache.size(2) == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(out.scalar_type() == query.scalar_type(), "query and out must share a dtype");
  const bool quantized = tokenmill::check_cache_dtype(query.scalar_type(), key_cache, value_cache, key_scales, value_scales);
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  block_tables.is_contiguous() && seq_lens.is_contiguous() && block_tables.size(0) == query.size(0) &&
                  seq_lens.size(0) == query.size(0),
              "block_tables [num_seqs, max_blocks] and seq_lens [num_seqs]: contiguous int32");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  for (int64_t i = 0; i < seq_lens.numel(); ++i) {
    TORCH_CHECK(lens[i] >= 1 && lens[i] <= block_tables.size(1) * key_cache.size(1),
                "every seq_len must be >= 1 and fit in its block table row");
  }
  TOKENMILL_DISPATCH_FLOAT_BF16(query.scalar_type(), "paged_decode_attention", [&] {
    if (quantized) {
      dispatch_head_dim<scalar_t, int8_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale,
                                          key_scales->data_ptr<float>(), value_scales->data_ptr<float>());
    } else if (key_cache.scalar_type() == at::kHalf) {  // float32 queries (check_cache_dtype)
      if constexpr (std::is_same_v<scalar_t, float>) {
        dispatch_head_dim<float, at::Half>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, nullptr,
                                           nullptr);
      }
    } else {
      dispatch_head_dim<scalar_t, scalar_t>(out, query, key_cache, value_cache, block_tables, seq_lens, scale, nullptr,
                                            nullptr);
    }
  });
}

namespace {

void check_norm_args(const at::Tensor& x, const at::Tensor& weight) {
  tokenmill::check_cpu(x, "x");
  tokenmill::check_cpu(weight, "weight");
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
  TOKENMILL_DISPATCH_FLOAT_BF16(x.scalar_type(), "rms_norm", [&] {
    rms_norm_impl<scalar_t>(out, x, weight, eps);
  });
  return out;
}

// The residual add and the next RMSNorm in one pass: returns (x + delta, rms_norm(x + delta)),
// the sum rounded to x's dtype first, as `x + delta` then `rms_norm` give. delta: like x.
std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps) {
  check_norm_args(x, weight);
  tokenmill::check_cpu(delta, "delta");
  TORCH_CHECK(delta.sizes() == x.sizes() && delta.scalar_type() == x.scalar_type() && delta.is_contiguous(),
              "delta: contiguous, x's shape and dtype");
  at::Tensor sum = at::empty_like(x), out = at::empty_like(x);
  TOKENMILL_DISPATCH_FLOAT_BF16(x.scalar_type(), "add_rms_norm", [&] {
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
    tokenmill::check_cpu(*t, "every tensor");
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
  const bool quantized = tokenmill::check_cache_dtype(qkv.scalar_type(), key_cache, value_cache, key_scales, value_scales);
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 && slot_mapping.size(0) == n &&
                  slot_mapping.is_contiguous(),
              "slot_mapping: contiguous [n] int64");
  const int64_t num_slots = key_cache.size(0) * key_cache.size(1);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t i = 0; i < n; ++i) TORCH_CHECK(slots[i] >= -1 && slots[i] < num_slots, "slot out of the cache's range");
  at::Tensor out = at::empty({n, num_heads + num_kv_heads, head_dim}, qkv.options());
  TOKENMILL_DISPATCH_FLOAT_BF16(qkv.scalar_type(), "rope_write_kv", [&] {
    rope_write_kv_impl<scalar_t>(out, qkv, cos2, sin2, slot_mapping, key_cache, value_cache, num_heads, num_kv_heads,
                                 quantized ? key_scales->data_ptr<float>() : nullptr,
                                 quantized ? value_scales->data_ptr<float>() : nullptr);
  });
  return out;
}
