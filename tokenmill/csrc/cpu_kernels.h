// The entry points of cpu_kernels.cpp that cpu_decoder.cpp calls (argument contracts there).
#pragma once

#include <ATen/core/Tensor.h>

#include <tuple>
#include <vector>

void paged_decode_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                            const at::Tensor& value_cache, const at::Tensor& block_tables,
                            const at::Tensor& seq_lens, double scale, const c10::optional<at::Tensor>& key_scales,
                            const c10::optional<at::Tensor>& value_scales);

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps);

std::tuple<at::Tensor, at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& weight,
                                                double eps);

at::Tensor rope_write_kv(const at::Tensor& qkv, const at::Tensor& cos, const at::Tensor& sin,
                         const at::Tensor& slot_mapping, at::Tensor key_cache, at::Tensor value_cache,
                         int64_t num_heads, int64_t num_kv_heads, const c10::optional<at::Tensor>& key_scales,
                         const c10::optional<at::Tensor>& value_scales);

// cpu_gemv.cpp: int4 or int8 weights at few rows and many (gemv_supported(): AVX2 and up; x fp32
// or bf16, y in x's dtype), bf16 weights x bf16 at 1-4 rows (native_bf16(): AVX-512 BF16).
bool gemv_supported();
bool native_bf16();
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t group_size);
at::Tensor bf16_linear(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias);
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor int8_tiled_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales);
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales);
// cpu_gemv.cpp: int8 weights at any number of rows (Int8Linear above its max_rows).
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias);
// cpu_gemv.cpp: int6 tiles at many rows as bf16 products (AVX-512 BF16; Int6Linear above its max_rows).
at::Tensor int6_gemm(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias);

// cpu_prefill.cpp: causal prefill attention over the paged cache (fp32 queries over an fp32 or
// int8 cache from AVX2 up; bf16 over a bf16 or int8 cache at AVX-512 BF16): the query dtypes
// this build takes.
std::vector<at::ScalarType> prefill_attention_dtypes();
void paged_prefill_attention(at::Tensor out, const at::Tensor& query, const at::Tensor& key_cache,
                             const at::Tensor& value_cache, const at::Tensor& block_tables, const at::Tensor& seq_lens,
                             const at::Tensor& query_lens, double scale, const c10::optional<at::Tensor>& key_scales,
                             const c10::optional<at::Tensor>& value_scales, const c10::optional<at::Tensor>& key,
                             const c10::optional<at::Tensor>& value);

// cpu_gemv_avx2.cpp: the quantized matmuls of the AVX2 level, for cpu_gemv.cpp's entry points
// (arguments checked there; x fp32 [M, K]; y fp32 [M, N]; at avx512_bf16 int4_wide_linear and
// int6_linear also take bf16 x, and return y in x's dtype).
namespace tokenmill::avx2 {
// Bytes per tile of 8 output channels and super-block of 256 input channels in the GGUF factor
// tables (layers/quantization/cpu_layouts.py tiled_int4_super_blocks, tiled_int6_super_blocks): Q4_K's 8 fp16 d
// and 8 fp16 m, then 128 six-bit factors in 96 bytes; Q6_K's 8 fp16 d, then 16 groups' 8 int8
// factors.
constexpr int64_t kQ4kSuperBlockBytes = 32 + 64 + 32;
constexpr int64_t kQ6kSuperBlockBytes = 16 + 16 * 8;
// At AVX-512 BF16 a Q4_K tensor's factors per tile of 16 output channels and super-block
// (layers/quantization/cpu_layouts.py tiled_int4_factors): the 16 channels' fp16 d and m, then per block of 32
// their 16 scale factors and 16 min factors, a byte each (4.625 bits a weight with the codes).
constexpr int64_t kInt4FactorBytes = 64 + 8 * 32;
at::Tensor int8_linear(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales);
at::Tensor int4_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t group_size);
at::Tensor int8_gemm(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& scales,
                     const c10::optional<at::Tensor>& bias);
at::Tensor int8_tiled_linear(const at::Tensor& x, const at::Tensor& tiles, const at::Tensor& scales);
at::Tensor int6_linear(const at::Tensor& x, const at::Tensor& low, const at::Tensor& high, const at::Tensor& scales);
// AVX-512 BF16 only: int4 over tiles of 16 output channels (x in int8, vpdpbusd on 512 bits).
at::Tensor int4_wide_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& pairs, int64_t group_size);
}  // namespace tokenmill::avx2

// cpu_sampler.cpp: one sampled token per row of fp32 logits (Gumbel-max over a counter-based hash
// of each row's key; min_p 0 = off).
at::Tensor sample_rows(const at::Tensor& logits, const at::Tensor& inv_temperature, const at::Tensor& min_p,
                       const at::Tensor& keys);
