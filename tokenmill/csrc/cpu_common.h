// Helpers shared by the CPU kernel files (cpu_kernels.cpp, cpu_gemv.cpp, cpu_prefill.cpp).
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>

#include <cstdint>
#include <initializer_list>
#include <type_traits>

// Each build targets one instruction-set level (layers/cpu_isa.py passes its -march flags and
// TOKENMILL_ISA_NAME). The AVX-512 BF16 kernels are built where the compiler targets it; the
// AVX2 ones (cpu_gemv_avx2.cpp, the fp32 prefill attention) where it targets AVX2 + FMA + F16C
// (x86-64-v3 and up); elsewhere (generic) the callers keep PyTorch's ops (gemv_supported(),
// native_bf16(), prefill_attention_dtypes()). No x86 intrinsic appears outside these macros, so
// the generic build compiles on any architecture (a NEON path would be one more macro and file).
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
#define TOKENMILL_AVX512_BF16 1
#endif
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define TOKENMILL_AVX2 1
#endif
// The AVX2 integer kernels (cpu_gemv_avx2.cpp) multiply bytes with vpdpbusd on 256-bit registers
// where the level has AVX-512 VNNI (avx512_vnni, avx512_bf16), with vpmaddubsw + vpmaddwd below.
#if defined(TOKENMILL_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define TOKENMILL_VNNI 1
#endif
#if defined(TOKENMILL_AVX512_BF16) || defined(TOKENMILL_AVX2)
#include <immintrin.h>
#endif

// The dtypes the kernels take: float32 and bfloat16, the engine's CPU compute dtypes
// (AT_DISPATCH_FLOATING_TYPES_AND(kBFloat16) would also instantiate every kernel for float64).
#define TOKENMILL_DISPATCH_FLOAT_BF16(TYPE, NAME, ...) \
  AT_DISPATCH_SWITCH(TYPE, NAME, AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__) AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

#define TOKENMILL_STRINGIFY2(x) #x
#define TOKENMILL_STRINGIFY(x) TOKENMILL_STRINGIFY2(x)
#ifdef TOKENMILL_ISA_NAME
#define TOKENMILL_ISA TOKENMILL_STRINGIFY(TOKENMILL_ISA_NAME)
#else
#define TOKENMILL_ISA "unnamed"
#endif

namespace tokenmill {

#ifdef TOKENMILL_AVX512_BF16
constexpr bool kAvx512Bf16Built = true;
#else
constexpr bool kAvx512Bf16Built = false;
#endif
#ifdef TOKENMILL_AVX2
constexpr bool kAvx2Built = true;
#else
constexpr bool kAvx2Built = false;
#endif

// Where a paged attention kernel finds its rows: query / output rows [tokens, num_heads,
// head_dim] (row strides q_row, out_row), the G = group query heads of each KV head, and the
// cache [num_blocks, block_size, num_kv_heads, head_dim] read through block tables of
// max_blocks entries per sequence.
struct PagedLayout {
  int64_t num_kv_heads = 0, group = 0, block_size = 0, block_stride = 0, token_stride = 0, q_row = 0, out_row = 0,
          max_blocks = 0;

  void set(const at::Tensor& query, const at::Tensor& out, const at::Tensor& key_cache,
           const at::Tensor& block_tables) {
    num_kv_heads = key_cache.size(2);
    group = query.size(1) / num_kv_heads;
    block_size = key_cache.size(1);
    block_stride = key_cache.stride(0);
    token_stride = key_cache.stride(1);
    q_row = query.stride(0);
    out_row = out.stride(0);
    max_blocks = block_tables.size(1);
  }
};

// The float of a bf16 given by its bits (a scale stored as bf16).
inline float bf16_bits_to_float(uint16_t bits) {
  return static_cast<float>(c10::BFloat16(bits, c10::BFloat16::from_bits()));
}

// f(std::integral_constant<int, R>{}) for R = rows (1-4; more as 4): the row kernels take their
// row count as a template argument.
template <typename F>
void with_row_count(int64_t rows, const F& f) {
  switch (rows) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    default: f(std::integral_constant<int, 4>{}); break;
  }
}

// f(std::integral_constant<int, r>) for 1 <= rows <= 8 (8 for more).
template <typename F>
void with_rows_up_to_8(int64_t rows, const F& f) {
  switch (rows) {
    case 7: f(std::integral_constant<int, 7>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 1: f(std::integral_constant<int, 1>{}); break;
    default: f(std::integral_constant<int, 8>{}); break;
  }
}

// f(std::integral_constant<int, r>) for 1 <= rows <= 12 (12 for more).
template <typename F>
void with_rows_up_to_12(int64_t rows, const F& f) {
  switch (rows) {
    case 11: f(std::integral_constant<int, 11>{}); break;
    case 10: f(std::integral_constant<int, 10>{}); break;
    case 9: f(std::integral_constant<int, 9>{}); break;
    default:
      if (rows <= 8) {
        with_rows_up_to_8(rows, f);
      } else {
        f(std::integral_constant<int, 12>{});
      }
  }
}

inline void check_cpu(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu(), name, " must be a CPU tensor");
}

