// paged_prefill_attention: causal attention of prefill chunks over their context in the paged KV
// cache (earlier context and the chunk itself, which the caller stored first), flash-attention
// style: nothing of size queries x keys exists, only one register tile of scores at a time with
// a running softmax max and sum per query row. bf16 queries and cache, head size 64 or 128,
// AVX-512 BF16 only (prefill_attention_supported(); elsewhere the backend keeps PyTorch's SDPA).
//
// Two phases, each over all threads:
// 1. Pack: each (chunk, KV head)'s keys and values, read through the block table, into the
//    layouts vdpbf16ps wants, per block of 64 keys: K as pairs of dims with 16 keys per vector
//    (a 16 x 16 transpose of 32-bit pairs), V as pairs of consecutive keys with 16 dims per
//    vector (two rows interleaved). Keys past the context are zeros.
// 2. Attend: work items of ~96 query rows (consecutive tokens of a chunk x the query heads of one
//    KV head, which share every key they read), taken most expensive first by whichever thread
//    is free. Each item runs register tiles of up to 6 rows over the key blocks up to its causal
//    limit: S = q . k (a bf16 pair of q broadcast against 16 keys, exact products, fp32 sums),
//    scaled; the online softmax update in fp32 (masked keys get weight 0); P rounded to bf16
//    pairs (as PyTorch's CPU flash attention and FlashAttention do), then O += P V by vdpbf16ps
//    into fp32 accumulators that were first rescaled by exp(m_old - m_new). Output O / l in bf16.
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <initializer_list>
#include <memory>
#include <vector>

bool prefill_attention_supported() { return tokenmill::kAvx512Bf16Built; }

#ifdef TOKENMILL_AVX512_BF16
namespace {

constexpr int64_t kKeyBlock = 64;   // keys per packed block and per softmax update
constexpr int64_t kItemRows = 96;   // query rows per work item, about (whole tokens)
constexpr float kNoMax = -1e30f;    // running max before any key (finite: built with -ffast-math)

template <int64_t D>
struct PrefillAttention : tokenmill::PagedLayout {
  static constexpr int64_t kPairs = D / 2;                  // bf16 pairs per K row
  static constexpr int64_t kOutVecs = D / 16;               // fp32 vectors per output row
  static constexpr int kTileRows = kOutVecs <= 4 ? 6 : 3;  // accumulators: kTileRows x max(4, kOutVecs)
  static constexpr int64_t kBlockWords = kKeyBlock * kPairs;  // uint32 per packed K (or V) block

  const uint16_t* q;
  const void* k_cache;  // bf16, or int8 codes with k_scales / v_scales
  const void* v_cache;
  const float* k_scales;
  const float* v_scales;
  const uint16_t* own_k;  // the query tokens' own keys and values (or null), rows own_k_row / own_v_row apart
  const uint16_t* own_v;
  int64_t own_k_row, own_v_row;
  uint16_t* out;
  const int32_t* tables;
  float scale;

  // Keys [0, n) of one KV head of a chunk into kp and vp, whole blocks: from the chunk's own K/V
  // rows (own: the chunk has no earlier context; its rows start at token q_start) or from the
  // cache through its block table (an int8 cache dequantized to bf16 as dequantize_kv does:
  // the code times its scale in fp32, rounded once).
  void pack(int64_t chunk, int64_t kv_head, int64_t n, bool own, int64_t q_start, uint32_t* kp, uint32_t* vp,
            std::vector<int64_t>& offsets) const {
    if (own) {
      const uint16_t* k = own_k + q_start * own_k_row + kv_head * D;
      const uint16_t* v = own_v + q_start * own_v_row + kv_head * D;
      pack_rows(n, kp, vp, [&](bool value, int64_t key, int64_t c) {
        return _mm512_loadu_si512(value ? v + key * own_v_row + 32 * c : k + key * own_k_row + 32 * c);
      });
      return;
    }
    offsets.resize(n);
    tokenmill::cached_row_offsets(tables + chunk * max_blocks, 0, n, block_size, block_stride, token_stride,
                                  kv_head * D, offsets.data());
    if (k_scales) {  // offset / D: the token-head's scale
      const auto* k = static_cast<const int8_t*>(k_cache);
      const auto* v = static_cast<const int8_t*>(v_cache);
      pack_rows(n, kp, vp, [&](bool value, int64_t key, int64_t c) {
        const int64_t off = offsets[key];
        return widen_int8((value ? v : k) + off + 32 * c, (value ? v_scales : k_scales)[off / D]);
      });
    } else {
      const auto* k = static_cast<const uint16_t*>(k_cache);
      const auto* v = static_cast<const uint16_t*>(v_cache);
      pack_rows(n, kp, vp, [&](bool value, int64_t key, int64_t c) {
        return _mm512_loadu_si512((value ? v : k) + offsets[key] + 32 * c);
      });
    }
  }

