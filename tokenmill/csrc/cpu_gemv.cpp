// Matmuls of a few rows (the decode steps of 1-3 requests) that read the weight once at close to
// memory speed, where PyTorch's kernels leave bandwidth unused on this model's small matrices
// (2 cores, AVX-512 BF16), and int8 / int4 matmuls of many rows (below). Built only where the
// compiler targets AVX-512 BF16 (-march=native on such a CPU); elsewhere gemv_supported() is
// false and the linears keep PyTorch's kernels.
//
// int4_linear: weight-only int4 (layers/linear.py Int4Linear), w = q * scale + min per group of
// `group_size` input channels (q = 0..15): at this level cpu_gemv_avx2.cpp's int4_wide_linear,
// tiles of 16 output channels, x quantized to int8 per block of 32 and multiplied with the codes
// by vpdpbusd (64 products an instruction, where vdpbf16ps on bf16 activations takes 32 and the
// codes widen to bf16 first: at 4-64 rows 1.1-1.3x the time of the bf16 kernel it replaced).
// int8_tiled_linear: weight-only int8 over tiles of 16 output channels, one kernel for every row
// count on a layout made for vdpbf16ps: per tile and quad of input channels 4i .. 4i + 3, 64
// bytes, byte 2c + j of the first 32 = code(c, 4i + j), of the second code(c, 4i + 2 + j) (c:
// the channel in the tile, j = 0, 1). Widened to bf16 (exact), the first 32 are the 16
// channels' pairs (4i, 4i + 1), the second their pairs (4i + 2, 4i + 3): each meets one broadcast
// pair of x in a vdpbf16ps (exact products, fp32 sums, 16 channels at once, no horizontal sums),
// and the sums take the channels' scales once. Up to kSingleTileRows rows one tile at a time
// widens its codes as it goes; above, a tile pair is widened once into a buffer that every block
// of rows reads (tiled_matmul).
// bf16_linear: a bf16 weight [N, K] as it is (DenseLinear), 32 weights per vdpbf16ps.
// int8_linear: weight-only int8 with one scale per output row (Int8Linear, the quantized
// configs' LM head), codes widened to fp32 16 at a time, fp32 FMAs, the scale applied once.
// All three: parallel over output rows, several accumulators per row so that the additions do
// not wait on each other, the result rounded once to bf16.
// int8_gemm: the same weights at many rows, compute-bound there, at about a bf16 matmul's speed:
// panels of 32 output channels widened once to bf16 (int8 codes exactly), then vdpbf16ps over
// every row.
// int6_gemm: Int6Linear's tiles (int6_linear's layout, cpu_gemv_avx2.cpp) at many rows the same
// way, each weight widened once per call to bf16 as scale (q - 32) of its group of 16.
// Longer than 600 lines on purpose: the few-row and many-row matmuls of the AVX-512 BF16 level
// share the tile layouts, the row dispatch and the argument checks defined here.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <vector>

bool gemv_supported() { return tokenmill::kAvx512Bf16Built || tokenmill::kAvx2Built; }
bool native_bf16() { return tokenmill::kAvx512Bf16Built; }

