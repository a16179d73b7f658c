// paged_prefill_attention: causal attention of prefill chunks over their context in the paged KV
// cache (earlier context and the chunk itself, which the caller stored first), flash-attention
// style: nothing of size queries x keys exists, only one register tile of scores at a time with
// a running softmax max and sum per query row. Head size 64 or 128, two kernels of one shape
// (prefill_attention_dtypes(); elsewhere the backend keeps PyTorch's SDPA):
// - fp32 queries over an fp32, float16 or int8 cache, AVX2 + FMA (every level from avx2 up): fp32
//   products, softmax and P V throughout (within ~1e-6 of a float64 reference, as fp32 SDPA).
// - bf16 queries over a bf16 or int8 cache, AVX-512 BF16 only: products by vdpbf16ps.
//
// Two phases, each over all threads, shared by both kernels:
// 1. Pack: each (chunk, KV head)'s keys and values, read through the block table (an int8
//    cache dequantized as dequantize_kv does: the code times its scale in fp32, rounded once to
//    the compute dtype) or from the chunk's own K/V rows, per block of 64 keys, into the layout
//    the kernel's products want; keys past the context are zeros.
// 2. Attend: work items of ~96 query rows (consecutive tokens of a chunk x the query heads of one
//    KV head, which share every key they read), taken most expensive first by whichever thread
//    is free. Each item runs register tiles of query rows over the key blocks up to its causal
//    limit (later blocks are never touched): S = q . k, scaled; the online softmax update in fp32
//    (masked keys get weight 0); then O += P V into fp32 accumulators that were first rescaled by
//    exp(m_old - m_new). Output O / l. Each row is computed whole by one thread, so results do
//    not depend on the thread count.
//
// fp32 (F32Prefill): K packed transposed, dims x 64 keys, so a score tile is FMAs of a broadcast
// q element against 8 keys (tiles of 6 rows x 16 keys: 12 accumulators); V as it is, keys x dims,
// so P V is FMAs of a broadcast weight against 8 dims (tiles of 6 rows x 16 dims).
// bf16 (Bf16Prefill): K as pairs of dims with 16 keys per vector (a 16 x 16 transpose of 32-bit
// pairs), V as pairs of consecutive keys with 16 dims per vector (two rows interleaved); S by a
// bf16 pair of q broadcast against 16 keys (exact products, fp32 sums); P rounded to bf16 pairs
// (as PyTorch's CPU flash attention and FlashAttention do), P V by vdpbf16ps; tiles of up to 6
// rows (3 at head size 128).
// Longer than 600 lines on purpose: the bf16, fp32 and int8-cache variants of the prefill
// kernel share its tiling, packing and online softmax, written once over a Kernel policy.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <utility>
#include <vector>

std::vector<at::ScalarType> prefill_attention_dtypes() {
  std::vector<at::ScalarType> dtypes;
  if (tokenmill::kAvx2Built) dtypes.push_back(at::kFloat);
  if (tokenmill::kAvx512Bf16Built) dtypes.push_back(at::kBFloat16);
  return dtypes;
}

#ifdef TOKENMILL_AVX2
namespace {

constexpr int64_t kKeyBlock = 64;   // keys per packed block and per softmax update
constexpr int64_t kItemRows = 96;   // query rows per work item, about (whole tokens)
constexpr float kNoMax = -1e30f;    // running max before any key (finite: built with -ffast-math)

// What both kernels share: where rows are, the packing walk (own rows, or the cache through the
// block table, bf16/fp32 or int8) and the split of an item's rows into tiles. Kernel supplies
// kHeadDim, kTileRows, load (one vector of a row, or of int8 codes times a scale), pack_rows
// (a block's layout from those loads) and tile<R> (R rows over the packed blocks). Elem: the
// query, output and cache element (bf16 bits or float); Packed: the packed K/V element.
template <typename Kernel, typename Elem, typename Packed>
struct PrefillShape : tokenmill::PagedLayout {
  using ElemType = Elem;
  using PackedType = Packed;

  const Elem* q;
  const void* k_cache;  // Elem, float16 (k_half; Elem float), or int8 codes with k_scales / v_scales
  const void* v_cache;
  bool k_half = false;
  const float* k_scales;
  const float* v_scales;
  const Elem* own_k;  // the query tokens' own keys and values (or null), rows own_k_row / own_v_row apart
  const Elem* own_v;
  int64_t own_k_row, own_v_row;
  Elem* out;
  const int32_t* tables;
  float scale;

