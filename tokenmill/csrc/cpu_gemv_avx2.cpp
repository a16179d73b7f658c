// The quantized matmuls for CPUs without bf16 dot products (x86-64-v3: AVX2, FMA, F16C), the
// kernels behind int8_linear / int4_linear / int8_gemm (cpu_gemv.cpp) at the avx2, avx512 and
// avx512_vnni levels (and int6_linear at every level from avx2 up). Activations are fp32 (dtype
// "auto" on these CPUs). At avx512_vnni the int8 and int6 kernels add byte products with
// vpdpbusd (dot4_add, dot8_add); int4 keeps vpmaddubsw (int4_block_sums).
//
// Integer products, as llama.cpp does: each row of x is quantized to int8 per block of 32 values
// (d = absmax / 127, codes round(x / d)) and multiplied with the weight codes by vpmaddubsw
// (unsigned x signed bytes, pairs summed to int16).
// - int8 (symmetric, one scale per output channel), few rows (decode, memory-bound; the weight
//   read once as it is stored): a block's dot product with 32 codes is vpmaddubsw with |w| as
//   the unsigned operand and the x codes with w's sign as the signed one (|w| <= 128, |x code|
//   <= 127: no int16 overflow), vpmaddwd to int32, then one fp32 FMA with the block's scale;
//   y = scale * sum_blocks d_b * isum_b. Int8Linear keeps a weight with K % 32 == 0 and N % 8
//   == 0 in tiles of 8 output channels (int8_tiled_linear, every row count): there the int16
//   sums of int8 x int8 cannot be added without overflow, so a vpmaddwd follows every
//   vpmaddubsw, half of fp32's multiply-port instructions per product. int8_linear reads the
//   codes as stored, few rows; int8_gemm, many rows of other shapes, widens the weights to fp32
//   once per panel of output channels (in a per-thread buffer that stays in cache) and runs 4 x
//   3 accumulators of 8 dot-product lanes; from kDenseRows rows the whole weight is widened once
//   and at::mm multiplies it.
// - int4 (asymmetric groups, w = q * scale + min, q = 0..15), every row count: one kernel over
//   tiles of 8 output channels (int4_tile). q is the unsigned operand as it is, and 8 products
//   of 15 x 127 fit an int16 sum, so a whole block's sums stay in int16: one vpmaddubsw per 32
//   products, where fp32 needs four FMAs. With z = min + 8 scale, w = (q - 8) scale + z, and
//   sum (q - 8) x_code = isum_b - 8 csum_b (csum_b: the block's sum of x codes) exactly, so
//   y = sum_blocks scale_g d_b (isum_b - 8 csum_b) + sum_blocks z_g * sum(x of block b), the
//   products 8 d_b csum_b made once per block and row when x is quantized (QuantizedRows).
//   Splitting around the group's middle keeps the quantization error of x multiplied by
//   weights of the size of w - z (centred, like int8's), not of w - min (up to twice the
//   range): with min in place of z, batch-1 perplexity was 2% above the bf16 path's.
// Longer than 600 lines on purpose: the int8, int4 and int6 kernels share x's quantization
// (QuantizedRows), the factor tables and the tile walk (over_tiles), and every template
// instantiation of a kernel inlines them from this one translation unit.
#include "cpu_common.h"
#include "cpu_kernels.h"

#ifdef TOKENMILL_AVX2

#include <ATen/Parallel.h>
#include <ATen/ops/addmm.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/mm.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <type_traits>
#include <vector>

namespace tokenmill::avx2 {
namespace {

constexpr int64_t kBlock = 32;   // activation values per int8 scale
constexpr int64_t kTileRows = 4;  // rows of x per few-row pass and per many-row tile
static_assert(kTileRows == 4, "with_row_count (cpu_common.h) dispatches 1-4 rows");
constexpr int64_t kTileCols = 3;  // output channels per many-row tile
constexpr int64_t kPanel = 24;    // output channels widened to fp32 at a time (a multiple of kTileCols)
constexpr int64_t kPanelTiles = 8;  // int4 tiles of 8 output channels a thread runs all rows over at a time
constexpr int64_t kDenseRows = 256;  // from this many rows the whole weight is widened and multiplied by at::mm
// How far ahead of its weight reads a few-row kernel prefetches: the hardware prefetcher alone
// left them at ~55% of the bandwidth F.linear's fp32 reads reach (benchmarks/cpu_matmul.py).
constexpr int64_t kPrefetchBytes = 8192;

inline float hsum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

inline int32_t hsum_epi32(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
}

// acc + in each 32-bit lane the sum of the 4 products of u's unsigned bytes with s's signed
// bytes. With VNNI (the avx512_vnni level) one vpdpbusd; without, vpmaddubsw, vpmaddwd and
// vpaddd, whose int16 pair sums saturate at 32767 where vpdpbusd's do not: every caller's
// operands keep a pair below that, so both give the same sums.
inline __m256i dot4_add(__m256i acc, __m256i u, __m256i s) {
#ifdef TOKENMILL_VNNI
  return _mm256_dpbusd_epi32(acc, u, s);
#else
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1)));
#endif
}

// How many independent sums a kernel keeps per row where it would keep one. vpdpbusd adds into
// its accumulator, so one sum is a chain that waits out vpdpbusd's latency (4-5 cycles) at every
// step: at 1 row that left int4 at 0.77x of vpmaddubsw's speed, whose products are independent
// and only a 1-cycle add chains. With VNNI there are 32 vector registers for the extra sums.
#ifdef TOKENMILL_VNNI
constexpr int kChains = 2;
#else
constexpr int kChains = 1;
#endif