#ifdef TOKENMILL_AVX512_BF16
namespace {

// How far ahead of their weight reads the int8 few-row kernels prefetch: without it
// the hardware prefetcher left them well below the bandwidth a plain stream reaches.
constexpr int64_t kQuantPrefetchBytes = 8192;

inline __m512 bf16x16_to_fp32(const uint16_t* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}

// int8 tiles: up to this many rows one tile at a time, widened as it goes (up to
// kTileRowsPerPass rows a pass; on the default model's matrices, 2 cores, Zen 5: at 8 rows 141 vs
// 221 µs for tile pairs); above it tile pairs widened once into a buffer that blocks of
// kBufferRows rows read.
constexpr int64_t kSingleTileRows = 24;
constexpr int64_t kBufferRows = 8;
// Rows a pass over a tile widened as it goes: each pass widens the tile's codes again, so 5 rows
// in passes of 4 cost nearly twice 4 rows (a speculative verification of 4 drafts is 5 rows).
constexpr int64_t kTileRowsPerPass = 8;

// The int8 tiles of a call and what every tile kernel shares (the layout above; sm: the [N] bf16
// scales).
struct Tiles {
  const uint32_t* x;  // bf16 pairs, kpairs per row
  const uint8_t* codes;
  const uint16_t* sm;
  uint16_t* y;        // bf16 [M, N]
  int64_t kpairs, N;
  static constexpr int64_t kQuadBytes = 64;
  int64_t tile_bytes() const { return kpairs / 2 * kQuadBytes; }
};

// One quad of a tile's codes (64 bytes at p) as vdpbf16ps operands: lo = the 16 channels' pairs
// (4i, 4i + 1), hi = their pairs (4i + 2, 4i + 3), exact in bf16.
inline void widen_int8_quad(const uint8_t* p, __m512i& lo, __m512i& hi) {
  const auto* c = reinterpret_cast<const int8_t*>(p);
  lo = (__m512i)_mm512_cvtne2ps_pbh(tokenmill::int8x16_to_fp32(c + 16), tokenmill::int8x16_to_fp32(c));
  hi = (__m512i)_mm512_cvtne2ps_pbh(tokenmill::int8x16_to_fp32(c + 48), tokenmill::int8x16_to_fp32(c + 32));
}

// y[r, 16 t0 .. 16 (t0 + T)) for R rows of x from row m0, T tiles from tile t0 (cols: the valid
// output channels of them); S accumulators per (row, tile) so that enough sums are in flight.
// Buffered: the tiles' widened pairs from buf ([kpairs][16 T] pairs) instead of their codes.
// (Not inlined: inlined into tiled_matmul's loops it ran at half speed from 4 to 24 rows.)
template <int R, int T, int S, bool Buffered = false>
[[gnu::noinline]] void tile_rows(const Tiles& a, int64_t m0, int64_t t0, int64_t cols, const uint32_t* buf = nullptr) {
  const uint32_t* x = a.x + m0 * a.kpairs;
  const uint8_t* codes = a.codes + t0 * a.tile_bytes();
  __m512 dot[R][T][S];
  for (int r = 0; r < R; ++r) {
    for (int t = 0; t < T; ++t) {
      for (int i = 0; i < S; ++i) dot[r][t][i] = _mm512_setzero_ps();
    }
  }
  for (int64_t q = 0; q < a.kpairs / 2; ++q) {
    __m512i lo[T], hi[T];  // pairs 2q and 2q + 1 of each tile's 16 channels
    for (int t = 0; t < T; ++t) {
      if constexpr (Buffered) {
        lo[t] = _mm512_loadu_si512(buf + (2 * q) * (16 * T) + 16 * t);
        hi[t] = _mm512_loadu_si512(buf + (2 * q + 1) * (16 * T) + 16 * t);
      } else {
        const uint8_t* p = codes + t * a.tile_bytes() + q * Tiles::kQuadBytes;
        _mm_prefetch(reinterpret_cast<const char*>(p + kQuantPrefetchBytes), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(p + kQuantPrefetchBytes + 32), _MM_HINT_T0);
        widen_int8_quad(p, lo[t], hi[t]);
      }
    }
    for (int r = 0; r < R; ++r) {
      // one broadcast of x's pairs serves every tile (a broadcast per multiply measured 1.3x the
      // time at 64-512 rows)
      const __m512bh x0 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * a.kpairs + 2 * q]));
      const __m512bh x1 = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * a.kpairs + 2 * q + 1]));
      for (int t = 0; t < T; ++t) {
        dot[r][t][0] = _mm512_dpbf16_ps(dot[r][t][0], x0, (__m512bh)lo[t]);
        dot[r][t][S - 1] = _mm512_dpbf16_ps(dot[r][t][S - 1], x1, (__m512bh)hi[t]);
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    const __m512 scale = bf16x16_to_fp32(a.sm + 16 * (t0 + t));
    for (int r = 0; r < R && cols > 16 * t; ++r) {
      __m512 d = dot[r][t][0];
      if constexpr (S == 2) d = _mm512_add_ps(d, dot[r][t][1]);
      const int64_t c = cols - 16 * t;
      const __mmask16 mask = c >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << c) - 1);
      _mm256_mask_storeu_epi16(a.y + (m0 + r) * a.N + 16 * (t0 + t), mask, (__m256i)_mm512_cvtneps_pbh(_mm512_mul_ps(d, scale)));
    }
  }
}

// y = x W^T for the tiled weight of `a`, every row count, over items of tiles taken by the
// threads in turn. Up to kSingleTileRows rows: one tile at a time (one stream of codes per
// thread reads fastest), widened as it goes, up to 8 rows a pass (one row: two accumulators per
// tile). More: a tile pair widened once into a buffer that blocks of kBufferRows rows read (an
// odd last tile alone, the same way).
void tiled_matmul(const Tiles& a, int64_t M) {
  const int64_t tiles = a.N / 16, per_item = M <= kSingleTileRows ? 1 : 2;
  const bool buffered = per_item == 2;
  at::parallel_for(0, (tiles + per_item - 1) / per_item, 1, [&](int64_t begin, int64_t end) {
    std::vector<uint32_t> buf(buffered ? a.kpairs * 32 : 0);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t0 = item * per_item, n = std::min(per_item, tiles - t0);
      if (M == 1) {
        tile_rows<1, 1, 2>(a, 0, t0, 16);
      } else if (n == 2) {
        const uint8_t* codes = a.codes + t0 * a.tile_bytes();
        for (int64_t q = 0; q < a.kpairs / 2; ++q) {
          for (int t = 0; t < 2; ++t) {
            __m512i lo, hi;
            widen_int8_quad(codes + t * a.tile_bytes() + q * Tiles::kQuadBytes, lo, hi);
            _mm512_storeu_si512(buf.data() + (2 * q) * 32 + 16 * t, lo);
            _mm512_storeu_si512(buf.data() + (2 * q + 1) * 32 + 16 * t, hi);
          }
        }
        for (int64_t m0 = 0; m0 < M; m0 += kBufferRows) {
          tokenmill::with_rows_up_to_8(std::min(kBufferRows, M - m0), [&](auto r) {
            tile_rows<decltype(r)::value, 2, 1, true>(a, m0, t0, 32, buf.data());
          });
        }
      } else {
        for (int64_t m0 = 0; m0 < M; m0 += kTileRowsPerPass) {
          tokenmill::with_rows_up_to_8(std::min(kTileRowsPerPass, M - m0), [&](auto r) {
            tile_rows<decltype(r)::value, 1, 2>(a, m0, t0, 16);
          });
        }
      }
    }
  });
}

