// CPU bfloat16 GEMM y = x · Wᵀ (+ bias) by AVX512-BF16 (VDPBF16PS), with W packed once into
// 32-column panels: the bf16 linears of the CPU path (PackedLinear) where the CPU has
// AVX512-BF16 but no AMX. Built on first use by kernel_backends/cpu/extension.py.
//
// Layout: k runs in pairs (k = 2j, 2j + 1; an odd K ends in a zero). Panel p holds output
// columns 32p .. 32p+31 as [K/2][32][2] (columns past N are zero): one k pair of the panel is
// two 64-byte vectors, read in the order the 8 x 32 register tile consumes them. x is
// packed per call into strips of up to 8 rows, [K/2][8] pairs (rows past a strip's own
// zero), shared out as evenly as ceil(M / 8) strips allow. A tile runs the whole K in
// registers (16 fp32 accumulators), then adds nothing more: y = bf16(bias + Σ pairs), rounded
// to nearest even once. Threads split the panels. With two strips or more, each strip's
// tile requests its share of the thread's next panel while it computes (the panel's first
// strip then finds it in cache: 32 rows, 13 % faster than each strip reading its own panel
// a little ahead, which one strip alone still does).
//
// Every output element is the same sequence of VDPBF16PS steps (k pairs in order, the bias
// first) whatever the number of rows and threads: a row's result does not depend on what it
// is batched with.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>

#include "strips.h"

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define LP_BF16_PANEL_GEMM 1
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kMr = 8, kNr = 32;

#ifdef LP_BF16_PANEL_GEMM
// Rows r of the tile: two accumulators each (columns 0-15, 16-31), named (the compiler
// spills an array of them).
#define BG_ROWS(F) F(0) F(1) F(2) F(3) F(4) F(5) F(6) F(7)
#define BG_DECLARE(r) __m512 c##r##0, c##r##1;
#define BG_INIT(r)    \
  if constexpr (R > r) { \
    c##r##0 = init0;     \
    c##r##1 = init1;     \
  }
#define BG_DOT(r)                                                                   \
  if constexpr (R > r) {                                                            \
    const __m512bh x = (__m512bh)_mm512_set1_epi32(static_cast<int>(a[r]));        \
    c##r##0 = _mm512_dpbf16_ps(c##r##0, x, b0);                                     \
    c##r##1 = _mm512_dpbf16_ps(c##r##1, x, b1);                                     \
  }
