// The quantized linears' AVX-512 paths. Built into every x86-64 build of the kernels with
// their own targets (the rest of the build is -march=native), chosen at run time
// (quant_gemm.cpp):
// - "avx512" (AVX-512F): 16 floats a vector, two a 32-weight chunk, float32 activations
//   (bfloat16 ones widened once per call), the loop of quant_gemm_body.h;
// - "avx512_bf16" (AVX512-BF16), bfloat16 activations: each chunk's weights w = d q + c
//   are computed in float32 (one FMA), rounded once to bfloat16 (as the twin rounds its
//   dequantized weight to the activations' dtype; int8's q is exact in bf16, its scale
//   multiplies the sum), and every row of x takes them in one VDPBF16PS (32 products, exact
//   in float32, summed in float32): one instruction a chunk and row where the float32
//   loop takes three, and no widening of x.
//   The 4-bit formats and Q5_K take their weights from a table instead (weight_table,
//   weight_indices): a chunk's (d, c) has 16 (32) possible weights, bf16(d q + c) for every
//   q, one FMA on the vector [0 .. 15] and one conversion, and its 32 weights are one VPERMW
//   of their q into it: the same bits as converting each weight, without widening the
//   integers to float32 (2 x cvtepu8_epi32, and / shift, cvtepi32_ps, FMA a chunk before).
//   int4 builds its table once a group (2-4 chunks at 64, 128 weights); Q4_K one conversion
//   for the two chunks that share 32 bytes. At 1-8 rows the scalar work around the vectors
//   was as dear as the decode: the K-quants' scales are unpacked and multiplied in vectors
//   (block_scales_bf16), the fp16 scales converted by F16C (half_f16c), the same products.
//   Q8_0, int8 and Q6_K (8, 6 bits: 256 or 64 values a 16-weight scale) still convert each
//   weight (Q6_K's q assembled in bytes first, a half super-block's bytes loaded once:
//   rows_of_column_q6_k). int4 in groups of 128 decodes a group's 64 bytes as 16-bit words
//   (int4_words). At 1-2 rows, int4 (word order), Q4_K and Q6_K run two columns at once
//   (column_run_bf16): one column's two accumulator chains held a row to ~3 cycles a chunk.
//   Figures: benchmarks/results/2026-12-07-s27-quant-lut.md, 2026-12-07-s28-quant-words.md,
//   2026-12-07-s30-column-pairs.md.
#include "quant_gemm.h"

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx2,fma")

namespace lp_quant {
namespace {

struct V {
  using reg = __m512;
  static constexpr int W = 16;
  static inline reg zero() { return _mm512_setzero_ps(); }
  static inline reg load(const float* p) { return _mm512_loadu_ps(p); }
  static inline void store(float* p, reg v) { _mm512_storeu_ps(p, v); }
  static inline reg set1(float v) { return _mm512_set1_ps(v); }
  static inline reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  static inline reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  static inline reg fma(reg a, reg b, reg c) { return _mm512_fmadd_ps(a, b, c); }
  static inline float hsum(reg a) { return _mm512_reduce_add_ps(a); }
};

// 16 bytes -> the 32 nibbles: low nibbles are weights 0-15, high nibbles 16-31 (ggml).
inline void decode_nibbles(const uint8_t* q, __m512* out) {
  const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q)));
  out[0] = _mm512_cvtepi32_ps(_mm512_and_si512(v, _mm512_set1_epi32(0x0F)));
  out[1] = _mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4));
}

// 32 bytes -> their low (shift 0) or high (shift 4) nibbles: Q4_K's sub-blocks.
inline void decode_nibbles32(const uint8_t* q, int shift, __m512* out) {
  const __m512i mask = _mm512_set1_epi32(0x0F);
  for (int i = 0; i < 2; ++i) {
    const __m512i v =
        _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16 * i)));
    out[i] = _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(shift)),
                                                 mask));
  }
}

// Q5_K: the nibbles of decode_nibbles32, bit 4 from bit hshift of the 32 qh bytes.
inline void decode_q5_k(const Chunk& ch, __m512* out) {
  const __m512i mask = _mm512_set1_epi32(0x0F), one = _mm512_set1_epi32(1);
  const __m128i s = _mm_cvtsi32_si128(ch.shift), hs = _mm_cvtsi32_si128(ch.hshift);
  for (int i = 0; i < 2; ++i) {
    const __m512i v = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(ch.q + 16 * i)));
    const __m512i h = _mm512_cvtepu8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(ch.qh + 16 * i)));
    const __m512i lo = _mm512_and_si512(_mm512_srl_epi32(v, s), mask);
    const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srl_epi32(h, hs), one), 4);
    out[i] = _mm512_cvtepi32_ps(_mm512_or_si512(lo, hi));
  }
}

