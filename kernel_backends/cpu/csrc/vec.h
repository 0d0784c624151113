// AVX2 helpers shared by the CPU kernels (compiled only where -march=native has AVX2+FMA;
// every kernel keeps a scalar path for other CPUs and dtypes).
#pragma once

#include <c10/util/BFloat16.h>

#include <type_traits>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace loraplex_vec {

// Eight floats from eight float or bfloat16 values (a bfloat16 is the high half of a float).
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}

// Eight floats stored as float, or rounded to bfloat16 as c10 rounds (to nearest even; NaN
// to the quiet NaN 0x7FC0).
inline void store8(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
inline void store8(c10::BFloat16* p, __m256 v) {
  const __m256i bits = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
  const __m256i high = _mm256_srli_epi32(rounded, 16);  // each value in a lane's low half
  const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(high),
                                          _mm256_extracti128_si256(high, 1));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), packed);
}

// The dtypes with vector loads and stores here (float16 keeps the scalar paths).
template <typename T>
constexpr bool kVec8 = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// v rounded to T's precision and widened back (as static_cast<float>(T(v)) per lane):
// identity for float, bfloat16's round-to-nearest-even (NaN stays NaN) for bfloat16.
template <typename T>
inline __m256 round8(__m256 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    const __m256i bits = _mm256_castps_si256(v);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
    __m256i rounded = _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF)));
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC00000), nan);
    return _mm256_castsi256_ps(_mm256_and_si256(rounded, _mm256_set1_epi32(-65536)));
  }
}

// The sum of a vector's eight lanes.
inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 0x55)));
}

// Cephes' expf constants, shared by exp256 and exp512 (the same polynomial at either width).
namespace expf_consts {
constexpr float kLo = -87.33654f, kHi = 88.37626f, kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f, kLn2Lo = -2.12194440e-4f;
constexpr float kP[6] = {1.9875691500E-4f, 1.3981999507E-3f, 8.3334519073E-3f,
                         4.1665795894E-2f, 1.6666665459E-1f, 5.0000001201E-1f};
}  // namespace expf_consts

// e^x for 8 floats (Cephes' expf: range reduction by ln 2, degree-5 polynomial; within
// 2 ulp of std::exp over the softmax's range x <= 0, and 0 below -87.3).
inline __m256 exp256(__m256 x) {
  const __m256 lo = _mm256_set1_ps(expf_consts::kLo);
  const __m256 under = _mm256_cmp_ps(x, lo, _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, lo), _mm256_set1_ps(expf_consts::kHi));
  __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(expf_consts::kLog2e)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(expf_consts::kLn2Hi), x);
  x = _mm256_fnmadd_ps(n, _mm256_set1_ps(expf_consts::kLn2Lo), x);
  __m256 y = _mm256_set1_ps(expf_consts::kP[0]);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(expf_consts::kP[1]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(expf_consts::kP[2]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(expf_consts::kP[3]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(expf_consts::kP[4]));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(expf_consts::kP[5]));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  y = _mm256_mul_ps(y, _mm256_castsi256_ps(e));
  return _mm256_andnot_ps(under, y);
}

// The eight lane sums of a[0..7], as one vector: a transpose-and-add (hadd) tree.
inline __m256 sum8(const __m256* a) {
  const __m256 s01 = _mm256_hadd_ps(a[0], a[1]), s23 = _mm256_hadd_ps(a[2], a[3]);
  const __m256 s45 = _mm256_hadd_ps(a[4], a[5]), s67 = _mm256_hadd_ps(a[6], a[7]);
  const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
  return _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                       _mm256_permute2f128_ps(s03, s47, 0x31));
}

