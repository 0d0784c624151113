// The attention scores of the batch-invariant kernel (paged_prefill.cpp, which serves the
// prefill tiles and, with --batch-invariant on, the decodes): s = q · k for a few query rows
// against cached key rows read in place (no transposed copy of the keys).
//
// The one order of every score, whatever the call: eight partial sums, lane i summing the
// products q[d] · k[d] of d = i, i + 8, i + 16, ... in that order, one fused multiply-add
// each; then the lanes in the fixed tree ((l0 + l1) + (l2 + l3)) + ((l4 + l5) + (l6 + l7)).
// A score depends on its row's q and its position's k only: not on the other rows or
// positions of the call, the register tile, the ISA width (AVX-512 builds run this same
// AVX2 code) or the path (the scalar twin below computes the same bits).
#pragma once

#include <cmath>
#include <cstdint>

#include "vec.h"

namespace loraplex_scores {

constexpr int64_t kPositions = 4;  // positions per register tile (callers pad to a multiple)
constexpr int kTileRows = 3;       // query rows per register tile

// The fixed order above, one score at a time (plain C; used where the vector path is not:
// no AVX2, or a head_dim that is not a multiple of 8). std::fma rounds once, as the FMA
// instruction does, so on an AVX2 CPU its bits are the vector path's.
template <typename scalar_t>
inline float dot_fixed(const float* q, const scalar_t* k, int64_t dim) {
  float lane[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  for (int64_t d = 0; d < dim; ++d)
    lane[d % 8] = std::fma(q[d], static_cast<float>(k[d]), lane[d % 8]);
  return ((lane[0] + lane[1]) + (lane[2] + lane[3])) + ((lane[4] + lane[5]) + (lane[6] + lane[7]));
}

#if defined(__AVX2__) && defined(__FMA__)
// The lane sums of a[0..3] in the fixed tree, as one vector: two hadd levels give each
// accumulator (l0 + l1) + (l2 + l3) in the low half and (l4 + l5) + (l6 + l7) in the high.
inline __m128 sum4(const __m256* a) {
  const __m256 s03 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  return _mm_add_ps(_mm256_castps256_ps128(s03), _mm256_extractf128_ps(s03, 1));
}

// RR <= kTileRows rows x kPositions positions: s[r * ld + j] for j < n (n a multiple of 4).
template <int RR, typename scalar_t>
void dot_tile(const float* q, int64_t dim, const scalar_t* const* k, int64_t n, float* s,
              int64_t ld) {
  for (int64_t j = 0; j < n; j += kPositions) {
    __m256 acc[RR][kPositions];
    for (int r = 0; r < RR; ++r)
      for (int c = 0; c < kPositions; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t d = 0; d < dim; d += 8) {
      __m256 qv[RR];
      for (int r = 0; r < RR; ++r) qv[r] = _mm256_loadu_ps(q + r * dim + d);
      for (int c = 0; c < kPositions; ++c) {
        const __m256 kv = load8(k[j + c] + d);
        for (int r = 0; r < RR; ++r) acc[r][c] = _mm256_fmadd_ps(qv[r], kv, acc[r][c]);
      }
    }
    for (int r = 0; r < RR; ++r) _mm_storeu_ps(s + r * ld + j, sum4(acc[r]));
  }
}
#endif

// s[r * ld + j] = q[r] · k[j] for r < R (q rows dim apart, already scaled) and j < n, n a
// multiple of kPositions (k[j] readable for every such j: callers pad with a real row and
// mask those scores). Each score in the fixed order above.
template <int R, typename scalar_t>
void dot_scores(const float* q, int64_t dim, const scalar_t* const* k, int64_t n, float* s,
                int64_t ld) {
#if defined(__AVX2__) && defined(__FMA__)
  if (dim % 8 == 0) {
    constexpr int first = R < kTileRows ? R : kTileRows;
    dot_tile<first>(q, dim, k, n, s, ld);
    if constexpr (R > kTileRows) dot_scores<R - kTileRows>(q + kTileRows * dim, dim, k, n,
                                                           s + kTileRows * ld, ld);
    return;
  }
#endif
  for (int r = 0; r < R; ++r)
    for (int64_t j = 0; j < n; ++j) s[r * ld + j] = dot_fixed(q + r * dim, k[j], dim);
}

}  // namespace loraplex_scores