// sums[0 .. kChains - 1] + the products of u1 with s1 and of u2 with s2 (as dot4_add): with VNNI
// one vpdpbusd into each chain; without, the two int16 pair sums are added before one vpmaddwd,
// which the caller's operands leave room for (each pair below 16384).
inline void dot8_add(__m256i* sums, __m256i u1, __m256i s1, __m256i u2, __m256i s2) {
#ifdef TOKENMILL_VNNI
  sums[0] = _mm256_dpbusd_epi32(sums[0], u1, s1);
  sums[1] = _mm256_dpbusd_epi32(sums[1], u2, s2);
#else
  const __m256i pairs = _mm256_add_epi16(_mm256_maddubs_epi16(u1, s1), _mm256_maddubs_epi16(u2, s2));
  sums[0] = _mm256_add_epi32(sums[0], _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#endif
}

// The total of a row's kChains sums.
inline __m256i chains_total(const __m256i* sums) {
  if constexpr (kChains == 2) return _mm256_add_epi32(sums[0], sums[1]);
  return sums[0];
}

// x [M, K] fp32 as int8 codes per block of 32: q [M, K], d [M, K/32] (the block's scale), and
// for int4 and int6 terms [M, K/32, 8]: the block's scale again, its exact fp32 sum, 8 x scale x
// the sum of its codes (int4_tile's centring term) and 32 x scale x the sums of its two halves'
// codes (int6_tile's), side by side so that a row's per-block values are one stream. The arrays
// live in a buffer of the calling thread, reused by its next matmul (prefill quantizes ~1M values
// a matmul: fresh pages each call would cost more than the quantizing), and many rows are
// quantized in parallel.
struct QuantizedRows {
  static constexpr int64_t kTerms = 8;  // floats per block in terms (the last three unused)
  int64_t blocks = 0;
  int8_t* q = nullptr;
  float* d = nullptr;
  float* terms = nullptr;

  // x fp32, or bf16 (at avx512_bf16, whose int4 and int6 kernels take the engine's bf16
  // activations as they are: each value widens exactly to the fp32 it stands for)
  template <typename T>
  QuantizedRows(const T* x, int64_t M, int64_t K) : blocks(K / kBlock) {
    thread_local std::vector<int8_t> q_buffer;
    thread_local std::vector<float> float_buffer;
    const int64_t n = M * blocks;
    if (static_cast<int64_t>(q_buffer.size()) < M * K) q_buffer.resize(M * K);
    if (static_cast<int64_t>(float_buffer.size()) < (1 + kTerms) * n) float_buffer.resize((1 + kTerms) * n);
    q = q_buffer.data();
    d = float_buffer.data();
    terms = d + n;
    at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
      for (int64_t b = begin; b < end; ++b) quantize_block(x + b * kBlock, b);
    });
  }

  // Where row m's codes, block scales and per-block terms start.
  const int8_t* row_codes(int64_t m) const { return q + m * blocks * kBlock; }
  const float* row_scales(int64_t m) const { return d + m * blocks; }
  const float* row_terms(int64_t m) const { return terms + m * blocks * kTerms; }

 private:
  static __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
  static __m256 load8(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }

  template <typename T>
  void quantize_block(const T* src, int64_t b) {
    const __m256 sign = _mm256_set1_ps(-0.0f);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    __m256 v[4], amax = _mm256_setzero_ps(), sum = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(src + 8 * i);
      amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, v[i]));
      sum = _mm256_add_ps(sum, v[i]);
    }
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    const float max = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
    d[b] = max / 127.f;
    const __m256 inv = _mm256_set1_ps(max > 0.f ? 127.f / max : 0.f);
    __m256i c[4];
    for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));  // round to nearest
    const int32_t first = hsum_epi32(_mm256_add_epi32(c[0], c[1])), second = hsum_epi32(_mm256_add_epi32(c[2], c[3]));
    float* t = terms + b * kTerms;
    t[0] = d[b];
    t[1] = hsum(sum);
    t[2] = static_cast<float>(8 * (first + second)) * d[b];
    t[3] = static_cast<float>(32 * first) * d[b];
    t[4] = static_cast<float>(32 * second) * d[b];
    t[5] = t[6] = t[7] = 0.f;
    // packs work within 128-bit lanes; the permute puts the 32 codes back in order
    const __m256i c16 = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + b * kBlock), _mm256_permutevar8x32_epi32(c16, order));
  }
};

// Few-row passes take C output channels at a time (2 for 1-2 rows, 1 for 3-4) and, with one
// row, split each channel's blocks over two accumulators (S): every row x channel dot product is
// a chain of dependent FMAs, and with one row a single chain per channel would leave the FMA
// units waiting on their own latency.
template <int R>
constexpr int kChannels = R <= 2 ? 2 : 1;
template <int R>
constexpr int kSplits = R == 1 ? 2 : 1;

// Runs pass(C, n) over channels [begin, end) in steps of C = kChannels<R>, then one at a time.
template <int R, typename Pass>
inline void over_channels(int64_t begin, int64_t end, const Pass& pass) {
  constexpr int C = kChannels<R>;
  int64_t n = begin;
  for (; n + C <= end; n += C) pass(std::integral_constant<int, C>{}, n);
  for (; n < end; ++n) pass(std::integral_constant<int, 1>{}, n);
}

// Rows r0 .. r0 + R - 1 of y, output channels [begin, end): int8 codes [N, K], bf16 scales [N].
template <int R>
void int8_rows(const QuantizedRows& xq, int64_t r0, const int8_t* codes, const uint16_t* scales, float* y, int64_t K,
               int64_t N, int64_t begin, int64_t end) {
  constexpr int S = kSplits<R>;
  const int8_t* xr[R];
  const float* dr[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.row_codes(r0 + r);
    dr[r] = xq.row_scales(r0 + r);
  }
  over_channels<R>(begin, end, [&](auto c_count, int64_t n) {
    constexpr int C = decltype(c_count)::value;
    __m256 acc[R][C][S];
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < C; ++c) {
        for (int s = 0; s < S; ++s) acc[r][c][s] = _mm256_setzero_ps();
      }
    }
    const int8_t* w = codes + n * K;
    for (int64_t b = 0; b < xq.blocks; ++b) {
      // the weight rows are one stream, C rows a pass: ask for what the passes after next read
      _mm_prefetch(reinterpret_cast<const char*>(w + b * kBlock + kPrefetchBytes), _MM_HINT_T0);
      __m256i wv[C], aw[C];
#pragma GCC unroll 2
      for (int c = 0; c < C; ++c) {
        wv[c] = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + c * K + b * kBlock));
        aw[c] = _mm256_abs_epi8(wv[c]);
      }
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const __m256i xv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xr[r] + b * kBlock));
        const __m256 d = _mm256_broadcast_ss(dr[r] + b);
#pragma GCC unroll 2
        for (int c = 0; c < C; ++c) {
          const __m256i dot = dot4_add(_mm256_setzero_si256(), aw[c], _mm256_sign_epi8(xv, wv[c]));
          __m256& a = acc[r][c][b % S];
          a = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), d, a);
        }
      }
    }
    for (int c = 0; c < C; ++c) {
      const float scale = bf16_bits_to_float(scales[n + c]);
      for (int r = 0; r < R; ++r) {
        __m256 sum = acc[r][c][0];
        if constexpr (S == 2) sum = _mm256_add_ps(sum, acc[r][c][1]);
        y[(r0 + r) * N + n + c] = hsum(sum) * scale;
      }
    }
  });
}

// int8 over tiles of 8 output channels (Int8Linear's layout at this level, layers/linear.py
// tiled_int8_layout, width 8): tile [K/4, 32], byte 4c + j of step t = code(c, 4t + j). x's 4
// codes broadcast, vpmaddubsw with |w| unsigned and x with w's sign (as int8_rows), then
// vpmaddwd per step: the int16 pair sums of int8 x int8 (up to 2 x 128 x 127) leave no room to
// add two. Twice the multiply-port instructions of int4 per product, half of fp32's; few rows
// read the tiles as one stream. Rows r0 .. r0 + R - 1 of one tile.
template <int R>
void int8_tile(const QuantizedRows& xq, int64_t r0, const int8_t* tile, const float* scale, float* y, int64_t N,
               int64_t n0) {
  const int64_t blocks = xq.blocks;
  const int8_t* xr[R];
  const float* dr[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.row_codes(r0 + r);
    dr[r] = xq.row_scales(r0 + r);
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    for (int64_t line = 0; line < 4; ++line) {  // the block's 256 bytes, kPrefetchBytes ahead
      _mm_prefetch(reinterpret_cast<const char*>(tile + b * 256 + kPrefetchBytes + 64 * line), _MM_HINT_T0);
    }
    __m256i part[R][kChains];  // step s adds into chain s % kChains
    for (int r = 0; r < R; ++r) {
      for (int c = 0; c < kChains; ++c) part[r][c] = _mm256_setzero_si256();
    }
#pragma GCC unroll 1
    for (int s0 = 0; s0 < 8; s0 += kChains) {
#pragma GCC unroll 2
      for (int c = 0; c < kChains; ++c) {
        const int s = s0 + c;
        const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(tile + (b * 8 + s) * 32));
        const __m256i aw = _mm256_abs_epi8(w);
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const __m256i x4 = _mm256_castps_si256(_mm256_broadcast_ss(reinterpret_cast<const float*>(xr[r] + b * kBlock + 4 * s)));
          part[r][c] = dot4_add(part[r][c], aw, _mm256_sign_epi8(x4, w));
        }
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(chains_total(part[r])), _mm256_set1_ps(dr[r][b]), acc[r]);
    }
  }
  const __m256 s8 = _mm256_loadu_ps(scale + n0);
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * N + n0, _mm256_mul_ps(acc[r], s8));
}