// Q6_K: (nibble | 2 bits of qh << 4) - 32, times the scale of its 16 weights (d, d1). q is
// built in bytes, ((ql >> shift) & 15) | (bits hshift, hshift + 1 of qh) << 4, minus 32, all
// 32 in a few 256-bit ops, and widened only to convert (before: eleven 512-bit ops a 16
// weights; the same q, scale and product, so the same bits).
inline void decode_q6_k(const Chunk& ch, __m512* out) {
  const __m256i ql = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch.q));
  const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch.qh));
  const __m256i lo = _mm256_and_si256(_mm256_srl_epi16(ql, _mm_cvtsi32_si128(ch.shift)),
                                      _mm256_set1_epi8(15));
  // bits hshift, hshift + 1 of each byte to its bits 4, 5 (16-bit shifts by at most 4 keep
  // them within the byte; the mask drops what crossed from the other one)
  const __m256i up = ch.hshift <= 4 ? _mm256_sll_epi16(qh, _mm_cvtsi32_si128(4 - ch.hshift))
                                    : _mm256_srl_epi16(qh, _mm_cvtsi32_si128(ch.hshift - 4));
  const __m256i q = _mm256_sub_epi8(
      _mm256_or_si256(lo, _mm256_and_si256(up, _mm256_set1_epi8(0x30))), _mm256_set1_epi8(32));
  out[0] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
                         _mm512_set1_ps(ch.d));
  out[1] = _mm512_mul_ps(
      _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
      _mm512_set1_ps(ch.d1));
}

inline void decode_int8(const uint8_t* q, __m512* out) {
  out[0] = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))));
  out[1] = _mm512_cvtepi32_ps(
      _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + 16))));
}

#include "quant_gemm_body.h"

}  // namespace

void run_avx512(const Problem& p, int64_t n0, int64_t n1) { run(p, n0, n1); }
bool built_avx512() { return true; }

}  // namespace lp_quant

#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16,avx2,fma,f16c")

namespace lp_quant {
namespace {

// block_scales<F> (quant_gemm.h) in vectors: super-block b's scales (and offsets), the same
// products (a float32 multiply each, the offsets' sign flipped after), eight or sixteen at
// once where the scalar loop takes one. k4_block_scales: the eight scales d and offsets c of
// the Q4_K / Q5_K super-block at blk.
inline void k4_block_scales(const uint8_t* blk, float* d, float* c) {
  alignas(16) uint8_t sc[16];
  k4_scale_bytes(blk + 4, sc);
  const __m128i bytes = _mm_load_si128(reinterpret_cast<const __m128i*>(sc));
  const __m256 scale = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(bytes));
  const __m256 mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)));
  _mm256_storeu_ps(d, _mm256_mul_ps(_mm256_set1_ps(half_f16c(blk)), scale));
  _mm256_storeu_ps(c, _mm256_xor_ps(_mm256_mul_ps(_mm256_set1_ps(half_f16c(blk + 2)), mins),
                                    _mm256_set1_ps(-0.f)));
}