  // Keys [0, n) of one KV head of a chunk into kp and vp, whole blocks: from the chunk's own K/V
  // rows (own: the chunk has no earlier context; its rows start at token q_start) or from the
  // cache through its block table.
  void pack(int64_t chunk, int64_t kv_head, int64_t n, bool own, int64_t q_start, Packed* kp, Packed* vp,
            std::vector<int64_t>& offsets) const {
    constexpr int64_t D = Kernel::kHeadDim;
    if (own) {
      const Elem* k = own_k + q_start * own_k_row + kv_head * D;
      const Elem* v = own_v + q_start * own_v_row + kv_head * D;
      Kernel::pack_rows(n, kp, vp, [&](bool value, int64_t key, int64_t c) {
        return Kernel::load(value ? v + key * own_v_row : k + key * own_k_row, c);
      });
      return;
    }
    offsets.resize(n);
    tokenmill::cached_row_offsets(tables + chunk * max_blocks, 0, n, block_size, block_stride, token_stride,
                                  kv_head * D, offsets.data());
    if (k_scales) {  // offset / D: the token-head's scale
      const auto* k = static_cast<const int8_t*>(k_cache);
      const auto* v = static_cast<const int8_t*>(v_cache);
      Kernel::pack_rows(n, kp, vp, [&](bool value, int64_t key, int64_t c) {
        const int64_t off = offsets[key];
        return Kernel::load((value ? v : k) + off, (value ? v_scales : k_scales)[off / D], c);
      });
    } else if (k_half) {
      if constexpr (std::is_same_v<Elem, float>) {
        const auto* k = static_cast<const at::Half*>(k_cache);
        const auto* v = static_cast<const at::Half*>(v_cache);
        Kernel::pack_rows(n, kp, vp, [&](bool value, int64_t key, int64_t c) {
          return Kernel::load((value ? v : k) + offsets[key], c);
        });
      }
    } else {
      const auto* k = static_cast<const Elem*>(k_cache);
      const auto* v = static_cast<const Elem*>(v_cache);
      Kernel::pack_rows(n, kp, vp, [&](bool value, int64_t key, int64_t c) {
        return Kernel::load((value ? v : k) + offsets[key], c);
      });
    }
  }

  // The online-softmax step of one row over a block of keys (valid > 0 of them visible to it):
  // scores sr[0, valid) become weights exp(s - m_new) in sr[0, width) (0 past valid); the row's
  // running max m and sum l are updated and corr = exp(m_old - m_new) rescales its output.
  static void softmax_step(float* sr, int64_t valid, int64_t width, float& m, float& l, float& corr) {
    float mx = m;
    for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, sr[j]);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < width; ++j) {
      const float p = j < valid ? std::exp(sr[j] - mx) : 0.f;
      sr[j] = p;
      sum += p;
    }
    corr = std::exp(m - mx);
    l = l * corr + sum;
    m = mx;
  }

  // Query tokens [t0, t1) of a chunk (its rows start at q_start; ctx tokens of context precede
  // it) for the query heads of kv_head.
  void attend(int64_t q_start, int64_t ctx, int64_t kv_head, int64_t t0, int64_t t1, const Packed* kp,
              const Packed* vp) const {
    constexpr int kTileRows = Kernel::kTileRows;
    constexpr int64_t D = Kernel::kHeadDim;
    const Kernel& kernel = static_cast<const Kernel&>(*this);
    const int64_t rows = (t1 - t0) * group;
    const Elem* qrows[kTileRows];
    Elem* orows[kTileRows];
    int64_t limit[kTileRows];
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r0));
      for (int i = 0; i < n; ++i) {  // row r: token t0 + r / group, head kv_head * group + r % group
        const int64_t t = t0 + (r0 + i) / group, head = kv_head * group + (r0 + i) % group;
        qrows[i] = q + (q_start + t) * q_row + head * D;
        orows[i] = out + (q_start + t) * out_row + head * D;
        limit[i] = ctx + t + 1;
      }
      switch (n) {
        case 1: kernel.template tile<1>(qrows, limit, orows, kp, vp); break;
        case 2: kernel.template tile<2>(qrows, limit, orows, kp, vp); break;
        case 3: kernel.template tile<3>(qrows, limit, orows, kp, vp); break;
        case 4: if constexpr (kTileRows >= 4) kernel.template tile<4>(qrows, limit, orows, kp, vp); break;
        case 5: if constexpr (kTileRows >= 5) kernel.template tile<5>(qrows, limit, orows, kp, vp); break;
        default: kernel.template tile<kTileRows>(qrows, limit, orows, kp, vp);
      }
    }
  }
};

