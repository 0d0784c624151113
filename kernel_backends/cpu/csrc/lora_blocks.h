// The LoRA kernel's inner blocks (lora_gather.cpp): the expand of a token or of a
// block of tokens from B (r-major or rank-major), and the shrink of a block of tokens by A,
// in float32 and bfloat16, vectorised where the ISA allows. Header-only: templates.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "vec.h"

namespace lora_blocks {

constexpr int64_t kBlock = 4;          // rows of one slot that share each weight read
constexpr int64_t kExpandChunk = 256;  // B rows per chunk: 8 KB at rank 8, L1-resident

// o[n] += dot(b[n * ld : n * ld + r], h[:r]) for n < width: the expand of one token.
template <typename scalar_t>
void expand_row(const scalar_t* b, int64_t ld, const float* h, int64_t r, int64_t width,
                scalar_t* o) {
  int64_t n = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    // Eight output rows at a time: eight vector dot products over k, then one 8x8
    // transpose-and-sum (hadd) instead of eight horizontal sums.
    const int64_t r8 = r - r % 8;
    for (; r8 > 0 && n + 8 <= width; n += 8) {
      __m256 acc[8];
      for (int q = 0; q < 8; ++q) acc[q] = _mm256_setzero_ps();
      for (int64_t k = 0; k < r8; k += 8) {
        const __m256 hv = _mm256_loadu_ps(h + k);
        for (int q = 0; q < 8; ++q)
          acc[q] = _mm256_fmadd_ps(_mm256_loadu_ps(b + (n + q) * ld + k), hv, acc[q]);
      }
      __m256 sum = sum8(acc);  // [8] row sums
      alignas(32) float tail[8];
      for (int q = 0; q < 8; ++q) {  // ranks that are not a multiple of 8
        float t = 0.f;
        for (int64_t k = r8; k < r; ++k) t += b[(n + q) * ld + k] * h[k];
        tail[q] = t;
      }
      sum = _mm256_add_ps(sum, _mm256_load_ps(tail));
      _mm256_storeu_ps(o + n, _mm256_add_ps(_mm256_loadu_ps(o + n), sum));
    }
  }
#endif
  for (; n < width; ++n) {
    const scalar_t* b_n = b + n * ld;
    float acc = 0.f;
    for (int64_t k = 0; k < r; ++k) acc += static_cast<float>(b_n[k]) * h[k];
    o[n] = static_cast<scalar_t>(static_cast<float>(o[n]) + acc);
  }
}

// The expand of a block of CNT rows from an r-major B (bt[k * ld + n] = B[n, k], the CPU
// slot layout), 8·NV columns a step from column n on: o[q][c] += Σ_k h[q * r + k] · bt[k *
// ld + c], vectorised over c with no horizontal sums; each B vector is loaded once for the
// block's CNT rows. Every output is the same sum (k in order, in one accumulator, then added
// to o once) whatever NV, so a row's result does not depend on its block. float and
// bfloat16 (B and o converted on load, o rounded once on store). Returns the columns done.
template <typename scalar_t, int CNT, int NV>
int64_t expand_cols(const scalar_t* bt, int64_t ld, const float* h, int64_t r, int64_t width,
                    scalar_t* const* o, int64_t n) {
#if defined(__AVX2__) && defined(__FMA__)
  for (; n + 8 * NV <= width; n += 8 * NV) {
    __m256 acc[CNT][NV];
    for (int q = 0; q < CNT; ++q)
      for (int v = 0; v < NV; ++v) acc[q][v] = _mm256_setzero_ps();
    for (int64_t k = 0; k < r; ++k) {
      __m256 b[NV];
      for (int v = 0; v < NV; ++v) b[v] = load8(bt + k * ld + n + 8 * v);
      for (int q = 0; q < CNT; ++q) {
        const __m256 hq = _mm256_set1_ps(h[q * r + k]);
        for (int v = 0; v < NV; ++v) acc[q][v] = _mm256_fmadd_ps(hq, b[v], acc[q][v]);
      }
    }
    for (int q = 0; q < CNT; ++q)
      for (int v = 0; v < NV; ++v)
        store8(o[q] + n + 8 * v, _mm256_add_ps(load8(o[q] + n + 8 * v), acc[q][v]));
  }
#endif
  return n;
}

