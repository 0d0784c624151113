// The 6 x 16 float32 register tile shared by the tiled CPU kernels (panel_gemm.cpp,
// paged_prefill.cpp): six rows of accumulators c{r}0, c{r}1 (columns 0-7 and 8-15), named
// rather than an array, which the compiler would spill. AVX2 + FMA only.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

// F(r) for the six rows
#define LP_TILE_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5)
#define LP_TILE_DECLARE(r) __m256 c##r##0, c##r##1;
// row r += x (broadcast) ⊗ (b0, b1)
#define LP_TILE_FMA(r, x, b0, b1)              \
  c##r##0 = _mm256_fmadd_ps(x, b0, c##r##0); \
  c##r##1 = _mm256_fmadd_ps(x, b1, c##r##1);
// row r to dst + r * stride (16 floats)
#define LP_TILE_STORE(r, dst, stride)                \
  _mm256_storeu_ps((dst) + r * (stride), c##r##0); \
  _mm256_storeu_ps((dst) + r * (stride) + 8, c##r##1);
#endif