// The fp32 kernel (AVX2 + FMA). Packed blocks: K [D dims][64 keys], V [64 keys][D dims].
template <int64_t D>
struct F32Prefill : PrefillShape<F32Prefill<D>, float, float> {
  static constexpr int64_t kHeadDim = D;
  static constexpr int kTileRows = 6;                    // accumulators: 6 rows x 2 vectors
  static constexpr int64_t kBlockElems = kKeyBlock * D;  // floats per packed K (or V) block

  // Dims 8c .. 8c + 7 of a row (float16 widened exactly), or of int8 codes times their scale
  // (exact products in fp32).
  static __m256 load(const float* row, int64_t c) { return _mm256_loadu_ps(row + 8 * c); }
  static __m256 load(const at::Half* row, int64_t c) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + 8 * c)));
  }
  static __m256 load(const int8_t* codes, float scale, int64_t c) {
    const __m128i x = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + 8 * c));
    return _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(x)), _mm256_set1_ps(scale));
  }

  // The packed layouts from row(value, key, c): dims 8c .. 8c + 7 of key `key` (< n) of K or V.
  template <typename Row>
  static void pack_rows(int64_t n, float* kp, float* vp, const Row& row) {
    const int64_t blocks = (n + kKeyBlock - 1) / kKeyBlock;
    const auto load_row = [&](bool value, int64_t key, int64_t c) {
      return key < n ? row(value, key, c) : _mm256_setzero_ps();
    };
    __m256 a[8];
    for (int64_t b = 0; b < blocks; ++b) {
      float* kb = kp + b * kBlockElems;
      for (int64_t j = 0; j < kKeyBlock / 8; ++j) {  // 8 keys x 8 dims at a time, transposed
        for (int64_t c = 0; c < D / 8; ++c) {
          for (int64_t i = 0; i < 8; ++i) a[i] = load_row(false, b * kKeyBlock + 8 * j + i, c);
          tokenmill::transpose8(a);
          for (int64_t p = 0; p < 8; ++p) _mm256_storeu_ps(kb + (8 * c + p) * kKeyBlock + 8 * j, a[p]);
        }
      }
      float* vb = vp + b * kBlockElems;
      for (int64_t j = 0; j < kKeyBlock; ++j) {
        for (int64_t c = 0; c < D / 8; ++c) _mm256_storeu_ps(vb + j * D + 8 * c, load_row(true, b * kKeyBlock + j, c));
      }
    }
  }

  // Scores of R query rows x the first 16 * groups keys of packed block kb, times scale, into s [R][64].
  template <int R>
  static void scores(const float* const* qrows, const float* kb, int64_t groups, float scale, float* s) {
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < groups; ++g) {
      const float* kg = kb + 16 * g;
      __m256 acc[R][2];
      for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        const __m256 k0 = _mm256_loadu_ps(kg + d * kKeyBlock), k1 = _mm256_loadu_ps(kg + d * kKeyBlock + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 qv = _mm256_broadcast_ss(qrows[r] + d);
          acc[r][0] = _mm256_fmadd_ps(qv, k0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(qv, k1, acc[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(s + r * kKeyBlock + 16 * g, _mm256_mul_ps(acc[r][0], vscale));
        _mm256_storeu_ps(s + r * kKeyBlock + 16 * g + 8, _mm256_mul_ps(acc[r][1], vscale));
      }
    }
  }

  // o[r] = o[r] * corr[r] + P[r] V over the first `keys` keys of packed block vb; P [R][64].
  template <int R>
  static void values(const float* p, const float* vb, int64_t keys, const float* corr, float* o) {
    for (int64_t d0 = 0; d0 < D; d0 += 16) {
      __m256 acc[R][2];
      for (int r = 0; r < R; ++r) {
        const __m256 c = _mm256_set1_ps(corr[r]);
        acc[r][0] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d0), c);
        acc[r][1] = _mm256_mul_ps(_mm256_loadu_ps(o + r * D + d0 + 8), c);
      }
      for (int64_t j = 0; j < keys; ++j) {
        const __m256 v0 = _mm256_loadu_ps(vb + j * D + d0), v1 = _mm256_loadu_ps(vb + j * D + d0 + 8);
        for (int r = 0; r < R; ++r) {
          const __m256 pv = _mm256_broadcast_ss(p + r * kKeyBlock + j);
          acc[r][0] = _mm256_fmadd_ps(pv, v0, acc[r][0]);
          acc[r][1] = _mm256_fmadd_ps(pv, v1, acc[r][1]);
        }
      }
      for (int r = 0; r < R; ++r) {
        _mm256_storeu_ps(o + r * D + d0, acc[r][0]);
        _mm256_storeu_ps(o + r * D + d0 + 8, acc[r][1]);
      }
    }
  }

  // R query rows, the r-th attending keys [0, limit[r]) (limits ascending), through the packed
  // blocks; their outputs O / l at orows[r].
  template <int R>
  void tile(const float* const* qrows, const int64_t* limit, float* const* orows, const float* kp,
            const float* vp) const {
    alignas(32) float s[R * kKeyBlock], o[R * D], m[R], l[R], corr[R];
    std::fill(o, o + R * D, 0.f);
    std::fill(m, m + R, kNoMax);
    std::fill(l, l + R, 0.f);
    const int64_t kmax = limit[R - 1];
    for (int64_t k0 = 0; k0 < kmax; k0 += kKeyBlock) {
      const int64_t b = k0 / kKeyBlock, keys = std::min<int64_t>(kmax - k0, kKeyBlock);
      scores<R>(qrows, kp + b * kBlockElems, (keys + 15) / 16, this->scale, s);
      for (int r = 0; r < R; ++r) {
        float* sr = s + r * kKeyBlock;
        const int64_t valid = std::min<int64_t>(limit[r] - k0, kKeyBlock);
        if (valid <= 0) {  // none of this block's keys is visible to row r yet
          corr[r] = 1.f;
          std::fill(sr, sr + keys, 0.f);
          continue;
        }
        this->softmax_step(sr, valid, keys, m[r], l[r], corr[r]);
      }
      values<R>(s, vp + b * kBlockElems, keys, corr, o);
    }
    for (int r = 0; r < R; ++r) {
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < D; ++d) orows[r][d] = o[r * D + d] * inv;
    }
  }
};

