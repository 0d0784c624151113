// CPU kernel of paged decode attention: one query token per sequence reads its context's
// keys and values in place through the block table (no gathered copy of the context), so
// the step reads each cached K/V row once. Built on first use by kernel_backends/cpu/extension.py.
//
// out[b, h] = softmax(cap(scale · q[b, h] · K[b]ᵀ)) · V[b] over the first context_lens[b]
// positions (only the last `window` of them when window > 0); cap(s) = softcap ·
// tanh(s / softcap) when softcap > 0, else s. Positions past a context (or before its
// window) are never read (they may hold another request's or stale, even non-finite,
// values). Query heads h share KV head h / (Hq / Hkv).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "vec.h"

namespace {

// The cached rows of one (sequence, KV head): row(p) points at position p's head_dim
// values, read in place through the block table. Blocks hold 2^block_shift positions (a
// shift and a mask rather than a 64-bit division a row: 7 % of a decode call).
template <typename scalar_t>
struct ContextRows {
  const scalar_t* base;
  const int32_t* table;
  int64_t block_shift, block_stride, row_stride;
  const scalar_t* row(int64_t p) const {
    const int64_t in_block = p & ((int64_t{1} << block_shift) - 1);
    return base + table[p >> block_shift] * block_stride + in_block * row_stride;
  }
};

#if defined(__AVX512F__) && defined(__AVX512DQ__)
// The eight lane sums of a[0..7] (16 lanes each), as one vector: halves added, then sum8.
inline __m256 sum8x16(const __m512* a) {
  __m256 h[8];
  for (int j = 0; j < 8; ++j)
    h[j] = _mm256_add_ps(_mm512_castps512_ps256(a[j]), _mm512_extractf32x8_ps(a[j], 1));
  return sum8(h);
}

// scores_of on AVX-512 for head_dim % 16 == 0: eight positions, 16 lanes a step.
template <typename scalar_t>
int64_t scores_512(const float* q, const ContextRows<scalar_t>& k, int64_t first,
                   int64_t len, int64_t dim, float* s) {
  int64_t p = 0;
  for (; p + 8 <= len; p += 8) {
    __m512 acc[8];
    const scalar_t* rows[8];
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm512_setzero_ps();
      rows[j] = k.row(first + p + j);
    }
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 qv = _mm512_loadu_ps(q + d);
      for (int j = 0; j < 8; ++j) acc[j] = _mm512_fmadd_ps(load16(rows[j] + d), qv, acc[j]);
    }
    _mm256_storeu_ps(s + p, sum8x16(acc));
  }
  return p;
}
#endif

#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
// s[i] = scale · (q · k_{first + i}) for bfloat16 rows, head_dim % 32 == 0, eight positions
// at a time: VDPBF16PS sums the exact products of bfloat16 pairs in float32 (q stays
// bfloat16, as the model gave it; the scale multiplies the sum). Returns the positions done.
inline int64_t scores_dpbf16(const c10::BFloat16* q, const ContextRows<c10::BFloat16>& k,
                             int64_t first, int64_t len, int64_t dim, float scale, float* s) {
  const __m256 sv = _mm256_set1_ps(scale);
  int64_t p = 0;
  for (; p + 8 <= len; p += 8) {
    __m512 acc[8];
    const c10::BFloat16* rows[8];
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm512_setzero_ps();
      rows[j] = k.row(first + p + j);
    }
    for (int64_t d = 0; d < dim; d += 32) {
      const __m512bh qv = reinterpret_cast<__m512bh>(_mm512_loadu_si512(q + d));
      for (int j = 0; j < 8; ++j)
        acc[j] = _mm512_dpbf16_ps(
            acc[j], reinterpret_cast<__m512bh>(_mm512_loadu_si512(rows[j] + d)), qv);
    }
    _mm256_storeu_ps(s + p, _mm256_mul_ps(sum8x16(acc), sv));
  }
  for (; p < len; ++p) {  // the last positions: the same products, summed in order
    const c10::BFloat16* kp = k.row(first + p);
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += static_cast<float>(q[d]) * static_cast<float>(kp[d]);
    s[p] = dot * scale;
  }
  return len;
}
#endif

// s[i] = q · k_{first + i} for i < len (q already scaled).
template <typename scalar_t>
void scores_of(const float* q, const ContextRows<scalar_t>& k, int64_t first, int64_t len,
               int64_t dim, float* s) {
  int64_t p = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVec8<scalar_t>) {
#if defined(__AVX512F__) && defined(__AVX512DQ__)
    if (dim % 16 == 0) p = scores_512(q, k, first, len, dim, s);
#endif
    if (dim % 8 == 0) {
      for (; p + 8 <= len; p += 8) {  // eight positions, one hadd tree for their sums
        __m256 acc[8];
        const scalar_t* rows[8];
        for (int j = 0; j < 8; ++j) {
          acc[j] = _mm256_setzero_ps();
          rows[j] = k.row(first + p + j);
        }
        for (int64_t d = 0; d < dim; d += 8) {
          const __m256 qv = _mm256_loadu_ps(q + d);
          for (int j = 0; j < 8; ++j)
            acc[j] = _mm256_fmadd_ps(load8(rows[j] + d), qv, acc[j]);
        }
        _mm256_storeu_ps(s + p, sum8(acc));
      }
    }
  }
