// The quantized linears' AVX2 path (8 floats a vector; AVX2, FMA and F16C). Built into every
// x86-64 build of the kernels with its own target, so a build on an AVX-512 CPU holds it too
// and its tests run it there, chosen at run time where the CPU has AVX2 and FMA but not
// AVX-512F (quant_gemm.cpp).
//
// Unlike the other paths (quant_gemm_body.h: integers times x, the scale and offset applied
// to each chunk's sum) this one decodes every weight to its value w, with the twin's own
// operations (kernel_backends/torch/quantized_linear.py, gguf-py's: (q - 8) d, q d + m,
// q D - DM, (q - 32) D, (q - z) s; int8's q, its row's scale s multiplying the sum), so its w are the twin's bit for bit (where it
// fuses, as q d - 8 d, q D - 32 D or q D - DM, the fused result is the twin's: one rounding
// of the same exact value, -8 d and -32 D being exact and, for q D - DM, q D too), and each (row, column) is Σ w x: one FMA a weight and row, nothing
// a chunk (no per-chunk scale FMA, no offsets, no chunk sums of x). The loops over rows and
// columns are quant_gemm_avx2_tiles.h.
//
// A format's "unit" is what one decode call yields: a 32-weight chunk (Q8_0, Q4_0, Q4_1,
// int8, int4) or a 256-weight super-block (Q4_K, Q5_K, Q6_K, whose scales are read once a
// super-block). A decoder calls sink(off, par, w) for each vector of 8 weights of the unit
// in a fixed order: off, the weights' first index in the unit (x's offset); par, the call's
// index & 1 (which of the two accumulators takes it).
#include "quant_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#include <type_traits>

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")