// r[0..7] as the rows of an 8 x 8 matrix, transposed in place (r[i][j] <- r[j][i]).
inline void transpose8(__m256* r) {
  const __m256 t0 = _mm256_unpacklo_ps(r[0], r[1]), t1 = _mm256_unpackhi_ps(r[0], r[1]);
  const __m256 t2 = _mm256_unpacklo_ps(r[2], r[3]), t3 = _mm256_unpackhi_ps(r[2], r[3]);
  const __m256 t4 = _mm256_unpacklo_ps(r[4], r[5]), t5 = _mm256_unpackhi_ps(r[4], r[5]);
  const __m256 t6 = _mm256_unpacklo_ps(r[6], r[7]), t7 = _mm256_unpackhi_ps(r[6], r[7]);
  const __m256 u0 = _mm256_shuffle_ps(t0, t2, 0x44), u1 = _mm256_shuffle_ps(t0, t2, 0xEE);
  const __m256 u2 = _mm256_shuffle_ps(t1, t3, 0x44), u3 = _mm256_shuffle_ps(t1, t3, 0xEE);
  const __m256 u4 = _mm256_shuffle_ps(t4, t6, 0x44), u5 = _mm256_shuffle_ps(t4, t6, 0xEE);
  const __m256 u6 = _mm256_shuffle_ps(t5, t7, 0x44), u7 = _mm256_shuffle_ps(t5, t7, 0xEE);
  r[0] = _mm256_permute2f128_ps(u0, u4, 0x20);
  r[1] = _mm256_permute2f128_ps(u1, u5, 0x20);
  r[2] = _mm256_permute2f128_ps(u2, u6, 0x20);
  r[3] = _mm256_permute2f128_ps(u3, u7, 0x20);
  r[4] = _mm256_permute2f128_ps(u0, u4, 0x31);
  r[5] = _mm256_permute2f128_ps(u1, u5, 0x31);
  r[6] = _mm256_permute2f128_ps(u2, u6, 0x31);
  r[7] = _mm256_permute2f128_ps(u3, u7, 0x31);
}

// s[i] = e^(s[i] - m) in place for i < n (a multiple of 8); returns their sum (the softmax's
// shift-exponentiate-sum, shared by the attention kernels).
inline float exp_shift_sum(float* s, int64_t n, float m) {
  const __m256 mv = _mm256_set1_ps(m);
  __m256 sum = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(s + i), mv));
    _mm256_storeu_ps(s + i, e);
    sum = _mm256_add_ps(sum, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, sum);
  float total = 0.f;
  for (float lane : lanes) total += lane;
  return total;
}

#if defined(__AVX512F__)
// The 16-wide twins of load8, store8, round8 and exp256 for AVX-512: lane by lane the same
// results (the same rounding, NaN rule and polynomial), so a kernel may use either width.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // exact: a bfloat16 is a float's high half
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}

// v's bits rounded to bfloat16 as c10 rounds (nearest even; NaN to 0x7FC0), still in a
// float's high half.
inline __m512i round_bits16(__m512 v) {
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_add_epi32(bits, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_blend_epi32(nan, rounded, _mm512_set1_epi32(0x7FC00000));
}

inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(c10::BFloat16* p, __m512 v) {
  const __m256i packed = _mm512_cvtepi32_epi16(_mm512_srli_epi32(round_bits16(v), 16));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), packed);
}

template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return _mm512_castsi512_ps(_mm512_and_si512(round_bits16(v), _mm512_set1_epi32(-65536)));
  }
}

inline __m512 exp512(__m512 x) {
  const __m512 lo = _mm512_set1_ps(expf_consts::kLo);
  const __mmask16 under = _mm512_cmp_ps_mask(x, lo, _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, lo), _mm512_set1_ps(expf_consts::kHi));
  __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(expf_consts::kLog2e)),
                                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(expf_consts::kLn2Hi), x);
  x = _mm512_fnmadd_ps(n, _mm512_set1_ps(expf_consts::kLn2Lo), x);
  __m512 y = _mm512_set1_ps(expf_consts::kP[0]);
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(expf_consts::kP[1]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(expf_consts::kP[2]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(expf_consts::kP[3]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(expf_consts::kP[4]));
  y = _mm512_fmadd_ps(y, x, _mm512_set1_ps(expf_consts::kP[5]));
  y = _mm512_fmadd_ps(y, _mm512_mul_ps(x, x), _mm512_add_ps(x, _mm512_set1_ps(1.f)));
  const __m512i e = _mm512_slli_epi32(
      _mm512_add_epi32(_mm512_cvtps_epi32(n), _mm512_set1_epi32(127)), 23);
  y = _mm512_mul_ps(y, _mm512_castsi512_ps(e));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~under), y);
}
#endif

}  // namespace loraplex_vec

#if defined(__AVX512F__)
using loraplex_vec::exp512;
using loraplex_vec::load16;
using loraplex_vec::round16;
using loraplex_vec::store16;
#endif
using loraplex_vec::exp256;
using loraplex_vec::hsum8;
using loraplex_vec::kVec8;
using loraplex_vec::load8;
using loraplex_vec::round8;
using loraplex_vec::store8;
using loraplex_vec::exp_shift_sum;
using loraplex_vec::sum8;
using loraplex_vec::transpose8;
#endif