// For each output row n in [begin, end): M dot products over `steps` steps, step(n, i, acc, j)
// adding step i of row n into acc[m][j] for every m; four accumulators per product, so that the
// additions do not wait on each other; then store(n, m, the product's fp32 sum).
template <int M, typename Step, typename Store>
void dot_rows(int64_t steps, int64_t begin, int64_t end, const Step& step, const Store& store) {
  for (int64_t n = begin; n < end; ++n) {
    __m512 acc[M][4];
    for (int m = 0; m < M; ++m) {
      for (int j = 0; j < 4; ++j) acc[m][j] = _mm512_setzero_ps();
    }
    int64_t i = 0;
    for (; i + 3 < steps; i += 4) {
      for (int j = 0; j < 4; ++j) step(n, i + j, acc, j);
    }
    for (; i < steps; ++i) step(n, i, acc, 0);
    for (int m = 0; m < M; ++m) {
      const __m512 total = _mm512_add_ps(_mm512_add_ps(acc[m][0], acc[m][1]), _mm512_add_ps(acc[m][2], acc[m][3]));
      store(n, m, _mm512_reduce_add_ps(total));
    }
  }
}

// Rows [begin, end) of y = x W^T (+ bias) for M rows of x, W [N, K] bf16: 32 weights a step,
// the weight prefetched 2 KB ahead (the LM head at 1 row: 1.0 -> 0.8 ms; bf16 is bandwidth-bound
// here, unlike int8 and int4).
constexpr int64_t kPrefetchAhead = 1024;  // bf16 elements
template <int M>
void bf16_rows(const uint16_t* x, const uint16_t* w, const float* bias, at::BFloat16* y, int64_t K, int64_t N,
               int64_t begin, int64_t end) {
  const auto step = [&](int64_t n, int64_t i, __m512 (*acc)[4], int j) {
    const uint16_t* src = w + n * K + i * 32;
    _mm_prefetch(reinterpret_cast<const char*>(src + kPrefetchAhead), _MM_HINT_T0);
    const __m512i wv = _mm512_loadu_si512(src);
    for (int m = 0; m < M; ++m) {
      acc[m][j] = _mm512_dpbf16_ps(acc[m][j], (__m512bh)wv, (__m512bh)_mm512_loadu_si512(x + m * K + i * 32));
    }
  };
  dot_rows<M>(K / 32, begin, end, step, [&](int64_t n, int m, float sum) {
    y[m * N + n] = static_cast<at::BFloat16>(sum + (bias ? bias[n] : 0.f));
  });
}

// Rows [begin, end) of y = (x codes^T) * scale for M rows of x (as fp32, xf [M, K]), codes
// [N, K] int8: 16 codes a step, widened to fp32.
template <int M>
void int8_rows(const float* xf, const int8_t* codes, const uint16_t* scales, at::BFloat16* y, int64_t K, int64_t N,
               int64_t begin, int64_t end) {
  const auto step = [&](int64_t n, int64_t i, __m512 (*acc)[4], int j) {
    const auto* src = reinterpret_cast<const __m128i*>(codes + n * K + i * 16);
    if (i % 4 == 0) _mm_prefetch(reinterpret_cast<const char*>(src) + kQuantPrefetchBytes, _MM_HINT_T0);
    const __m512 wv = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(src)));
    for (int m = 0; m < M; ++m) acc[m][j] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(xf + m * K + i * 16), acc[m][j]);
  };
  dot_rows<M>(K / 16, begin, end, step, [&](int64_t n, int m, float sum) {
    y[m * N + n] = static_cast<at::BFloat16>(sum * tokenmill::bf16_bits_to_float(scales[n]));
  });
}

// rows(M_constant, begin, end) over the N output rows in parallel, M (1-4) as a compile-time
// constant (std::integral_constant) for the row kernels' templates.
template <typename Rows>
void for_output_rows(int64_t M, int64_t N, const Rows& rows) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    tokenmill::with_row_count(M, [&](auto m) { rows(m, begin, end); });
  });
}

// Many rows (int8_gemm): output channels in panels of 32. A panel's weights widen
// once to bf16 in the order vdpbf16ps wants them, buf[kp * 32 + j] = (w[j][2kp], w[j][2kp + 1])
// (16 channels' pairs transposed in registers); then every block of up to 8 rows of x runs over
// it, one x pair broadcast per row and step, 8 x 2 accumulators.
constexpr int64_t kPanel = 32;

// A panel from its rows: buf[kp * 32 + j] = pair kp of output channel j, where
// row_pairs(j, k, whole) gives channel j's bf16 pairs for k .. k + 31 (whole = false: k .. k + 15
// in the low half, K % 32 == 16); channels past `rows` are zeros.
template <typename RowPairs>
void fill_panel(int64_t K, int64_t rows, uint32_t* buf, const RowPairs& row_pairs) {
  __m512i a[16], t[16];
  for (int64_t k = 0; k < K; k += 32) {
    const bool whole = k + 32 <= K;
    for (int64_t half = 0; half < 2; ++half) {
      for (int64_t i = 0; i < 16; ++i) {
        const int64_t j = half * 16 + i;
        a[i] = j < rows ? row_pairs(j, k, whole) : _mm512_setzero_si512();
      }
      tokenmill::transpose16(a, t);
      for (int64_t p = 0; p < (whole ? 16 : 8); ++p) _mm512_storeu_si512(buf + (k / 2 + p) * kPanel + half * 16, t[p]);
    }
  }
}

