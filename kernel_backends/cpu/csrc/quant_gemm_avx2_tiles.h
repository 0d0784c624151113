// The AVX2 path's loops over rows and columns (included by quant_gemm_avx2.cpp after its
// decoders, under its target pragma).
//
// Every (row m, column n) is the same operations whatever the call: the unit's calls in the
// decoder's order, each group's t = Σ q x (its first product a multiply, the rest FMAs), then
// a += d t, the offsets into a (offsets8), over the units in order (Q4_0 and Q4_1: each w x
// into a or t by its par, put_w); then y = hsum(a) (put_w: hsum(a + t); int8: + its K % 32
// tail, times its scale), + bias. How rows and columns are grouped into register tiles
// (R rows x C columns: each decoded vector serves R rows, each x vector C columns) changes
// no value and no order, so a row's result does not depend on the rows beside it, nor on
// the row count, nor on the threads.
//
// Rows come in blocks of up to 4, columns in tiles of ~kTileBytes of weight (kept in L2
// while every block of rows takes them); each unit is decoded in registers once per block
// of rows and column. (A float32 scratch of decoded columns, read by every block of rows as
// the other paths do from 16 rows on, was 1.3-1.6x slower here at 8 to 128 rows: its x and
// decoded w stream from L2, where the decode in registers reads a quarter of the bytes.)
constexpr int64_t kTileBytes = 96 * 1024;  // weight bytes a tile of columns holds

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// Accumulators of R rows against one column; x and xs point at the rows' current unit (xs:
// its chunks' sums of x).
template <int R>
struct Acc {
  __m256 a[R], t[R];
  const float* x[R];
  const float* xs[R];
  inline void put(int off, bool first, __m256 q) {
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_loadu_ps(x[r] + off);
      t[r] = first ? _mm256_mul_ps(q, v) : _mm256_fmadd_ps(q, v, t[r]);
    }
  }
  inline void fold(__m256 d) {
    for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(d, t[r], a[r]);
  }
  inline void put_w(int off, int par, __m256 w) {
    for (int r = 0; r < R; ++r) {
      __m256& s = par ? t[r] : a[r];
      s = _mm256_fmadd_ps(w, _mm256_loadu_ps(x[r] + off), s);
    }
  }
  inline void offsets8(__m256 c) {
    for (int r = 0; r < R; ++r) a[r] = _mm256_fmadd_ps(c, _mm256_loadu_ps(xs[r]), a[r]);
  }
};

// y[m .. m + R, n] from the accumulators: the sums, int8's tail past the last chunk, bias.
template <int F, int R>
inline void finish(const Problem& p, const Acc<R>& acc, int64_t m, int64_t n) {
  const int64_t full = p.K / 32 * 32;
  for (int r = 0; r < R; ++r) {
    float sum = hsum(whole_w(F) ? _mm256_add_ps(acc.a[r], acc.t[r]) : acc.a[r]);
    if constexpr (F == kInt8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(p.data + n * p.row_bytes);
      const float* x = p.x + (m + r) * p.K;
      for (int64_t k = full; k < p.K; ++k) sum += float(q[k]) * x[k];
      sum *= p.scales[n];
    }
    if (p.bias) sum += p.bias[n];
    p.y[y_at(p, m + r, n)] = sum;
  }
}

// Rows m .. m + R against columns n .. n + C, each unit decoded in registers.
template <int F, int R, int C>
inline void tile_decoded_here(const Problem& p, int64_t m, int64_t n) {
  constexpr int UW = unit_weights<F>();
  const int64_t units = p.K / UW;
  Acc<R> acc[C];
  Column col[C];
  for (int c = 0; c < C; ++c) {
    col[c] = column(p, n + c);
    for (int r = 0; r < R; ++r) {
      acc[c].a[r] = acc[c].t[r] = _mm256_setzero_ps();
      acc[c].x[r] = p.x + (m + r) * p.K;
      acc[c].xs[r] = p.xsum ? p.xsum + (m + r) * (p.K / 32) : nullptr;
    }
  }
  // The next C columns' bytes, requested into cache while these are decoded (C sequential
  // streams at once are otherwise read from memory slower than the one stream of a column
  // at a time: 0.7x at one row, cold; with the requests, 0.9-1.5x faster than that).
  const uint8_t* next[C];
  for (int c = 0; c < C; ++c) next[c] = p.data + std::min(n + C + c, p.N - 1) * p.row_bytes;
  for (int64_t u = 0; u < units; ++u) {
    for (int c = 0; c < C; ++c) {
      for (int b = 0; b < unit_bytes<F>(); b += 64)  // each cache line of the unit
        _mm_prefetch(reinterpret_cast<const char*>(next[c] + u * unit_bytes<F>() + b),
                     _MM_HINT_T0);
      decode_unit<F>(p, col[c], u, acc[c]);
      for (int r = 0; r < R; ++r) {
        acc[c].x[r] += UW;
        if constexpr (F == kQ4_K || F == kQ5_K) acc[c].xs[r] += UW / 32;
      }
    }
  }
  for (int c = 0; c < C; ++c) finish<F, R>(p, acc[c], m, n + c);
}