#endif
  for (; p < len; ++p) {
    const scalar_t* kp = k.row(first + p);
    float dot = 0.f;
    for (int64_t d = 0; d < dim; ++d) dot += q[d] * static_cast<float>(kp[d]);
    s[p] = dot;
  }
}

// s[i] = scale · (q · k_{first + i}) for i < len: qf is q · scale in float32, qraw q as
// the model gave it (bfloat16 rows with head_dim % 32 == 0 take VDPBF16PS on it).
template <typename scalar_t>
void scores_window(const float* qf, const scalar_t* qraw, const ContextRows<scalar_t>& k,
                   int64_t first, int64_t len, int64_t dim, float scale, float* s) {
#if defined(__AVX512F__) && defined(__AVX512DQ__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
    if (dim % 32 == 0) {
      scores_dpbf16(qraw, k, first, len, dim, scale, s);
      return;
    }
  }
#endif
  (void)qraw;
  (void)scale;
  scores_of(qf, k, first, len, dim, s);
}

// s[p] = softcap · tanh(s[p] / softcap) for p < len (Gemma 2's soft-capping).
inline void soft_cap(float* s, int64_t len, float softcap) {
  for (int64_t p = 0; p < len; ++p) s[p] = std::tanh(s[p] / softcap) * softcap;
}

// s[p] = exp(s[p] - max s) for p < len; returns their sum.
inline float exp_normalise(float* s, int64_t len) {
  float top = -std::numeric_limits<float>::infinity();
  for (int64_t p = 0; p < len; ++p) top = std::max(top, s[p]);
  int64_t p = 0;
  float sum = 0.f;
#if defined(__AVX2__) && defined(__FMA__)
  p = len - len % 8;
  sum = exp_shift_sum(s, p, top);
#endif
  for (; p < len; ++p) {
    s[p] = std::exp(s[p] - top);
    sum += s[p];
  }
  return sum;
}

#if defined(__AVX2__) && defined(__FMA__)
// acc[8W columns] += Σ_i w[i] v_{first + i}[8W columns]: W vector accumulators in registers.
template <int W, typename scalar_t>
void accumulate_columns(const float* w, const ContextRows<scalar_t>& v, int64_t first,
                        int64_t len, int64_t d0, float* acc) {
  __m256 a[W];
  for (int j = 0; j < W; ++j) a[j] = _mm256_loadu_ps(acc + d0 + 8 * j);
  for (int64_t i = 0; i < len; ++i) {
    const __m256 wi = _mm256_set1_ps(w[i]);
    const scalar_t* vi = v.row(first + i) + d0;
    for (int j = 0; j < W; ++j) a[j] = _mm256_fmadd_ps(wi, load8(vi + 8 * j), a[j]);
  }
  for (int j = 0; j < W; ++j) _mm256_storeu_ps(acc + d0 + 8 * j, a[j]);
}
#endif

#if defined(__AVX512F__)
// accumulate_columns in 16-wide vectors: acc[16W columns] += Σ_i w[i] v_{first + i}.
template <int W, typename scalar_t>
void accumulate_columns_512(const float* w, const ContextRows<scalar_t>& v, int64_t first,
                            int64_t len, int64_t d0, float* acc) {
  __m512 a[W];
  for (int j = 0; j < W; ++j) a[j] = _mm512_loadu_ps(acc + d0 + 16 * j);
  for (int64_t i = 0; i < len; ++i) {
    const __m512 wi = _mm512_set1_ps(w[i]);
    const scalar_t* vi = v.row(first + i) + d0;
    for (int j = 0; j < W; ++j) a[j] = _mm512_fmadd_ps(wi, load16(vi + 16 * j), a[j]);
  }
  for (int j = 0; j < W; ++j) _mm512_storeu_ps(acc + d0 + 16 * j, a[j]);
}
#endif

// acc[:dim] += Σ_i w[i] v_{first + i} (fp32 accumulators).
template <typename scalar_t>
void weighted_accumulate(const float* w, const ContextRows<scalar_t>& v, int64_t first,
                         int64_t len, int64_t dim, float* acc) {
  int64_t d0 = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (kVec8<scalar_t>) {
#if defined(__AVX512F__)
    for (; d0 + 64 <= dim; d0 += 64) accumulate_columns_512<4>(w, v, first, len, d0, acc);
    for (; d0 + 16 <= dim; d0 += 16) accumulate_columns_512<1>(w, v, first, len, d0, acc);
#endif
    for (; d0 + 64 <= dim; d0 += 64) accumulate_columns<8>(w, v, first, len, d0, acc);
    for (; d0 + 8 <= dim; d0 += 8) accumulate_columns<1>(w, v, first, len, d0, acc);
  }
#endif
  for (int64_t i = 0; i < len; ++i) {
    const scalar_t* vi = v.row(first + i);
    for (int64_t d = d0; d < dim; ++d) acc[d] += w[i] * static_cast<float>(vi[d]);
  }
}