namespace lp_quant {
namespace {

inline __m256i u8x8(const uint8_t* p) {  // 8 bytes, unsigned, one a lane
  return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256i i8x8(const uint8_t* p) {
  return _mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
}
inline __m256 f32(__m256i v) { return _mm256_cvtepi32_ps(v); }
inline __m256i lo4(__m256i v) { return _mm256_and_si256(v, _mm256_set1_epi32(0x0F)); }
inline __m256i hi4(__m256i v) { return _mm256_srli_epi32(v, 4); }  // v a zero-extended byte
inline __m256i sub(__m256i v, int s) { return _mm256_sub_epi32(v, _mm256_set1_epi32(s)); }
inline __m256 mul(__m256 a, float s) { return _mm256_mul_ps(a, _mm256_set1_ps(s)); }
inline float f16(const uint8_t* at) {  // F16C: exact, as half_to_float
  uint16_t h;
  std::memcpy(&h, at, 2);
  return _cvtsh_ss(h);
}

// Where a column's bytes, scales and zero points lie.
struct Column {
  const uint8_t* row;    // the column's bytes (row n of W)
  const float* scales;   // int8: its scale; int4: its groups' scales
  const uint8_t* zeros;  // int4: its groups' zero points
};

inline Column column(const Problem& p, int64_t n) {
  const int64_t groups = p.format == kInt4 ? p.K >> p.group_shift : 1;
  return {p.data + n * p.row_bytes, p.scales ? p.scales + n * groups : nullptr,
          p.zeros ? p.zeros + n * groups : nullptr};
}

template <int F>
constexpr int unit_weights() { return k_quant(F) ? 256 : 32; }
template <int F>  // the bytes of a unit
constexpr int unit_bytes() {
  return F == kQ8_0 ? 34 : F == kQ4_0 ? 18 : F == kQ4_1 ? 20 : F == kInt8 ? 32 : F == kInt4 ? 16
         : F == kQ4_K ? 144 : F == kQ5_K ? 176 : 210;
}

// Low nibbles of 16 bytes are weights 0-15, high ones 16-31 (ggml's Q4_0 / Q4_1; int4's
// evens then odds, as quant_linear orders x): w = f(nibble) for both halves of 8 bytes.
template <class Sink, class W>
inline void nibble_chunk(const uint8_t* q, Sink& sink, W w) {
  for (int h = 0; h < 2; ++h) {
    const __m256i v = u8x8(q + 8 * h);
    sink(8 * h, 0, w(lo4(v)));
    sink(16 + 8 * h, 1, w(hi4(v)));
  }
}

// Q4_K (144-byte super-blocks) and Q5_K (176): sub-block j's D_j = d sc_j and DM_j = dmin
// m_j (q4_k_chunks' products, exact), w = q D_j - DM_j; its 32 weights are the low (j even)
// or high nibbles of qs[32 (j / 2) ..], Q5_K's bit 4 bit j of qh[0 .. 32).
template <int F, class Sink>
inline void k4_unit(const uint8_t* blk, Sink& sink) {
  float d[8], c[8];
  q4_k_chunks(blk, 8, d, c, F == kQ5_K ? 176 : 144);  // c = -DM
  const uint8_t* qs = blk + (F == kQ5_K ? 48 : 16);
  for (int j = 0; j < 4; ++j) {
    const __m256 d0 = _mm256_set1_ps(d[2 * j]), c0 = _mm256_set1_ps(c[2 * j]);
    const __m256 d1 = _mm256_set1_ps(d[2 * j + 1]), c1 = _mm256_set1_ps(c[2 * j + 1]);
    for (int i = 0; i < 4; ++i) {
      const __m256i v = u8x8(qs + 32 * j + 8 * i);
      __m256i a = lo4(v), b = hi4(v);
      if constexpr (F == kQ5_K) {
        const __m256i h = _mm256_srli_epi32(u8x8(blk + 16 + 8 * i), 2 * j);
        const __m256i bit4 = _mm256_set1_epi32(16);
        a = _mm256_or_si256(a, _mm256_and_si256(_mm256_slli_epi32(h, 4), bit4));
        b = _mm256_or_si256(b, _mm256_and_si256(_mm256_slli_epi32(h, 3), bit4));
      }
      sink(64 * j + 8 * i, 0, _mm256_fmadd_ps(f32(a), d0, c0));
      sink(64 * j + 32 + 8 * i, 1, _mm256_fmadd_ps(f32(b), d1, c1));
    }
  }
}

// Q6_K (ggml's block_q6_K: ql[128], qh[64], int8 scales[16], fp16 d; dequantize_row_q6_K):
// in half h, lane l of the 32: weights l, l + 32, l + 64, l + 96 are the low nibble of
// ql[l], of ql[l + 32], the high nibble of ql[l], of ql[l + 32], each with 2 bits of qh[l]
// (bits 0-1, 2-3, 4-5, 6-7) as bits 4-5, minus 32; times d scale_g of their 16 weights.
template <class Sink>
inline void q6_k_unit(const uint8_t* blk, Sink& sink) {
  float s[16], c[16];
  q6_k_scales(blk, 8, s);
  for (int i = 0; i < 16; ++i) c[i] = -32.f * s[i];  // exact
  const __m256i bits45 = _mm256_set1_epi32(0x30);
  for (int h = 0; h < 2; ++h) {
    const uint8_t* ql = blk + 64 * h;
    const uint8_t* qh = blk + 128 + 32 * h;
    for (int i = 0; i < 4; ++i) {
      const __m256i a = u8x8(ql + 8 * i), b = u8x8(ql + 32 + 8 * i), hb = u8x8(qh + 8 * i);
      const float *g = s + 8 * h + i / 2, *gc = c + 8 * h + i / 2;
      // top: the two bits of qh already at bits 4-5
      auto w = [&](__m256i low, __m256i top, int k) __attribute__((always_inline)) {
        const __m256 q = f32(_mm256_or_si256(low, _mm256_and_si256(top, bits45)));
        return _mm256_fmadd_ps(q, _mm256_set1_ps(g[2 * k]), _mm256_set1_ps(gc[2 * k]));
      };
      const int at = 128 * h + 8 * i;
      sink(at, 0, w(lo4(a), _mm256_slli_epi32(hb, 4), 0));
      sink(at + 32, 1, w(lo4(b), _mm256_slli_epi32(hb, 2), 1));
      sink(at + 64, 0, w(hi4(a), hb, 2));
      sink(at + 96, 1, w(hi4(b), _mm256_srli_epi32(hb, 2), 3));
    }
  }
}

// Unit u of a column: sink(off, par, w) for each of its vectors.
template <int F, class Sink>
inline void decode_unit(const Problem& p, const Column& col, int64_t u, Sink& sink) {
  if constexpr (F == kQ8_0) {
    const uint8_t* b = col.row + u * 34;
    const float d = f16(b);
    for (int i = 0; i < 4; ++i) sink(8 * i, i & 1, mul(f32(i8x8(b + 2 + 8 * i)), d));
  } else if constexpr (F == kQ4_0) {
    const uint8_t* b = col.row + u * 18;
    const float d = f16(b);
    const __m256 dv = _mm256_set1_ps(d), c = _mm256_set1_ps(-8.f * d);  // q d - 8 d: exact
    nibble_chunk(b + 2, sink, [&](__m256i q) { return _mm256_fmadd_ps(f32(q), dv, c); });
  } else if constexpr (F == kQ4_1) {
    const uint8_t* b = col.row + u * 20;
    const __m256 d = _mm256_set1_ps(f16(b)), m = _mm256_set1_ps(f16(b + 2));
    nibble_chunk(b + 4, sink, [&](__m256i q) { return _mm256_fmadd_ps(f32(q), d, m); });
  } else if constexpr (F == kInt8) {
    for (int i = 0; i < 4; ++i) sink(8 * i, i & 1, f32(i8x8(col.row + u * 32 + 8 * i)));
  } else if constexpr (F == kInt4) {
    const int64_t g = u >> (p.group_shift - 5);
    const float s = col.scales[g];
    const int z = col.zeros[g];
    nibble_chunk(col.row + u * 16, sink, [&](__m256i q) { return mul(f32(sub(q, z)), s); });
  } else if constexpr (F == kQ4_K || F == kQ5_K) {
    k4_unit<F>(col.row + u * (F == kQ5_K ? 176 : 144), sink);
  } else {
    q6_k_unit(col.row + u * 210, sink);
  }
}

#include "quant_gemm_avx2_tiles.h"

}  // namespace

void run_avx2(const Problem& p, int64_t n0, int64_t n1) {
  switch (p.format) {
    case kQ8_0: columns<kQ8_0>(p, n0, n1); break;
    case kQ4_0: columns<kQ4_0>(p, n0, n1); break;
    case kQ4_1: columns<kQ4_1>(p, n0, n1); break;
    case kInt8: columns<kInt8>(p, n0, n1); break;
    case kInt4: columns<kInt4>(p, n0, n1); break;
    case kQ4_K: columns<kQ4_K>(p, n0, n1); break;
    case kQ5_K: columns<kQ5_K>(p, n0, n1); break;
    case kQ6_K: columns<kQ6_K>(p, n0, n1); break;
    default: break;
  }
}
bool built_avx2() { return true; }

}  // namespace lp_quant

#pragma GCC pop_options
#else
namespace lp_quant {
void run_avx2(const Problem&, int64_t, int64_t) {}
bool built_avx2() { return false; }
}  // namespace lp_quant
#endif
