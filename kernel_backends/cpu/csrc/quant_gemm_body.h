// The quantized linear's loop, for one ISA: included by quant_gemm_{scalar,avx2,avx512}
// after that ISA's `V` (a vector of W floats: zero, load, mul, fma, set1, hsum) and its
// chunk decoders (`decode_nibbles`, `decode_int8`, `decode_nibbles32`, `decode_q5_k`,
// `decode_q6_k`: 32 integers (Q6_K: weights) -> NV = 32 / W vectors of floats) are defined, under that ISA's target pragma.
//
// Each output column n (a row of W) is read once per block of up to kMb rows of x, chunk by
// chunk: the chunk is decoded into registers once and multiplied with each row's x
// (the same operations in the same order for every row, so a row's result does not
// depend on what it is batched with, nor on the threads). From kScratchRows rows on, a tile
// of columns is decoded once into a float32 scratch (decode_column: each chunk's decoded
// vectors, scale and offset, the very values the registers would hold) that stays in L2,
// and every block of rows reads it there instead of decoding again: prefill costs about a
// float GEMM plus one decode of W, and each (row, column) is still the same operations on
// the same values, bit for bit, whatever the number of rows.
constexpr int kNv = 32 / V::W;
constexpr int kMb = 4;  // rows of x a decoded chunk serves before the next is decoded
constexpr int64_t kTileBytes = 64 * 1024;  // weight bytes a tile of columns holds
constexpr int64_t kScratchRows = 16;  // from this many rows on, decode each tile once
constexpr int64_t kScratchBytes = 256 * 1024;  // decoded floats a tile of columns holds (L2)

template <int F>
inline void decode(const Chunk& ch, typename V::reg* out) {
  if constexpr (F == kQ4_K) {
    decode_nibbles32(ch.q, ch.shift, out);
  } else if constexpr (F == kQ5_K) {
    decode_q5_k(ch, out);
  } else if constexpr (F == kQ6_K) {
    decode_q6_k(ch, out);
  } else if constexpr (nibbles(F)) {
    decode_nibbles(ch.q, out);
  } else {
    decode_int8(ch.q, out);
  }
}

// Rows m0 .. m0+R of x against column n. Two accumulators a row (even and odd chunks),
// so that consecutive chunks do not wait on each other's FMA; the chunks' offsets are
// kept in `offsets` and dotted with x's chunk sums at the end.
// `decoded` (else null): column n's decode_column, read instead of decoding (`offsets` then
// points at its offsets).
template <int F, int R, bool Decoded = false>
inline void rows_of_column(const Problem& p, int64_t n, int64_t m0, float* offsets,
                           float* dk, const float* decoded = nullptr) {
  using reg = typename V::reg;
  const int64_t K = p.K, chunks = K / 32;
  const uint8_t* row = p.data + n * p.row_bytes;
  reg acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = V::zero();
  auto step = [&](int64_t c, int a) __attribute__((always_inline)) {
    reg q[kNv];
    float scale;
    if constexpr (Decoded) {
      for (int v = 0; v < kNv; ++v) q[v] = V::load(decoded + c * 32 + v * V::W);
      scale = decoded[chunks * 32 + c];
    } else {
      if constexpr (k_quant(F)) {  // a super-block's scales just before its chunks
        if ((c & 7) == 0) block_scales<F>(row, c >> 3, dk, offsets);
      }
      const Chunk ch = chunk_at<F>(p, row, n, c, dk, offsets);
      if constexpr (has_offset(F)) offsets[c] = ch.c;
      decode<F>(ch, q);
      scale = ch.d;
    }
    const reg d = V::set1(scale);
    for (int r = 0; r < R; ++r) {
      const float* x = p.x + (m0 + r) * K + c * 32;
      reg t = V::mul(q[0], V::load(x));
      for (int v = 1; v < kNv; ++v) t = V::fma(q[v], V::load(x + v * V::W), t);
      if constexpr (prescaled(F)) {
        acc[r][a] = V::add(acc[r][a], t);
      } else {
        acc[r][a] = V::fma(d, t, acc[r][a]);
      }
    }
  };
  int64_t c = 0;
  for (; c + 2 <= chunks; c += 2) {
    step(c, 0);
    step(c + 1, 1);
  }
  if (c < chunks) step(c, 0);
  for (int r = 0; r < R; ++r) {
    float sum = V::hsum(V::add(acc[r][0], acc[r][1]));
    if constexpr (F == kInt8) {
      const int8_t* q = reinterpret_cast<const int8_t*>(row);
      const float* x = p.x + (m0 + r) * K;
      for (int64_t k = chunks * 32; k < K; ++k) sum += float(q[k]) * x[k];  // K % 32 tail
      sum *= p.scales[n];
    }
    if constexpr (has_offset(F)) {  // Σ_c offset_c · xsum_c
      const float* xs = p.xsum + (m0 + r) * chunks;
      reg o = V::zero();
      c = 0;
      for (; c + V::W <= chunks; c += V::W) o = V::fma(V::load(offsets + c), V::load(xs + c), o);
      float tail = 0.f;
      for (; c < chunks; ++c) tail += offsets[c] * xs[c];
      sum += V::hsum(o) + tail;
    }
    if (p.bias) sum += p.bias[n];
    p.y[y_at(p, m0 + r, n)] = sum;
  }
}