// int4 over tiles of 8 output channels (Int4Linear's layout at this level, layers/linear.py
// tiled_int4_layout, width 8): codes [N/8, K/8, 32], byte 4c + j of step t = q(c, 8t + j) |
// q(c, 8t + 4 + j) << 4, so one 32-byte load gives the 8 channels' codes for 4 input channels
// (low nibbles) and the next 4 (high), each channel's 4 codes in its own 32-bit lane. x's 4 codes
// are broadcast to every lane, vpmaddubsw multiplies them with the 8 channels' codes, and the
// int16 sums of a whole block of 32 stay in one register (|sum| <= 8 x 2 x 15 x 127 = 30480):
// one vpmaddwd per block and row, not per 32 products. So many rows run near two vpmaddubsw a
// cycle, where fp32 FMAs do a quarter of the products (prefill and batched decode are
// compute-bound), and few rows read the tiles as one stream (decode is memory-bound).
// The block's scales and mins, 8 channels each, come from one of two tables (int4_tile):
// - Pairs: bf16 [N/8, groups, 16], the tile's 8 scales then its 8 mins (5 bits a weight at
//   groups of 32);
// - SuperBlocks: a GGUF Q4_K tensor's own factors, uint8 [N/8, K/256, 128] per tile and
//   super-block of 256 input channels: 8 fp16 d then 8 fp16 m (the negated dmin), then the 128
//   6-bit factors (per block of 32 the 8 channels' scale factors then their min factors) in 96
//   bytes; scale = d sc, min = m mn, exactly as the file has them, at the file's 4.5 bits a
//   weight.

// Adds block b's products of rows r0 .. r0 + R - 1 with the tile's codes w (the block's 128
// bytes) into part[r], as int16 sums, at every level: vpdpbusd (avx512_vnni) would take the same
// one multiply-port slot per 32 products, and measured 0.97-1.02x of this at 16-512 rows
// (benchmarks/cpu_levels.py).
template <int R>
inline void int4_block_sums(const int8_t* const* xr, int64_t b, const uint8_t* w, __m256i* part) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes), _MM_HINT_T0);
  _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + 64), _MM_HINT_T0);
  for (int r = 0; r < R; ++r) part[r] = _mm256_setzero_si256();
  // (not unrolled: unrolled, the compiler hoists every product and spills them)
#pragma GCC unroll 1
  for (int s = 0; s < 4; ++s) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * kBlock));
    const __m256i lo = _mm256_and_si256(raw, nibble), hi = _mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // x's 4 codes to every lane: a broadcast load (vbroadcastss), no trip through a scalar register
      const auto* x4 = reinterpret_cast<const float*>(xr[r] + b * kBlock + 8 * s);
      part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(lo, _mm256_castps_si256(_mm256_broadcast_ss(x4))));
      part[r] = _mm256_add_epi16(part[r], _mm256_maddubs_epi16(hi, _mm256_castps_si256(_mm256_broadcast_ss(x4 + 1))));
    }
  }
}

// The factors of a tile's blocks in order, one block a call of next(scale, min).
// The bf16 (scale, min) table: one group's 8 scales and 8 mins a 32-byte load.
struct Pairs {
  const uint16_t* p;
  int64_t blocks_per_group, in_group = 0;
  void next(__m256& scale, __m256& min) {
    const __m256i pr = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
    if (++in_group == blocks_per_group) {
      in_group = 0;
      p += 16;
    }
    scale = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_castsi256_si128(pr)), 16));
    min = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm256_extracti128_si256(pr, 1)), 16));
  }
};

// Q4_K's factors (see above): at a super-block's first block its d and m are widened from
// fp16 (F16C) and its 6-bit factors unpacked to bytes, f[16 j + c] the scale factor of channel c
// in block j and f[16 j + 8 + c] its min factor; each block's factors are then converted and
// multiplied by d and m. Packed, factor i (0..127) has its low 4 bits in the low nibble of low
// byte i (i < 64) or the high nibble of low byte i - 64, and its top 2 bits at bits 2 (i / 32) and 2 (i / 32) + 1
// of top byte i % 32: four 32-byte ORs of masked 16-bit shifts (bytes do not mix) unpack all 128.
struct SuperBlocks {
  static constexpr int64_t kBlocks = 8;  // blocks of 32 per super-block of 256
  static constexpr int64_t kBytes = kQ4kSuperBlockBytes;  // d and m, the low 4 bits, the top 2
  const uint8_t* p;
  int64_t block = 0;
  __m256 d = _mm256_setzero_ps(), m = _mm256_setzero_ps();
  alignas(32) uint8_t f[kBlocks * 16];
  void next(__m256& scale, __m256& min) {
    if (block == 0) {
      d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
      m = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16)));
      unpack(p + 32);
    }
    const uint8_t* fb = f + block * 16;
    scale = _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(fb)))));
    min = _mm256_mul_ps(m, _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(fb + 8)))));
    if (++block == kBlocks) {
      block = 0;
      p += kBytes;
    }
  }
  void unpack(const uint8_t* q) {
    const __m256i low4 = _mm256_set1_epi8(0x0F), top2 = _mm256_set1_epi8(0x30);
    const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q));
    const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 32));
    const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q + 64));
    auto* out = reinterpret_cast<__m256i*>(f);
    _mm256_store_si256(out, _mm256_or_si256(_mm256_and_si256(l0, low4), _mm256_and_si256(_mm256_slli_epi16(h, 4), top2)));
    _mm256_store_si256(out + 1, _mm256_or_si256(_mm256_and_si256(l1, low4), _mm256_and_si256(_mm256_slli_epi16(h, 2), top2)));
    _mm256_store_si256(out + 2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), low4), _mm256_and_si256(h, top2)));
    _mm256_store_si256(out + 3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), low4),
                                                _mm256_and_si256(_mm256_srli_epi16(h, 2), top2)));
  }
};