// R rows of y[:, panel] = (x buf) * scale + bias: x as bf16 pairs (x_row pairs per row).
template <int R>
void panel_rows(const uint32_t* x, int64_t x_row, const uint32_t* buf, int64_t kpairs, const float* scale,
                const float* bias, at::BFloat16* y, int64_t y_row, int64_t cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < kpairs; ++kp) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(buf + kp * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(buf + kp * kPanel + 16);
    for (int r = 0; r < R; ++r) {
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * x_row + kp]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], xv, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], xv, w1);
    }
  }
  const __m512 s0 = _mm512_loadu_ps(scale), s1 = _mm512_loadu_ps(scale + 16);
  const __m512 b0 = _mm512_loadu_ps(bias), b1 = _mm512_loadu_ps(bias + 16);
  const __mmask16 m0 = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __mmask16 m1 = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : static_cast<__mmask16>((1u << (cols - 16)) - 1);
  for (int r = 0; r < R; ++r) {
    auto* out = reinterpret_cast<uint16_t*>(y + r * y_row);
    _mm256_mask_storeu_epi16(out, m0, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][0], s0, b0)));
    _mm256_mask_storeu_epi16(out + 16, m1, (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(acc[r][1], s1, b1)));
  }
}

// Every row of x against one panel, 8 rows at a time, the last block's rows as a constant.
void panel_all_rows(const uint32_t* x, int64_t M, int64_t kpairs, const uint32_t* buf, const float* scale,
                    const float* bias, at::BFloat16* y, int64_t N, int64_t cols) {
  int64_t m = 0;
  const auto block = [&](auto r) {
    panel_rows<decltype(r)::value>(x + m * kpairs, kpairs, buf, kpairs, scale, bias, y + m * N, N, cols);
  };
  for (; m < M; m += 8) tokenmill::with_rows_up_to_8(std::min<int64_t>(8, M - m), block);
}

inline void prefetch_bytes(const void* p, int64_t bytes) {
  for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(static_cast<const char*>(p) + i, _MM_HINT_T0);
}

// y = (x W^T) * scales + bias over panels of 32 output channels (fill(n0, cols, buf) writes
// channels n0 .. n0 + cols - 1 into the panel buffer, e.g. by fill_panel); scales and bias [N] or
// None. Panels go to whichever thread is free (a thread the OS pauses holds no fixed share).
template <typename Fill, typename PrefetchRows>
void panel_gemm(const at::Tensor& x, int64_t N, const c10::optional<at::Tensor>& scales,
                const c10::optional<at::Tensor>& bias, at::Tensor& y, const Fill& fill,
                const PrefetchRows& prefetch_rows) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t panels = (N + kPanel - 1) / kPanel, kpairs = K / 2;
  // fp32 scales and biases, padded to whole panels
  std::vector<float> scale(panels * kPanel, 1.f), shift(panels * kPanel, 0.f);
  if (scales) {
    const at::Tensor s32 = scales->to(at::kFloat).contiguous();
    std::copy(s32.data_ptr<float>(), s32.data_ptr<float>() + N, scale.begin());
  }
  if (bias) {
    const at::Tensor b32 = bias->to(at::kFloat).contiguous();
    std::copy(b32.data_ptr<float>(), b32.data_ptr<float>() + N, shift.begin());
  }
  const auto* xp = reinterpret_cast<const uint32_t*>(x.data_ptr<at::BFloat16>());
  at::BFloat16* yp = y.data_ptr<at::BFloat16>();
  std::atomic<int64_t> next{0};
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), panels), 1, [&](int64_t, int64_t) {
    std::vector<uint32_t> buf(kpairs * kPanel);
    // Each thread takes its next panel before it works on the current one and prefetches its
    // weight rows (32 strided rows are more streams than the hardware prefetcher follows).
    for (int64_t p = next.fetch_add(1, std::memory_order_relaxed); p < panels;) {
      const int64_t after = next.fetch_add(1, std::memory_order_relaxed);
      if (after < panels) prefetch_rows(after * kPanel, std::min(kPanel, N - after * kPanel));
      const int64_t n0 = p * kPanel, cols = std::min(kPanel, N - n0);
      fill(n0, cols, buf.data());
      panel_all_rows(xp, M, kpairs, buf.data(), scale.data() + n0, shift.data() + n0, yp + n0, N, cols);
      p = after;
    }
  });
}

