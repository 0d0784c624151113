// Weight-only quantized linears (csrc/quant_gemm*.cpp): the problem one call solves and the
// per-ISA entry points. y [M, N] = x [M, K] · Wᵀ (+ bias), W kept in its quantized bytes
// (kernel_backends/quantized_weight.py), x and y float32 here (the torch glue converts
// bfloat16 activations once per call).
//
// Every format is a run of 32-weight chunks along K, each chunk c of output row n holding
// 32 small integers q (as stored), a scale d and an offset c: w = d * q + c. The kernels
// compute   y[m, n] = Σ_c d_c · (Σ_i q_i x_i) + Σ_c c_c · (Σ_i x_i)
// with the chunk sums of x (xsum) computed once per call: the offset costs one scalar FMA
// a chunk instead of one vector op a weight. (Q4_0: c = -8 d; Q4_1: c = m; int4: c = -z s;
// Q4_K and Q5_K: d = d_sb * scale_j, c = -dmin_sb * min_j of the 32-weight sub-block j of its
// 256-weight super-block; Q8_0 and int8: no offset.) Q6_K has two scales a chunk (one a 16
// weights: d_sb * scale_i) and q - 32 signed: its chunks are decoded with their scales
// applied (w itself, as int8's q), d = 1, no offset. (The AVX2 path, quant_gemm_avx2.cpp,
// has its own loop on the same sum: Q6_K's scales a 16 weights, Q4_0 / Q4_1 decoded whole.)
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#endif

namespace lp_quant {

enum Format : int { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2, kInt8 = 3, kInt4 = 4, kQ4_K = 5, kQ5_K = 6,
                  kQ6_K = 7 };
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2, kAvx512Bf16 = 3 };

struct Problem {
  const float* x;        // [M, K] float32, contiguous (int4: each 32-chunk evens then odds;
                         // int4_words: each 128 in word order, see int4_word_order)
  const uint16_t* xb;    // the avx512_bf16 path: x as bfloat16 bits, same layout (else null)
  const float* xsum;     // [M, K / 32]: each chunk's sum of x (formats with an offset)
  int64_t M, K, N;
  const uint8_t* data;   // [N, row_bytes]: the weight's bytes
  int64_t row_bytes;
  const float* scales;   // int8: [N]; int4: [N, K / group]
  const uint8_t* zeros;  // int4: [N, K / group]
  int group_shift;       // int4: log2 of the group size (5, 6, 7: 32, 64, 128 weights)
  int format;
  const float* bias;     // [N] or null
  float* y;              // [M, N] (null where yb takes the result)
  // The avx512_bf16 int4 path with groups of 128: x (xb) in word order and W's 64 bytes of a
  // group decoded as 32 16-bit words, four nibbles each (quant_gemm_avx512.cpp).
  bool int4_words = false;
  uint16_t* yb = nullptr;  // the avx512_bf16 path: y [M, N] as bfloat16 bits (float_to_bf16)
  int64_t ldy = 0;  // y's (yb's) row stride: N, or more where W is one part of a wider y
};

// Where y[m, n] lives: row m of y is ldy values long (0: N).
inline int64_t y_at(const Problem& p, int64_t m, int64_t n) {
  return m * (p.ldy ? p.ldy : p.N) + n;
}