// With z = min + 8 scale, w = (q - 8) scale + z, and sum (q - 8) x_code = isum_b - 8 csum_b
// exactly (csum_b: the block's sum of x codes), so y = sum_blocks scale_g d_b (isum_b - 8
// csum_b) + sum_blocks z_g * sum(x of block b), the products 8 d_b csum_b made once per block and
// row when x is quantized (QuantizedRows). Rows r0 .. r0 + R - 1, one tile; Factors: Pairs or
// SuperBlocks.
template <int R, typename Factors>
void int4_tile(const QuantizedRows& xq, int64_t r0, const uint8_t* codes, Factors factors, float* y, int64_t N,
               int64_t n0) {
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256 eight = _mm256_set1_ps(8.f);
  const int8_t* xr[R];
  const float* tr[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.row_codes(r0 + r);
    tr[r] = xq.row_terms(r0 + r);
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    __m256i part[R];
    int4_block_sums<R>(xr, b, codes + b * 4 * kBlock, part);
    __m256 scale, min;
    factors.next(scale, min);
    const __m256 zero_point = _mm256_fmadd_ps(eight, scale, min);
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) {
      // scale (d isum - 8 d csum) + z sum, with 8 d csum from the terms: three FP operations
      const float* t = tr[r] + b * QuantizedRows::kTerms;
      const __m256 isum = _mm256_cvtepi32_ps(_mm256_madd_epi16(part[r], ones));
      const __m256 centred = _mm256_fmsub_ps(isum, _mm256_broadcast_ss(t), _mm256_broadcast_ss(t + 2));
      acc[r] = _mm256_fmadd_ps(scale, centred, acc[r]);
      acc[r] = _mm256_fmadd_ps(zero_point, _mm256_broadcast_ss(t + 1), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) _mm256_storeu_ps(y + (r0 + r) * N + n0, acc[r]);
}

#ifdef TOKENMILL_AVX512_BF16
// int4 at avx512_bf16 (layers/quantization/cpu_layouts.py tiled_int4_layout at width 16, span 4): int4_tile's
// arithmetic on 512-bit registers, 16 output channels a tile. Codes [N/16, K/8, 64], byte 4c + j
// of step t = q(c, 8t + j) | q(c, 8t + 4 + j) << 4: one 64-byte load gives the 16 channels'
// codes for 4 input channels (low nibbles) and the next 4 (high), each channel's 4 codes in its
// own 32-bit lane, and vpdpbusd adds their products with x's 4 broadcast codes into that lane:
// 64 products an instruction, where vdpbf16ps on bf16 activations takes 32 and the codes must
// first widen to bf16 words. The block's sums and its scale, min and centring term as int4_tile
// (the same operations in the same order, so a channel's fp32 sum is int4_tile's bit for bit).
constexpr int64_t kWideTile = 16;  // output channels a tile

// 16 sums stored as y's dtype (bf16: rounded to nearest even, as Tensor.to rounds).
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(v));
}
constexpr int64_t kWideBlockBytes = kWideTile * kBlock / 2;  // a block's codes of a tile: 256

// The bf16 (scale, min) table at width 16: per tile and group the 16 scales, then the 16 mins.
struct WidePairs {
  const uint16_t* p;
  int64_t blocks_per_group, in_group = 0;
  void next(__m512& scale, __m512& min) {
    const __m512i pr = _mm512_loadu_si512(p);
    if (++in_group == blocks_per_group) {
      in_group = 0;
      p += 2 * kWideTile;
    }
    scale = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(pr)), 16));
    min = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(pr, 1)), 16));
  }
};

// A Q4_K tensor's factors at width 16 (layers/quantization/cpu_layouts.py tiled_int4_factors; kInt4FactorBytes
// per tile and super-block): the 16 channels' fp16 d and m, then per block their scale factors
// and min factors a byte each; scale = d sc, min = m mn, as SuperBlocks gives them.
struct WideFactors {
  const uint8_t* p;
  int64_t block = 0;
  __m512 d = _mm512_setzero_ps(), m = _mm512_setzero_ps();
  void next(__m512& scale, __m512& min) {
    if (block == 0) {
      d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      m = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
    }
    const uint8_t* f = p + 64 + block * 2 * kWideTile;
    const auto widen = [](const uint8_t* q) {
      return _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
    };
    scale = _mm512_mul_ps(d, widen(f));
    min = _mm512_mul_ps(m, widen(f + kWideTile));
    if (++block == 8) {  // the blocks of 32 of a super-block of 256
      block = 0;
      p += kInt4FactorBytes;
    }
  }
};

// Rows r0 .. r0 + R - 1 of y, one tile of 16 channels from n0. Up to 2 rows each row's products
// go to two sums (the low nibbles' and the high ones'), so that vpdpbusd's latency is hidden.
template <int R, typename Factors, typename Out>
void int4_wide_tile(const QuantizedRows& xq, int64_t r0, const uint8_t* codes, Factors factors, Out* y, int64_t N,
                    int64_t n0) {
  constexpr int S = R <= 2 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512 eight = _mm512_set1_ps(8.f);
  const int8_t* xr[R];
  const float* tr[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.row_codes(r0 + r);
    tr[r] = xq.row_terms(r0 + r);
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* w = codes + b * kWideBlockBytes;
    __m512i part[R][S];
    for (int r = 0; r < R; ++r) {
      for (int i = 0; i < S; ++i) part[r][i] = _mm512_setzero_si512();
    }
#pragma GCC unroll 4
    for (int s = 0; s < 4; ++s) {
      _mm_prefetch(reinterpret_cast<const char*>(w + s * 64 + kPrefetchBytes), _MM_HINT_T0);
      const __m512i raw = _mm512_loadu_si512(w + s * 64);
      const __m512i lo = _mm512_and_si512(raw, nibble), hi = _mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble);
      for (int r = 0; r < R; ++r) {
        // x's 4 codes to every lane by the multiply's own broadcast load
        const int8_t* x8 = xr[r] + b * kBlock + 8 * s;
        part[r][0] = dpbusd_broadcast(part[r][0], lo, x8);
        part[r][S - 1] = dpbusd_broadcast(part[r][S - 1], hi, x8 + 4);
      }
    }
    __m512 scale, min;
    factors.next(scale, min);
    const __m512 zero_point = _mm512_fmadd_ps(eight, scale, min);
    for (int r = 0; r < R; ++r) {
      const float* t = tr[r] + b * QuantizedRows::kTerms;
      __m512i total = part[r][0];
      if constexpr (S == 2) total = _mm512_add_epi32(total, part[r][1]);
      const __m512 isum = _mm512_cvtepi32_ps(total);
      const __m512 centred = _mm512_fmsub_ps(isum, _mm512_set1_ps(t[0]), _mm512_set1_ps(t[2]));
      acc[r] = _mm512_fmadd_ps(scale, centred, acc[r]);
      acc[r] = _mm512_fmadd_ps(zero_point, _mm512_set1_ps(t[1]), acc[r]);
    }
  }
  for (int r = 0; r < R; ++r) store16(y + (r0 + r) * N + n0, acc[r]);
}
#endif

// 8 sums stored as y's dtype (bf16 at avx512_bf16 only: rounded to nearest even, as Tensor.to).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
#ifdef TOKENMILL_AVX512_BF16
inline void store8(c10::BFloat16* p, __m256 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), (__m128i)_mm256_cvtneps_pbh(v));
}
#endif