template <int F>
inline void block_scales_bf16(const uint8_t* row, int64_t b, float* dk, float* ck) {
  if constexpr (F == kQ4_K || F == kQ5_K) {
    k4_block_scales(row + b * (F == kQ4_K ? 144 : 176), dk + 8 * b, ck + 8 * b);
  } else if constexpr (F == kQ6_K) {
    const uint8_t* blk = row + b * 210;
    const __m512 s = _mm512_cvtepi32_ps(
        _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
    _mm512_storeu_ps(dk + 16 * b, _mm512_mul_ps(_mm512_set1_ps(half_f16c(blk + 208)), s));
  }
}

// The formats whose chunk's weights take a table of their 16 (4-bit q) or 32 (Q5_K's 5-bit
// q) possible values: the chunk's 32 weights one VPERMW of their q into it.
constexpr bool lut(int F) { return nibbles(F) || F == kQ4_K || F == kQ5_K; }

// The table of a chunk's (d, c): entry i = bf16(d * (i mod 16) + c) for i = 0 .. 31 (4-bit
// formats: both halves the 16 values), or bf16(d * i + c) (5-bit: Q5_K). The same FMA on the
// same float32 q, d and c, rounded by the same conversion, as the decode-then-FMA of every
// weight: each weight the table gives is that weight's bf16 bits.
template <int Bits>
inline __m512i weight_table(float d, float c) {
  const __m512 lo = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 vd = _mm512_set1_ps(d), vc = _mm512_set1_ps(c);
  const __m512 t0 = _mm512_fmadd_ps(lo, vd, vc);
  if constexpr (Bits == 4) return (__m512i)_mm512_cvtne2ps_pbh(t0, t0);
  const __m512 t1 = _mm512_fmadd_ps(_mm512_add_ps(lo, _mm512_set1_ps(16.f)), vd, vc);
  return (__m512i)_mm512_cvtne2ps_pbh(t1, t0);
}

// The 32 table indices (16-bit words; VPERMW reads bits 0-4 of each) of a chunk:
// - 16 bytes (Q4_0, Q4_1, int4): weights 0-15 the low nibbles, 16-31 the high ones. The low
//   ones keep their byte's bit 4 (the 4-bit table repeats at 16, so it does not matter);
// - 32 bytes, shift 0 or 4 (Q4_K): the low or high nibbles, bit 4 again free;
// - Q5_K: those nibbles, bit 4 from bit hshift of the 32 qh bytes.
template <int F>
inline __m512i weight_indices(const Chunk& ch) {
  if constexpr (nibbles(F)) {
    const __m512i b = _mm512_cvtepu8_epi16(
        _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(ch.q))));
    const __m512i shifts = _mm512_set_epi64(0x0004000400040004, 0x0004000400040004,
                                            0x0004000400040004, 0x0004000400040004, 0, 0, 0, 0);
    return _mm512_srlv_epi16(b, shifts);
  } else {
    const __m512i b =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch.q)));
    const __m512i lo = _mm512_srl_epi16(b, _mm_cvtsi32_si128(ch.shift));
    if constexpr (F == kQ4_K) return lo;
    const __m512i h =
        _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(ch.qh)));
    const __m512i hb = _mm512_slli_epi16(_mm512_srl_epi16(h, _mm_cvtsi32_si128(ch.hshift)), 4);
    // (lo & 15) | hb: hb's bit 4 is q's, its bits 0-3 are 0, those above 4 VPERMW ignores
    return _mm512_ternarylogic_epi32(lo, hb, _mm512_set1_epi16(15), 0xEC);
  }
}

template <int F>
inline __m512bh weights_bf16(const Problem& p, const uint8_t* row, int64_t n, int64_t c,
                             const float* dk, const float* ck) {
  const Chunk ch = chunk_at<F, half_f16c>(p, row, n, c, dk, ck);
  if constexpr (lut(F)) {
    return (__m512bh)_mm512_permutexvar_epi16(weight_indices<F>(ch),
                                              weight_table<F == kQ5_K ? 5 : 4>(ch.d, ch.c));
  }
  __m512 q[2];
  decode<F>(ch, q);
  if constexpr (prescaled(F)) return _mm512_cvtne2ps_pbh(q[1], q[0]);
  const __m512 d = _mm512_set1_ps(ch.d), off = _mm512_set1_ps(ch.c);
  return _mm512_cvtne2ps_pbh(_mm512_fmadd_ps(q[1], d, off), _mm512_fmadd_ps(q[0], d, off));
}

inline float bf16_to_float(uint16_t b) {
  const uint32_t bits = uint32_t(b) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

constexpr int kMbBf16 = 8;  // rows a chunk's bf16 weights serve before the next decode
constexpr int kMsBf16 = 4;  // rows of a tile over decoded columns (three columns at a time)
// From this many bf16 rows on, decode each tile of columns once (float32: kScratchRows, 16):
// 1.06-1.11x the register loop at 8 rows, 1.3-1.4x at 12 (float32 decoded: 0.5-0.9x there)
constexpr int64_t kScratchRowsBf16 = 8;

// y[m, n] from column n's two accumulators (chunk parity) for row m.
template <int F>
inline void finish_bf16(const Problem& p, int64_t n, int64_t m, __m512 a0, __m512 a1) {
  float sum = _mm512_reduce_add_ps(_mm512_add_ps(a0, a1));
  if constexpr (F == kInt8) {
    const int8_t* q = reinterpret_cast<const int8_t*>(p.data + n * p.row_bytes);
    const uint16_t* x = p.xb + m * p.K;
    for (int64_t k = p.K / 32 * 32; k < p.K; ++k) sum += float(q[k]) * bf16_to_float(x[k]);
    sum *= p.scales[n];
  }
  if (p.bias) sum += p.bias[n];
  p.yb[y_at(p, m, n)] = float_to_bf16(sum);
}

// int4 group g of column n's table (chunk<kInt4>'s d and c).
inline __m512i int4_table(const Problem& p, int64_t n, int64_t g) {
  const int64_t i = n * (p.K >> p.group_shift) + g;
  const float s = p.scales[i];
  return weight_table<4>(s, -float(p.zeros[i]) * s);
}

// int4, G = 1, 2 or 4 chunks a group (of 32, 64, 128 weights): rows_of_column_bf16's steps
// (the same weights, products and sums in the same order), the group's table built once for
// its G chunks (chunk<kInt4>'s d and c).
template <int R, int G>
inline void rows_of_column_int4(const Problem& p, int64_t n, int64_t m0) {
  const int64_t K = p.K, chunks = K / 32;
  const uint8_t* row = p.data + n * p.row_bytes;
  auto table = [&](int64_t c) __attribute__((always_inline)) {
    return int4_table(p, n, c / G);
  };
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto step = [&](int64_t c, int a, __m512i t) __attribute__((always_inline)) {
    Chunk ch{};
    ch.q = row + c * 16;
    const __m512bh w = (__m512bh)_mm512_permutexvar_epi16(weight_indices<kInt4>(ch), t);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(p.xb + (m0 + r) * K + c * 32);
      acc[r][a] = _mm512_dpbf16_ps(acc[r][a], w, (__m512bh)x);
    }
  };
  int64_t c = 0;
  __m512i t = _mm512_setzero_si512();
  for (; c + 2 <= chunks; c += 2) {
    if (G == 1 || c % G == 0) t = table(c);  // G >= 2: c even, c and c + 1 one group
    step(c, 0, t);
    if (G == 1) t = table(c + 1);
    step(c + 1, 1, t);
  }
  if (c < chunks) step(c, 0, table(c));
  for (int r = 0; r < R; ++r) finish_bf16<kInt4>(p, n, m0 + r, acc[r][0], acc[r][1]);
}