// A panel's buffer (panel_rows's layout: buf[kp * 32 + j] = channel j's bf16 pair kp) from
// Int6Linear's tiles (cpu_gemv_avx2.cpp int6_tile: low [N/8, K/8, 32], high [N/8, K/16, 32]),
// `tiles` tiles of 8 channels from tile t0, each weight scale (q - 32) rounded once to bf16. A
// tile's step s (8 input channels) holds channel c's codes in bytes 4c .. 4c + 3, inputs 8s + j
// in the low nibbles and 8s + 4 + j in the high ones, their top 2 bits in the step pair's high
// bytes (bits 0-3 for the even step, 4-7 for the odd). Widened in tile order (byte 4c + j ->
// element 4c + j), a step's low nibbles give channel c's pairs (8s, 8s + 1) and (8s + 2, 8s + 3)
// as the 32-bit elements 2c and 2c + 1; one permute puts each pair's 8 channels side by side.
// scale(t, g) gives the tile's 8 scales of group g (16 input channels) as fp32.
template <typename Scale>
void fill_int6_panel(const uint8_t* low, const uint8_t* high, int64_t K, int64_t t0, int64_t tiles, uint32_t* buf,
                     const Scale& scale) {
  const __m256i nibble = _mm256_set1_epi8(0x0F), top = _mm256_set1_epi8(0x30);
  const __m512i centre = _mm512_set1_epi16(32);
  // element e of a half: channel e / 4 (first half) or 4 + e / 4 (second)
  const __m512i first = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  const __m512i second = _mm512_add_epi32(first, _mm512_set1_epi32(4));
  const __m512i pairs = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
  for (int64_t i = 0; i < tiles; ++i) {
    const int64_t t = t0 + i;
    const uint8_t* lw = low + t * K * 4;
    const uint8_t* hw = high + t * K * 2;
    uint32_t* out = buf + i * 8;
    for (int64_t g = 0; g < K / 16; ++g) {
      const __m512 s8 = _mm512_castps256_ps512(scale(t, g));
      const __m512 s_first = _mm512_permutexvar_ps(first, s8), s_second = _mm512_permutexvar_ps(second, s8);
      const __m256i bits_pair = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(hw + g * 32));
      for (int64_t h = 0; h < 2; ++h) {
        const int64_t step = 2 * g + h;
        const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(lw + step * 32));
        const __m256i bits = h ? _mm256_srli_epi16(bits_pair, 4) : bits_pair;
        const __m256i codes[2] = {
            _mm256_or_si256(_mm256_and_si256(raw, nibble), _mm256_and_si256(_mm256_slli_epi16(bits, 4), top)),
            _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(raw, 4), nibble),
                            _mm256_and_si256(_mm256_slli_epi16(bits, 2), top))};
        for (int64_t n = 0; n < 2; ++n) {  // the low nibbles' inputs 8s .. 8s + 3, then the high ones'
          const __m512i q = _mm512_sub_epi16(_mm512_cvtepu8_epi16(codes[n]), centre);
          const __m512 lo = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_castsi512_si256(q))), s_first);
          const __m512 hi =
              _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi16_epi32(_mm512_extracti64x4_epi64(q, 1))), s_second);
          const __m512i both = _mm512_permutexvar_epi32(pairs, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          const int64_t kp = step * 4 + n * 2;  // the pair (8s + 4n, 8s + 4n + 1)
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + kp * kPanel), _mm512_castsi512_si256(both));
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + (kp + 1) * kPanel), _mm512_extracti64x4_epi64(both, 1));
        }
      }
    }
  }
}

}  // namespace
#endif

namespace {

// The checks every matmul kernel here makes: built here, CPU tensors, contiguous, x fp32 or bf16
// [M, K] with 1 <= M (<= max_rows; 0: any number of rows).
void check_matmul_args(const char* kernel, const at::Tensor& x, std::initializer_list<const at::Tensor*> weights,
                       int64_t max_rows) {
  TORCH_CHECK(gemv_supported(), kernel, " needs AVX2 or AVX-512 BF16 (see gemv_supported)");
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "contiguous CPU tensors");
  for (const at::Tensor* t : weights) TORCH_CHECK(t->device().is_cpu() && t->is_contiguous(), "contiguous CPU tensors");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat) && x.size(0) >= 1 &&
                  (max_rows == 0 || x.size(0) <= max_rows),
              "x: fp32 or bf16 [M, K] with 1 <= M", max_rows ? " <= " + std::to_string(max_rows) : std::string());
}

// The AVX-512 BF16 few-row kernels take 1-4 rows (int4_linear any number); the AVX2 ones any
// number (4 at a time).
constexpr int64_t kFewRowsMax = tokenmill::kAvx512Bf16Built ? 4 : 0;

// An entry point of a level without the kernel (check_matmul_args has refused the call already).
at::Tensor not_built(const char* kernel) {
  TORCH_CHECK(false, kernel, " is not built at this instruction-set level");
  return at::Tensor();
}

// The kernels of the AVX-512 BF16 level compute on bf16 activations, the AVX2 level's on fp32.
at::Tensor as_kernel_dtype(const at::Tensor& x) {
  return x.to(tokenmill::kAvx512Bf16Built ? at::kBFloat16 : at::kFloat);
}