#ifdef TOKENMILL_AVX512_BF16
// The bf16 kernel (AVX-512 BF16). Packed blocks of uint32 bf16 pairs: K [D / 2 dim pairs][64
// keys], V [32 key pairs][D dims].
template <int64_t D>
struct Bf16Prefill : PrefillShape<Bf16Prefill<D>, uint16_t, uint32_t> {
  static constexpr int64_t kHeadDim = D;
  static constexpr int64_t kPairs = D / 2;                  // bf16 pairs per K row
  static constexpr int64_t kOutVecs = D / 16;               // fp32 vectors per output row
  static constexpr int kTileRows = kOutVecs <= 4 ? 6 : 3;  // accumulators: kTileRows x max(4, kOutVecs)
  static constexpr int64_t kBlockElems = kKeyBlock * kPairs;  // uint32 per packed K (or V) block

  // bf16 dims 32c .. 32c + 31 of a row, or of int8 codes times their scale in fp32, rounded to
  // bf16 (round to nearest even, as PyTorch's .to()).
  static __m512i load(const uint16_t* row, int64_t c) { return _mm512_loadu_si512(row + 32 * c); }
  static __m512i load(const int8_t* codes, float scale, int64_t c) {
    const __m512 s = _mm512_set1_ps(scale);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(tokenmill::int8x16_to_fp32(codes + 32 * c + 16), s),
                                        _mm512_mul_ps(tokenmill::int8x16_to_fp32(codes + 32 * c), s));
  }

  // The packed layouts from row(value, key, c): bf16 dims 32c .. 32c + 31 of key `key` (< n) of K or V.
  template <typename Row>
  static void pack_rows(int64_t n, uint32_t* kp, uint32_t* vp, const Row& row) {
    const int64_t blocks = (n + kKeyBlock - 1) / kKeyBlock;
    const auto load = [&](bool value, int64_t key, int64_t c) {
      return key < n ? row(value, key, c) : _mm512_setzero_si512();
    };
    // lo: dims 0-15 of two rows interleaved (row a's dim i in element 2i, row b's in 2i + 1); hi: dims 16-31.
    alignas(64) uint16_t lo_idx[32], hi_idx[32];
    for (int i = 0; i < 16; ++i) {
      lo_idx[2 * i] = i, lo_idx[2 * i + 1] = 32 + i;
      hi_idx[2 * i] = 16 + i, hi_idx[2 * i + 1] = 48 + i;
    }
    const __m512i lo = _mm512_load_si512(lo_idx), hi = _mm512_load_si512(hi_idx);
    __m512i a[16], t[16];
    for (int64_t b = 0; b < blocks; ++b) {
      uint32_t* kb = kp + b * kBlockElems;  // [pair][64 keys]
      for (int64_t j = 0; j < kKeyBlock / 16; ++j) {
        for (int64_t c = 0; c < D / 32; ++c) {
          for (int64_t i = 0; i < 16; ++i) a[i] = load(false, b * kKeyBlock + 16 * j + i, c);
          tokenmill::transpose16(a, t);
          for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kb + (16 * c + p) * kKeyBlock + 16 * j, t[p]);
        }
      }
      uint32_t* vb = vp + b * kBlockElems;  // [key pair][D dims]
      for (int64_t jp = 0; jp < kKeyBlock / 2; ++jp) {
        const int64_t key = b * kKeyBlock + 2 * jp;
        for (int64_t c = 0; c < D / 32; ++c) {
          const __m512i x0 = load(true, key, c), x1 = load(true, key + 1, c);
          _mm512_storeu_si512(vb + jp * D + 32 * c, _mm512_permutex2var_epi16(x0, lo, x1));
          _mm512_storeu_si512(vb + jp * D + 32 * c + 16, _mm512_permutex2var_epi16(x0, hi, x1));
        }
      }
    }
  }

  // Scores of R query rows (bf16 pairs at qrows[r]) x the first 16 * NG keys of packed block kb,
  // times scale, into s [R][64].
  template <int R, int NG>
  static void scores(const uint32_t* const* qrows, const uint32_t* kb, float scale, float* s) {
    __m512 acc[R][NG];
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_setzero_ps();
    }
    for (int64_t p = 0; p < kPairs; ++p) {
      __m512bh k[NG];
      for (int j = 0; j < NG; ++j) k[j] = (__m512bh)_mm512_loadu_si512(kb + p * kKeyBlock + 16 * j);
      for (int r = 0; r < R; ++r) {
        const __m512bh qv = (__m512bh)_mm512_set1_epi32(static_cast<int>(qrows[r][p]));
        for (int j = 0; j < NG; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], qv, k[j]);
      }
    }
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int r = 0; r < R; ++r) {
      for (int j = 0; j < NG; ++j) _mm512_storeu_ps(s + r * kKeyBlock + 16 * j, _mm512_mul_ps(acc[r][j], vscale));
    }
  }

  // o[r] = o[r] * corr[r] + P[r] V over the first `pairs` key pairs of packed block vb; P as bf16
  // pairs pb [R][32].
  template <int R>
  static void values(const uint32_t* pb, const uint32_t* vb, int64_t pairs, const float* corr, float* o) {
    __m512 acc[R][kOutVecs];
    for (int r = 0; r < R; ++r) {
      const __m512 c = _mm512_set1_ps(corr[r]);
      for (int64_t v = 0; v < kOutVecs; ++v) acc[r][v] = _mm512_mul_ps(_mm512_loadu_ps(o + r * D + 16 * v), c);
    }
    for (int64_t jp = 0; jp < pairs; ++jp) {
      __m512bh vv[kOutVecs];
      for (int64_t v = 0; v < kOutVecs; ++v) vv[v] = (__m512bh)_mm512_loadu_si512(vb + jp * D + 16 * v);
      for (int r = 0; r < R; ++r) {
        const __m512bh pv = (__m512bh)_mm512_set1_epi32(static_cast<int>(pb[r * (kKeyBlock / 2) + jp]));
        for (int64_t v = 0; v < kOutVecs; ++v) acc[r][v] = _mm512_dpbf16_ps(acc[r][v], pv, vv[v]);
      }
    }
    for (int r = 0; r < R; ++r) {
      for (int64_t v = 0; v < kOutVecs; ++v) _mm512_storeu_ps(o + r * D + 16 * v, acc[r][v]);
    }
  }

  template <int R>
  static void scores_upto(const uint32_t* const* qrows, const uint32_t* kb, float scale, float* s, int64_t keys) {
    switch ((std::min<int64_t>(keys, kKeyBlock) + 15) / 16) {
      case 1: scores<R, 1>(qrows, kb, scale, s); break;
      case 2: scores<R, 2>(qrows, kb, scale, s); break;
      case 3: scores<R, 3>(qrows, kb, scale, s); break;
      default: scores<R, 4>(qrows, kb, scale, s);
    }
  }

  // R query rows, the r-th attending keys [0, limit[r]) (limits ascending), through the packed
  // blocks; their outputs O / l in bf16 at orows[r].
  template <int R>
  void tile(const uint16_t* const* rows, const int64_t* limit, uint16_t* const* orows, const uint32_t* kp,
            const uint32_t* vp) const {
    alignas(64) float s[R * kKeyBlock], o[R * D], m[R], l[R], corr[R];
    alignas(64) uint32_t pb[R * kKeyBlock / 2];
    const uint32_t* qrows[R];  // each row as bf16 pairs
    for (int r = 0; r < R; ++r) qrows[r] = reinterpret_cast<const uint32_t*>(rows[r]);
    std::fill(s, s + R * kKeyBlock, 0.f);  // (the columns a short last block leaves unwritten stay finite)
    std::fill(o, o + R * D, 0.f);
    std::fill(m, m + R, kNoMax);
    std::fill(l, l + R, 0.f);
    const int64_t kmax = limit[R - 1];
    for (int64_t k0 = 0; k0 < kmax; k0 += kKeyBlock) {
      const int64_t b = k0 / kKeyBlock;
      scores_upto<R>(qrows, kp + b * kBlockElems, this->scale, s, kmax - k0);
      for (int r = 0; r < R; ++r) {
        float* sr = s + r * kKeyBlock;
        const int64_t valid = std::min<int64_t>(limit[r] - k0, kKeyBlock);
        if (valid <= 0) {  // none of this block's keys is visible to row r yet
          corr[r] = 1.f;
          std::fill(pb + r * kKeyBlock / 2, pb + (r + 1) * kKeyBlock / 2, 0u);
          continue;
        }
        this->softmax_step(sr, valid, kKeyBlock, m[r], l[r], corr[r]);
        for (int64_t j = 0; j < kKeyBlock; j += 32) {  // pair i of keys (j + 2i, j + 2i + 1)
          const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + j + 16), _mm512_loadu_ps(sr + j));
          _mm512_storeu_si512(pb + r * kKeyBlock / 2 + j / 2, (__m512i)pair);
        }
      }
      const int64_t pairs = (std::min<int64_t>(kmax - k0, kKeyBlock) + 1) / 2;
      values<R>(pb, vp + b * kBlockElems, pairs, corr, o);
    }
    for (int r = 0; r < R; ++r) {
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < D; ++d) orows[r][d] = c10::BFloat16(o[r * D + d] * inv).x;
    }
  }
};
#endif