// int4 in word order (Problem::int4_words, groups of 128): the group's 64 bytes as 32 16-bit
// words, w[k] = VPERMW of the words shifted by 4k into the group's table (bits 0-3 nibble k,
// bit 4 free: the table repeats at 16): the group's 128 weights, no widening of the bytes,
// each vector k the x vector k of the group (int4_word_order), taken as chunk 4g + k.
inline void int4_words(const uint8_t* q, __m512i table, __m512bh* w) {
  const __m512i v = _mm512_loadu_si512(q);
  w[0] = (__m512bh)_mm512_permutexvar_epi16(v, table);
  w[1] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 4), table);
  w[2] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 8), table);
  w[3] = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(v, 12), table);
}

// bytes of W requested ahead of the bytes read (int4: four 2048-weight columns): cold, one
// row, int4 1.01-1.11x without (the largest linears most), 30-32 GB/s of a 32.6 GB/s
// roofline on Zen 4
constexpr int64_t kWeightAhead = 4096;

// rows_of_column_int4 in word order: a group (four chunks) at a time, chunk 4g + k into the
// accumulator of its parity, as the chunk loop sums them. C columns n + j * stride at once,
// each with its own accumulators and the very steps of one column (the same sums in the
// same order): a VDPBF16PS waits ~6 cycles for its accumulator, so one column's two chains
// hold a row to 3 cycles a chunk; with C columns the chains are C times as many.
template <int R, int C = 1>
inline void rows_of_column_int4_words(const Problem& p, int64_t n, int64_t m0,
                                      int64_t stride = 1) {
  const int64_t K = p.K;
  __m512 acc[C][R][2];
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r) acc[j][r][0] = acc[j][r][1] = _mm512_setzero_ps();
  for (int64_t g = 0; g < K / 128; ++g) {
    __m512bh w[C][4];
    for (int j = 0; j < C; ++j) {
      const uint8_t* row = p.data + (n + j * stride) * p.row_bytes;
      _mm_prefetch(reinterpret_cast<const char*>(row + g * 64 + kWeightAhead), _MM_HINT_T0);
      int4_words(row + g * 64, int4_table(p, n + j * stride, g), w[j]);
    }
    for (int k = 0; k < 4; ++k)
      for (int r = 0; r < R; ++r) {
        const __m512i x = _mm512_loadu_si512(p.xb + (m0 + r) * K + g * 128 + k * 32);
        for (int j = 0; j < C; ++j)
          acc[j][r][k & 1] = _mm512_dpbf16_ps(acc[j][r][k & 1], w[j][k], (__m512bh)x);
      }
  }
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r)
      finish_bf16<kInt4>(p, n + j * stride, m0 + r, acc[j][r][0], acc[j][r][1]);
}