#define BG_STORE(r)                                                                 \
  if constexpr (R > r) {                                                            \
    _mm256_mask_storeu_epi16(y + r * ldy, lo, (__m256i)_mm512_cvtneps_pbh(c##r##0)); \
    _mm256_mask_storeu_epi16(y + r * ldy + 16, hi,                                  \
                             (__m256i)_mm512_cvtneps_pbh(c##r##1));                 \
  }

// y[R][cols] (rows ldy apart) = bf16(bias + Σ_j a[j][0..R) · b[j]): a: a strip of packed x
// ([K2][8] pairs); b: a panel ([K2][2] vectors of 16 pairs, 64-byte aligned). `stream`: this
// tile is the panel's first read, so prefetch the panel a few pairs ahead of the loads.
// `next_lines` cache lines from `next` on are requested too, evenly over the k pairs.
template <int R>
void tile(int64_t K2, const uint32_t* __restrict a, const __m512bh* __restrict b,
          uint16_t* __restrict y, int64_t ldy, int64_t cols, const float* bias, bool stream,
          const char* next, int64_t next_lines) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const __m512 init0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
  const __m512 init1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
  BG_ROWS(BG_DECLARE)
  BG_ROWS(BG_INIT)
  constexpr int64_t kAhead = 8;  // pairs: 1 KB of the panel ahead
  int64_t owed = 0;  // next_lines per k pair, in K2ths: every line requested by the last pair
  for (int64_t j = 0; j < K2; ++j, a += kMr, b += 2) {
    for (owed += next_lines; owed >= K2; owed -= K2, next += 64) _mm_prefetch(next, _MM_HINT_T0);
    if (stream) {
      _mm_prefetch(reinterpret_cast<const char*>(b + 2 * kAhead), _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(b + 2 * kAhead + 1), _MM_HINT_T0);
    }
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(b), b1 = (__m512bh)_mm512_loadu_si512(b + 1);
    BG_ROWS(BG_DOT)
  }
  BG_ROWS(BG_STORE)
}

void tile_rows(int64_t rows, int64_t K2, const uint32_t* a, const __m512bh* b, uint16_t* y,
               int64_t ldy, int64_t cols, const float* bias, bool stream, const char* next,
               int64_t next_lines) {
  switch (rows) {
    case 8: return tile<8>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
    case 7: return tile<7>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
    case 6: return tile<6>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
    case 5: return tile<5>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
    case 4: return tile<4>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
    case 3: return tile<3>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
    case 2: return tile<2>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
    default: return tile<1>(K2, a, b, y, ldy, cols, bias, stream, next, next_lines);
  }
}
#endif

// x [M, K] bf16 -> strips [S][K2][8] pairs (k 2j in the low half; a missing k or row is 0)
void pack_rows(const uint16_t* x, int64_t M, int64_t K, uint32_t* strips) {
  const int64_t S = (M + kMr - 1) / kMr, K2 = (K + 1) / 2;
  at::parallel_for(0, S, 1, [&](int64_t s0, int64_t s1) {
    for (int64_t s = s0; s < s1; ++s) {
      uint32_t* dst = strips + s * K2 * kMr;
      const int64_t first = strip_start(s, M, S), rows = strip_start(s + 1, M, S) - first;
      for (int64_t i = 0; i < kMr; ++i) {
        const uint16_t* row = x + (first + i) * K;
        for (int64_t j = 0; j < K2; ++j) {
          uint32_t pair = 0;
          if (i < rows) {
            pair = row[2 * j];
            if (2 * j + 1 < K) pair |= static_cast<uint32_t>(row[2 * j + 1]) << 16;
          }
          dst[j * kMr + i] = pair;
        }
      }
    }
  });
}

}  // namespace

bool bf16_panel_gemm_available() {
#ifdef LP_BF16_PANEL_GEMM
  return true;
#else
  return false;
#endif
}

// weight [N, K] -> panels [ceil(N/32), ceil(K/2), 64] bfloat16: element (j, c, h) of panel p
// is W[32p + c, 2j + h] (0 past N or K)
torch::Tensor pack_panels_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_panels_bf16: weight must be [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t P = (N + kNr - 1) / kNr, K2 = (K + 1) / 2;
  const auto w = weight.detach().contiguous().to(torch::kBFloat16);
  auto panels = torch::zeros({P, K2, 2 * kNr}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(panels.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t c = 0; c < kNr && p * kNr + c < N; ++c)
        for (int64_t k = 0; k < K; ++k)
          dst[(p * K2 + k / 2) * 2 * kNr + 2 * c + k % 2] = src[(p * kNr + c) * K + k];
  });
  return panels;
}

// x [M, K] bfloat16 -> y [M, N] = x · Wᵀ (+ bias) in bfloat16; panels from
// pack_panels_bf16(W); bias, if defined, float32 [N].
torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels,
                                c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16,
              "panel_linear_bf16: x must be 2-D bfloat16");
  const int64_t K = x.size(1), K2 = (K + 1) / 2;
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == torch::kBFloat16 &&
                  panels.size(2) == 2 * kNr && panels.size(1) == K2 &&
                  panels.size(0) == (N + kNr - 1) / kNr && panels.is_contiguous(),
              "panel_linear_bf16: panels do not match x and N");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == torch::kFloat &&
                        bias->numel() == N),
              "panel_linear_bf16: bias must be float32 [N]");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0), P = panels.size(0);
  auto y = torch::empty({M, N}, xc.options());
#ifdef LP_BF16_PANEL_GEMM
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias ? y.copy_(bias->expand({M, N})) : y.zero_();
  const int64_t S = (M + kMr - 1) / kMr;
  // uninitialised (pack_rows writes every element)
  std::unique_ptr<uint32_t[]> strips(new uint32_t[S * K2 * kMr]);
  pack_rows(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K,
            strips.get());
  const float* pb = bias ? bias->data_ptr<float>() : nullptr;
  const auto* w = reinterpret_cast<const __m512bh*>(panels.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t panel_lines = 2 * K2;  // a panel: K2 pairs of two 64-byte vectors
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t cols = std::min(kNr, N - p * kNr);
      const bool ahead = S >= 2 && p + 1 < p1;  // strip s requests part s of the next panel
      const char* next = reinterpret_cast<const char*>(w + (p + 1) * K2 * 2);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t first = strip_start(s, M, S), rows = strip_start(s + 1, M, S) - first;
        const int64_t l0 = s * panel_lines / S, l1 = (s + 1) * panel_lines / S;
        tile_rows(rows, K2, strips.get() + s * K2 * kMr, w + p * K2 * 2,
                  out + first * N + p * kNr, N, cols, pb ? pb + p * kNr : nullptr,
                  s == 0 && (S == 1 || p == p0), ahead ? next + 64 * l0 : nullptr,
                  ahead ? l1 - l0 : 0);
      }
    }
  });
#else
  TORCH_CHECK(false, "panel_linear_bf16: built without AVX512-BF16");
#endif
  return y;
}
