// O += P·V of the batch-invariant kernel (paged_prefill.cpp, which serves the prefill tiles
// and, with --batch-invariant on, the decodes): a register tile's R rows of probabilities
// against the chunk's value rows, read in place.
//
// The one order of every output, whatever the call: o · alpha (one multiply), then one
// fused multiply-add per position, in the positions' order. The column passes (32 or 64
// columns for the narrow tiles of 1-3 rows, a decode's KV-head group; 16 for 4-6 rows; a
// plain-C tail with std::fma) only decide which outputs share a loop, never an output's
// arithmetic: a row's sums do not depend on its tile's size.
#pragma once

#include <cmath>
#include <cstdint>

#include "tile_6x16.h"
#include "vec.h"

namespace loraplex_values {

#if defined(__AVX2__) && defined(__FMA__)
// The register tile's first R rows (R <= 6, a template parameter where these are used):
// the rows past R are declared but never touched, so the compiler drops them. Row r's
// arithmetic is the same whatever R, so a row's sums do not depend on its tile's size.
#define LP_ACC_DECLARE LP_TILE_ROWS(LP_TILE_DECLARE)
#define LP_IF_ROW(r, ...) \
  if constexpr (R > r) { __VA_ARGS__ }
#define LP_FMA_ROW(r, a, stride, b0, b1) \
  LP_IF_ROW(r, LP_TILE_FMA(r, _mm256_broadcast_ss((a) + r * (stride)), b0, b1))
#define LP_R_ROWS(a, stride, b0, b1)                                                   \
  LP_FMA_ROW(0, a, stride, b0, b1) LP_FMA_ROW(1, a, stride, b0, b1)                    \
  LP_FMA_ROW(2, a, stride, b0, b1) LP_FMA_ROW(3, a, stride, b0, b1)                    \
  LP_FMA_ROW(4, a, stride, b0, b1) LP_FMA_ROW(5, a, stride, b0, b1)
#define LP_STORE_ROW(r) LP_IF_ROW(r, LP_TILE_STORE(r, lp_dst, lp_stride))
#define LP_STORE_R(dst, stride)                   \
  {                                               \
    float* lp_dst = (dst);                        \
    const int64_t lp_stride = (stride);           \
    LP_TILE_ROWS(LP_STORE_ROW)                    \
  }

// accumulate_rows' passes of 8W columns for a narrow tile (R * W <= 12 accumulators, so the
// FMA chains cover both FMA ports' latency, where 16-column passes leave 2R chains: a
// decode's 3-row tile ran at two thirds of the ports' rate). Returns the columns done.
template <int R, int W, int64_t kChunk, typename scalar_t>
int64_t accumulate_wide(const float* p, const scalar_t* const* v, int64_t dim, int64_t keys,
                        const float* alpha, float* o) {
  int64_t d0 = 0;
  for (; d0 + 8 * W <= dim; d0 += 8 * W) {
    __m256 acc[R][W];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c)
        acc[r][c] = _mm256_mul_ps(_mm256_set1_ps(alpha[r]),
                                  _mm256_loadu_ps(o + r * dim + d0 + 8 * c));
    for (int64_t j = 0; j < keys; ++j) {
      __m256 pj[R];
      for (int r = 0; r < R; ++r) pj[r] = _mm256_broadcast_ss(p + r * kChunk + j);
      for (int c = 0; c < W; ++c) {
        const __m256 vc = load8(v[j] + d0 + 8 * c);
        for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(pj[r], vc, acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < W; ++c) _mm256_storeu_ps(o + r * dim + d0 + 8 * c, acc[r][c]);
  }
  return d0;
}
#endif

// o[r][:] = o[r][:] · alpha[r] + Σ_{j < keys} p[r][j] · v[j][:] for R <= 6 rows (o rows
// D apart, p rows kChunk apart; v[j] the cached row of the chunk's position j, read in
// place), in the column passes above. The positions j >= keys hold p = 0 in every row
// (masked), so leaving them out adds nothing that the sum would hold.
template <int R, int64_t kChunk, typename scalar_t>
void accumulate_rows(const float* p, const scalar_t* const* v, int64_t dim, int64_t keys,
                     const float* alpha, float* o) {
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (R <= 3)
    d0 = accumulate_wide<R, R == 1 ? 8 : 4, kChunk>(p, v, dim, keys, alpha, o);
  for (; d0 + 16 <= dim; d0 += 16) {
    float* od = o + d0;
#define LP_SCALED(r)                                                                     \
  LP_IF_ROW(r, c##r##0 = _mm256_mul_ps(_mm256_set1_ps(alpha[r]), _mm256_loadu_ps(od + r * dim)); \
            c##r##1 = _mm256_mul_ps(_mm256_set1_ps(alpha[r]), _mm256_loadu_ps(od + r * dim + 8));)
    LP_ACC_DECLARE
    c00 = c01 = c10 = c11 = c20 = c21 = c30 = c31 = c40 = c41 = c50 = c51 = _mm256_setzero_ps();
    LP_SCALED(0) LP_SCALED(1) LP_SCALED(2) LP_SCALED(3) LP_SCALED(4) LP_SCALED(5)
#undef LP_SCALED
    for (int64_t j = 0; j < keys; ++j) {
      const __m256 v0 = load8(v[j] + d0);
      const __m256 v1 = load8(v[j] + d0 + 8);
      LP_R_ROWS(p + j, kChunk, v0, v1)
    }
    LP_STORE_R(od, dim)
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t d = d0; d < dim; ++d) {
      float acc = o[r * dim + d] * alpha[r];  // the vector lanes' ops: one multiply, FMAs
      for (int64_t j = 0; j < keys; ++j)
        acc = std::fma(p[r * kChunk + j], static_cast<float>(v[j][d]), acc);
      o[r * dim + d] = acc;
    }
}

}  // namespace loraplex_values