// Q4_K, chunks two at a time: chunks c (even) and c + 1 are the low and high nibbles of the
// same 32 bytes, so one widening serves both, and one conversion both tables: entries 0-15
// chunk c + 1's (index: the high nibble, bit 4 clear), 16-31 chunk c's (the byte with bit 4
// set: the low nibble + 16). Each weight, product and sum as rows_of_column_bf16's steps.
// C columns n + j * stride at once, as rows_of_column_int4_words. The scales go to a ring of
// this frame's (kScaleRing chunks a column): the caller's heap scratch made the loop reload
// what the stores might alias, and one super-block's eight slots written over at each
// super-block held the next one's loads behind the stores (hot, one row: 1.16x, ring
// against the row's scratch; 1.2x against one super-block's slots).
constexpr int kScaleRing = 64;  // chunks (8 super-blocks) of scales the K-quant loops keep
template <int R, int C = 1>
inline void rows_of_column_q4_k(const Problem& p, int64_t n, int64_t m0, int64_t stride = 1) {
  const int64_t K = p.K, chunks = K / 32;  // K % 256 == 0: whole super-blocks, chunk pairs
  const __m512 iota = _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  alignas(64) float dk[C][kScaleRing], ck[C][kScaleRing];
  __m512 acc[C][R][2];
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r) acc[j][r][0] = acc[j][r][1] = _mm512_setzero_ps();
  for (int64_t c = 0; c < chunks; c += 2) {
    const int i = int(c % kScaleRing);  // chunk c's slot (i % 8: its place in its block)
    for (int j = 0; j < C; ++j) {
      const uint8_t* blk = p.data + (n + j * stride) * p.row_bytes + (c >> 3) * 144;
      if (i % 8 == 0) k4_block_scales(blk, dk[j] + i, ck[j] + i);
      const uint8_t* q = blk + 16 + 16 * (i % 8);
      // each pair's 32 bytes ahead (prefetch_ahead's one burst a super-block: 0.86-0.94x)
      _mm_prefetch(reinterpret_cast<const char*>(q + kWeightAhead), _MM_HINT_T0);
      const __m512i b =
          _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
      const __m512 t0 = _mm512_fmadd_ps(iota, _mm512_set1_ps(dk[j][i]), _mm512_set1_ps(ck[j][i]));
      const __m512 t1 =
          _mm512_fmadd_ps(iota, _mm512_set1_ps(dk[j][i + 1]), _mm512_set1_ps(ck[j][i + 1]));
      const __m512i table = (__m512i)_mm512_cvtne2ps_pbh(t0, t1);
      const __m512bh w0 =
          (__m512bh)_mm512_permutexvar_epi16(_mm512_or_si512(b, _mm512_set1_epi16(16)), table);
      const __m512bh w1 = (__m512bh)_mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), table);
      for (int r = 0; r < R; ++r) {
        const uint16_t* x = p.xb + (m0 + r) * K + c * 32;
        acc[j][r][0] = _mm512_dpbf16_ps(acc[j][r][0], w0, (__m512bh)_mm512_loadu_si512(x));
        acc[j][r][1] = _mm512_dpbf16_ps(acc[j][r][1], w1, (__m512bh)_mm512_loadu_si512(x + 32));
      }
    }
  }
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r)
      finish_bf16<kQ4_K>(p, n + j * stride, m0 + r, acc[j][r][0], acc[j][r][1]);
}

// Q6_K, a half super-block (four chunks, 128 weights) at a time: its 64 ql and 32 qh bytes
// loaded once for the four (decode_q6_k loads them a chunk), each chunk's q built in bytes
// with fixed shifts, then decode_q6_k's conversion and products: the same weights, so each
// product and sum as rows_of_column_bf16's steps. C columns and the ring of scales as
// rows_of_column_q4_k.
template <int R, int C = 1>
inline void rows_of_column_q6_k(const Problem& p, int64_t n, int64_t m0, int64_t stride = 1) {
  const int64_t K = p.K, blocks = K / 256;
  alignas(64) float dk[C][2 * kScaleRing];  // 16 a super-block
  __m512 acc[C][R][2];
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r) acc[j][r][0] = acc[j][r][1] = _mm512_setzero_ps();
  for (int64_t b = 0; b < blocks; ++b) {
    const int s0 = int(16 * (b % (kScaleRing / 8)));  // the block's 16 slots
    for (int h = 0; h < 2; ++h) {
      for (int j = 0; j < C; ++j) {
        const uint8_t* blk = p.data + (n + j * stride) * p.row_bytes + b * 210;
        if (h == 0) {
          const __m512 sc = _mm512_cvtepi32_ps(
              _mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(blk + 192))));
          _mm512_store_ps(dk[j] + s0, _mm512_mul_ps(_mm512_set1_ps(half_f16c(blk + 208)), sc));
        }
        const uint8_t* ql = blk + 64 * h;
        _mm_prefetch(reinterpret_cast<const char*>(ql + kWeightAhead), _MM_HINT_T0);
        _mm_prefetch(reinterpret_cast<const char*>(blk + 128 + 32 * h + kWeightAhead),
                     _MM_HINT_T0);
        const __m256i l0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql));
        const __m256i l1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(ql + 32));
        const __m256i qh = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 128 + 32 * h));
        const __m256i m4 = _mm256_set1_epi8(15), m2 = _mm256_set1_epi8(0x30);
        const __m256i lo[4] = {_mm256_and_si256(l0, m4), _mm256_and_si256(l1, m4),
                               _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                               _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4)};
        // bits 2k, 2k + 1 of qh to bits 4, 5 (decode_q6_k's, the shifts fixed)
        const __m256i hi[4] = {_mm256_and_si256(_mm256_slli_epi16(qh, 4), m2),
                               _mm256_and_si256(_mm256_slli_epi16(qh, 2), m2),
                               _mm256_and_si256(qh, m2),
                               _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2)};
        for (int k = 0; k < 4; ++k) {
          const int c = 4 * h + k, at = s0 + 2 * c;  // chunk c of the block, its scales' slots
          const __m256i q = _mm256_sub_epi8(_mm256_or_si256(lo[k], hi[k]), _mm256_set1_epi8(32));
          const __m512 w0 = _mm512_mul_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(q))),
              _mm512_set1_ps(dk[j][at]));
          const __m512 w1 = _mm512_mul_ps(
              _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(q, 1))),
              _mm512_set1_ps(dk[j][at + 1]));
          const __m512bh w = _mm512_cvtne2ps_pbh(w1, w0);
          for (int r = 0; r < R; ++r) {
            const __m512i x = _mm512_loadu_si512(p.xb + (m0 + r) * K + b * 256 + c * 32);
            acc[j][r][k & 1] = _mm512_dpbf16_ps(acc[j][r][k & 1], w, (__m512bh)x);
          }
        }
      }
    }
  }
  for (int j = 0; j < C; ++j)
    for (int r = 0; r < R; ++r)
      finish_bf16<kQ6_K>(p, n + j * stride, m0 + r, acc[j][r][0], acc[j][r][1]);
}