// 6-bit weights (symmetric groups of 16, w = scale (q - 32), q = 0..63) over tiles of 8 output
// channels (Int6Linear's layout, layers/quantization/cpu_layouts.py tiled_int6_layout): low [N/8, K/8, 32], each
// byte the low 4 bits of two codes exactly as int4's tile holds its codes; high [N/8, K/16, 32],
// byte p of pair u the top 2 bits of the codes of low byte p in steps 2u (bits 0-3) and 2u + 1
// (bits 4-7), each byte's two codes' bits low nibble's first; scales [N/8, K/16, 8] bf16 (a pair
// of steps is a group). A step ORs each code's top bits in above its low 4 bits (bytes do not mix:
// 16-bit shifts of values below 16 and masks), then vpmaddubsw as int4_tile, but pair sums up to
// 2 x 63 x 127 leave room for adding one more: a vpmaddwd per step of 8 input channels, not per
// block. sum (q - 32) x_code = isum - 32 csum per group, the 32 d csum from the terms. Rows r0 ..
// r0 + R - 1, one tile. The groups' scales come from one of two tables, one group a call of
// next(): GroupScales, bf16 [N/8, K/16, 8] (7 bits a weight), or Q6_K's own factors,
// Int6SuperBlocks.
template <int R, typename Scales, typename Out>
void int6_tile(const QuantizedRows& xq, int64_t r0, const uint8_t* low, const uint8_t* high, Scales scales,
               Out* y, int64_t N, int64_t n0) {
  const __m256i nibble = _mm256_set1_epi8(0x0F);
  const __m256i top = _mm256_set1_epi8(0x30);
  const int64_t blocks = xq.blocks;
  const int8_t* xr[R];
  const float* tr[R];
  __m256 acc[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.row_codes(r0 + r);
    tr[r] = xq.row_terms(r0 + r);
    acc[r] = _mm256_setzero_ps();
  }
  for (int64_t b = 0; b < blocks; ++b) {
    const uint8_t* w = low + b * 4 * kBlock;
    const uint8_t* h = high + b * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(h + kPrefetchBytes / 2), _MM_HINT_T0);
    __m256i isum[R][kChains];  // the group's sums (dot8_add)
#pragma GCC unroll 1
    for (int s = 0; s < 4; ++s) {
      if (!(s & 1)) {
        for (int r = 0; r < R; ++r) {
          for (int c = 0; c < kChains; ++c) isum[r][c] = _mm256_setzero_si256();
        }
      }
      const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + s * kBlock));
      __m256i bits = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + (s >> 1) * kBlock));
      if (s & 1) bits = _mm256_srli_epi16(bits, 4);
      const __m256i lo = _mm256_or_si256(_mm256_and_si256(raw, nibble), _mm256_and_si256(_mm256_slli_epi16(bits, 4), top));
      const __m256i hi = _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble),
                                         _mm256_and_si256(_mm256_slli_epi16(bits, 2), top));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) {
        const auto* x4 = reinterpret_cast<const float*>(xr[r] + b * kBlock + 8 * s);
        dot8_add(isum[r], lo, _mm256_castps_si256(_mm256_broadcast_ss(x4)), hi,
                 _mm256_castps_si256(_mm256_broadcast_ss(x4 + 1)));
      }
      if (s & 1) {  // the group's end: scale (d isum - 32 d csum)
        const __m256 scale = scales.next();
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) {
          const float* t = tr[r] + b * QuantizedRows::kTerms;
          const __m256 centred =
              _mm256_fmsub_ps(_mm256_cvtepi32_ps(chains_total(isum[r])), _mm256_broadcast_ss(t), _mm256_broadcast_ss(t + 3 + (s >> 1)));
          acc[r] = _mm256_fmadd_ps(scale, centred, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store8(y + (r0 + r) * N + n0, acc[r]);
}

// int6_tile's bf16 scales, a group's 8 a 16-byte load.
struct GroupScales {
  const uint16_t* p;
  __m256 next() {
    const __m256i s16 = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    p += 8;
    return _mm256_castsi256_ps(_mm256_slli_epi32(s16, 16));
  }
};

// A GGUF Q6_K tensor's factors, uint8 [N/8, K/256, 144] per tile and super-block of 256 input
// channels: the 8 channels' fp16 d, then per group of 16 their int8 factors sc; scale = d sc,
// exactly the file's, at 6.5625 bits a weight.
struct Int6SuperBlocks {
  static constexpr int64_t kGroups = 16;  // groups of 16 per super-block of 256
  static constexpr int64_t kBytes = kQ6kSuperBlockBytes;  // d, then kGroups x 8 factors
  const uint8_t* p;
  int64_t group = 0;
  __m256 d = _mm256_setzero_ps();
  __m256 next() {
    if (group == 0) d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    const __m128i f = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 16 + group * 8));
    if (++group == kGroups) {
      group = 0;
      p += kBytes;
    }
    return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(f)));
  }
};

#ifdef TOKENMILL_AVX512_BF16
// int6 at avx512_bf16: int6_tile's arithmetic on 512-bit registers, over a pair of its tiles of
// 8 output channels (tiles t and t + 1, the layout unchanged: int6_gemm reads it too). Each
// 32-byte load of the two tiles goes into one half of a register, and vpdpbusd multiplies the
// 16 channels' codes with x's 4 broadcast codes, 64 products an instruction; the unpacking of the
// top bits runs once for both tiles. The same operations per channel as int6_tile (so the same
// fp32 sums, bit for bit).
inline __m512i both_tiles(const uint8_t* first, const uint8_t* second) {
  return _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first))),
                            _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second)), 1);
}

template <int R, typename Scales, typename Out>
void int6_tile_pair(const QuantizedRows& xq, int64_t r0, const uint8_t* low, const uint8_t* high, int64_t K,
                    Scales first, Scales second, Out* y, int64_t N, int64_t n0) {
  constexpr int S = R <= 2 ? 2 : 1;
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i top = _mm512_set1_epi8(0x30);
  const uint8_t* low2 = low + K * 4;   // tile t + 1's codes
  const uint8_t* high2 = high + K * 2;
  const int8_t* xr[R];
  const float* tr[R];
  __m512 acc[R];
  for (int r = 0; r < R; ++r) {
    xr[r] = xq.row_codes(r0 + r);
    tr[r] = xq.row_terms(r0 + r);
    acc[r] = _mm512_setzero_ps();
  }
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const int64_t wb = b * 4 * kBlock, hb = b * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(low + wb + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(low + wb + kPrefetchBytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(low2 + wb + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(low2 + wb + kPrefetchBytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(high + hb + kPrefetchBytes / 2), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(high2 + hb + kPrefetchBytes / 2), _MM_HINT_T0);
    __m512i isum[R][S];  // the group's sums
#pragma GCC unroll 1
    for (int s = 0; s < 4; ++s) {
      if (!(s & 1)) {
        for (int r = 0; r < R; ++r) {
          for (int c = 0; c < S; ++c) isum[r][c] = _mm512_setzero_si512();
        }
      }
      const __m512i raw = both_tiles(low + wb + s * kBlock, low2 + wb + s * kBlock);
      __m512i bits = both_tiles(high + hb + (s >> 1) * kBlock, high2 + hb + (s >> 1) * kBlock);
      if (s & 1) bits = _mm512_srli_epi16(bits, 4);
      const __m512i lo = _mm512_or_si512(_mm512_and_si512(raw, nibble), _mm512_and_si512(_mm512_slli_epi16(bits, 4), top));
      const __m512i hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(raw, 4), nibble),
                                         _mm512_and_si512(_mm512_slli_epi16(bits, 2), top));
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        const int8_t* x8 = xr[r] + b * kBlock + 8 * s;
        isum[r][0] = dpbusd_broadcast(isum[r][0], lo, x8);
        isum[r][S - 1] = dpbusd_broadcast(isum[r][S - 1], hi, x8 + 4);
      }
      if (s & 1) {  // the group's end: scale (d isum - 32 d csum)
        const __m512 scale = _mm512_insertf32x8(_mm512_castps256_ps512(first.next()), second.next(), 1);
#pragma GCC unroll 8
        for (int r = 0; r < R; ++r) {
          const float* t = tr[r] + b * QuantizedRows::kTerms;
          __m512i total = isum[r][0];
          if constexpr (S == 2) total = _mm512_add_epi32(total, isum[r][1]);
          const __m512 centred =
              _mm512_fmsub_ps(_mm512_cvtepi32_ps(total), _mm512_set1_ps(t[0]), _mm512_set1_ps(t[3 + (s >> 1)]));
          acc[r] = _mm512_fmadd_ps(scale, centred, acc[r]);
        }
      }
    }
  }
  for (int r = 0; r < R; ++r) store16(y + (r0 + r) * N + n0, acc[r]);
}
#endif

