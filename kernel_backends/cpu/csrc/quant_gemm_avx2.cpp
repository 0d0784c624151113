// The quantized linears' AVX2 path (8 floats a vector; AVX2, FMA and F16C). Built into every
// x86-64 build of the kernels with its own target, so a build on an AVX-512 CPU holds it too
// and its tests run it there, chosen at run time where the CPU has AVX2 and FMA but not
// AVX-512F (quant_gemm.cpp).
//
// Scales factored out of the inner loop (quant_gemm.h's sum; Q4_0 and Q4_1 excepted, below):
// a group's integers q (32 weights; Q6_K's 16) are converted to float and dotted with x,
// t = Σ q x, then one FMA takes the group's scale, a += d t; Q4_K's and Q5_K's offsets are
// the chunk sums of x (Problem::xsum, once a call) times each chunk's offset. Where the twin's weight is d (q - z) with d not exact
// times q (int4: a float32 scale) or with z its own integer (Q6_K's 32), q - z is taken in
// integers first. With one nonzero x per chunk (x = the identity's rows) every product is
// exact but the last rounding, so y is dequantize(W)ᵀ bit for bit: d q is exact for the
// GGUF formats (an fp16 d (11 bits) times a 6-bit scale and a q of at most 6 bits fits
// float32's 24), and d q + c is then the twin's q d + c rounded once.
//
// A format's "unit" is what one decode call takes: a 32-weight chunk (Q8_0, Q4_0, Q4_1,
// int8, int4) or a 256-weight super-block (Q4_K, Q5_K, Q6_K, whose scales are read once a
// super-block and whose integers are unpacked 32 bytes at a time in the byte domain into a
// SuperBlock, then widened 8 at a time; a K-quant's one row takes 4 columns' SuperBlocks
// at once, row_super_blocks). A decoder calls, in a fixed order, the sink's
// put(off, first, q) for each vector of 8 integers (off: their first index in the unit;
// first: the group's first vector), fold(d) at the end of each group, and offsets8(c) for a
// super-block's offsets; or put_w(off, par, w) for weights decoded whole (Q4_0, Q4_1: two
// accumulators, par = which) (quant_gemm_avx2_tiles.h).
#include "quant_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

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
inline __m256i load32(const uint8_t* p) {
  return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
}
inline void store32(uint8_t* p, __m256i v) {
  _mm256_store_si256(reinterpret_cast<__m256i*>(p), v);
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
// Formats whose weights are decoded whole, summed by put_w (not folded by groups).
constexpr bool whole_w(int F) { return F == kQ4_0 || F == kQ4_1; }

// Low nibbles of 16 bytes are weights 0-15, high ones 16-31 (ggml's Q4_0 / Q4_1; int4's
// evens then odds, as quant_linear orders x): put(q) for the chunk's four vectors, q = the
// nibbles less z (int4's zero point), then fold(s).
template <class Sink>
inline void int4_chunk(const uint8_t* q, Sink& sink, float s, int z) {
  const __m256i a = u8x8(q), b = u8x8(q + 8);
  sink.put(0, true, f32(sub(lo4(a), z)));
  sink.put(8, false, f32(sub(lo4(b), z)));
  sink.put(16, false, f32(sub(hi4(a), z)));
  sink.put(24, false, f32(sub(hi4(b), z)));
  sink.fold(_mm256_set1_ps(s));
}

// Q4_0 (w = q d - 8 d) and Q4_1 (w = q d + m), the nibbles as above: each weight decoded whole
// (one FMA, exact: d q is exact, so this is the twin's q d + c rounded once) and taken by
// put_w. (Folding d and summing the offsets per chunk, as the K-quants do, was 0.9x this at
// 8 rows: two scalar offsets' work a chunk and row outweigh the one decode FMA a vector.)
template <class Sink>
inline void q4_chunk(const uint8_t* q, Sink& sink, float d, float c) {
  const __m256 dv = _mm256_set1_ps(d), cv = _mm256_set1_ps(c);
  for (int h = 0; h < 2; ++h) {
    const __m256i v = u8x8(q + 8 * h);
    sink.put_w(8 * h, 0, _mm256_fmadd_ps(f32(lo4(v)), dv, cv));
    sink.put_w(16 + 8 * h, 1, _mm256_fmadd_ps(f32(hi4(v)), dv, cv));
  }
}

// A K-quant super-block unpacked in the byte domain (k_unpack): its 256 integers as bytes in
// weight order (widened 8 at a time from here: one load a vector, not register shuffles), the
// scale of each group of G weights (Q4_K, Q5_K: 8 of 32; Q6_K: 16 of 16) and, Q4_K and Q5_K,
// the offsets of its 8 sub-blocks.
struct SuperBlock {
  alignas(32) uint8_t q[256];  // Q6_K: signed (q - 32)
  alignas(32) float d[16];
  __m256 offsets;              // -DM_j (exact); Q6_K: unused
};
template <int F>
constexpr int group_weights() { return F == kQ6_K ? 16 : 32; }

// Q4_K (144-byte super-blocks) and Q5_K (176): sub-block j's D_j = d sc_j and DM_j = dmin
// m_j (q4_k_chunks' products, exact; the 12 scale bytes unpacked as ggml's kmask code does),
// w = q D_j - DM_j; its 32 weights are the low (j even) or high nibbles of qs[32 (j / 2) ..],
// Q5_K's bit 4 bit j of qh[0 .. 32). Unpacked 32 bytes (64 weights) at a time.
template <int F>
inline void k4_unpack(const uint8_t* blk, SuperBlock& sb) {
  uint32_t u[4];
  std::memcpy(u, blk + 4, 12);
  u[3] = ((u[2] >> 4) & 0x0f0f0f0f) | (((u[1] >> 6) & 0x03030303) << 4);  // mins 4-7
  const uint32_t mins = u[1] & 0x3f3f3f3f;                                  // mins 0-3
  u[1] = (u[2] & 0x0f0f0f0f) | (((u[0] >> 6) & 0x03030303) << 4);          // scales 4-7
  u[2] = mins;
  u[0] &= 0x3f3f3f3f;                                                       // scales 0-3
  const uint8_t* sm = reinterpret_cast<const uint8_t*>(u);
  _mm256_store_ps(sb.d, _mm256_mul_ps(f32(u8x8(sm)), _mm256_set1_ps(half_f16c(blk))));
  const __m256 dm = _mm256_mul_ps(f32(u8x8(sm + 8)), _mm256_set1_ps(half_f16c(blk + 2)));
  sb.offsets = _mm256_xor_ps(dm, _mm256_set1_ps(-0.f));  // -DM_j: exact
  const uint8_t* qs = blk + (F == kQ5_K ? 48 : 16);
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  for (int j = 0; j < 4; ++j) {
    const __m256i v = load32(qs + 32 * j);
    __m256i a = _mm256_and_si256(v, m4), b = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if constexpr (F == kQ5_K) {  // bit c of qh[l] as bit 4 of q (16-bit shifts: the bits
      const __m256i h = load32(blk + 16), bit4 = _mm256_set1_epi8(0x10);  // moved across
      auto at4 = [&](int c) {  // bytes land outside bit 4)
        return c <= 4 ? _mm256_slli_epi16(h, 4 - c) : _mm256_srli_epi16(h, c - 4);
      };
      a = _mm256_or_si256(a, _mm256_and_si256(at4(2 * j), bit4));
      b = _mm256_or_si256(b, _mm256_and_si256(at4(2 * j + 1), bit4));
    }
    store32(sb.q + 64 * j, a);
    store32(sb.q + 64 * j + 32, b);
  }
}

// Q6_K (ggml's block_q6_K: ql[128], qh[64], int8 scales[16], fp16 d; dequantize_row_q6_K):
// in half h, lane l of the 32: weights l, l + 32, l + 64, l + 96 are the low nibble of
// ql[l], of ql[l + 32], the high nibble of ql[l], of ql[l + 32], each with 2 bits of qh[l]
// (bits 0-1, 2-3, 4-5, 6-7) as bits 4-5, minus 32 (in bytes: -32 .. 31); the scale of each
// 16 weights d scale_g (q6_k_scales' products).
inline void q6_k_unpack(const uint8_t* blk, SuperBlock& sb) {
  const __m256 d = _mm256_set1_ps(half_f16c(blk + 208));
  _mm256_store_ps(sb.d, _mm256_mul_ps(f32(i8x8(blk + 192)), d));
  _mm256_store_ps(sb.d + 8, _mm256_mul_ps(f32(i8x8(blk + 200)), d));
  const __m256i m4 = _mm256_set1_epi8(0x0F), m30 = _mm256_set1_epi8(0x30);
  const __m256i c32 = _mm256_set1_epi8(32);
  for (int h = 0; h < 2; ++h) {  // 16-bit shifts: the bits moved across bytes are masked off
    const __m256i a = load32(blk + 64 * h), b = load32(blk + 64 * h + 32);
    const __m256i hb = load32(blk + 128 + 32 * h);
    auto q = [&](__m256i low, __m256i top) {
      return _mm256_sub_epi8(_mm256_or_si256(low, _mm256_and_si256(top, m30)), c32);
    };
    uint8_t* o = sb.q + 128 * h;
    store32(o, q(_mm256_and_si256(a, m4), _mm256_slli_epi16(hb, 4)));
    store32(o + 32, q(_mm256_and_si256(b, m4), _mm256_slli_epi16(hb, 2)));
    store32(o + 64, q(_mm256_and_si256(_mm256_srli_epi16(a, 4), m4), hb));
    store32(o + 96, q(_mm256_and_si256(_mm256_srli_epi16(b, 4), m4), _mm256_srli_epi16(hb, 2)));
  }
}

template <int F>
inline void k_unpack(const uint8_t* blk, SuperBlock& sb) {
  if constexpr (F == kQ6_K) q6_k_unpack(blk, sb);
  else k4_unpack<F>(blk, sb);
}

// Vector i (8 integers) of an unpacked super-block, as floats.
template <int F>
inline __m256 sb_vector(const SuperBlock& sb, int i) {
  return f32(F == kQ6_K ? i8x8(sb.q + 8 * i) : u8x8(sb.q + 8 * i));
}

// A K-quant super-block into a sink: its offsets, then each group's vectors, folded by the
// group's scale.
template <int F, class Sink>
inline void k_unit(const uint8_t* blk, Sink& sink) {
  constexpr int G = group_weights<F>();
  SuperBlock sb;
  k_unpack<F>(blk, sb);
  asm volatile("" ::: "memory");  // widen from sb.q (one load a vector), not by shuffles
  if constexpr (F != kQ6_K) sink.offsets8(sb.offsets);
  for (int g = 0; g < 256 / G; ++g) {
    for (int i = 0; i < G / 8; ++i)
      sink.put(G * g + 8 * i, i == 0, sb_vector<F>(sb, G / 8 * g + i));
    sink.fold(_mm256_broadcast_ss(sb.d + g));
  }
}

// Unit u of a column: the sink's calls for it.
template <int F, class Sink>
inline void decode_unit(const Problem& p, const Column& col, int64_t u, Sink& sink) {
  if constexpr (F == kQ8_0) {
    const uint8_t* b = col.row + u * 34;
    for (int i = 0; i < 4; ++i) sink.put(8 * i, i == 0, f32(i8x8(b + 2 + 8 * i)));
    sink.fold(_mm256_set1_ps(half_f16c(b)));
  } else if constexpr (F == kQ4_0) {
    const uint8_t* b = col.row + u * 18;
    const float d = half_f16c(b);
    q4_chunk(b + 2, sink, d, -8.f * d);  // -8 d: exact
  } else if constexpr (F == kQ4_1) {
    const uint8_t* b = col.row + u * 20;
    q4_chunk(b + 4, sink, half_f16c(b), half_f16c(b + 2));
  } else if constexpr (F == kInt8) {  // exact integers; the row's scale multiplies the sum
    for (int i = 0; i < 4; ++i) sink.put(8 * i, i == 0, f32(i8x8(col.row + u * 32 + 8 * i)));
    sink.fold(_mm256_set1_ps(1.f));
  } else if constexpr (F == kInt4) {  // (q - z) s: q - z in integers (s q is not exact)
    const int64_t g = u >> (p.group_shift - 5);
    int4_chunk(col.row + u * 16, sink, col.scales[g], col.zeros[g]);
  } else {
    k_unit<F>(col.row + u * unit_bytes<F>(), sink);
  }
}

#include "quant_gemm_avx2_tiles.h"

}  // namespace

void run_avx2(const Problem& p, int64_t n0, int64_t n1) {
  with_format(p.format, [&](auto f) { columns<decltype(f)::value>(p, n0, n1); });
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