// The bytes of chunk c's block kWeightAhead on requested: the K-quants' whole super-block
// at its first chunk, the others' chunk (a line twice at most).
template <int F>
inline void prefetch_ahead(const uint8_t* row, int64_t c) {
  if constexpr (k_quant(F)) {
    constexpr int64_t bytes = F == kQ4_K ? 144 : F == kQ5_K ? 176 : 210;
    if ((c & 7) != 0) return;
    const char* at = reinterpret_cast<const char*>(row + (c >> 3) * bytes + kWeightAhead);
    for (int64_t i = 0; i < bytes; i += 64) _mm_prefetch(at + i, _MM_HINT_T0);
  } else {
    constexpr int64_t bytes = F == kQ8_0 ? 34 : F == kQ4_0 ? 18 : F == kQ4_1 ? 20
                              : F == kInt8 ? 32 : 16;
    _mm_prefetch(reinterpret_cast<const char*>(row + c * bytes + kWeightAhead), _MM_HINT_T0);
  }
}

// Rows m0 .. m0+R of x (bf16) against column n; two accumulators a row (chunk parity).
template <int F, int R>
inline void rows_of_column_bf16(const Problem& p, int64_t n, int64_t m0, float* dk, float* ck) {
  if constexpr (F == kQ4_K) return rows_of_column_q4_k<R>(p, n, m0);
  if constexpr (F == kQ6_K) return rows_of_column_q6_k<R>(p, n, m0);
  if constexpr (F == kInt4) {
    if (p.int4_words) return rows_of_column_int4_words<R>(p, n, m0);
    switch (p.group_shift) {
      case 5: return rows_of_column_int4<R, 1>(p, n, m0);
      case 6: return rows_of_column_int4<R, 2>(p, n, m0);
      default: return rows_of_column_int4<R, 4>(p, n, m0);
    }
  }
  const int64_t K = p.K, chunks = K / 32;
  const uint8_t* row = p.data + n * p.row_bytes;
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  auto step = [&](int64_t c, int a) __attribute__((always_inline)) {
    if constexpr (k_quant(F)) {
      if ((c & 7) == 0) block_scales_bf16<F>(row, c >> 3, dk, ck);
    }
    prefetch_ahead<F>(row, c);
    const __m512bh w = weights_bf16<F>(p, row, n, c, dk, ck);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(p.xb + (m0 + r) * K + c * 32);
      acc[r][a] = _mm512_dpbf16_ps(acc[r][a], w, (__m512bh)x);
    }
  };
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    step(c, 0);
    step(c + 1, 1);
  }
  if (c < chunks) step(c, 0);
  for (int r = 0; r < R; ++r) finish_bf16<F>(p, n, m0 + r, acc[r][0], acc[r][1]);
}