// The cache holds `compute` or, under float32, float16 (`kv_cache_dtype` float16; no scales), or
// int8 codes with float32 scales [num_blocks, block_size, num_kv_heads] for both K and V.
// Returns whether it is int8.
inline bool check_cache_dtype(at::ScalarType compute, const at::Tensor& key_cache, const at::Tensor& value_cache,
                              const c10::optional<at::Tensor>& key_scales,
                              const c10::optional<at::Tensor>& value_scales) {
  const bool quantized = key_scales.has_value();
  TORCH_CHECK(quantized == value_scales.has_value(), "key_scales and value_scales: both or neither");
  const bool half = !quantized && compute == at::kFloat && key_cache.scalar_type() == at::kHalf;
  TORCH_CHECK(value_cache.scalar_type() == key_cache.scalar_type() &&
                  (half || key_cache.scalar_type() == (quantized ? at::kChar : compute)),
              "the cache must hold the compute dtype or float16 under float32 (without scales), or int8 codes "
              "(with scales)");
  if (quantized) {
    for (const at::Tensor* t : {&*key_scales, &*value_scales}) {
      check_cpu(*t, "every tensor");
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->is_contiguous() && t->sizes() == key_cache.sizes().slice(0, 3),
                  "key_scales and value_scales: contiguous float32 [num_blocks, block_size, num_kv_heads]");
    }
  }
  return quantized;
}

// Offsets, in cache elements, of the K (and V: the caches share one layout) vectors of tokens
// [begin, end) of one KV head, read through a sequence's block table. In a contiguous cache
// offset / head_dim is also the index of the token-head's int8 scale.
inline void cached_row_offsets(const int32_t* table, int64_t begin, int64_t end, int64_t block_size,
                               int64_t block_stride, int64_t token_stride, int64_t head_offset, int64_t* offsets) {
  int64_t block = begin / block_size, j = begin % block_size;
  int64_t base = table[block] * block_stride + head_offset;
  for (int64_t t = begin; t < end; ++t) {
    if (j == block_size) {
      j = 0;
      base = table[++block] * block_stride + head_offset;
    }
    *offsets++ = base + j++ * token_stride;
  }
}

#ifdef TOKENMILL_AVX2
// Lane i = the sum of the 8 lanes of v[i].
inline __m256 sum_each_of_8(const __m256* v) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
#endif

#ifdef TOKENMILL_AVX2
// The 8 x 8 transpose of fp32 rows in place: r[i][k] -> r[k][i] (unpacks, in-lane shuffles, then
// 128-bit lane swaps; 24 shuffles).
inline void transpose8(__m256* r) {
  __m256 t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int h = 0; h < 8; h += 4) {  // u[h + e], lane L: element 4L + e of rows h .. h + 3
    u[h] = _mm256_shuffle_ps(t[h], t[h + 2], 0x44);
    u[h + 1] = _mm256_shuffle_ps(t[h], t[h + 2], 0xEE);
    u[h + 2] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0x44);
    u[h + 3] = _mm256_shuffle_ps(t[h + 1], t[h + 3], 0xEE);
  }
  for (int e = 0; e < 4; ++e) {
    r[e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x20);
    r[4 + e] = _mm256_permute2f128_ps(u[e], u[4 + e], 0x31);
  }
}
#endif

#ifdef TOKENMILL_AVX512_BF16
// acc + vpdpbusd(u, the 4 signed bytes at x in every lane), the 4 bytes read by the instruction
// itself (an embedded broadcast, {1to16}). From the intrinsics GCC emits a separate vbroadcastss
// per multiply: with one multiply per broadcast (the int4 and int6 kernels, each nibble half
// meeting its own 4 codes of x) that took int4 at 8-64 rows from 300 to 230 GOPS a core on Zen 4.
// Where one broadcast register serves several multiplies (the int8 tiles, the int8 and int6
// panels, prefill attention), keep it: a broadcast per multiply there measured 1.3x the time at 64-512 rows.
inline __m512i dpbusd_broadcast(__m512i acc, __m512i u, const void* x) {
  asm("vpdpbusd %[x]%{1to16%}, %[u], %[acc]" : [acc] "+v"(acc) : [u] "v"(u), [x] "m"(*static_cast<const int32_t*>(x)));
  return acc;
}

// 16 int8 codes as fp32 (exact).
inline __m512 int8x16_to_fp32(const int8_t* codes) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes))));
}

// The 16 x 16 transpose of 32-bit elements: a[i][k] -> out[k][i] (interleaves, then 128-bit
// chunk shuffles; 64 shuffles).
inline void transpose16(const __m512i* a, __m512i* out) {
  __m512i b[16], c[16];
  for (int i = 0; i < 16; i += 2) {
    b[i] = _mm512_unpacklo_epi32(a[i], a[i + 1]);
    b[i + 1] = _mm512_unpackhi_epi32(a[i], a[i + 1]);
  }
  for (int g = 0; g < 4; ++g) {  // c[4g + e], chunk L: element 4L + e of rows 4g .. 4g + 3
    c[4 * g] = _mm512_unpacklo_epi64(b[4 * g], b[4 * g + 2]);
    c[4 * g + 1] = _mm512_unpackhi_epi64(b[4 * g], b[4 * g + 2]);
    c[4 * g + 2] = _mm512_unpacklo_epi64(b[4 * g + 1], b[4 * g + 3]);
    c[4 * g + 3] = _mm512_unpackhi_epi64(b[4 * g + 1], b[4 * g + 3]);
  }
  for (int e = 0; e < 4; ++e) {
    const __m512i y0 = _mm512_shuffle_i32x4(c[e], c[4 + e], 0x44), y1 = _mm512_shuffle_i32x4(c[e], c[4 + e], 0xEE);
    const __m512i y2 = _mm512_shuffle_i32x4(c[8 + e], c[12 + e], 0x44);
    const __m512i y3 = _mm512_shuffle_i32x4(c[8 + e], c[12 + e], 0xEE);
    out[e] = _mm512_shuffle_i32x4(y0, y2, 0x88);
    out[4 + e] = _mm512_shuffle_i32x4(y0, y2, 0xDD);
    out[8 + e] = _mm512_shuffle_i32x4(y1, y3, 0x88);
    out[12 + e] = _mm512_shuffle_i32x4(y1, y3, 0xDD);
  }
}
#endif

}  // namespace tokenmill