// float -> bfloat16 bits, rounded to nearest even (NaN: a quiet NaN), as c10::BFloat16 and
// torch's .to(torch.bfloat16) round every non-NaN float.
inline uint16_t float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0;
  return uint16_t((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// int4 with 128-weight groups on the avx512_bf16 path: byte i of a 16-byte chunk a holds
// weights 32a + 2i (low nibble) and 32a + 2i + 1 (high), so the 16-bit word j = 8a + b of a
// group's 64 bytes holds weights 32a + 4b + k as its nibble k (k = 0 .. 3). x is laid out
// to match, each 128 as four 32-vectors: vector k, lane j = x[32a + 4b + k].
inline bool int4_word_order(int format, int group, bool bf16_path) {
  return bf16_path && format == kInt4 && group == 128;
}

// fn(std::integral_constant<int, F>{}) for format F (nothing for an unknown one): the one
// switch from a run-time format to each path's template instance.
template <class Fn>
inline void with_format(int format, Fn&& fn) {
  switch (format) {
    case kQ8_0: fn(std::integral_constant<int, kQ8_0>{}); break;
    case kQ4_0: fn(std::integral_constant<int, kQ4_0>{}); break;
    case kQ4_1: fn(std::integral_constant<int, kQ4_1>{}); break;
    case kInt8: fn(std::integral_constant<int, kInt8>{}); break;
    case kInt4: fn(std::integral_constant<int, kInt4>{}); break;
    case kQ4_K: fn(std::integral_constant<int, kQ4_K>{}); break;
    case kQ5_K: fn(std::integral_constant<int, kQ5_K>{}); break;
    case kQ6_K: fn(std::integral_constant<int, kQ6_K>{}); break;
    default: break;
  }
}

// y[:, n0:n1) of the problem, on one thread.
void run_scalar(const Problem& p, int64_t n0, int64_t n1);
void run_avx2(const Problem& p, int64_t n0, int64_t n1);
void run_avx512(const Problem& p, int64_t n0, int64_t n1);
void run_avx512_bf16(const Problem& p, int64_t n0, int64_t n1);  // x in xb (bfloat16)
// W's rows n0 .. n1 as bfloat16 [n1 - n0][K] (K % 32 == 0): the avx512_bf16 path's weights.
void dequantize_avx512_bf16(const Problem& p, int64_t n0, int64_t n1, uint16_t* out);
bool built_avx2();
bool built_avx512();

// IEEE half -> float, exactly: the magnitude's bits moved into float32's exponent and
// mantissa fields, times 2^112 (exact; also for subnormals and zero), then the sign.
inline float half_to_float(const uint8_t* at) {
  uint16_t h;
  std::memcpy(&h, at, 2);
  uint32_t bits;
  if ((h & 0x7C00) == 0x7C00) {  // inf, nan
    bits = (uint32_t(h & 0x8000) << 16) | 0x7F800000u | (uint32_t(h & 0x3FF) << 13);
  } else {
    const uint32_t mag = uint32_t(h & 0x7FFF) << 13;
    float f;
    std::memcpy(&f, &mag, 4);
    f *= 0x1p112f;
    std::memcpy(&bits, &f, 4);
    bits |= uint32_t(h & 0x8000) << 16;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

#if defined(__x86_64__) && defined(__GNUC__)
// An fp16 as float32 by F16C: exact, as half_to_float for every non-NaN half (subnormals
// included), in three instructions where half_to_float takes a dozen. For the paths built
// with F16C (quant_gemm_avx2.cpp, quant_gemm_avx512.cpp's avx512_bf16 part).
__attribute__((target("f16c"))) inline float half_f16c(const uint8_t* at) {
  uint16_t h;
  std::memcpy(&h, at, 2);
  return _cvtsh_ss(h);
}
#endif

// Chunk c of row n: its scale d and offset (0 where the format has none) and where its
// integers start.
struct Chunk {
  float d, c;
  const uint8_t* q;
  int shift = 0;  // Q4_K: the chunk's nibbles are the low (0) or high (4) ones of 32 bytes
  const uint8_t* qh = nullptr;  // Q5_K / Q6_K: the 32 bytes holding the high bit(s)
  int hshift = 0;  // Q5_K: bit hshift of qh[i] is q_i's bit 4; Q6_K: bits hshift, +1: 4, 5
  float d1 = 0.f;  // Q6_K: the scale of weights 16-31 (d: of weights 0-15)
};

// Half: how an fp16 scale is read (half_to_float; a path built with F16C passes its own,
// the same value in fewer instructions).
template <int F, float (*Half)(const uint8_t*) = half_to_float>
inline Chunk chunk(const Problem& p, const uint8_t* row, int64_t n, int64_t c) {
  if constexpr (F == kQ8_0) {
    const uint8_t* b = row + c * 34;
    return {Half(b), 0.f, b + 2};
  } else if constexpr (F == kQ4_0) {
    const uint8_t* b = row + c * 18;
    const float d = Half(b);
    return {d, -8.f * d, b + 2};
  } else if constexpr (F == kQ4_1) {
    const uint8_t* b = row + c * 20;
    return {Half(b), Half(b + 2), b + 4};
  } else if constexpr (F == kInt8) {
    return {1.f, 0.f, row + c * 32};  // the row's scale multiplies the sum at the end
  } else if constexpr (F == kQ4_K) {  // ggml's get_scale_min_k4
    const uint8_t* b = row + (c >> 3) * 144;
    const uint8_t* s = b + 4;
    const int j = int(c & 7);
    int sc, mn;
    if (j < 4) {
      sc = s[j] & 63;
      mn = s[j + 4] & 63;
    } else {
      sc = (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4);
      mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4);
    }
    return {half_to_float(b) * float(sc), -(half_to_float(b + 2) * float(mn)),
            b + 16 + 32 * (j >> 1), (j & 1) * 4};
  } else {
    const int64_t at = n * (p.K >> p.group_shift) + (c >> (p.group_shift - 5));
    const float s = p.scales[at];
    return {s, -float(p.zeros[at]) * s, row + c * 16};
  }
}

// A Q4_K / Q5_K super-block's twelve scale bytes s unpacked by ggml's kmask trick, four bytes
// at a time (every mask and shift stays within its byte, so the bytes come out the same on
// either endianness): out[0 .. 8) the sub-blocks' 6-bit scales, out[8 .. 16) their mins,
// each get_scale_min_k4's.
inline void k4_scale_bytes(const uint8_t* s, uint8_t* out) {
  uint32_t u[4];
  std::memcpy(u, s, 12);
  constexpr uint32_t k6 = 0x3F3F3F3Fu, k4 = 0x0F0F0F0Fu, k2 = 0x03030303u;
  u[3] = ((u[2] >> 4) & k4) | (((u[1] >> 6) & k2) << 4);
  const uint32_t mins_lo = u[1] & k6;
  u[1] = (u[2] & k4) | (((u[0] >> 6) & k2) << 4);
  u[2] = mins_lo;
  u[0] &= k6;
  std::memcpy(out, u, 16);
}

// Q4_K (block_bytes 144) and Q5_K (176): the scale d and offset c of each of `chunks`
// chunks, each super-block's two fp16 and twelve scale bytes read once for its eight
// chunks (the same products as chunk<kQ4_K>).
inline void q4_k_chunks(const uint8_t* row, int64_t chunks, float* d, float* c,
                        int64_t block_bytes = 144) {
  for (int64_t b = 0; b < chunks / 8; ++b) {
    const uint8_t* blk = row + b * block_bytes;
    const float dd = half_to_float(blk), dmin = half_to_float(blk + 2);
    float* db = d + 8 * b;
    float* cb = c + 8 * b;
    uint8_t sc[16];
    k4_scale_bytes(blk + 4, sc);
    for (int j = 0; j < 8; ++j) {
      db[j] = dd * float(sc[j]);
      cb[j] = -(dmin * float(sc[j + 8]));
    }
  }
}

// Q6_K (ggml's block_q6_K: ql[128], qh[64], int8 scales[16], fp16 d): the scale of each of
// a row's 16-weight groups, d * scale_i (as the twin's products), d read once a super-block.
inline void q6_k_scales(const uint8_t* row, int64_t chunks, float* d) {
  for (int64_t b = 0; b < chunks / 8; ++b) {
    const uint8_t* blk = row + b * 210;
    const float dd = half_to_float(blk + 208);
    for (int i = 0; i < 16; ++i) d[16 * b + i] = dd * float(int8_t(blk[192 + i]));
  }
}

// The scales (and offsets) of super-block b's eight chunks: Q4_K, Q5_K, Q6_K (else
// nothing), computed just before its chunks (a first pass over the whole row's super-blocks
// made the long rows of down [2048, 8192] up to 1.6x slower, cold).
template <int F>
inline void block_scales(const uint8_t* row, int64_t b, float* dk, float* ck) {
  if constexpr (F == kQ4_K) q4_k_chunks(row + b * 144, 8, dk + 8 * b, ck + 8 * b, 144);
  if constexpr (F == kQ5_K) q4_k_chunks(row + b * 176, 8, dk + 8 * b, ck + 8 * b, 176);
  if constexpr (F == kQ6_K) q6_k_scales(row + b * 210, 8, dk + 16 * b);
}
constexpr bool k_quant(int F) { return F == kQ4_K || F == kQ5_K || F == kQ6_K; }

// chunk<F>, with the K-quants' scales and offsets from block_scales. Q5_K's sub-block j
// (ggml's dequantize_row_q5_K): the low (j even) or high nibbles of qs[32 * (j / 2) ..], bit
// j of qh[0 .. 32). Q6_K's 32 weights j of a super-block (dequantize_row_q6_K: half h = j / 4,
// k = j % 4): the low (k < 2) or high nibbles of ql[64 h + 32 (k % 2) ..], bits 2k, 2k + 1 of
// qh[32 h ..], scales 2j and 2j + 1.
template <int F, float (*Half)(const uint8_t*) = half_to_float>
inline Chunk chunk_at(const Problem& p, const uint8_t* row, int64_t n, int64_t c,
                      const float* dk, const float* ck) {
  if constexpr (F == kQ4_K) {
    return {dk[c], ck[c], row + (c >> 3) * 144 + 16 + 32 * ((c & 7) >> 1), int(c & 1) * 4};
  } else if constexpr (F == kQ5_K) {
    const uint8_t* b = row + (c >> 3) * 176;
    return {dk[c], ck[c], b + 48 + 32 * ((c & 7) >> 1), int(c & 1) * 4, b + 16, int(c & 7)};
  } else if constexpr (F == kQ6_K) {
    const uint8_t* b = row + (c >> 3) * 210;
    const int j = int(c & 7), h = j >> 2, k = j & 3;
    return {dk[2 * c], 0.f, b + 64 * h + 32 * (k & 1), (k >> 1) * 4, b + 128 + 32 * h, 2 * k,
            dk[2 * c + 1]};
  } else {
    return chunk<F, Half>(p, row, n, c);
  }
}

constexpr bool has_offset(int F) {
  return F == kQ4_0 || F == kQ4_1 || F == kInt4 || F == kQ4_K || F == kQ5_K;
}
// The decoded chunk is w itself (its scale applied, or the row's at the end): no d.
constexpr bool prescaled(int F) { return F == kInt8 || F == kQ6_K; }
constexpr bool nibbles(int F) { return F == kQ4_0 || F == kQ4_1 || F == kInt4; }

}  // namespace lp_quant
