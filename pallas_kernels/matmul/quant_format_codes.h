// The quantised matmul's format codes and block sizes, one account for every instruction set's
// source (quant.cc, quant_float_avx2.cc, quant_neon.cc): quant_formats.py's FORMATS order, the
// `fmt` attribute quant.py passes. BF16 and F16 are plain 16-bit weights in 32-weight "blocks",
// so that a bf16 / f16 weight is held once, in the layout every step size reads (float
// activations only). Q4_1 takes float activations only for now: its int8 mode (which needs
// the activation blocks' sums, llama.cpp's q8_1) is not written yet.
#pragma once

#include <cstdint>

namespace jaxbatch_quant {

enum Format : int64_t {
  kQ8_0 = 0, kQ4_0 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4, kBF16 = 5, kF16 = 6, kMXFP4 = 7,
  kQ4_1 = 8, kNumFormats
};
inline constexpr int64_t kBlockWeights[kNumFormats] = {32, 32, 256, 256, 256, 32, 32, 32, 32};
inline constexpr int64_t kBlockBytes[kNumFormats] = {34, 18, 144, 176, 210, 64, 64, 17, 20};

// moe.cc: true while this thread runs routed experts one call per thread (no pool dispatch)
bool OnOneThread();

}  // namespace jaxbatch_quant