// A K-quant's one row m against columns n .. n + C: the C columns' super-blocks unpacked
// first, then each vector of x loaded once and taken by the C columns' t in turn. The same
// operations per column, in the same order, as Acc<1> takes them from k_unit, so y is the
// same bits as in any other tile. (At one row the kernel is bound by its uops and loads,
// not by the chains of t and a: splitting each into 2 partial sums changed nothing; x
// loaded once a vector for the 4 columns instead of once a column and vector: 1.12-1.20x,
// benchmarks/results/2026-12-07-s25-quant-chains.md.)
template <int F, int C>
inline void row_super_blocks(const Problem& p, int64_t m, int64_t n) {
  constexpr int G = group_weights<F>(), UB = unit_bytes<F>();
  const float* x = p.x + m * p.K;
  const float* xs = p.xsum ? p.xsum + m * (p.K / 32) : nullptr;
  __m256 a[C], t[C];
  const uint8_t* row[C];
  const uint8_t* next[C];  // the next C columns, requested into cache (tile_decoded_here)
  for (int c = 0; c < C; ++c) {
    a[c] = t[c] = _mm256_setzero_ps();
    row[c] = p.data + (n + c) * p.row_bytes;
    next[c] = p.data + std::min(n + C + c, p.N - 1) * p.row_bytes;
  }
  SuperBlock sb[C];
  for (int64_t u = 0; u < p.K / 256; ++u, x += 256) {
    for (int c = 0; c < C; ++c) {
      for (int b = 0; b < UB; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(next[c] + u * UB + b), _MM_HINT_T0);
      k_unpack<F>(row[c] + u * UB, sb[c]);
    }
    asm volatile("" ::: "memory");  // widen from sb[c].q, not by shuffles
    if constexpr (F != kQ6_K) {
      const __m256 s = _mm256_loadu_ps(xs + 8 * u);
      for (int c = 0; c < C; ++c) a[c] = _mm256_fmadd_ps(sb[c].offsets, s, a[c]);
    }
    for (int g = 0; g < 256 / G; ++g) {
      for (int i = 0; i < G / 8; ++i) {
        const __m256 v = _mm256_loadu_ps(x + G * g + 8 * i);
        for (int c = 0; c < C; ++c) {
          const __m256 q = sb_vector<F>(sb[c], G / 8 * g + i);
          t[c] = i == 0 ? _mm256_mul_ps(q, v) : _mm256_fmadd_ps(q, v, t[c]);
        }
      }
      for (int c = 0; c < C; ++c)
        a[c] = _mm256_fmadd_ps(_mm256_broadcast_ss(sb[c].d + g), t[c], a[c]);
    }
  }
  for (int c = 0; c < C; ++c) {
    Acc<1> acc;
    acc.a[0] = a[c];
    finish<F, 1>(p, acc, m, n + c);
  }
}

// Rows m .. m + R (R = 1 .. 4) against columns t0 .. t1, decoded here: C columns a time
// (C = 4 / R: eight accumulators), the last ones one a time; a K-quant's one row by
// row_super_blocks.
template <int F, int R>
inline void rows_decoded_here(const Problem& p, int64_t m, int64_t t0, int64_t t1) {
  constexpr int C = R == 1 ? 4 : R == 2 ? 2 : 1;
  int64_t n = t0;
  if constexpr (R == 1 && k_quant(F)) {
    for (; n + C <= t1; n += C) row_super_blocks<F, C>(p, m, n);
    for (; n < t1; ++n) row_super_blocks<F, 1>(p, m, n);
    return;
  }
  for (; n + C <= t1; n += C) tile_decoded_here<F, R, C>(p, m, n);
  for (; n < t1; ++n) tile_decoded_here<F, R, 1>(p, m, n);
}

// Every row against columns t0 .. t1, in blocks of 4 rows, then the last 1-3.
template <int F>
inline void all_rows(const Problem& p, int64_t t0, int64_t t1) {
  int64_t m = 0;
  for (; m + 4 <= p.M; m += 4) rows_decoded_here<F, 4>(p, m, t0, t1);
  switch (p.M - m) {
    case 3: rows_decoded_here<F, 3>(p, m, t0, t1); break;
    case 2: rows_decoded_here<F, 2>(p, m, t0, t1); break;
    case 1: rows_decoded_here<F, 1>(p, m, t0, t1); break;
    default: break;
  }
}

// Columns n0 .. n1 of y, every row (one thread): tiles of ~kTileBytes of weight, each read
// from memory once and from L2 by every block of rows.
template <int F>
void columns(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t tile = std::max<int64_t>(4, kTileBytes / p.row_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) all_rows<F>(p, t0, std::min(n1, t0 + tile));
}