#ifdef TOKENMILL_AVX512_BF16
// int6 at avx512_bf16 for one row: one tile of 8 output channels, a group's two steps a 512-bit
// register (step 2g in the low half, 2g + 1 in the high: 64 contiguous bytes of the tile's low
// bits), so a thread reads one forward stream with half the instructions of int6_tile. The top
// bits of both steps come from one 32-byte load broadcast to both halves, the high half shifted
// down by 4 (vpsrlvw); masking before the shifts keeps each byte's bits its own, so one
// vpternlogd puts them above the low 4 bits. Two vpermd spread x's codes of the group to the
// halves (in the loop: a table made once a call would be 128 bytes a group, read from L2 at
// K = 8960). The group's sums of the two halves add up to int6_tile's (exact integers), then the
// same fp32 operations: the same y, bit for bit. On Zen 5 (Qwen2.5-1.5B's Q6_K down projection,
// in cache) it takes about 0.7x int6_tile's time.
template <typename Scales, typename Out>
void int6_tile_one_row(const QuantizedRows& xq, const uint8_t* low, const uint8_t* high, Scales scales, Out* y,
                       int64_t n0) {
  const __m512i nibble = _mm512_set1_epi8(0x0F);
  const __m512i top_lo = _mm512_set1_epi8(0x03), top_hi = _mm512_set1_epi8(0x0C);
  const __m512i halves = _mm512_set_epi16(4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 4, 0, 0, 0, 0, 0, 0, 0, 0, 0,
                                          0, 0, 0, 0, 0, 0, 0);
  const float* t = xq.row_terms(0);
  const int8_t* xc = xq.row_codes(0);
  const __m512i lo_index = _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0);
  const __m512i hi_index = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
  __m256 acc = _mm256_setzero_ps();
  for (int64_t b = 0; b < xq.blocks; ++b) {
    const uint8_t* w = low + b * 4 * kBlock;
    const uint8_t* h = high + b * 2 * kBlock;
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(w + kPrefetchBytes + 64), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(h + kPrefetchBytes / 2), _MM_HINT_T0);
#pragma GCC unroll 2
    for (int g = 0; g < 2; ++g) {
      const __m512i raw = _mm512_loadu_si512(w + g * 2 * kBlock);
      const __m512i bits = _mm512_srlv_epi16(
          _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + g * kBlock))), halves);
      // (raw & 0x0F) | top: vpternlogd 0xEC is (a & c) | b
      const __m512i lo =
          _mm512_ternarylogic_epi32(raw, _mm512_slli_epi16(_mm512_and_si512(bits, top_lo), 4), nibble, 0xEC);
      const __m512i hi = _mm512_ternarylogic_epi32(_mm512_srli_epi16(raw, 4),
                                                   _mm512_slli_epi16(_mm512_and_si512(bits, top_hi), 2), nibble, 0xEC);
      const __m512i x16 =
          _mm512_castsi128_si512(_mm_loadu_si128(reinterpret_cast<const __m128i*>(xc + b * kBlock + 16 * g)));
      const __m512i lo_sums = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, _mm512_permutexvar_epi32(lo_index, x16));
      const __m512i sums = _mm512_dpbusd_epi32(lo_sums, hi, _mm512_permutexvar_epi32(hi_index, x16));
      const __m256i total = _mm256_add_epi32(_mm512_castsi512_si256(sums), _mm512_extracti64x4_epi64(sums, 1));
      // the group's end as int6_tile's: scale (d isum - 32 d csum)
      const float* terms = t + b * QuantizedRows::kTerms;
      const __m256 centred =
          _mm256_fmsub_ps(_mm256_cvtepi32_ps(total), _mm256_broadcast_ss(terms), _mm256_broadcast_ss(terms + 3 + g));
      acc = _mm256_fmadd_ps(scales.next(), centred, acc);
    }
  }
  store8(y + n0, acc);
}
#endif

// tile(R, r0, t) for every tile t and every group of up to RowsPerPass rows from r0 (above 4,
// the groups as even as they go), over the threads: a panel of kPanelTiles tiles (L2-sized) takes every row group of x
// before the next panel. Each thread owns an equal run of panels and takes them from its front,
// one at a time; a thread done with its own takes panels from the back of the run with the most
// left. With a fixed split of a decode matmul (1 row, 2 cores) one half ended 10-20 us after the
// other on average, of 250-300 us a call: the cores' shares of the memory bandwidth move from
// call to call. Taking the straggler's last panels keeps each thread's reads one forward
// stream; handing out panels from one shared counter interleaved the threads' streams and lost
// more than it saved.
template <int64_t RowsPerPass = kTileRows, int64_t PanelTiles = kPanelTiles, typename Tile>
void over_tiles(int64_t tiles, int64_t M, const Tile& tile) {
  static_assert(RowsPerPass == 4 || RowsPerPass == 8 || RowsPerPass == 12,
                "with_row_count, with_rows_up_to_8 or with_rows_up_to_12 dispatches the rows");
  const int64_t panels = (tiles + PanelTiles - 1) / PanelTiles;
  const int64_t threads = std::min<int64_t>(at::get_num_threads(), panels);
  // A run [lo, hi) of panels, packed lo | hi << 32 so that its owner and a thief change it with
  // one compare-exchange; a cache line each, so that the owners' updates do not collide.
  struct alignas(64) Run {
    std::atomic<uint64_t> bounds;
  };
  std::vector<Run> runs(threads);
  for (int64_t i = 0; i < threads; ++i) {
    runs[i].bounds.store(uint64_t(panels * i / threads) | uint64_t(panels * (i + 1) / threads) << 32,
                         std::memory_order_relaxed);
  }
  const auto run_panel = [&](int64_t panel) {
    const int64_t t0 = panel * PanelTiles, t1 = std::min(tiles, t0 + PanelTiles);
    if constexpr (RowsPerPass > 4) {
      // passes as even as they go: 16 rows as 8 + 8, not 12 + 4 (a pass of few rows keeps too
      // few sums in flight to fill the multiply pipes)
      const int64_t passes = (M + RowsPerPass - 1) / RowsPerPass;
      for (int64_t i = 0, r0 = 0; i < passes; ++i) {
        const int64_t rows = M / passes + (i < M % passes);
        const auto pass = [&](auto r) {
          for (int64_t t = t0; t < t1; ++t) tile(r, r0, t);
        };
        if constexpr (RowsPerPass == 12) {
          with_rows_up_to_12(rows, pass);
        } else {
          with_rows_up_to_8(rows, pass);
        }
        r0 += rows;
      }
    } else {
      for (int64_t r0 = 0; r0 < M; r0 += RowsPerPass) {
        with_row_count(M - r0, [&](auto r) {
          for (int64_t t = t0; t < t1; ++t) tile(r, r0, t);
        });
      }
    }
  };
  // Takes a panel from the front (owner) or the back (thief) of run i; -1 when it is empty.
  const auto take = [&](int64_t i, bool front) -> int64_t {
    uint64_t bounds = runs[i].bounds.load(std::memory_order_relaxed);
    while (true) {
      const uint64_t lo = bounds & 0xffffffffu, hi = bounds >> 32;
      if (lo >= hi) return -1;
      const uint64_t next = front ? (lo + 1) | hi << 32 : lo | (hi - 1) << 32;
      if (runs[i].bounds.compare_exchange_weak(bounds, next, std::memory_order_relaxed)) {
        return int64_t(front ? lo : hi - 1);
      }
    }
  };
  at::parallel_for(0, threads, 1, [&](int64_t begin, int64_t end) {
    for (int64_t own = begin; own < end; ++own) {
      for (int64_t panel; (panel = take(own, true)) >= 0;) run_panel(panel);
    }
    while (true) {
      int64_t victim = -1;
      uint64_t most = 0;
      for (int64_t i = 0; i < threads; ++i) {
        const uint64_t bounds = runs[i].bounds.load(std::memory_order_relaxed);
        const uint64_t left = (bounds >> 32) - std::min(bounds >> 32, bounds & 0xffffffffu);
        if (left > most) {
          most = left;
          victim = i;
        }
      }
      if (victim < 0) return;
      const int64_t panel = take(victim, false);
      if (panel >= 0) run_panel(panel);
    }
  });
}