// Positions per window: a window's K (then V) rows of one KV head (64 x head_dim values)
// stay in L1/L2 while each of the head's query heads reads them.
constexpr int64_t kWindow = 64;

template <typename scalar_t>
void decode_heads(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& context_lens, double scale, double softcap,
                  int64_t window, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t num_kv_heads = k_cache.size(2), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t shift = __builtin_ctzll(static_cast<uint64_t>(k_cache.size(1)));
  const scalar_t* q_p = q.data_ptr<scalar_t>();
  const int64_t q_seq = q.stride(0), q_head = q.stride(1);  // q rows may be strided
  const int32_t* table_p = block_tables.data_ptr<int32_t>();
  const int32_t* len_p = context_lens.data_ptr<int32_t>();
  scalar_t* out_p = out.data_ptr<scalar_t>();
  const float sc = static_cast<float>(scale);
  // One work item = (sequence, KV head): its `group` query heads read the same K/V rows,
  // window by window, so each row comes from memory once (read once per query head, a
  // long context's rows outgrew L2 and came from memory `group` times).
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf(group * head_dim), scores, acc(group * head_dim), denom(group);
    std::vector<scalar_t> qraw(group * head_dim);  // the group's q rows, dense
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      // positions first .. first + len - 1: the context, or its last `window` positions
      const int64_t first = window > 0 ? std::max<int64_t>(0, len_p[b] - window) : 0;
      const int64_t len = len_p[b] - first;
      const int32_t* table = table_p + b * max_blocks;
      const ContextRows<scalar_t> k{k_cache.data_ptr<scalar_t>() + kvh * k_cache.stride(2),
                                    table, shift, k_cache.stride(0), k_cache.stride(1)};
      const ContextRows<scalar_t> v{v_cache.data_ptr<scalar_t>() + kvh * v_cache.stride(2),
                                    table, shift, v_cache.stride(0), v_cache.stride(1)};
      const int64_t head0 = (b * num_heads + kvh * group) * head_dim;  // the group's out
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d) {
          const scalar_t x = q_p[b * q_seq + (kvh * group + g) * q_head + d];
          qraw[g * head_dim + d] = x;
          qf[g * head_dim + d] = static_cast<float>(x) * sc;
        }
      scores.resize(group * len);  // scores[g * len + p] of position first + p
      for (int64_t p0 = 0; p0 < len; p0 += kWindow)
        for (int64_t g = 0; g < group; ++g)
          scores_window(qf.data() + g * head_dim, qraw.data() + g * head_dim, k, first + p0,
                        std::min(kWindow, len - p0), head_dim, sc,
                        scores.data() + g * len + p0);
      if (softcap > 0) soft_cap(scores.data(), group * len, static_cast<float>(softcap));
      for (int64_t g = 0; g < group; ++g) denom[g] = exp_normalise(scores.data() + g * len, len);
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t p0 = 0; p0 < len; p0 += kWindow)
        for (int64_t g = 0; g < group; ++g)
          weighted_accumulate(scores.data() + g * len + p0, v, first + p0,
                              std::min(kWindow, len - p0), head_dim, acc.data() + g * head_dim);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          out_p[head0 + g * head_dim + d] =
              static_cast<scalar_t>(acc[g * head_dim + d] / denom[g]);
    }
  });
}

}  // namespace

torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, double softcap,
                                     int64_t window) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.stride(2) == 1, "q must be [B, Hq, D] with dense rows");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.stride(3) == 1,
              "k and v caches must share a [NB, bs, Hkv, D] layout with dense rows");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(), "q and the caches differ in dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "q heads do not match the cache");
  TORCH_CHECK(softcap >= 0 && window >= 0, "softcap and window must be >= 0 (0 = off)");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == torch::kInt32 && context_lens.is_contiguous() &&
                  block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "block_tables [B, max_blocks] and context_lens [B] must be int32");
  const int32_t* len_p = context_lens.data_ptr<int32_t>();
  const int32_t* table_p = block_tables.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  TORCH_CHECK(block_size > 0 && (block_size & (block_size - 1)) == 0,
              "block size ", block_size, " is not a power of two");
  for (int64_t b = 0; b < q.size(0); ++b) {  // the kernel indexes memory with these
    TORCH_CHECK(len_p[b] >= 1 && (len_p[b] + block_size - 1) / block_size <= max_blocks,
                "context length ", len_p[b], " does not fit the block table");
    for (int64_t j = 0; j < (len_p[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(table_p[b * max_blocks + j] >= 0 &&
                      table_p[b * max_blocks + j] < k_cache.size(0),
                  "block ", table_p[b * max_blocks + j], " out of range");
  }
  auto out = torch::empty(q.sizes(), q.options());  // dense, whatever q's strides
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_attention_decode", [&] {
    decode_heads<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, scale, softcap,
                           window, out);
  });
  return out;
}
