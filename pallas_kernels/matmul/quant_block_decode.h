// Block layouts and scalar decodes of the GGUF formats, written once and shared by every
// instruction set's driver (quant.cc, quant_float_avx2.cc, quant_neon.cc): the byte offsets of
// a block's fields, and one portable decode of a block to its 32 f32 weights. The SIMD paths
// read the same offsets; the scalar decode is the aarch64 path's own and the reference the SIMD
// paths compute bit for bit (tests/kernels/test_quant_matmul.py reads the weights back).
//
// Q4_1 (ggml's block_q4_1, 20 bytes for 32 weights): f16 d at 0, f16 m at 2, then 16 bytes of
// nibbles at 4 (byte j: low nibble = weight j, high nibble = weight j + 16); w = d * q + m.
// d * q is exact in f32 (an f16 times a 4-bit integer: at most 15 significant bits), so the one
// rounding is the sum's and an FMA gives the same bits: the gguf package's (d * q) + m.
#pragma once

#include <cstdint>
#include <cstring>

namespace jaxbatch_quant {

struct Q4_1Layout {
  static constexpr int QK = 32, BYTES = 20;
  static constexpr int D = 0, M = 2, QS = 4;  // byte offsets: f16 d, f16 m, 16 nibble bytes
};

// IEEE half (its bits) -> f32, exactly (subnormals, infinities and NaNs included), with no
// instruction-set dependence
inline float half_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t bits;
  if (exp == 0x1F) {
    bits = sign | 0x7F800000u | (man << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  } else if (man == 0) {
    bits = sign;
  } else {  // subnormal half: man 2^-24, normal in f32
    int e = 113;  // the exponent field of 2^-14, lowered while the mantissa is normalised
    uint32_t m = man;
    while (!(m & 0x400u)) {
      m <<= 1;
      --e;
    }
    bits = sign | (static_cast<uint32_t>(e) << 23) | ((m & 0x3FFu) << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline float half_at(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return half_to_float(h);
}

// one Q4_1 block -> its 32 weights
inline void decode_q4_1(const uint8_t* p, float* out) {
  const float d = half_at(p + Q4_1Layout::D), m = half_at(p + Q4_1Layout::M);
  const uint8_t* qs = p + Q4_1Layout::QS;
  for (int j = 0; j < 16; ++j) {
    out[j] = d * static_cast<float>(qs[j] & 0xF) + m;
    out[j + 16] = d * static_cast<float>(qs[j] >> 4) + m;
  }
}

}  // namespace jaxbatch_quant