// int4_linear's weight in the level's tiles of `width` output channels (layers/linear.py
// tiled_int4_layout): AVX-512 BF16 width 16 (the layout above), AVX2 width 8
// (cpu_gemv_avx2.cpp); packed [N/width, K width/64, 32] uint8, pairs [N/width, K/group_size,
// 2 width] bf16, or a Q4_K tensor's factors (group_size 32): at width 8 its super-blocks
// (tiled_int4_super_blocks: uint8 [N/8, K/256, 128]), at width 16 tiled_int4_factors' table
// (uint8 [N/16, K/256, kInt4FactorBytes]). Returns N.
int64_t check_int4_weight(int64_t K, const at::Tensor& packed, const at::Tensor& pairs, int64_t group_size) {
  TORCH_CHECK(K % 64 == 0 && (group_size == 32 || group_size % 64 == 0) && K % group_size == 0,
              "K must be a multiple of 64, group_size 32 or a multiple of 64 dividing K");
  const int64_t width = tokenmill::kAvx512Bf16Built ? 16 : 8;
  TORCH_CHECK(packed.scalar_type() == at::kByte && packed.dim() == 3 && packed.size(1) == K * width / 64 &&
                  packed.size(2) == 32,
              "packed: uint8 [N/", width, ", K/", 64 / width, ", 32]");
  if (pairs.scalar_type() == at::kByte && width == 16) {
    TORCH_CHECK(group_size == 32 && K % 256 == 0 && pairs.dim() == 3 && pairs.size(0) == packed.size(0) &&
                    pairs.size(1) == K / 256 && pairs.size(2) == tokenmill::avx2::kInt4FactorBytes,
                "factors: uint8 [N/16, K/256, ", tokenmill::avx2::kInt4FactorBytes, "] at width 16 (AVX-512 BF16), group_size 32");
    return packed.size(0) * width;
  }
  if (pairs.scalar_type() == at::kByte) {
    TORCH_CHECK(width == 8 && group_size == 32 && K % 256 == 0 && pairs.dim() == 3 &&
                    pairs.size(0) == packed.size(0) && pairs.size(1) == K / 256 &&
                    pairs.size(2) == tokenmill::avx2::kQ4kSuperBlockBytes,
                "super-blocks: uint8 [N/8, K/256, ", tokenmill::avx2::kQ4kSuperBlockBytes,
                "] at width 8 (AVX2 and AVX-512 without BF16), group_size 32");
    return packed.size(0) * width;
  }
  TORCH_CHECK(pairs.scalar_type() == at::kBFloat16 && pairs.dim() == 3 && pairs.size(0) == packed.size(0) &&
                  pairs.size(1) == K / group_size && pairs.size(2) == 2 * width,
              "pairs: bf16 [N/", width, ", K/group_size, ", 2 * width, "]");
  return packed.size(0) * width;
}


}  // namespace

// x [M, K] (bf16 at AVX-512 BF16, fp32 at AVX2) contiguous, any M >= 1; packed and pairs in the
// level's layout (check_int4_weight); group_size 32 or a multiple of 64, K a multiple of 64.
// Returns y [M, N] in x's dtype. At every level x is quantized to int8 per block of 32 and the
// integer products take each group's scale and min in fp32 (cpu_gemv_avx2.cpp): the AVX-512 BF16
// level's tiles of 16 give the AVX2 level's tiles of 8 the same fp32 sums, bit for bit.
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t group_size) {
  check_matmul_args("int4_linear", x, {&packed, &pairs}, 0);
  const int64_t N = check_int4_weight(x.size(1), packed, pairs, group_size);
#if defined(TOKENMILL_AVX512_BF16)
  const at::Tensor y = tokenmill::avx2::int4_wide_linear(x, packed, pairs, group_size);
#elif defined(TOKENMILL_AVX2)
  const at::Tensor y = tokenmill::avx2::int4_linear(as_kernel_dtype(x), packed, pairs, group_size);
#else
  const at::Tensor y = not_built("int4_linear");
#endif
  return y.to(x.scalar_type());
}

// x [M, K] contiguous, any M >= 1, and the codes in the level's tiles (layers/linear.py
// tiled_int8_layout): at AVX-512 BF16 x bf16, tiles [N/16, K/2, 32], K a multiple of 4 (exact
// products, fp32 sums, one rounding); at AVX2 x fp32, tiles [N/8, K/4, 32], K a multiple of 32
// (x in int8 per block of 32, cpu_gemv_avx2.cpp). scales [N] bf16. Returns y [M, N] in x's
// dtype = (x codes^T) * scales.
at::Tensor int8_tiled_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales) {
  check_matmul_args("int8_tiled_linear", x, {&tiles, &scales}, 0);
  const int64_t M = x.size(0), K = x.size(1);
  constexpr int64_t width = tokenmill::kAvx512Bf16Built ? 16 : 8, span = 32 / width;
  TORCH_CHECK(tiles.dim() == 3 && tiles.scalar_type() == at::kChar && tiles.size(1) * span == K && tiles.size(2) == 32 &&
                  K % (tokenmill::kAvx512Bf16Built ? 4 : 32) == 0,
              "tiles: int8 [N/", width, ", K/", span, ", 32], K a multiple of ", tokenmill::kAvx512Bf16Built ? 4 : 32);
  const int64_t N = tiles.size(0) * width;
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.scalar_type() == at::kBFloat16, "scales: bf16 [N]");
  const at::Tensor xk = as_kernel_dtype(x);
#if defined(TOKENMILL_AVX512_BF16)
  at::Tensor y = at::empty({M, N}, xk.options());
  const Tiles a{reinterpret_cast<const uint32_t*>(xk.data_ptr<c10::BFloat16>()),
                reinterpret_cast<const uint8_t*>(tiles.data_ptr<int8_t>()),
                reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>()),
                reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>()), K / 2, N};
  tiled_matmul(a, M);
#elif defined(TOKENMILL_AVX2)
  const at::Tensor y = tokenmill::avx2::int8_tiled_linear(xk, tiles, scales);