  // 32 int8 codes times scale, rounded to bf16 (round to nearest even, as PyTorch's .to()).
  static __m512i widen_int8(const int8_t* codes, float scale) {
    const __m512 s = _mm512_set1_ps(scale);
    return (__m512i)_mm512_cvtne2ps_pbh(_mm512_mul_ps(tokenmill::int8x16_to_fp32(codes + 16), s),
                                        _mm512_mul_ps(tokenmill::int8x16_to_fp32(codes), s));
  }

  // pack's layouts from row(value, key, c): bf16 dims 32c .. 32c + 31 of key `key` (< n) of K or V.
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
      uint32_t* kb = kp + b * kBlockWords;  // [pair][64 keys]
      for (int64_t j = 0; j < kKeyBlock / 16; ++j) {
        for (int64_t c = 0; c < D / 32; ++c) {
          for (int64_t i = 0; i < 16; ++i) a[i] = load(false, b * kKeyBlock + 16 * j + i, c);
          tokenmill::transpose16(a, t);
          for (int64_t p = 0; p < 16; ++p) _mm512_storeu_si512(kb + (16 * c + p) * kKeyBlock + 16 * j, t[p]);
        }
      }
      uint32_t* vb = vp + b * kBlockWords;  // [key pair][D dims]
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
  void tile(const uint32_t* const* qrows, const int64_t* limit, uint16_t* const* orows, const uint32_t* kp,
            const uint32_t* vp) const {
    alignas(64) float s[R * kKeyBlock], o[R * D], m[R], l[R], corr[R];
    alignas(64) uint32_t pb[R * kKeyBlock / 2];
    std::fill(s, s + R * kKeyBlock, 0.f);  // (the columns a short last block leaves unwritten stay finite)
    std::fill(o, o + R * D, 0.f);
    std::fill(m, m + R, kNoMax);
    std::fill(l, l + R, 0.f);
    const int64_t kmax = limit[R - 1];
    for (int64_t k0 = 0; k0 < kmax; k0 += kKeyBlock) {
      const int64_t b = k0 / kKeyBlock;
      scores_upto<R>(qrows, kp + b * kBlockWords, scale, s, kmax - k0);
      for (int r = 0; r < R; ++r) {
        float* sr = s + r * kKeyBlock;
        const int64_t valid = std::min<int64_t>(limit[r] - k0, kKeyBlock);
        if (valid <= 0) {  // none of this block's keys is visible to row r yet
          corr[r] = 1.f;
          std::fill(pb + r * kKeyBlock / 2, pb + (r + 1) * kKeyBlock / 2, 0u);
          continue;
        }
        float mx = m[r];
        for (int64_t j = 0; j < valid; ++j) mx = std::max(mx, sr[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < kKeyBlock; ++j) {
          const float p = j < valid ? std::exp(sr[j] - mx) : 0.f;
          sr[j] = p;
          sum += p;
        }
        corr[r] = std::exp(m[r] - mx);
        l[r] = l[r] * corr[r] + sum;
        m[r] = mx;
        for (int64_t j = 0; j < kKeyBlock; j += 32) {  // pair i of keys (j + 2i, j + 2i + 1)
          const __m512bh pair = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(sr + j + 16), _mm512_loadu_ps(sr + j));
          _mm512_storeu_si512(pb + r * kKeyBlock / 2 + j / 2, (__m512i)pair);
        }
      }
      const int64_t pairs = (std::min<int64_t>(kmax - k0, kKeyBlock) + 1) / 2;
      values<R>(pb, vp + b * kBlockWords, pairs, corr, o);
    }
    for (int r = 0; r < R; ++r) {
      const float inv = 1.f / l[r];
      for (int64_t d = 0; d < D; ++d) orows[r][d] = c10::BFloat16(o[r * D + d] * inv).x;
    }
  }

