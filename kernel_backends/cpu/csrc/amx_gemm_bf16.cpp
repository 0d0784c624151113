// CPU bfloat16 GEMM y = x · Wᵀ (+ bias) on AMX tiles (TDPBF16PS), with W packed once into
// 32-column panels of 16 x 16-pair B tiles: the batch-invariant bf16 linears of the CPU path
// (PackedLinear's "amx_tiles" layout) where the CPU has AMX. Built on first use by
// kernel_backends/cpu/extension.py; without AMX at build time (-march=native) it compiles to
// stubs and amx_gemm_bf16_available() is false.
//
// Layout: K runs in blocks of 32 (16 k pairs; past K: zeros). Panel p holds output columns
// 32p .. 32p+31 as [KB][2][16][32]: for k block b, half h (columns 16h .. 16h+15) is one
// 1 KB B tile, row j = k pair (32b + 2j, 32b + 2j + 1) of 16 columns, pairs interleaved
// ((j, 2c + e) = W[32p + 16h + c, 32b + 2j + e]; columns past N are zero). A panel is
// contiguous, read front to back. A tiles are 16 rows x 32 k of x in place (row stride K),
// or of a zero-padded copy where K is not a multiple of 32 or for the last rows (< 16).
//
// Invariance: TDPBF16PS computes each C element from its own A row and B column only, so
// an output element is the same sequence of k blocks 0 .. KB-1 from a zero tile, whichever
// block shape (32 x 32 from 2 A tiles, or 16 x 32 from 1), row count, place and thread
// computes it; then y = bf16(sum + bias), the float32 sum and bias added once and rounded to
// nearest even once. A row's bits do not depend on what it is batched with.
//
// Threads: rows in chunks of kChunkRows, each chunk's panels shared out (chunk-major, so a
// thread's A rows stay in L2 while its panels stream); within an item, 32-row blocks. Every
// thread loads its tile configuration at the start of the call (oneDNN's AMX kernels run on
// the same threads with their own) and releases the tiles at the end.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <mutex>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512F__) && \
    defined(__AVX512BF16__) && defined(__linux__)
#define LP_AMX_GEMM 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTile = 16;        // rows of a tile; k pairs of a B tile; columns of a C tile
constexpr int64_t kKBlock = 32;      // bf16 k values of an A tile row
constexpr int64_t kPanel = 32;       // output columns of a panel (two B tiles)
constexpr int64_t kBlockRows = 32;   // rows of an output block (two A tiles)
constexpr int64_t kChunkRows = 256;  // rows of a work item: a thread's A rows stay in L2

#ifdef LP_AMX_GEMM
// Linux hands out AMX tile state only on request (once per process; torch or oneDNN may
// have asked already, asking again is harmless).
bool request_amx() {
  static bool granted = false;
  static std::once_flag once;
  std::call_once(once, [] {
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    granted = syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  });
  return granted;
}

// palette 1: tiles 0-1 A (16 rows x 64 bytes), 2-3 B (16 pairs x 16 columns), 4-7 C
// (16 x 16 float32); every tile 16 rows of 64 bytes.
struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  TileConfig() {
    for (int t = 0; t < 8; ++t) {
      colsb[t] = 64;
      rows[t] = kTile;
    }
  }
};

// c[TA * 16][32] (float32, row stride 32) = Σ_b A(b) · B(b) over k blocks b = 0 .. KB-1 in
// order, from zero tiles: a0 (and a1 where TA == 2) the A tiles' first rows (stride lda
// elements), b the panel ([KB][2][16][32]).
template <int TA>
void block(const uint16_t* a0, const uint16_t* a1, int64_t lda, const uint16_t* b, int64_t KB,
           float* c) {
  const int64_t stride = lda * 2;
  _tile_zero(4);
  _tile_zero(5);
  if constexpr (TA == 2) {
    _tile_zero(6);
    _tile_zero(7);
  }
  for (int64_t kb = 0; kb < KB; ++kb, b += 2 * kTile * kPanel) {
    _tile_loadd(2, b, 64);
    _tile_loadd(3, b + kTile * kPanel, 64);
    _tile_loadd(0, a0 + kb * kKBlock, stride);
    _tile_dpbf16ps(4, 0, 2);
    _tile_dpbf16ps(5, 0, 3);
    if constexpr (TA == 2) {
      _tile_loadd(1, a1 + kb * kKBlock, stride);
      _tile_dpbf16ps(6, 1, 2);
      _tile_dpbf16ps(7, 1, 3);
    }
  }
  _tile_stored(4, c, kPanel * 4);
  _tile_stored(5, c + kTile, kPanel * 4);
  if constexpr (TA == 2) {
    _tile_stored(6, c + kTile * kPanel, kPanel * 4);
    _tile_stored(7, c + kTile * kPanel + kTile, kPanel * 4);
  }
}