// expand_cols over as many columns as vectors allow: CNT rows take 8·NV columns a step with
// CNT·NV = 8 accumulators (enough independent FMAs to hide their latency; one row alone
// streams B fastest in wide steps), then 16 at a time. The columns done are the multiples of
// 16 below width whatever CNT.
template <typename scalar_t, int CNT>
int64_t expand_block_t_vec(const scalar_t* bt, int64_t ld, const float* h, int64_t r,
                           int64_t width, scalar_t* const* o) {
  constexpr int NV = CNT == 1 ? 8 : CNT == 2 ? 4 : 2;
  int64_t n = expand_cols<scalar_t, CNT, NV>(bt, ld, h, r, width, o, 0);
  if constexpr (NV > 2) n = expand_cols<scalar_t, CNT, 2>(bt, ld, h, r, width, o, n);
  return n;
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// The bfloat16 bits of h[k] and h[k + 1] (0 past the rank) as one VDPBF16PS pair, in every
// lane. h holds bfloat16 values already (round_to_bf16): taking the high halves is exact.
inline __m512bh h_pair(const float* h, int64_t k, int64_t r) {
  uint32_t lo = 0, hi = 0;
  std::memcpy(&lo, h + k, sizeof lo);
  if (k + 1 < r) std::memcpy(&hi, h + k + 1, sizeof hi);
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32((lo >> 16) | (hi & 0xFFFF0000u)));
}

// The expand of CNT rows by VDPBF16PS from an r-major bfloat16 B, 32·NV columns a step from
// column n on: rank rows k and k + 1 of B are interleaved per column (unpacklo/hi: columns
// 0-3, 8-11, 16-19, 24-27 of each 32 in one vector, the others in the second), each
// column's pair of products added to its fp32 sum, k in order; the sums are put back in
// column order and added to o once, rounded to nearest even. Every output is the same sum
// whatever CNT and NV, so a row's result does not depend on its block. Never reads B past
// rank row r - 1. h: [CNT][r], bfloat16 values (the shrink's sums rounded, as PEFT's bf16
// lora_A output is). Returns the columns done.
template <int CNT, int NV>
int64_t expand_cols_dpbf16(const c10::BFloat16* bt, int64_t ld, const float* h, int64_t r,
                           int64_t width, c10::BFloat16* const* o, int64_t n) {
  const __m512i first = _mm512_setr_epi32(0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7, 20, 21, 22, 23);
  const __m512i second =
      _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31);
  for (; n + 32 * NV <= width; n += 32 * NV) {
    __m512 lo[CNT][NV], hi[CNT][NV];
    for (int q = 0; q < CNT; ++q)
      for (int v = 0; v < NV; ++v) lo[q][v] = hi[q][v] = _mm512_setzero_ps();
    for (int64_t k = 0; k < r; k += 2) {
      __m512bh pl[NV], ph[NV];
      for (int v = 0; v < NV; ++v) {
        const __m512i b0 = _mm512_loadu_si512(bt + k * ld + n + 32 * v);
        const __m512i b1 =
            k + 1 < r ? _mm512_loadu_si512(bt + (k + 1) * ld + n + 32 * v) : _mm512_setzero_si512();
        pl[v] = reinterpret_cast<__m512bh>(_mm512_unpacklo_epi16(b0, b1));
        ph[v] = reinterpret_cast<__m512bh>(_mm512_unpackhi_epi16(b0, b1));
      }
      for (int q = 0; q < CNT; ++q) {
        const __m512bh hq = h_pair(h + q * r, k, r);
        for (int v = 0; v < NV; ++v) {
          lo[q][v] = _mm512_dpbf16_ps(lo[q][v], pl[v], hq);
          hi[q][v] = _mm512_dpbf16_ps(hi[q][v], ph[v], hq);
        }
      }
    }
    for (int q = 0; q < CNT; ++q)
      for (int v = 0; v < NV; ++v)
        for (int half = 0; half < 2; ++half) {
          const __m512 sums = _mm512_permutex2var_ps(lo[q][v], half ? second : first, hi[q][v]);
          c10::BFloat16* dst = o[q] + n + 32 * v + 16 * half;
          const __m512 sum = _mm512_add_ps(load16(dst), sums);
          _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                              reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(sum)));
        }
  }
  return n;
}

// h[0, n) rounded to bfloat16 values (nearest even), in place: the expand's inputs where it
// runs on VDPBF16PS.
inline void round_to_bf16(float* h, int64_t n) {
  for (int64_t i = 0; i < n; ++i) h[i] = static_cast<float>(c10::BFloat16(h[i]));
}

// expand_cols_dpbf16 over as many columns as it allows: 2·CNT·NV >= 6 accumulators (128
// columns a step for one row, 64 for two, 32 for more), then 32; the columns done are the
// multiples of 32 below width whatever CNT.
template <int CNT>
int64_t expand_block_dpbf16(const c10::BFloat16* bt, int64_t ld, const float* h, int64_t r,
                            int64_t width, c10::BFloat16* const* o) {
  constexpr int NV = CNT == 1 ? 4 : CNT == 2 ? 2 : 1;
  int64_t n = expand_cols_dpbf16<CNT, NV>(bt, ld, h, r, width, o, 0);
  if constexpr (NV > 1) n = expand_cols_dpbf16<CNT, 1>(bt, ld, h, r, width, o, n);
  return n;
}
#endif