// Column n's chunks as rows_of_column_bf16 decodes them, to w [chunks] (32 bf16 each).
template <int F>
inline void decode_column_bf16(const Problem& p, int64_t n, __m512bh* w, float* dk, float* ck) {
  const uint8_t* row = p.data + n * p.row_bytes;
  if constexpr (F == kInt4) {
    if (p.int4_words) {
      for (int64_t g = 0; g < p.K / 128; ++g)
        int4_words(row + g * 64, int4_table(p, n, g), w + 4 * g);
      return;
    }
  }
  for (int64_t c = 0; c < p.K / 32; ++c) {
    if constexpr (k_quant(F)) {
      if ((c & 7) == 0) block_scales_bf16<F>(row, c >> 3, dk, ck);
    }
    _mm512_storeu_si512(w + c, (__m512i)weights_bf16<F>(p, row, n, c, dk, ck));
  }
}

// Rows m0 .. m0+R against C decoded columns n0 .. n0+C (w: column n0's chunks, the next
// column `chunks` vectors on): each (row, column) the very steps of rows_of_column_bf16.
template <int F, int R, int C>
inline void tile_decoded_bf16(const Problem& p, int64_t n0, int64_t m0, const __m512bh* w) {
  const int64_t K = p.K, chunks = K / 32;
  __m512 acc[R][C][2];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) acc[r][j][0] = acc[r][j][1] = _mm512_setzero_ps();
  auto step = [&](int64_t c, int a) __attribute__((always_inline)) {
    __m512bh wc[C];
    for (int j = 0; j < C; ++j) wc[j] = (__m512bh)_mm512_loadu_si512(w + j * chunks + c);
    for (int r = 0; r < R; ++r) {
      const __m512i x = _mm512_loadu_si512(p.xb + (m0 + r) * K + c * 32);
      for (int j = 0; j < C; ++j)
        acc[r][j][a] = _mm512_dpbf16_ps(acc[r][j][a], wc[j], (__m512bh)x);
    }
  };
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    step(c, 0);
    step(c + 1, 1);
  }
  if (c < chunks) step(c, 0);
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < C; ++j) finish_bf16<F>(p, n0 + j, m0 + r, acc[r][j][0], acc[r][j][1]);
}

template <int F, int R>
inline void tile_columns_bf16(const Problem& p, int64_t t0, int64_t t1, int64_t m,
                              const __m512bh* w) {
  const int64_t chunks = p.K / 32;
  int64_t n = t0;
  for (; n + 3 <= t1; n += 3) tile_decoded_bf16<F, R, 3>(p, n, m, w + (n - t0) * chunks);
  if (t1 - n == 2) tile_decoded_bf16<F, R, 2>(p, n, m, w + (n - t0) * chunks);
  if (t1 - n == 1) tile_decoded_bf16<F, R, 1>(p, n, m, w + (n - t0) * chunks);
}

// Many rows: each tile of columns (~kScratchBytes of bf16 weights) decoded once, then every
// block of kMsBf16 rows against it, three columns at a time (4 x 3 x 2 accumulators).
template <int F>
void columns_decoded_bf16(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t chunks = p.K / 32;
  const int64_t tile = std::max<int64_t>(2, kScratchBytes / 2 / (chunks * 64));
  std::vector<__m512bh> scratch(tile * chunks);
  std::vector<float> scales(2 * (p.K / 32) + 1);
  float* dk = scales.data();
  float* ck = dk + p.K / 32;
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t n = t0; n < t1; ++n)
      decode_column_bf16<F>(p, n, scratch.data() + (n - t0) * chunks, dk, ck);
    int64_t m = 0;
    for (; m + kMsBf16 <= p.M; m += kMsBf16)
      tile_columns_bf16<F, kMsBf16>(p, t0, t1, m, scratch.data());
    switch (p.M - m) {
      case 3: tile_columns_bf16<F, 3>(p, t0, t1, m, scratch.data()); break;
      case 2: tile_columns_bf16<F, 2>(p, t0, t1, m, scratch.data()); break;
      case 1: tile_columns_bf16<F, 1>(p, t0, t1, m, scratch.data()); break;
      default: break;
    }
  }
}

// Columns t0 .. t1 against rows m .. m + R, a column at a time; at 1-2 rows int4 in word
// order, Q4_K and Q6_K two at once, column n with column n + half of the tile: two places in
// two far rows of W read side by side (int4's adjacent pairs, two rows 1 KB apart, were
// 0.75-0.8x one column cold). Cold, 1 row, against one column at a time (with Q6_K's and the
// rings' changes): Q6_K 1.15-1.25x, Q4_K 1.04-1.09x, int4 0.98-1.04x (at the read roofline;
// 2 rows 1.03-1.10x, hot 1.24x); benchmarks/results/2026-12-07-s30-column-pairs.md.
template <int F, int R>
inline void column_run_bf16(const Problem& p, int64_t t0, int64_t t1, int64_t m, float* dk,
                            float* ck) {
  int64_t n = t0;
  if constexpr (R <= 2 && (F == kInt4 || F == kQ4_K || F == kQ6_K)) {
    if (F != kInt4 || p.int4_words) {
      const int64_t half = (t1 - t0) / 2;
      for (; n < t0 + half; ++n) {
        if constexpr (F == kInt4) rows_of_column_int4_words<R, 2>(p, n, m, half);
        if constexpr (F == kQ4_K) rows_of_column_q4_k<R, 2>(p, n, m, half);
        if constexpr (F == kQ6_K) rows_of_column_q6_k<R, 2>(p, n, m, half);
      }
      n = t0 + 2 * half;
    }
  }
  for (; n < t1; ++n) rows_of_column_bf16<F, R>(p, n, m, dk, ck);
}