// Every chunk of the step through Kernel: pack, then attend (see the top of the file).
template <typename Kernel>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_lens,
                  double scale, const float* k_scales, const float* v_scales, const at::Tensor* key,
                  const at::Tensor* value) {
  using Elem = typename Kernel::ElemType;
  using Packed = typename Kernel::PackedType;
  Kernel attn;
  attn.set(query, out, key_cache, block_tables);
  attn.q = static_cast<const Elem*>(query.data_ptr());
  attn.k_cache = key_cache.data_ptr();
  attn.v_cache = value_cache.data_ptr();
  attn.k_half = key_cache.scalar_type() == at::kHalf;
  attn.k_scales = k_scales;
  attn.v_scales = v_scales;
  attn.own_k = key ? static_cast<const Elem*>(key->data_ptr()) : nullptr;
  attn.own_v = value ? static_cast<const Elem*>(value->data_ptr()) : nullptr;
  attn.own_k_row = key ? key->stride(0) : 0;
  attn.own_v_row = value ? value->stride(0) : 0;
  attn.out = static_cast<Elem*>(out.data_ptr());
  attn.tables = block_tables.data_ptr<int32_t>();
  attn.scale = static_cast<float>(scale);
  const int64_t chunks = seq_lens.size(0), kv_heads = attn.num_kv_heads;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();

  // Packed K and V of each (chunk, KV head): whole blocks of 64 keys, head_elems[c] elements per
  // head of chunk c, its heads from elems[c] on.
  std::vector<int64_t> elems(chunks + 1, 0), head_elems(chunks), q_start(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    head_elems[c] = (lens[c] + kKeyBlock - 1) / kKeyBlock * Kernel::kBlockElems;
    elems[c + 1] = elems[c] + kv_heads * head_elems[c];
    q_start[c + 1] = q_start[c] + qlens[c];
  }
  std::unique_ptr<Packed[]> kp(new Packed[elems[chunks]]), vp(new Packed[elems[chunks]]);
  const auto packed = [&](int64_t c, int64_t h) { return elems[c] + h * head_elems[c]; };
  at::parallel_for(0, chunks * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<int64_t> offsets;
    for (int64_t i = begin; i < end; ++i) {
      const int64_t c = i / kv_heads, h = i % kv_heads;
      attn.pack(c, h, lens[c], key && lens[c] == qlens[c], q_start[c], kp.get() + packed(c, h), vp.get() + packed(c, h),
                offsets);
    }
  });

  struct Item {
    int64_t chunk, kv_head, t0, t1, cost;
  };
  std::vector<Item> items;
  const int64_t tokens = std::max<int64_t>(1, kItemRows / attn.group);
  for (int64_t c = 0; c < chunks; ++c) {
    const int64_t ctx = lens[c] - qlens[c];
    for (int64_t t0 = 0; t0 < qlens[c]; t0 += tokens) {
      const int64_t t1 = std::min<int64_t>(qlens[c], t0 + tokens);
      for (int64_t h = 0; h < kv_heads; ++h) items.push_back({c, h, t0, t1, (t1 - t0) * (ctx + t1)});
    }
  }
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  std::atomic<int64_t> next{0};
  const int64_t num_items = static_cast<int64_t>(items.size());
  at::parallel_for(0, std::min<int64_t>(at::get_num_threads(), num_items), 1, [&](int64_t, int64_t) {
    for (int64_t i; (i = next.fetch_add(1, std::memory_order_relaxed)) < num_items;) {
      const Item& it = items[i];
      const int64_t off = packed(it.chunk, it.kv_head);
      attn.attend(q_start[it.chunk], lens[it.chunk] - qlens[it.chunk], it.kv_head, it.t0, it.t1, kp.get() + off,
                  vp.get() + off);
    }
  });
}