// f.template operator()<C>() for C = cnt (1..kBlock; more reads as kBlock): the block
// kernels take their row count as a template argument (their accumulators are registers).
template <typename F>
int64_t by_count(int64_t cnt, F&& f) {
  static_assert(kBlock == 4, "one case per row count");
  switch (cnt) {
    case 1: return f.template operator()<1>();
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    default: return f.template operator()<4>();
  }
}

template <typename scalar_t>
void expand_block_t(const scalar_t* bt, int64_t ld, const float* h, int64_t r, int64_t cnt,
                    int64_t width, scalar_t* const* o) {
  int64_t n = 0;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>)  // 32 columns a step; the rest below
    n = by_count(cnt, [&]<int C>() { return expand_block_dpbf16<C>(bt, ld, h, r, width, o); });
#endif
  if constexpr (std::is_same_v<scalar_t, float> || std::is_same_v<scalar_t, c10::BFloat16>) {
    if (n < width) {  // 16 columns a step from column `done` on
      const int64_t done = n;
      scalar_t* rest[kBlock];
      for (int64_t q = 0; q < cnt; ++q) rest[q] = o[q] + done;
      n += by_count(cnt, [&]<int C>() {
        return expand_block_t_vec<scalar_t, C>(bt + done, ld, h, r, width - done, rest);
      });
    }
  }
  for (int64_t q = 0; q < cnt; ++q)
    for (int64_t c = n; c < width; ++c) {
      float acc = 0.f;
      for (int64_t k = 0; k < r; ++k) acc += static_cast<float>(bt[k * ld + c]) * h[q * r + k];
      o[q][c] = static_cast<scalar_t>(static_cast<float>(o[q][c]) + acc);
    }
}

#if defined(__AVX2__) && defined(__FMA__)
// h[q * r + k0 + j] = a_{k0+j} · x_q for KR rank rows of A and CNT token rows of x (fp32,
// [CNT][in]): KR·CNT accumulators, each A and x vector loaded once for all of them. Each
// accumulator sums the columns c ≡ l (mod 8) in lane l in order of c, then its lanes
// (hsum8), then the columns past the last multiple of 8 in order: the same sum whatever CNT
// and KR, so a row's h does not depend on its block.
template <typename scalar_t, int CNT, int KR>
void shrink_tile(const scalar_t* a, int64_t lda, int64_t in, const float* x, int64_t r,
                 int64_t k0, float* h) {
  __m256 s[KR][CNT];
  for (int j = 0; j < KR; ++j)
    for (int q = 0; q < CNT; ++q) s[j][q] = _mm256_setzero_ps();
  const int64_t in8 = in - in % 8;
  for (int64_t c = 0; c < in8; c += 8) {
    __m256 xv[CNT];
    for (int q = 0; q < CNT; ++q) xv[q] = _mm256_loadu_ps(x + q * in + c);
    for (int j = 0; j < KR; ++j) {
      const __m256 av = load8(a + (k0 + j) * lda + c);
      for (int q = 0; q < CNT; ++q) s[j][q] = _mm256_fmadd_ps(av, xv[q], s[j][q]);
    }
  }
  for (int j = 0; j < KR; ++j)
    for (int q = 0; q < CNT; ++q) {
      float t = hsum8(s[j][q]);
      for (int64_t c = in8; c < in; ++c)
        t += static_cast<float>(a[(k0 + j) * lda + c]) * x[q * in + c];
      h[q * r + k0 + j] = t;
    }
}

// shrink_tile over every rank row: KR rows at a time so that KR·CNT >= 8 accumulators hide
// the FMA latency (one token alone reads eight A rows at once), the last ones singly.
template <typename scalar_t, int CNT>
void shrink_rows(const scalar_t* a, int64_t lda, int64_t in, const float* x, int64_t r,
                 float* h) {
  constexpr int KR = CNT == 1 ? 8 : CNT == 2 ? 4 : 2;
  int64_t k = 0;
  for (; k + KR <= r; k += KR) shrink_tile<scalar_t, CNT, KR>(a, lda, in, x, r, k, h);
  for (; k < r; ++k) shrink_tile<scalar_t, CNT, 1>(a, lda, in, x, r, k, h);
}
#endif

