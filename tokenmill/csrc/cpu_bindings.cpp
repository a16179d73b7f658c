// The Python module of the CPU kernels (layers/cpu_kernels.py loads it): the entry points of
// cpu_kernels.h and the DecoderStack class (cpu_decoder.cpp). The one file with the module
// definition; the kernel files include ATen's tensor headers only, not torch/extension.h (about
// 25 s of a build's compile time each on 2 cores).
#include "cpu_common.h"
#include "cpu_kernels.h"

#include <torch/csrc/utils/pybind.h>

#include <string>

// Adds the DecoderStack class (cpu_decoder.cpp) to the extension module.
void bind_decoder_stack(pybind11::module& m);

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
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal prefill attention over the paged cache (CPU; fp32 or bf16 queries, prefill_attention_dtypes())",
        pybind11::arg("out"), pybind11::arg("query"), pybind11::arg("key_cache"), pybind11::arg("value_cache"),
        pybind11::arg("block_tables"), pybind11::arg("seq_lens"), pybind11::arg("query_lens"), pybind11::arg("scale"),
        pybind11::arg("key_scales") = pybind11::none(), pybind11::arg("value_scales") = pybind11::none(),
        pybind11::arg("key") = pybind11::none(), pybind11::arg("value") = pybind11::none());
  m.def("prefill_attention_dtypes", &prefill_attention_dtypes,
        "the query dtypes paged_prefill_attention takes in this build (float32 from AVX2 up, bfloat16 at AVX-512 BF16)");
  m.def("rms_norm", &rms_norm, "RMSNorm (CPU)");
  m.def("add_rms_norm", &add_rms_norm, "residual add + RMSNorm (CPU): (x + delta, rms_norm(x + delta))");
  m.def("int4_linear", &int4_linear, "weight-only int4 linear at any number of rows (CPU; x fp32 or bf16)", pybind11::arg("x"),
        pybind11::arg("packed"), pybind11::arg("pairs"), pybind11::arg("group_size"));
  m.def("bf16_linear", &bf16_linear, "bf16 linear at 1-4 rows (CPU, AVX-512 BF16)", pybind11::arg("x"),
        pybind11::arg("weight"), pybind11::arg("bias") = pybind11::none());
  m.def("int8_linear", &int8_linear, "weight-only int8 linear at few rows (CPU; x fp32 or bf16)", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"));
  m.def("int8_tiled_linear", &int8_tiled_linear, "weight-only int8 linear over 16-channel tiles, any number of rows "
        "(CPU, AVX-512 BF16)", pybind11::arg("x"), pybind11::arg("tiles"), pybind11::arg("scales"));
  m.def("int6_linear", &int6_linear, "weight-only 6-bit linear (symmetric groups of 16) at any number of rows "
        "(CPU, AVX2 and up; x fp32 or bf16)", pybind11::arg("x"), pybind11::arg("low"), pybind11::arg("high"),
        pybind11::arg("scales"));
  m.def("int6_gemm", &int6_gemm, "weight-only 6-bit linear on int6_linear's tiles at many rows, widened to bf16 "
        "(CPU, AVX-512 BF16; x fp32 or bf16)", pybind11::arg("x"), pybind11::arg("low"), pybind11::arg("high"),
        pybind11::arg("scales"), pybind11::arg("bias") = pybind11::none());
  m.def("int8_gemm", &int8_gemm, "weight-only int8 linear at any number of rows (CPU; x fp32 or bf16)", pybind11::arg("x"),
        pybind11::arg("codes"), pybind11::arg("scales"), pybind11::arg("bias") = pybind11::none());
  m.def("gemv_supported", &gemv_supported,
        "whether the quantized matmul kernels (int4_linear, int8_linear, int8_gemm) were built (AVX2 and up)");
  m.def("native_bf16", &native_bf16, "whether bf16_linear and the bf16 dot-product paths were built (AVX-512 BF16)");
  m.def("sample_rows", &sample_rows, "one token per row of fp32 logits, sampled at inv_temperature and min_p by "
        "the Gumbel-max trick, the noise hashed from each row's int64 key (CPU)", pybind11::arg("logits"),
        pybind11::arg("inv_temperature"), pybind11::arg("min_p"), pybind11::arg("keys"));
  m.def("isa", [] { return std::string(TOKENMILL_ISA); }, "the instruction-set level this module was built for");
  m.def("integer_dot", [] {
#if defined(TOKENMILL_VNNI)
    return std::string("vpdpbusd");
#elif defined(TOKENMILL_AVX2)
    return std::string("vpmaddubsw");
#else
    return std::string("none");
#endif
  }, "the instruction the integer matmul kernels multiply bytes with: vpdpbusd (AVX-512 VNNI), vpmaddubsw "
        "(AVX2), or none (not built)");
  bind_decoder_stack(m);
}
