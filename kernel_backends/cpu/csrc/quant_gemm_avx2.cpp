// The quantized linears' AVX2 path (8 floats a vector, four a 32-weight chunk, AVX2/FMA
// intrinsics only). Built into every x86-64 build of the kernels with its own target, so a
// build on an AVX-512 CPU holds it too and its tests run it there (the compiler may still
// encode those instructions in EVEX form under -march=native: the same operations), chosen
// at run time where the CPU has AVX2 and FMA but not AVX-512F (quant_gemm.cpp).
#include "quant_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx2,fma")

namespace lp_quant {
namespace {

struct V {
  using reg = __m256;
  static constexpr int W = 8;
  static inline reg zero() { return _mm256_setzero_ps(); }
  static inline reg load(const float* p) { return _mm256_loadu_ps(p); }
  static inline void store(float* p, reg v) { _mm256_storeu_ps(p, v); }
  static inline reg set1(float v) { return _mm256_set1_ps(v); }
  static inline reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  static inline reg fma(reg a, reg b, reg c) { return _mm256_fmadd_ps(a, b, c); }
  static inline float hsum(reg a) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
  }
};

inline __m256 bytes_to_floats(__m128i eight) {  // the low 8 bytes, unsigned
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(eight));
}

// 16 bytes -> the 32 nibbles: low nibbles are weights 0-15, high nibbles 16-31 (ggml).
inline void decode_nibbles(const uint8_t* q, __m256* out) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q));
  const __m128i mask = _mm_set1_epi8(0x0F);
  const __m128i lo = _mm_and_si128(b, mask), hi = _mm_and_si128(_mm_srli_epi16(b, 4), mask);
  out[0] = bytes_to_floats(lo);
  out[1] = bytes_to_floats(_mm_srli_si128(lo, 8));
  out[2] = bytes_to_floats(hi);
  out[3] = bytes_to_floats(_mm_srli_si128(hi, 8));
}

// 32 bytes -> their low (shift 0) or high (shift 4) nibbles: Q4_K's sub-blocks.
inline void decode_nibbles32(const uint8_t* q, int shift, __m256* out) {
  const __m256i mask = _mm256_set1_epi32(0x0F);
  const __m128i count = _mm_cvtsi32_si128(shift);
  for (int i = 0; i < 4; ++i) {
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i)));
    out[i] = _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srl_epi32(v, count), mask));
  }
}

// Q5_K: the nibbles of decode_nibbles32, bit 4 from bit hshift of the 32 qh bytes.
inline void decode_q5_k(const Chunk& ch, __m256* out) {
  const __m256i mask = _mm256_set1_epi32(0x0F), one = _mm256_set1_epi32(1);
  const __m128i s = _mm_cvtsi32_si128(ch.shift), hs = _mm_cvtsi32_si128(ch.hshift);
  for (int i = 0; i < 4; ++i) {
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ch.q + 8 * i)));
    const __m256i h =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ch.qh + 8 * i)));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(v, s), mask);
    const __m256i hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, hs), one), 4);
    out[i] = _mm256_cvtepi32_ps(_mm256_or_si256(lo, hi));
  }
}

// Q6_K: (nibble | 2 bits of qh << 4) - 32, times the scale of its 16 weights (d, d1).
inline void decode_q6_k(const Chunk& ch, __m256* out) {
  const __m256i mask = _mm256_set1_epi32(0x0F), three = _mm256_set1_epi32(3);
  const __m256i bias = _mm256_set1_epi32(32);
  const __m128i s = _mm_cvtsi32_si128(ch.shift), hs = _mm_cvtsi32_si128(ch.hshift);
  for (int i = 0; i < 4; ++i) {
    const __m256i v =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ch.q + 8 * i)));
    const __m256i h =
        _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(ch.qh + 8 * i)));
    const __m256i lo = _mm256_and_si256(_mm256_srl_epi32(v, s), mask);
    const __m256i hi = _mm256_slli_epi32(_mm256_and_si256(_mm256_srl_epi32(h, hs), three), 4);
    const __m256i q = _mm256_sub_epi32(_mm256_or_si256(lo, hi), bias);
    out[i] = _mm256_mul_ps(_mm256_cvtepi32_ps(q), _mm256_set1_ps(i < 2 ? ch.d : ch.d1));
  }
}

inline void decode_int8(const uint8_t* q, __m256* out) {
  for (int i = 0; i < 4; ++i)
    out[i] = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
        _mm_loadl_epi64(reinterpret_cast<const __m128i*>(q + 8 * i))));
}

#include "quant_gemm_body.h"

}  // namespace

void run_avx2(const Problem& p, int64_t n0, int64_t n1) { run(p, n0, n1); }
bool built_avx2() { return true; }

}  // namespace lp_quant

#pragma GCC pop_options
#else
namespace lp_quant {
void run_avx2(const Problem&, int64_t, int64_t) {}
bool built_avx2() { return false; }
}  // namespace lp_quant
#endif