// h[q * r + k] = a[k · lda :] · x[q] for the block's cnt <= kBlock rows (x rows already
// fp32): every A row is loaded once for all of them.
template <typename scalar_t>
void shrink_block(const scalar_t* a, int64_t lda, int64_t in, const float* x, int64_t cnt,
                  int64_t r, float* h) {
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVec8<scalar_t>) {
    by_count(cnt, [&]<int C>() {
      shrink_rows<scalar_t, C>(a, lda, in, x, r, h);
      return int64_t{0};
    });
    return;
  }
#endif
  if (cnt == 1) {
    for (int64_t k = 0; k < r; ++k) {
      const scalar_t* a_k = a + k * lda;
      float acc = 0.f;
#pragma omp simd reduction(+ : acc)
      for (int64_t c = 0; c < in; ++c) acc += static_cast<float>(a_k[c]) * x[c];
      h[k] = acc;
    }
    return;
  }
  // Rows past cnt repeat the last row; their sums are computed and dropped.
  const float* x0 = x;
  const float* x1 = x + std::min<int64_t>(1, cnt - 1) * in;
  const float* x2 = x + std::min<int64_t>(2, cnt - 1) * in;
  const float* x3 = x + std::min<int64_t>(3, cnt - 1) * in;
  for (int64_t k = 0; k < r; ++k) {
    const scalar_t* a_k = a + k * lda;
    float s0 = 0.f, s1 = 0.f, s2 = 0.f, s3 = 0.f;
#pragma omp simd reduction(+ : s0, s1, s2, s3)
    for (int64_t c = 0; c < in; ++c) {
      const float av = static_cast<float>(a_k[c]);
      s0 += av * x0[c];
      s1 += av * x1[c];
      s2 += av * x2[c];
      s3 += av * x3[c];
    }
    const float sums[4] = {s0, s1, s2, s3};
    for (int64_t q = 0; q < cnt; ++q) h[q * r + k] = sums[q];
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// KR rank rows of A against CNT rows of x (bfloat16, in % 32 == 0) by VDPBF16PS, 32
// products a step, each exact in fp32 and summed in fp32: h[q * r + k0 + j] = a_{k0+j} · x_q.
// KR·CNT independent accumulators; each sums its products in order of c, then its lanes, so
// a row's h does not depend on its block or on KR.
template <int CNT, int KR>
void shrink_tile_bf16_512(const c10::BFloat16* a, int64_t lda, int64_t in,
                          const c10::BFloat16* const* x, int64_t r, int64_t k0, float* h) {
  __m512 s[KR][CNT];
  for (int j = 0; j < KR; ++j)
    for (int q = 0; q < CNT; ++q) s[j][q] = _mm512_setzero_ps();
  for (int64_t c = 0; c < in; c += 32) {
    __m512bh xv[CNT];
    for (int q = 0; q < CNT; ++q)
      xv[q] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(x[q] + c));
    for (int j = 0; j < KR; ++j) {
      const __m512bh av = reinterpret_cast<__m512bh>(_mm512_loadu_si512(a + (k0 + j) * lda + c));
      for (int q = 0; q < CNT; ++q) s[j][q] = _mm512_dpbf16_ps(s[j][q], av, xv[q]);
    }
  }
  for (int j = 0; j < KR; ++j)
    for (int q = 0; q < CNT; ++q) h[q * r + k0 + j] = _mm512_reduce_add_ps(s[j][q]);
}

// shrink_block for bfloat16 A and x (x's own rows, in % 32 == 0): KR rank rows at a time so
// that KR·CNT >= 8 accumulators hide VDPBF16PS's latency, the last ones singly (the same
// sums as the fp32 form, in another order).
template <int CNT>
void shrink_rows_bf16_512(const c10::BFloat16* a, int64_t lda, int64_t in,
                          const c10::BFloat16* const* x, int64_t r, float* h) {
  constexpr int KR = CNT == 1 ? 8 : CNT == 2 ? 4 : 2;
  int64_t k = 0;
  for (; k + KR <= r; k += KR) shrink_tile_bf16_512<CNT, KR>(a, lda, in, x, r, k, h);
  for (; k < r; ++k) shrink_tile_bf16_512<CNT, 1>(a, lda, in, x, r, k, h);
}

inline void shrink_block_bf16_512(const c10::BFloat16* a, int64_t lda, int64_t in,
                                  const c10::BFloat16* const* x, int64_t cnt, int64_t r,
                                  float* h) {
  by_count(cnt, [&]<int C>() {
    shrink_rows_bf16_512<C>(a, lda, in, x, r, h);
    return int64_t{0};
  });
}
#endif

}  // namespace lora_blocks