// Column n decoded as rows_of_column decodes it, into out: the chunks' vectors [chunks][32],
// then their scales [chunks], then their offsets [chunks].
template <int F>
inline void decode_column(const Problem& p, int64_t n, float* out, float* dk) {
  using reg = typename V::reg;
  const int64_t chunks = p.K / 32;
  const uint8_t* row = p.data + n * p.row_bytes;
  float* scales = out + chunks * 32;
  float* offsets = scales + chunks;
  for (int64_t c = 0; c < chunks; ++c) {
    if constexpr (k_quant(F)) {
      if ((c & 7) == 0) block_scales<F>(row, c >> 3, dk, offsets);
    }
    const Chunk ch = chunk_at<F>(p, row, n, c, dk, offsets);
    if constexpr (has_offset(F)) offsets[c] = ch.c;
    reg q[kNv];
    decode<F>(ch, q);
    for (int v = 0; v < kNv; ++v) V::store(out + c * 32 + v * V::W, q[v]);
    scales[c] = ch.d;
  }
}

// Rows m .. m + R for column n from its decoded column, R < kMb (the last rows).
template <int F, bool Decoded>
inline void last_rows(const Problem& p, int64_t n, int64_t m, float* off, float* dk,
                      const float* decoded) {
  switch (p.M - m) {
    case 3: rows_of_column<F, 3, Decoded>(p, n, m, off, dk, decoded); break;
    case 2: rows_of_column<F, 2, Decoded>(p, n, m, off, dk, decoded); break;
    case 1: rows_of_column<F, 1, Decoded>(p, n, m, off, dk, decoded); break;
    default: break;
  }
}

// Many rows: each tile of columns (~kScratchBytes decoded) decoded once, then every block of
// kMb rows against each of its columns.
template <int F>
void columns_decoded(const Problem& p, int64_t n0, int64_t n1) {
  const int64_t chunks = p.K / 32, per_column = chunks * 34;
  std::vector<float> scratch(std::max<int64_t>(1, kScratchBytes / 4 / per_column) * per_column);
  std::vector<float> dk(F == kQ6_K ? p.K / 16 : p.K / 32 + 1);
  const int64_t tile = int64_t(scratch.size()) / per_column;
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    for (int64_t n = t0; n < t1; ++n)
      decode_column<F>(p, n, scratch.data() + (n - t0) * per_column, dk.data());
    int64_t m = 0;
    for (; m + kMb <= p.M; m += kMb)
      for (int64_t n = t0; n < t1; ++n) {
        float* dec = scratch.data() + (n - t0) * per_column;
        rows_of_column<F, kMb, true>(p, n, m, dec + chunks * 33, dk.data(), dec);
      }
    for (int64_t n = t0; n < t1; ++n) {
      float* dec = scratch.data() + (n - t0) * per_column;
      last_rows<F, true>(p, n, m, dec + chunks * 33, dk.data(), dec);
    }
  }
}

// Columns n0 .. n1 in tiles of ~kTileBytes of weight: each tile is read from memory once
// and serves every block of kMb rows from cache, so a block of x (kMb rows, ≤ 128 KB at
// K = 8192) is read once a tile, not once a column. Each (row, column) is the same
// operations whatever the tiling.
template <int F>
void columns(const Problem& p, int64_t n0, int64_t n1) {
  if (p.M >= kScratchRows && p.K >= 32) return columns_decoded<F>(p, n0, n1);
  std::vector<float> offsets(has_offset(F) ? p.K / 32 : 0), scales(F == kQ4_K || F == kQ5_K ? p.K / 32 : F == kQ6_K ? p.K / 16 : 0);
  float* off = offsets.data();
  float* dk = scales.data();
  const int64_t tile = std::max<int64_t>(1, kTileBytes / p.row_bytes);
  for (int64_t t0 = n0; t0 < n1; t0 += tile) {
    const int64_t t1 = std::min(n1, t0 + tile);
    int64_t m = 0;
    for (; m + kMb <= p.M; m += kMb)
      for (int64_t n = t0; n < t1; ++n) rows_of_column<F, kMb>(p, n, m, off, dk);
    for (int64_t n = t0; n < t1; ++n) last_rows<F, false>(p, n, m, off, dk, nullptr);
  }
}

void run(const Problem& p, int64_t n0, int64_t n1) {
  with_format(p.format, [&](auto f) { columns<decltype(f)::value>(p, n0, n1); });
}
