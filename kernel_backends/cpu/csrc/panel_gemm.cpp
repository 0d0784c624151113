// CPU float32 GEMM y = x · Wᵀ (+ bias) with W packed once into 16-column panels: the linears
// of the CPU path (PackedLinear). Built on first use by kernel_backends/cpu/extension.py.
//
// Layout: panel p holds output columns 16p .. 16p+15 as [K][16] (columns past N are zero),
// so a panel streams from memory once per call in the order the 6 x 16 register tile reads
// it. x is packed per call into strips of up to 6 rows ([K][6]), as even as they go. K runs
// in near-equal blocks (k_block: a block of a panel, at most 20 KB, stays in L1 while every
// strip of rows reads it); threads split the panels.
//
// Every output element is the same sequence of FMAs whatever the number of rows and
// threads (k blocks in order, k in order within a block, bias first): a row's result does
// not depend on what it is batched with.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "strips.h"
#include "tile_6x16.h"

#if defined(__AVX2__) && defined(__FMA__)
#define LP_PANEL_GEMM 1
#endif

namespace {

constexpr int64_t kMr = 6, kNr = 16;
constexpr int64_t kStripsPerChunk = 16;  // 96 rows of packed x stay in L2 across panels

// K in near-equal blocks of at most 320, or of 96 (64) for up to 10 (2) strips of x: then a
// k block of every strip (24 B a k each) and of B (64 B a k) fit in L1 together, and each
// block of B is read from L1 by all the strips (with more strips, 320 is as fast or
// faster). The k blocks do not change the order of the FMAs, so the result does not depend
// on them.
int64_t k_block(int64_t K, int64_t strips) {
  const int64_t max_kc = strips <= 2 ? 64 : strips <= 10 ? 96 : 320;
  const int64_t blocks = (K + max_kc - 1) / max_kc;
  return (K + blocks - 1) / blocks;
}

#ifdef LP_PANEL_GEMM
// Up to six rows x sixteen columns of accumulators, named (an array of them is spilled).
#define PG_INIT(r)                                                         \
  if constexpr (R > r) {                                                   \
    if (acc) {                                                             \
      c##r##0 = _mm256_loadu_ps(c + r * ldc);                              \
      c##r##1 = _mm256_loadu_ps(c + r * ldc + 8);                          \
    } else {                                                               \
      c##r##0 = init0;                                                     \
      c##r##1 = init1;                                                     \
    }                                                                      \
  }
#define PG_FMA(r)                                                          \
  if constexpr (R > r) {                                                   \
    const __m256 x = _mm256_broadcast_ss(a + r);                           \
    LP_TILE_FMA(r, x, b0, b1)                                              \
  }
#define PG_STORE(r)                                                        \
  if constexpr (R > r) {                                                   \
    LP_TILE_STORE(r, c, ldc)                                               \
  }

// c[R][16] (rows ldc apart) = (acc ? c : bias) + Σ_k a[k][0..R) ⊗ b[k][0..16)
// a: a strip of packed x ([kc][6]); b: a block of a panel ([kc][16], 32-byte aligned).
// First, prefetch `lines` cache lines from `ahead` (a share of the next block of B).
template <int R>
void tile(int64_t kc, const float* __restrict a, const float* __restrict b,
          float* __restrict c, int64_t ldc, bool acc, const float* bias, const char* ahead,
          int64_t lines) {
  for (int64_t i = 0; i < lines; ++i) _mm_prefetch(ahead + 64 * i, _MM_HINT_T0);
  const __m256 init0 = bias ? _mm256_loadu_ps(bias) : _mm256_setzero_ps();
  const __m256 init1 = bias ? _mm256_loadu_ps(bias + 8) : _mm256_setzero_ps();
  LP_TILE_ROWS(LP_TILE_DECLARE)
  LP_TILE_ROWS(PG_INIT)
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(b), b1 = _mm256_load_ps(b + 8);
    LP_TILE_ROWS(PG_FMA)
    a += kMr;
    b += kNr;
  }
  LP_TILE_ROWS(PG_STORE)
}

void tile_rows(int64_t rows, int64_t kc, const float* a, const float* b, float* c,
               int64_t ldc, bool acc, const float* bias, const char* ahead, int64_t lines) {
  switch (rows) {
    case 6: return tile<6>(kc, a, b, c, ldc, acc, bias, ahead, lines);
    case 5: return tile<5>(kc, a, b, c, ldc, acc, bias, ahead, lines);
    case 4: return tile<4>(kc, a, b, c, ldc, acc, bias, ahead, lines);
    case 3: return tile<3>(kc, a, b, c, ldc, acc, bias, ahead, lines);
    case 2: return tile<2>(kc, a, b, c, ldc, acc, bias, ahead, lines);
    default: return tile<1>(kc, a, b, c, ldc, acc, bias, ahead, lines);
  }
}

// x [M, K] -> strips [S][K][6] (rows past a strip's own zero)
void pack_rows(const float* x, int64_t M, int64_t K, float* strips) {
  const int64_t S = (M + kMr - 1) / kMr;
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      float* dst = strips + s * K * kMr;
      const int64_t first = strip_start(s, M, S), rows = strip_start(s + 1, M, S) - first;
      if (rows == kMr) {  // a full strip: six rows read in step, written in order
        const float* r0 = x + first * K;
        const float *r1 = r0 + K, *r2 = r1 + K, *r3 = r2 + K, *r4 = r3 + K, *r5 = r4 + K;
        for (int64_t k = 0; k < K; ++k, dst += kMr) {
          dst[0] = r0[k]; dst[1] = r1[k]; dst[2] = r2[k];
          dst[3] = r3[k]; dst[4] = r4[k]; dst[5] = r5[k];
        }
        continue;
      }
      for (int64_t i = 0; i < kMr; ++i)
        for (int64_t k = 0; k < K; ++k)
          dst[k * kMr + i] = i < rows ? x[(first + i) * K + k] : 0.f;
    }
  });
}

