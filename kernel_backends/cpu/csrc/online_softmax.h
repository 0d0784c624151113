// The online softmax (flash-attention order) of the tiled prefill kernel
// (paged_prefill.cpp): one chunk of scores for the kRows rows of a register tile.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "vec.h"

// The online-softmax step of a register tile's kRows rows over their chunk scores
// s[r][0..width) (rows kChunk apart; width a multiple of 8, each row's positions past it
// masked). Row r: the positions j outside [lo[r], hi[r]) are masked to -inf first (the causal
// bound, the window's start; 0 <= lo, hi <= width); then the new running max m[r],
// alpha[r] = exp(old m - new m) (the factor for what was summed so far), s = exp(s - m) and
// l[r] = l[r] · alpha[r] + Σ s. Masked scores exponentiate to 0. A row that has seen no
// position yet (all -inf so far: a window starts past this chunk) keeps m = -inf, its scores
// 0 and alpha 1; alpha = 0 at the first chunk with a visible position (old m = -inf). Each
// row's arithmetic is that of the row alone; the rows interleave only for parallelism.
template <int kRows, int64_t kChunk>
void softmax_rows(float* s, int64_t width, const int64_t* lo, const int64_t* hi, float* m,
                  float* l, float* alpha) {
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  float mx[kRows], sum[kRows];
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 ninf = _mm256_set1_ps(kNegInf);
  for (int r = 0; r < kRows; ++r) {  // mask, running max
    float* row = s + r * kChunk;
    const __m256i lov = _mm256_set1_epi32(static_cast<int>(lo[r]));
    const __m256i hiv = _mm256_set1_epi32(static_cast<int>(hi[r]));
    __m256i jv = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    __m256 mv = _mm256_set1_ps(m[r]);
    for (int64_t j = 0; j < width; j += 8) {  // visible: !(j < lo) and j < hi
      const __m256i seen = _mm256_andnot_si256(_mm256_cmpgt_epi32(lov, jv),
                                               _mm256_cmpgt_epi32(hiv, jv));
      const __m256 x =
          _mm256_blendv_ps(ninf, _mm256_loadu_ps(row + j), _mm256_castsi256_ps(seen));
      _mm256_storeu_ps(row + j, x);
      mv = _mm256_max_ps(mv, x);
      jv = _mm256_add_epi32(jv, _mm256_set1_epi32(8));
    }
    mv = _mm256_max_ps(mv, _mm256_permute2f128_ps(mv, mv, 1));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0x4e));
    mv = _mm256_max_ps(mv, _mm256_shuffle_ps(mv, mv, 0xb1));
    mx[r] = _mm256_cvtss_f32(mv);
  }
  __m256 acc[kRows];  // e^(s - mx), each row's lanes summed vector by vector in order
  for (int r = 0; r < kRows; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t j = 0; j < width; j += 8)
    for (int r = 0; r < kRows; ++r) {
      float* x = s + r * kChunk + j;
      const __m256 e = exp256(_mm256_sub_ps(_mm256_loadu_ps(x), _mm256_set1_ps(mx[r])));
      _mm256_storeu_ps(x, e);
      acc[r] = _mm256_add_ps(acc[r], e);
    }
  for (int r = 0; r < kRows; ++r) {
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc[r]);
    sum[r] = 0.f;
    for (float lane : lanes) sum[r] += lane;
  }
#else
  for (int r = 0; r < kRows; ++r) {
    float* row = s + r * kChunk;
    mx[r] = m[r];
    for (int64_t j = 0; j < width; ++j) {
      if (j < lo[r] || j >= hi[r]) row[j] = kNegInf;
      mx[r] = std::max(mx[r], row[j]);
    }
    sum[r] = 0.f;
    for (int64_t j = 0; j < width; ++j) {
      row[j] = std::exp(row[j] - mx[r]);
      sum[r] += row[j];
    }
  }
#endif
  for (int r = 0; r < kRows; ++r) {
    if (mx[r] == kNegInf) {  // nothing visible yet (the exps above are NaN)
      std::fill(s + r * kChunk, s + r * kChunk + width, 0.f);
      alpha[r] = 1.f;
      continue;  // l[r] · 1 + 0
    }
    alpha[r] = m[r] == kNegInf ? 0.f : std::exp(m[r] - mx[r]);  // exp(-inf) = 0
    m[r] = mx[r];
    l[r] = l[r] * alpha[r] + sum[r];
  }
}