// Tiles of columns as columns() (quant_gemm_body.h): a block of x read once a tile.
template <int F>
void columns_bf16(const Problem& p, int64_t n0, int64_t n1) {
  if (p.M >= kScratchRowsBf16 && p.K >= 32) return columns_decoded_bf16<F>(p, n0, n1);
  // Q5_K's scales and offsets (Q4_K and Q6_K keep theirs in their loops' rings)
  std::vector<float> scales(F == kQ5_K ? 2 * (p.K / 32) : 0);
  float* dk = scales.data();
  float* ck = dk + p.K / 32;
  const int64_t tile = std::max<int64_t>(1, kTileBytes / p.row_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    int64_t m = 0;
    for (; m + kMbBf16 <= p.M; m += kMbBf16) column_run_bf16<F, kMbBf16>(p, t0, t1, m, dk, ck);
    switch (p.M - m) {
      case 7: column_run_bf16<F, 7>(p, t0, t1, m, dk, ck); break;
      case 6: column_run_bf16<F, 6>(p, t0, t1, m, dk, ck); break;
      case 5: column_run_bf16<F, 5>(p, t0, t1, m, dk, ck); break;
      case 4: column_run_bf16<F, 4>(p, t0, t1, m, dk, ck); break;
      case 3: column_run_bf16<F, 3>(p, t0, t1, m, dk, ck); break;
      case 2: column_run_bf16<F, 2>(p, t0, t1, m, dk, ck); break;
      case 1: column_run_bf16<F, 1>(p, t0, t1, m, dk, ck); break;
      default: break;
    }
  }
}

// Rows n0 .. n1 of W as bfloat16, out [n1 - n0][K]: the kernel's own bf16 weights
// (weights_bf16), int8's scaled first (w = s q, rounded once, as the twin rounds it).
template <int F>
void dequantize_rows_bf16(const Problem& p, int64_t n0, int64_t n1, uint16_t* out) {
  const int64_t chunks = p.K / 32;
  std::vector<float> scales(2 * chunks + 1);
  float* dk = scales.data();
  float* ck = dk + chunks;
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* row = p.data + n * p.row_bytes;
    uint16_t* o = out + (n - n0) * p.K;
    for (int64_t c = 0; c < chunks; ++c) {
      __m512bh w;
      if constexpr (F == kInt8) {
        __m512 q[2];
        decode_int8(row + c * 32, q);
        const __m512 s = _mm512_set1_ps(p.scales[n]);
        w = _mm512_cvtne2ps_pbh(_mm512_mul_ps(q[1], s), _mm512_mul_ps(q[0], s));
      } else {
        if constexpr (k_quant(F)) {
          if ((c & 7) == 0) block_scales_bf16<F>(row, c >> 3, dk, ck);
        }
        w = weights_bf16<F>(p, row, n, c, dk, ck);
      }
      if constexpr (F == kInt4) {  // the nibbles decode as evens then odds: interleave
        alignas(64) static const uint16_t order[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5,
                                                       21, 6, 22, 7, 23, 8, 24, 9, 25, 10, 26,
                                                       11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
        w = (__m512bh)_mm512_permutexvar_epi16(_mm512_load_si512(order), (__m512i)w);
      }
      _mm512_storeu_si512(o + c * 32, (__m512i)w);
    }
  }
}

}  // namespace

void dequantize_avx512_bf16(const Problem& p, int64_t n0, int64_t n1, uint16_t* out) {
  with_format(p.format,
              [&](auto f) { dequantize_rows_bf16<decltype(f)::value>(p, n0, n1, out); });
}

void run_avx512_bf16(const Problem& p, int64_t n0, int64_t n1) {
  with_format(p.format, [&](auto f) { columns_bf16<decltype(f)::value>(p, n0, n1); });
}

}  // namespace lp_quant

#pragma GCC pop_options
#else
namespace lp_quant {
void run_avx512(const Problem&, int64_t, int64_t) {}
void run_avx512_bf16(const Problem&, int64_t, int64_t) {}
void dequantize_avx512_bf16(const Problem&, int64_t, int64_t, uint16_t*) {}
bool built_avx512() { return false; }
}  // namespace lp_quant
#endif