// prefill_impl for Kernel<head_dim> (64 or 128).
template <template <int64_t> class Kernel, typename... Args>
void prefill_head_dim(int64_t head_dim, Args&&... args) {
  if (head_dim == 64) {
    prefill_impl<Kernel<64>>(std::forward<Args>(args)...);
  } else {
    prefill_impl<Kernel<128>>(std::forward<Args>(args)...);
  }
}

}  // namespace
#endif

// out, query [num_tokens, num_heads, head_dim] fp32 or bf16 (prefill_attention_dtypes(); rows
// may be strided): the chunks' query tokens one chunk after another; key_cache, value_cache
// [num_blocks, block_size, num_kv_heads, head_dim] contiguous, already holding every chunk's keys
// and values: query's dtype, or int8 codes with key_scales, value_scales [num_blocks,
// block_size, num_kv_heads] float32 (kv_cache_dtype int8); block_tables [num_chunks,
// max_blocks] int32; seq_lens [num_chunks] int32 (context length, the chunk included);
// query_lens [num_chunks] int32 (sum = num_tokens). Chunk c's query i sits at position seq_len -
// query_len + i and attends keys 0 .. that position. key, value (optional, both or neither): the
// query tokens' own keys and values [num_tokens, num_kv_heads, head_dim] in query's dtype (rows
// may be strided); a chunk with no earlier context then attends to them instead of the cache
// (with an int8 cache: at full precision, as the torch backend's SDPA path does).
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_lens, double scale, const c10::optional<at::Tensor>& key_scales,
                             const c10::optional<at::Tensor>& value_scales, const c10::optional<at::Tensor>& key,
                             const c10::optional<at::Tensor>& value) {
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &key_cache, &value_cache,
                                                                      &block_tables, &seq_lens, &query_lens}) {
    tokenmill::check_cpu(*t, "every tensor");
  }
  const at::ScalarType dtype = query.scalar_type();
  const std::vector<at::ScalarType> dtypes = prefill_attention_dtypes();
  TORCH_CHECK(std::find(dtypes.begin(), dtypes.end(), dtype) != dtypes.end(),
              "paged_prefill_attention takes fp32 queries (AVX2 and up) or bf16 (AVX-512 BF16), as "
              "prefill_attention_dtypes() lists for this build (", TOKENMILL_ISA, "), not ", dtype);
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out: [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "query and out rows must be [num_heads, head_dim] contiguous");
  TORCH_CHECK(out.scalar_type() == dtype, "out must have query's dtype");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim], same shape");
  const bool quantized = tokenmill::check_cache_dtype(dtype, key_cache, value_cache, key_scales, value_scales);
  const int64_t head_dim = query.size(2), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && query.size(1) % kv_heads == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(key.has_value() == value.has_value(), "key and value: both or neither");
  if (key) {
    for (const at::Tensor* t : {&*key, &*value}) {
      tokenmill::check_cpu(*t, "every tensor");
      TORCH_CHECK(t->scalar_type() == dtype && t->dim() == 3 && t->size(0) == query.size(0) &&
                      t->size(1) == kv_heads && t->size(2) == head_dim && t->stride(2) == 1 && t->stride(1) == head_dim,
                  "key and value: [num_tokens, num_kv_heads, head_dim] in query's dtype with contiguous rows");
    }
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
                  query_lens.scalar_type() == at::kInt && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  seq_lens.is_contiguous() && query_lens.is_contiguous() && seq_lens.size(0) == block_tables.size(0) &&
                  query_lens.size(0) == block_tables.size(0),
              "block_tables [num_chunks, max_blocks], seq_lens and query_lens [num_chunks]: contiguous int32");
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();
  const int32_t* tables = block_tables.data_ptr<int32_t>();
  int64_t total = 0;
  for (int64_t c = 0; c < seq_lens.size(0); ++c) {
    TORCH_CHECK(qlens[c] >= 1 && qlens[c] <= lens[c] && lens[c] <= block_tables.size(1) * key_cache.size(1),
                "every chunk needs 1 <= query_len <= seq_len <= its block table's capacity");
    for (int64_t b = 0; b < (lens[c] + key_cache.size(1) - 1) / key_cache.size(1); ++b) {
      const int32_t id = tables[c * block_tables.size(1) + b];
      TORCH_CHECK(id >= 0 && id < key_cache.size(0), "block id out of the cache's range");
    }
    total += qlens[c];
  }
  TORCH_CHECK(total == query.size(0), "query_lens must sum to the number of query tokens");
#ifdef TOKENMILL_AVX2
  const float* k_scales = quantized ? key_scales->data_ptr<float>() : nullptr;
  const float* v_scales = quantized ? value_scales->data_ptr<float>() : nullptr;
  const at::Tensor* own_k = key ? &*key : nullptr;
  const at::Tensor* own_v = value ? &*value : nullptr;
  if (dtype == at::kFloat) {
    prefill_head_dim<F32Prefill>(head_dim, out, query, key_cache, value_cache, block_tables, seq_lens, query_lens, scale,
                                 k_scales, v_scales, own_k, own_v);
  }
#ifdef TOKENMILL_AVX512_BF16
  if (dtype == at::kBFloat16) {
    prefill_head_dim<Bf16Prefill>(head_dim, out, query, key_cache, value_cache, block_tables, seq_lens, query_lens, scale,
                                  k_scales, v_scales, own_k, own_v);
  }
#endif
#endif
}