  // Query tokens [t0, t1) of a chunk (its rows start at q_start; ctx tokens of context precede
  // it) for the query heads of kv_head.
  void attend(int64_t q_start, int64_t ctx, int64_t kv_head, int64_t t0, int64_t t1, const uint32_t* kp,
              const uint32_t* vp) const {
    const int64_t rows = (t1 - t0) * group;
    const uint32_t* qrows[kTileRows];
    uint16_t* orows[kTileRows];
    int64_t limit[kTileRows];
    for (int64_t r0 = 0; r0 < rows; r0 += kTileRows) {
      const int n = static_cast<int>(std::min<int64_t>(kTileRows, rows - r0));
      for (int i = 0; i < n; ++i) {  // row r: token t0 + r / group, head kv_head * group + r % group
        const int64_t t = t0 + (r0 + i) / group, head = kv_head * group + (r0 + i) % group;
        qrows[i] = reinterpret_cast<const uint32_t*>(q + (q_start + t) * q_row + head * D);
        orows[i] = out + (q_start + t) * out_row + head * D;
        limit[i] = ctx + t + 1;
      }
      switch (n) {
        case 1: tile<1>(qrows, limit, orows, kp, vp); break;
        case 2: tile<2>(qrows, limit, orows, kp, vp); break;
        case 3: tile<3>(qrows, limit, orows, kp, vp); break;
        case 4: if constexpr (kTileRows >= 4) tile<4>(qrows, limit, orows, kp, vp); break;
        case 5: if constexpr (kTileRows >= 5) tile<5>(qrows, limit, orows, kp, vp); break;
        default: tile<kTileRows>(qrows, limit, orows, kp, vp);
      }
    }
  }
};

template <int64_t D>
void prefill_impl(at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache, const at::Tensor& value_cache,
                  const at::Tensor& block_tables, const at::Tensor& seq_lens, const at::Tensor& query_lens,
                  double scale, const float* k_scales, const float* v_scales, const at::Tensor* key,
                  const at::Tensor* value) {
  using Attn = PrefillAttention<D>;
  Attn attn;
  attn.set(query, out, key_cache, block_tables);
  attn.q = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  attn.k_cache = key_cache.data_ptr();
  attn.v_cache = value_cache.data_ptr();
  attn.k_scales = k_scales;
  attn.v_scales = v_scales;
  attn.own_k = key ? reinterpret_cast<const uint16_t*>(key->data_ptr<at::BFloat16>()) : nullptr;
  attn.own_v = value ? reinterpret_cast<const uint16_t*>(value->data_ptr<at::BFloat16>()) : nullptr;
  attn.own_k_row = key ? key->stride(0) : 0;
  attn.own_v_row = value ? value->stride(0) : 0;
  attn.out = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  attn.tables = block_tables.data_ptr<int32_t>();
  attn.scale = static_cast<float>(scale);
  const int64_t chunks = seq_lens.size(0), kv_heads = attn.num_kv_heads;
  const int32_t* lens = seq_lens.data_ptr<int32_t>();
  const int32_t* qlens = query_lens.data_ptr<int32_t>();

  // Packed K and V of each (chunk, KV head): whole blocks of 64 keys, head_words[c] words per
  // head of chunk c, its heads from words[c] on.
  std::vector<int64_t> words(chunks + 1, 0), head_words(chunks), q_start(chunks + 1, 0);
  for (int64_t c = 0; c < chunks; ++c) {
    head_words[c] = (lens[c] + kKeyBlock - 1) / kKeyBlock * Attn::kBlockWords;
    words[c + 1] = words[c] + kv_heads * head_words[c];
    q_start[c + 1] = q_start[c] + qlens[c];
  }
  std::unique_ptr<uint32_t[]> kp(new uint32_t[words[chunks]]), vp(new uint32_t[words[chunks]]);
  const auto packed = [&](int64_t c, int64_t h) { return words[c] + h * head_words[c]; };
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

}  // namespace
#endif

// out, query [num_tokens, num_heads, head_dim] bf16 (rows may be strided): the chunks' query
// tokens one chunk after another; key_cache, value_cache [num_blocks, block_size, num_kv_heads,
// head_dim] contiguous, already holding every chunk's keys and values: bf16, or int8 codes with
// key_scales, value_scales [num_blocks, block_size, num_kv_heads] float32 (kv_cache_dtype int8);
// block_tables [num_chunks, max_blocks] int32; seq_lens [num_chunks] int32 (context length, the
// chunk included); query_lens [num_chunks] int32 (sum = num_tokens). Chunk c's query i sits at
// position seq_len - query_len + i and attends keys 0 .. that position. key, value (optional,
// both or neither): the query tokens' own keys and values [num_tokens, num_kv_heads, head_dim]
// bf16 (rows may be strided); a chunk with no earlier context then attends to them instead of
// the cache (with an int8 cache: at full precision, as the torch backend's SDPA path does).
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_lens, double scale, const c10::optional<at::Tensor>& key_scales,
                             const c10::optional<at::Tensor>& value_scales, const c10::optional<at::Tensor>& key,
                             const c10::optional<at::Tensor>& value) {
  TORCH_CHECK(prefill_attention_supported(), "paged_prefill_attention needs AVX-512 BF16 (prefill_attention_supported())");
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{&out, &query, &key_cache, &value_cache,
                                                                      &block_tables, &seq_lens, &query_lens}) {
    tokenmill::check_cpu(*t, "every tensor");
  }
  TORCH_CHECK(query.dim() == 3 && out.sizes() == query.sizes(), "query and out: [num_tokens, num_heads, head_dim]");
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == query.size(2) && out.stride(2) == 1 &&
                  out.stride(1) == out.size(2),
              "query and out rows must be [num_heads, head_dim] contiguous");
  TORCH_CHECK(query.scalar_type() == at::kBFloat16 && out.scalar_type() == at::kBFloat16, "query and out must be bf16");
  TORCH_CHECK(key_cache.dim() == 4 && key_cache.is_contiguous() && value_cache.is_contiguous() &&
                  key_cache.sizes() == value_cache.sizes(),
              "key_cache and value_cache: contiguous [num_blocks, block_size, num_kv_heads, head_dim], same shape");
  const bool quantized = tokenmill::check_cache_dtype(at::kBFloat16, key_cache, value_cache, key_scales, value_scales);
  const int64_t head_dim = query.size(2), kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && query.size(1) % kv_heads == 0,
              "head_dim must match and num_heads be a multiple of num_kv_heads");
  TORCH_CHECK(head_dim == 64 || head_dim == 128, "head_dim must be 64 or 128");
  TORCH_CHECK(key.has_value() == value.has_value(), "key and value: both or neither");
  if (key) {
    for (const at::Tensor* t : {&*key, &*value}) {
      tokenmill::check_cpu(*t, "every tensor");
      TORCH_CHECK(t->scalar_type() == at::kBFloat16 && t->dim() == 3 && t->size(0) == query.size(0) &&
                      t->size(1) == kv_heads && t->size(2) == head_dim && t->stride(2) == 1 && t->stride(1) == head_dim,
                  "key and value: bf16 [num_tokens, num_kv_heads, head_dim] with contiguous rows");
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
#ifdef TOKENMILL_AVX512_BF16
  const float* k_scales = quantized ? key_scales->data_ptr<float>() : nullptr;
  const float* v_scales = quantized ? value_scales->data_ptr<float>() : nullptr;
  const at::Tensor* own_k = key ? &*key : nullptr;
  const at::Tensor* own_v = value ? &*value : nullptr;
  if (head_dim == 64) {
    prefill_impl<64>(out, query, key_cache, value_cache, block_tables, seq_lens, query_lens, scale, k_scales, v_scales,
                     own_k, own_v);
  } else {
    prefill_impl<128>(out, query, key_cache, value_cache, block_tables, seq_lens, query_lens, scale, k_scales, v_scales,
                      own_k, own_v);
  }
#endif
}