// y[rows][cols] (row stride ldy) = bf16(c + bias), rounded to nearest even once
void store_rows(const float* c, int64_t rows, int64_t cols, const float* bias, uint16_t* y,
                int64_t ldy) {
  const __mmask16 lo = cols >= 16 ? 0xFFFF : (1u << cols) - 1;
  const __mmask16 hi = cols >= 32 ? 0xFFFF : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  const __m512 bias0 = bias ? _mm512_maskz_loadu_ps(lo, bias) : _mm512_setzero_ps();
  const __m512 bias1 = bias ? _mm512_maskz_loadu_ps(hi, bias + 16) : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r, c += kPanel, y += ldy) {
    const __m512 v0 = _mm512_add_ps(_mm512_load_ps(c), bias0);
    const __m512 v1 = _mm512_add_ps(_mm512_load_ps(c + 16), bias1);
    _mm256_mask_storeu_epi16(y, lo, (__m256i)_mm512_cvtneps_pbh(v0));
    _mm256_mask_storeu_epi16(y + 16, hi, (__m256i)_mm512_cvtneps_pbh(v1));
  }
}
#endif

// Where the A tiles of x are: tile t (rows 16t .. 16t+15) at base + 16t·lda while t < full,
// the rest in tail (16 rows of Kp, zero-padded), both read 32 k at a time up to Kp.
struct ASource {
  const uint16_t* base;
  int64_t lda;
  int64_t full;
  const uint16_t* tail;
  int64_t tail_lda;
  const uint16_t* tile(int64_t t) const {
    return t < full ? base + t * kTile * lda : tail + (t - full) * kTile * tail_lda;
  }
  int64_t stride(int64_t t) const { return t < full ? lda : tail_lda; }
};

}  // namespace

bool amx_gemm_bf16_available() {
#ifdef LP_AMX_GEMM
  return request_amx();
#else
  return false;
#endif
}

// weight [N, K] -> panels [ceil(N/32), ceil(K/32), 2, 16, 32] bfloat16: element
// (p, b, h, j, 2c + e) is W[32p + 16h + c, 32b + 2j + e] (0 past N or K)
torch::Tensor pack_amx_bf16(torch::Tensor weight) {
  TORCH_CHECK(weight.dim() == 2, "pack_amx_bf16: weight must be [N, K]");
  const int64_t N = weight.size(0), K = weight.size(1);
  const int64_t P = (N + kPanel - 1) / kPanel, KB = (K + kKBlock - 1) / kKBlock;
  const auto w = weight.detach().contiguous().to(torch::kBFloat16);
  auto panels = torch::zeros({P, KB, 2, kTile, kPanel}, w.options());
  const uint16_t* src = reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>());
  uint16_t* dst = reinterpret_cast<uint16_t*>(panels.data_ptr<at::BFloat16>());
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      for (int64_t col = 0; col < kPanel && p * kPanel + col < N; ++col) {
        const int64_t h = col / kTile, c = col % kTile;
        const uint16_t* row = src + (p * kPanel + col) * K;
        for (int64_t k = 0; k < K; ++k) {
          const int64_t b = k / kKBlock, j = (k % kKBlock) / 2, e = k % 2;
          dst[(((p * KB + b) * 2 + h) * kTile + j) * kPanel + 2 * c + e] = row[k];
        }
      }
  });
  return panels;
}