#else
  const at::Tensor y = not_built("int8_tiled_linear");
#endif
  return y.to(x.scalar_type());
}

// x [M, K] fp32 or bf16 contiguous, any M >= 1; a 6-bit weight in tiles of 8 output channels
// (layers/quantization/cpu_layouts.py tiled_int6_layout): low [N/8, K/8, 32] and high [N/8, K/16, 32] uint8, scales
// [N/8, K/16, 8] bf16 (groups of 16) or a Q6_K tensor's super-blocks (tiled_int6_super_blocks:
// uint8 [N/8, K/256, 144]), K a multiple of 32. Every level from AVX2 up runs the AVX2 kernel (x in
// int8 per block of 32, cpu_gemv_avx2.cpp). Returns y [M, N] in x's dtype.
// Int6Linear's tiles (int6_linear, int6_gemm): low uint8 [N/8, K/8, 32], high [N/8, K/16, 32],
// scales bf16 [N/8, K/16, 8] or Q6_K's super-blocks uint8 [N/8, K/256, 144].
void check_int6_weight(int64_t K, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales) {
  TORCH_CHECK(K % 32 == 0 && low.scalar_type() == at::kByte && low.dim() == 3 && low.size(1) == K / 8 &&
                  low.size(2) == 32,
              "low: uint8 [N/8, K/8, 32], K a multiple of 32");
  TORCH_CHECK(high.scalar_type() == at::kByte && high.dim() == 3 && high.size(0) == low.size(0) &&
                  high.size(1) == K / 16 && high.size(2) == 32,
              "high: uint8 [N/8, K/16, 32]");
  if (scales.scalar_type() == at::kByte) {
    TORCH_CHECK(K % 256 == 0 && scales.dim() == 3 && scales.size(0) == low.size(0) && scales.size(1) == K / 256 &&
                    scales.size(2) == tokenmill::avx2::kQ6kSuperBlockBytes,
                "super-blocks: uint8 [N/8, K/256, ", tokenmill::avx2::kQ6kSuperBlockBytes, "], K a multiple of 256");
  } else {
    TORCH_CHECK(scales.scalar_type() == at::kBFloat16 && scales.dim() == 3 && scales.size(0) == low.size(0) &&
                    scales.size(1) == K / 16 && scales.size(2) == 8,
                "scales: bf16 [N/8, K/16, 8]");
  }
}

at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales) {
  check_matmul_args("int6_linear", x, {&low, &high, &scales}, 0);
  const int64_t K = x.size(1);
  check_int6_weight(K, low, high, scales);
#if defined(TOKENMILL_AVX512_BF16)
  const at::Tensor y = tokenmill::avx2::int6_linear(x, low, high, scales);  // x fp32 or bf16 as it is
#elif defined(TOKENMILL_AVX2)
  const at::Tensor y = tokenmill::avx2::int6_linear(x.to(at::kFloat), low, high, scales);
#else
  const at::Tensor y = not_built("int6_linear");
#endif
  return y.to(x.scalar_type());
}

// x [M, K] bf16 contiguous, 1 <= M <= 4; weight [N, K] bf16 contiguous, K a multiple of 32; bias
// [N] bf16 or None. Returns y [M, N] bf16: each dot product in fp32 (+ the bias), rounded once.
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(native_bf16(), "bf16_linear needs AVX-512 BF16 (see native_bf16)");
  check_matmul_args("bf16_linear", x, {&weight}, 4);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16, "x: bf16");
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.size(1) == K && K % 32 == 0,
              "weight: bf16 [N, K], K a multiple of 32");
  at::Tensor b;
  if (bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu(), "bias: [N]");
    b = bias->to(at::kFloat).contiguous();
  }
  at::Tensor y = at::empty({M, N}, x.options());
#ifdef TOKENMILL_AVX512_BF16
  const auto* x16 = reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
  const auto* w16 = reinterpret_cast<const uint16_t*>(weight.data_ptr<c10::BFloat16>());
  const float* bp = bias ? b.data_ptr<float>() : nullptr;
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  for_output_rows(M, N, [&](auto m, int64_t begin, int64_t end) {
    bf16_rows<decltype(m)::value>(x16, w16, bp, out, K, N, begin, end);
  });
#endif
  return y;
}

// x [M, K] bf16 contiguous, 1 <= M <= 4; codes [N, K] int8 contiguous, K a multiple of 16;
// scales [N] bf16. Returns y [M, N] bf16 = (x codes^T in fp32) * scale, rounded once.
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales) {
  check_matmul_args("int8_linear", x, {&codes, &scales}, kFewRowsMax);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) == K && K % 16 == 0,
              "codes: int8 [N, K], K a multiple of 16");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.scalar_type() == at::kBFloat16, "scales: bf16 [N]");
#if defined(TOKENMILL_AVX512_BF16)
  at::Tensor y = at::empty({M, N}, x.options().dtype(at::kBFloat16));
  const at::Tensor xf = as_kernel_dtype(x).to(at::kFloat);
  const float* xp = xf.data_ptr<float>();
  const int8_t* cp = codes.data_ptr<int8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<c10::BFloat16>());
  at::BFloat16* out = y.data_ptr<at::BFloat16>();
  for_output_rows(M, N, [&](auto m, int64_t begin, int64_t end) {
    int8_rows<decltype(m)::value>(xp, cp, sp, out, K, N, begin, end);
  });