// Panels [p0, p1) of y for strips [c0, c1). Full panels write y in place; the last panel of
// an N that is no multiple of 16 goes through a scratch tile. While the strips read a block
// of B from L1, each also prefetches its share of the next block (this panel's next k block,
// else the next panel's first): B then streams from memory ahead of its first use.
void panel_range(int64_t p0, int64_t p1, int64_t c0, int64_t c1, const float* strips,
                 const float* panels, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K) {
  const int64_t S = (M + kMr - 1) / kMr, kc = k_block(K, S);
  alignas(64) float scratch[kMr * kNr];
  for (int64_t p = p0; p < p1; ++p) {
    const int64_t cols = std::min(kNr, N - p * kNr);
    const float* pb = bias ? bias + p * kNr : nullptr;
    for (int64_t k0 = 0; k0 < K; k0 += kc) {
      const int64_t kb = std::min(kc, K - k0);
      const float* b = panels + (p * K + k0) * kNr;
      const bool last_k = k0 + kc >= K;
      const float* next = !last_k     ? b + kc * kNr
                          : p + 1 < p1 ? panels + (p + 1) * K * kNr
                                       : nullptr;
      // one 64-byte line per k of the next block, shared out across the strips
      const int64_t next_lines = next ? std::min(kc, last_k ? K : K - k0 - kc) : 0;
      const int64_t share = (next_lines + (c1 - c0) - 1) / (c1 - c0);
      for (int64_t s = c0; s < c1; ++s) {
        const int64_t l0 = std::min(next_lines, (s - c0) * share);
        const int64_t lines = std::min(next_lines - l0, share);
        const char* ahead = next ? reinterpret_cast<const char*>(next + l0 * kNr) : nullptr;
        const int64_t first = strip_start(s, M, S), rows = strip_start(s + 1, M, S) - first;
        const float* a = strips + (s * K + k0) * kMr;
        float* out = y + first * N + p * kNr;
        if (cols == kNr) {
          tile_rows(rows, kb, a, b, out, N, k0 > 0, pb, ahead, lines);
          continue;
        }
        for (int64_t i = 0; i < rows && k0 > 0; ++i)
          std::memcpy(scratch + i * kNr, out + i * N, cols * sizeof(float));
        tile_rows(rows, kb, a, b, scratch, kNr, k0 > 0, pb, ahead, lines);
        for (int64_t i = 0; i < rows; ++i)
          std::memcpy(out + i * N, scratch + i * kNr, cols * sizeof(float));
      }
    }
  }
}
#endif

}  // namespace

bool panel_gemm_available() {
#ifdef LP_PANEL_GEMM
  return true;
#else
  return false;
#endif
}

// weight [N, K] -> panels [ceil(N/16), K, 16] float32, 64-byte aligned rows of 16
torch::Tensor pack_panels(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels: weight must be [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1), P = (N + kNr - 1) / kNr;
  const auto w = weight.detach().contiguous().to(torch::kFloat);
  auto panels = torch::zeros({P, K, kNr}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = panels.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t j = 0; j < kNr && p * kNr + j < N; ++j)
        for (int64_t k = 0; k < K; ++k) dst[(p * K + k) * kNr + j] = src[(p * kNr + j) * K + k];
  });
  return panels;
}

// x [M, K] float32 -> y [M, N] = x · Wᵀ (+ bias); panels from pack_panels(W); bias, if
// defined, padded to a multiple of 16 floats.
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels,
                           c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat,
              "panel_linear: x must be 2-D float32");
  TORCH_CHECK(panels.dim() == 3 && panels.size(2) == kNr && panels.size(1) == x.size(1) &&
                  panels.size(0) == (N + kNr - 1) / kNr && panels.is_contiguous(),
              "panel_linear: panels do not match x and N");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->numel() == panels.size(0) * kNr),
              "panel_linear: bias must hold ceil(N/16)*16 floats");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), K = xc.size(1), P = panels.size(0);
  auto y = torch::empty({M, N}, xc.options());
#ifdef LP_PANEL_GEMM
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias ? y.copy_(bias->narrow(0, 0, N).expand({M, N})) : y.zero_();
  const int64_t S = (M + kMr - 1) / kMr;
  // uninitialised (pack_rows writes every element): a std::vector would zero it first
  std::unique_ptr<float[]> buffer(new float[S * K * kMr + 16]);
  float* strips = reinterpret_cast<float*>(
      (reinterpret_cast<uintptr_t>(buffer.get()) + 63) & ~uintptr_t(63));
  pack_rows(xc.data_ptr<float>(), M, K, strips);
  const float* pb = bias ? bias->data_ptr<float>() : nullptr;
  const float* w = panels.data_ptr<float>();
  float* out = y.data_ptr<float>();
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t c0 = 0; c0 < S; c0 += kStripsPerChunk)
      panel_range(p0, p1, c0, std::min(S, c0 + kStripsPerChunk), strips, w, pb, out, M, N, K);
  });
#else
  TORCH_CHECK(false, "panel_linear: built without AVX2/FMA");
#endif
  return y;
}