// x [M, K] bfloat16 -> y [M, N] = x · Wᵀ (+ bias) in bfloat16; panels from pack_amx_bf16(W);
// bias, if defined, float32 [N].
torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor panels,
                              c10::optional<torch::Tensor> bias, int64_t N) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16,
              "amx_linear_bf16: x must be 2-D bfloat16");
  const int64_t K = x.size(1), KB = (K + kKBlock - 1) / kKBlock, Kp = KB * kKBlock;
  const int64_t P = (N + kPanel - 1) / kPanel;
  TORCH_CHECK(panels.dim() == 5 && panels.scalar_type() == torch::kBFloat16 &&
                  panels.size(0) == P && panels.size(1) == KB && panels.size(2) == 2 &&
                  panels.size(3) == kTile && panels.size(4) == kPanel && panels.is_contiguous(),
              "amx_linear_bf16: panels do not match x and N");
  TORCH_CHECK(!bias || (bias->is_contiguous() && bias->scalar_type() == torch::kFloat &&
                        bias->numel() == N),
              "amx_linear_bf16: bias must be float32 [N]");
  const auto xc = x.contiguous();
  const int64_t M = xc.size(0);
  auto y = torch::empty({M, N}, xc.options());
#ifdef LP_AMX_GEMM
  TORCH_CHECK(request_amx(), "amx_linear_bf16: the kernel refused AMX tile state");
  if (M == 0 || N == 0) return y;
  if (K == 0) return bias ? y.copy_(bias->expand({M, N})) : y.zero_();
  const uint16_t* px = reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>());
  // x in place where K is a multiple of 32 (all but its last M % 16 rows); else a copy
  const int64_t tiles = (M + kTile - 1) / kTile;
  const int64_t full = K == Kp ? M / kTile : 0;
  const int64_t copied = (tiles - full) * kTile;
  std::unique_ptr<uint16_t[]> scratch(new uint16_t[copied * Kp]());
  for (int64_t r = full * kTile; r < M; ++r)
    std::memcpy(scratch.get() + (r - full * kTile) * Kp, px + r * K, K * 2);
  const ASource a{px, K, full, scratch.get(), Kp};
  const float* pb = bias ? bias->data_ptr<float>() : nullptr;
  const uint16_t* w = reinterpret_cast<const uint16_t*>(panels.data_ptr<at::BFloat16>());
  uint16_t* out = reinterpret_cast<uint16_t*>(y.data_ptr<at::BFloat16>());
  const int64_t panel_size = KB * 2 * kTile * kPanel, chunks = (M + kChunkRows - 1) / kChunkRows;
  at::parallel_for(0, chunks * P, 1, [&](int64_t i0, int64_t i1) {
    const TileConfig config;
    _tile_loadconfig(&config);
    alignas(64) float c[kBlockRows * kPanel];
    for (int64_t item = i0; item < i1; ++item) {
      const int64_t chunk = item / P, p = item % P;
      const int64_t cols = std::min(kPanel, N - p * kPanel);
      const int64_t r1 = std::min(M, (chunk + 1) * kChunkRows);
      for (int64_t r0 = chunk * kChunkRows; r0 < r1; r0 += kBlockRows) {
        const int64_t t = r0 / kTile, rows = std::min(kBlockRows, r1 - r0);
        if (rows > kTile && a.stride(t) == a.stride(t + 1))
          block<2>(a.tile(t), a.tile(t + 1), a.stride(t), w + p * panel_size, KB, c);
        else if (rows > kTile) {  // the two tiles at different strides: one at a time
          block<1>(a.tile(t), nullptr, a.stride(t), w + p * panel_size, KB, c);
          block<1>(a.tile(t + 1), nullptr, a.stride(t + 1), w + p * panel_size, KB,
                   c + kTile * kPanel);
        } else {
          block<1>(a.tile(t), nullptr, a.stride(t), w + p * panel_size, KB, c);
        }
        store_rows(c, rows, cols, pb ? pb + p * kPanel : nullptr, out + r0 * N + p * kPanel, N);
      }
    }
    _tile_release();
  });
#else
  TORCH_CHECK(false, "amx_linear_bf16: built without AMX");
#endif
  return y;
}