#elif defined(TOKENMILL_AVX2)
  TORCH_CHECK(K % 32 == 0, "codes: K a multiple of 32");
  const at::Tensor y = tokenmill::avx2::int8_linear(as_kernel_dtype(x), codes, scales);
#else
  const at::Tensor y = not_built("int8_linear");
#endif
  return y.to(x.scalar_type());
}

// x [M, K] bf16 contiguous, any M >= 1; codes [N, K] int8 contiguous, K a multiple of 16; scales
// [N] bf16; bias [N] or None. Returns y [M, N] = (x codes^T) * scales + bias in bf16: exact
// products, fp32 sums, rounded once. For many rows (Int8Linear above its max_rows), where
// `_weight_int8pack_mm` is compute-bound at a fraction of a bf16 matmul's speed.
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  check_matmul_args("int8_gemm", x, {&codes, &scales}, 0);
  const int64_t M = x.size(0), K = x.size(1), N = codes.size(0);
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.size(1) == K && K % 16 == 0,
              "codes: int8 [N, K], K a multiple of 16");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == N && scales.scalar_type() == at::kBFloat16, "scales: bf16 [N]");
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu()), "bias: [N]");
  const at::Tensor xk = as_kernel_dtype(x);
#if defined(TOKENMILL_AVX512_BF16)
  at::Tensor y = at::empty({M, N}, xk.options());
  const auto* cp = codes.data_ptr<int8_t>();
  panel_gemm(xk, N, scales, bias, y, [&](int64_t n0, int64_t cols, uint32_t* buf) {
    fill_panel(K, cols, buf, [&](int64_t j, int64_t k, bool whole) {
      const int8_t* src = cp + (n0 + j) * K + k;
      return (__m512i)_mm512_cvtne2ps_pbh(whole ? tokenmill::int8x16_to_fp32(src + 16) : _mm512_setzero_ps(),
                                          tokenmill::int8x16_to_fp32(src));
    });
  }, [&](int64_t n0, int64_t rows) { prefetch_bytes(cp + n0 * K, rows * K); });
#elif defined(TOKENMILL_AVX2)
  const at::Tensor y = tokenmill::avx2::int8_gemm(xk, codes, scales, bias);
#else
  const at::Tensor y = not_built("int8_gemm");
#endif
  return y.to(x.scalar_type());
}

// x [M, K] fp32 or bf16 contiguous, any M >= 1; low, high, scales as int6_linear's; bias [N] or
// None. Returns y [M, N] in x's dtype: each weight widened to bf16 (scale (q - 32), rounded
// once), then bf16 products summed in fp32 (panel_gemm). For many rows at AVX-512 BF16, where
// int6_linear's int8 products take twice a bf16 matmul's time; the same codes, no second copy.
at::Tensor int6_gemm(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias) {
  check_matmul_args("int6_gemm", x, {&low, &high, &scales}, 0);
  const int64_t K = x.size(1), N = low.size(0) * 8;
  check_int6_weight(K, low, high, scales);
  TORCH_CHECK(!bias || (bias->dim() == 1 && bias->size(0) == N && bias->device().is_cpu()), "bias: [N]");
#if defined(TOKENMILL_AVX512_BF16)
  const at::Tensor xk = as_kernel_dtype(x);
  at::Tensor y = at::empty({x.size(0), N}, xk.options());
  const auto* lp = low.data_ptr<uint8_t>();
  const auto* hp = high.data_ptr<uint8_t>();
  const auto fill = [&](const auto& scale) {
    return [&, scale](int64_t n0, int64_t cols, uint32_t* buf) {
      if (cols < kPanel) {  // the last panel's missing channels: zeros
        for (int64_t kp = 0; kp < K / 2; ++kp) std::fill(buf + kp * kPanel + cols, buf + (kp + 1) * kPanel, 0u);
      }
      fill_int6_panel(lp, hp, K, n0 / 8, cols / 8, buf, scale);
    };
  };
  const auto prefetch = [&](int64_t n0, int64_t rows) {
    prefetch_bytes(lp + n0 / 8 * K * 4, rows / 8 * K * 4);
    prefetch_bytes(hp + n0 / 8 * K * 2, rows / 8 * K * 2);
  };
  if (scales.scalar_type() == at::kByte) {  // Q6_K's factors: d fp16 per 256, an int8 factor per 16
    const auto* sp = scales.data_ptr<uint8_t>();
    panel_gemm(xk, N, c10::nullopt, bias, y, fill([=](int64_t t, int64_t g) {
      const uint8_t* block = sp + (t * (K / 256) + g / 16) * tokenmill::avx2::kQ6kSuperBlockBytes;
      const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(block)));
      const __m128i f = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(block + 16 + (g % 16) * 8));
      return _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(f)));
    }), prefetch);
  } else {  // bf16 [N/8, K/16, 8]
    const auto* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<at::BFloat16>());
    panel_gemm(xk, N, c10::nullopt, bias, y, fill([=](int64_t t, int64_t g) {
      const __m128i s16 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(sp + (t * (K / 16) + g) * 8));
      return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(s16), 16));
    }), prefetch);
  }
  return y.to(x.scalar_type());
#else
  return not_built("int6_gemm");
#endif
}