// rows(R, r0, begin, end) for every group of up to kTileRows rows, over the output channels in
// parallel; each thread runs all row groups on a channel before the next, so a weight row is
// read from memory once however many rows there are.
template <typename Rows>
void for_rows_and_channels(int64_t M, int64_t N, const Rows& rows) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    if (M <= kTileRows) {
      with_row_count(M, [&](auto r) { rows(r, 0, begin, end); });
      return;
    }
    for (int64_t n0 = begin; n0 < end; n0 += 8) {
      const int64_t n1 = std::min(end, n0 + 8);
      for (int64_t r0 = 0; r0 < M; r0 += kTileRows) {
        with_row_count(M - r0, [&](auto r) { rows(r, r0, n0, n1); });
      }
    }
  });
}

// y[r][n0 + c] = x[r] . buf[c] for R rows and C channels of a panel (buf: C rows of K fp32).
template <int R, int C>
void tile(const float* x, int64_t K, const float* buf, float* y, int64_t N) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < K; k += 8) {
    __m256 w[C];
    for (int c = 0; c < C; ++c) w[c] = _mm256_loadu_ps(buf + c * K + k);
    for (int r = 0; r < R; ++r) {
      const __m256 xv = _mm256_loadu_ps(x + r * K + k);
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_fmadd_ps(xv, w[c], acc[r][c]);
    }
  }
  for (int r = 0; r < R; ++r) {
    for (int c = 0; c < C; ++c) y[r * N + c] = hsum(acc[r][c]);
  }
}

template <int R>
void tile_cols(const float* x, int64_t K, const float* buf, float* y, int64_t N, int64_t cols) {
  int64_t c = 0;
  for (; c + kTileCols <= cols; c += kTileCols) tile<R, kTileCols>(x, K, buf + c * K, y + c, N);
  for (; c < cols; ++c) tile<R, 1>(x, K, buf + c * K, y + c, N);
}

// y [M, N] = x [M, K] fp32 times the weight, widened by widen(n0, cols, buf) into buf [cols, K]
// fp32 for panels of kPanel output channels; bias [N] fp32 or null.
template <typename Widen>
void panel_gemm(const float* x, int64_t M, int64_t K, int64_t N, const float* bias, float* y, const Widen& widen) {
  if (M >= kDenseRows) {
    // Prefill-sized: the panels would stream x from beyond L2 once per panel; widen the whole
    // weight once (a few percent of the multiply at this many rows) and let the fp32 GEMM block it.
    // (a buffer kept per calling thread: a fresh one would cost page faults and zeroing each call)
    thread_local std::vector<float> widened;
    widened.resize(std::max<size_t>(widened.size(), N * K));
    float* wp = widened.data();
    at::parallel_for(0, (N + kPanel - 1) / kPanel, 1, [&](int64_t begin, int64_t end) {
      for (int64_t p = begin; p < end; ++p) widen(p * kPanel, std::min(kPanel, N - p * kPanel), wp + p * kPanel * K);
    });
    const auto opts = at::TensorOptions().dtype(at::kFloat);
    const at::Tensor w = at::from_blob(wp, {N, K}, opts);
    at::Tensor out = at::from_blob(y, {M, N}, opts);
    at::Tensor b = bias ? at::from_blob(const_cast<float*>(bias), {N}, opts) : at::Tensor();
    if (bias) {
      at::addmm_out(out, b, at::from_blob(const_cast<float*>(x), {M, K}, opts), w.t());
    } else {
      at::mm_out(out, at::from_blob(const_cast<float*>(x), {M, K}, opts), w.t());
    }
    return;
  }
  const int64_t panels = (N + kPanel - 1) / kPanel;
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buf(kPanel * K);
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      widen(n0, cols, buf.data());
      int64_t r = 0;
      for (; r + kTileRows <= M; r += kTileRows) tile_cols<kTileRows>(x + r * K, K, buf.data(), y + r * N + n0, N, cols);
      for (; r < M; ++r) tile_cols<1>(x + r * K, K, buf.data(), y + r * N + n0, N, cols);
      if (bias) {
        for (int64_t m = 0; m < M; ++m) {
          for (int64_t c = 0; c < cols; ++c) y[m * N + n0 + c] += bias[n0 + c];
        }
      }
    }
  });
}

}  // namespace

// The entry points below take what cpu_gemv.cpp has checked: x fp32 [M, K] contiguous; return fp32 [M, N].

at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows xq(x.data_ptr<float>(), M, K);
  const int8_t* cp = codes.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  float* out = y.data_ptr<float>();
  for_rows_and_channels(M, N, [&](auto r, int64_t r0, int64_t begin, int64_t end) {
    int8_rows<decltype(r)::value>(xq, r0, cp, sp, out, K, N, begin, end);
  });
  return y;
}

at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * 8;
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows xq(x.data_ptr<float>(), M, K);
  const uint8_t* w = packed.data_ptr<uint8_t>();
  float* out = y.data_ptr<float>();
  if (pairs.scalar_type() == at::kByte) {  // SuperBlocks
    const uint8_t* p = pairs.data_ptr<uint8_t>();
    const int64_t tile_bytes = K / 256 * SuperBlocks::kBytes;
    over_tiles(tiles, M, [&](auto r, int64_t r0, int64_t t) {
      int4_tile<decltype(r)::value>(xq, r0, w + t * K * 4, SuperBlocks{p + t * tile_bytes}, out, N, t * 8);
    });
    return y;
  }
  const auto* p = reinterpret_cast<const uint16_t*>(pairs.data_ptr<c10::BFloat16>());
  const int64_t groups = K / group_size, blocks_per_group = group_size / kBlock;
  over_tiles(tiles, M, [&](auto r, int64_t r0, int64_t t) {
    int4_tile<decltype(r)::value>(xq, r0, w + t * K * 4, Pairs{p + t * groups * 16, blocks_per_group}, out, N, t * 8);
  });
  return y;
}

#ifdef TOKENMILL_AVX512_BF16
at::Tensor int4_wide_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t group_size) {
  const int64_t M = x.size(0), K = x.size(1), tiles = packed.size(0), N = tiles * kWideTile;
  at::Tensor y = at::empty({M, N}, x.options());
  const uint8_t* w = packed.data_ptr<uint8_t>();
  const int64_t tile_codes = K * kWideTile / 2;
  TOKENMILL_DISPATCH_FLOAT_BF16(x.scalar_type(), "int4_wide_linear", [&] {
    const QuantizedRows xq(x.data_ptr<scalar_t>(), M, K);
    scalar_t* out = y.data_ptr<scalar_t>();
    // 4 tiles a panel: the 64 output channels of int4_linear's panels of 8 tiles of 8
    if (pairs.scalar_type() == at::kByte) {
      const uint8_t* p = pairs.data_ptr<uint8_t>();
      const int64_t tile_bytes = K / 256 * kInt4FactorBytes;
      over_tiles<12, 4>(tiles, M, [&](auto r, int64_t r0, int64_t t) {
        int4_wide_tile<decltype(r)::value>(xq, r0, w + t * tile_codes, WideFactors{p + t * tile_bytes}, out, N,
                                           t * kWideTile);
      });
      return;
    }
    const auto* p = reinterpret_cast<const uint16_t*>(pairs.data_ptr<c10::BFloat16>());
    const int64_t groups = K / group_size, blocks_per_group = group_size / kBlock;
    over_tiles<12, 4>(tiles, M, [&](auto r, int64_t r0, int64_t t) {
      int4_wide_tile<decltype(r)::value>(xq, r0, w + t * tile_codes,
                                         WidePairs{p + t * groups * 2 * kWideTile, blocks_per_group}, out, N,
                                         t * kWideTile);
    });
  });
  return y;
}
#endif

namespace {
// run(scales_of), scales_of(t) giving tile t's scale reader: Int6SuperBlocks over a Q6_K record's
// factors (uint8), GroupScales over bf16 scales.
template <typename Run>
void with_tile_scales(const at::Tensor& scales, int64_t K, const Run& run) {
  if (scales.scalar_type() == at::kByte) {
    const uint8_t* sp = scales.data_ptr<uint8_t>();
    const int64_t tile_bytes = K / 256 * Int6SuperBlocks::kBytes;
    run([=](int64_t t) { return Int6SuperBlocks{sp + t * tile_bytes}; });
  } else {
    const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
    run([=](int64_t t) { return GroupScales{sp + t * K / 2}; });
  }
}

// int6_linear with x and y of dtype T (float; bf16 at avx512_bf16).
template <typename T>
at::Tensor int6_linear_as(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), tiles = low.size(0), N = tiles * 8;
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows xq(x.data_ptr<T>(), M, K);
  const uint8_t* lp = low.data_ptr<uint8_t>();
  const uint8_t* hp = high.data_ptr<uint8_t>();
  T* out = y.data_ptr<T>();
#ifdef TOKENMILL_AVX512_BF16
  if (M == 1) {  // one tile at a time, a group a 512-bit register (int6_tile_one_row)
    with_tile_scales(scales, K, [&](const auto& scales_of) {
      over_tiles(tiles, 1, [&](auto, int64_t, int64_t t) {
        int6_tile_one_row(xq, lp + t * K * 4, hp + t * K * 2, scales_of(t), out, t * 8);
      });
    });
    return y;
  }
  // Tile pairs from 2 rows, 8 rows a pass, 4 pairs a panel (Qwen2.5-1.5B's Q6_K shapes, weights
  // in memory: 0.7x the time of tiles of 8 at 5-16 rows, the same at 2-4). Not for one row:
  // pairs read two streams of codes a thread and took 1.07x int6_tile's time on Zen 4.
  if (tiles % 2 == 0) {
    with_tile_scales(scales, K, [&](const auto& scales_of) {
      over_tiles<8, 4>(tiles / 2, M, [&](auto r, int64_t r0, int64_t pair) {
        const int64_t t = 2 * pair;
        int6_tile_pair<decltype(r)::value>(xq, r0, lp + t * K * 4, hp + t * K * 2, K, scales_of(t), scales_of(t + 1),
                                           out, N, t * 8);
      });
    });
    return y;
  }
#endif
  with_tile_scales(scales, K, [&](const auto& scales_of) {
    over_tiles(tiles, M, [&](auto r, int64_t r0, int64_t t) {
      int6_tile<decltype(r)::value>(xq, r0, lp + t * K * 4, hp + t * K * 2, scales_of(t), out, N, t * 8);
    });
  });
  return y;
}
}  // namespace

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales) {
#ifdef TOKENMILL_AVX512_BF16
  if (x.scalar_type() == at::kBFloat16) return int6_linear_as<c10::BFloat16>(x, low, high, scales);
#endif
  return int6_linear_as<float>(x, low, high, scales);
}

at::Tensor int8_tiled_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales) {
  const int64_t M = x.size(0), K = x.size(1), N = tiles.size(0) * 8;
  at::Tensor y = at::empty({M, N}, x.options());
  const QuantizedRows xq(x.data_ptr<float>(), M, K);
  const at::Tensor s32 = scales.to(at::kFloat).contiguous();
  const float* scale = s32.data_ptr<float>();
  const int8_t* w = tiles.data_ptr<int8_t>();
  float* out = y.data_ptr<float>();
  over_tiles(N / 8, M, [&](auto r, int64_t r0, int64_t t) {
    int8_tile<decltype(r)::value>(xq, r0, w + t * K * 8, scale, out, N, t * 8);
  });
  return y;
}

at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  at::Tensor y = at::empty({M, N}, x.options());
  const at::Tensor b = bias ? bias->to(at::kFloat).contiguous() : at::Tensor();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  float* out = y.data_ptr<float>();
  panel_gemm(x.data_ptr<float>(), M, K, N, bias ? b.data_ptr<float>() : nullptr, out,
             [&](int64_t n0, int64_t cols, float* buf) {
               for (int64_t c = 0; c < cols; ++c) {
                 const int8_t* src = cp + (n0 + c) * K;
                 const __m256 scale = _mm256_set1_ps(bf16_bits_to_float(sp[n0 + c]));
                 for (int64_t k = 0; k < K; k += 8) {
                   const __m256i codes8 = _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(src + k)));
                   _mm256_storeu_ps(buf + c * K + k, _mm256_mul_ps(_mm256_cvtepi32_ps(codes8), scale));
                 }
               }
             });
  return y;
}

}  // namespace tokenmill::avx2

#endif  // TOKENMILL_AVX2
