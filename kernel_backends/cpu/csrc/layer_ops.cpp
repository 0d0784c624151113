// CPU kernels of the elementwise work of a decoder layer, each one pass over its rows where
// the torch backend (kernel_backends/torch/layer_ops.py, the oracle) runs several small ops:
//
//   rms_norm:      out = w * (x * rsqrt(mean(x²) + eps)), the mean in fp32 (transformers)
//   add_rms_norm_: residual += x in place, then out = rms_norm(residual)
//   rope_store_kv: q, k rotated in place (rotate-half RoPE with per-token cos/sin rows), then
//                  k and v written to the paged cache at slot_mapping (slots < 0 skipped)
//   silu_mul:      out = silu(gu[:, :I]) * gu[:, I:]
//
// Rows may be strided views (the q/k/v split of one fused projection); the last dimension
// must be dense. Results are rounded to the input dtype where the torch forms round.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <type_traits>

#include "vec.h"

namespace {

constexpr int64_t kGrainElements = 16384;  // below this a call stays on one thread

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, kGrainElements / width); }

void check_rows(const torch::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.dim() == 2 && t.stride(1) == 1, name,
              " must be a CPU [rows, width] tensor with dense rows");
}

// Σ x² over one row, in fp32.
template <typename scalar_t>
float sum_squares(const scalar_t* x, int64_t n) {
  float total = 0.f;
#pragma omp simd reduction(+ : total)
  for (int64_t i = 0; i < n; ++i) total += static_cast<float>(x[i]) * static_cast<float>(x[i]);
  return total;
}

// o = w * to_dtype(x * inv), as transformers' LlamaRMSNorm rounds.
template <typename scalar_t>
void scale_row(const scalar_t* x, const scalar_t* w, float inv, int64_t n, scalar_t* o) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const scalar_t normed = static_cast<scalar_t>(static_cast<float>(x[i]) * inv);
    o[i] = static_cast<scalar_t>(static_cast<float>(w[i]) * static_cast<float>(normed));
  }
}

#if defined(__AVX2__) && defined(__FMA__)
// One bfloat16 row of norm_rows in 8-wide vectors, rounding where the scalar form rounds.
inline void norm_row_bf16(c10::BFloat16* row, const c10::BFloat16* add,
                          const c10::BFloat16* w, int64_t n, float eps, c10::BFloat16* o) {
  using T = c10::BFloat16;
  __m256 squares = _mm256_setzero_ps();
  for (int64_t i = 0; i < n; i += 8) {
    __m256 x = load8(row + i);
    if (add != nullptr) {
      x = round8<T>(_mm256_add_ps(x, load8(add + i)));
      store8(row + i, x);
    }
    squares = _mm256_fmadd_ps(x, x, squares);
  }
  const __m256 inv = _mm256_set1_ps(1.f / std::sqrt(hsum8(squares) / n + eps));
  for (int64_t i = 0; i < n; i += 8) {
    const __m256 normed = round8<T>(_mm256_mul_ps(load8(row + i), inv));
    store8(o + i, _mm256_mul_ps(load8(w + i), normed));
  }
}
#endif

#if defined(__AVX512F__)
// norm_row_bf16 in 16-wide vectors (width a multiple of 16): the same roundings; the sum of
// squares in another order of fp32 additions.
inline void norm_row_bf16_512(c10::BFloat16* row, const c10::BFloat16* add,
                              const c10::BFloat16* w, int64_t n, float eps,
                              c10::BFloat16* o) {
  using T = c10::BFloat16;
  __m512 squares = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 x = load16(row + i);
    if (add != nullptr) {
      x = round16<T>(_mm512_add_ps(x, load16(add + i)));
      store16(row + i, x);
    }
    squares = _mm512_fmadd_ps(x, x, squares);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(squares) / n + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 normed = round16<T>(_mm512_mul_ps(load16(row + i), inv));
    store16(o + i, _mm512_mul_ps(load16(w + i), normed));
  }
}
#endif

template <typename scalar_t>
void norm_rows(const torch::Tensor& x, const torch::Tensor* add, const torch::Tensor& w,
               double eps, torch::Tensor& out) {
  const int64_t n = x.size(1);
  at::parallel_for(0, x.size(0), grain_rows(n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* row = x.data_ptr<scalar_t>() + r * x.stride(0);
      const scalar_t* a = add != nullptr ? add->data_ptr<scalar_t>() + r * add->stride(0)
                                         : nullptr;
#if defined(__AVX512F__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (n % 16 == 0) {
          norm_row_bf16_512(row, a, w.data_ptr<scalar_t>(), n, static_cast<float>(eps),
                            out.data_ptr<scalar_t>() + r * n);
          continue;
        }
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (n % 8 == 0) {
          norm_row_bf16(row, a, w.data_ptr<scalar_t>(), n, static_cast<float>(eps),
                        out.data_ptr<scalar_t>() + r * n);
          continue;
        }
      }
#endif
      if (a != nullptr) {  // the residual stream: row += add[r], rounded to the dtype
#pragma omp simd
        for (int64_t i = 0; i < n; ++i)
          row[i] = static_cast<scalar_t>(static_cast<float>(row[i]) + static_cast<float>(a[i]));
      }
      const float inv =
          1.f / std::sqrt(sum_squares(row, n) / static_cast<float>(n) + static_cast<float>(eps));
      scale_row(row, w.data_ptr<scalar_t>(), inv, n, out.data_ptr<scalar_t>() + r * n);
    }
  });
}

torch::Tensor norm(torch::Tensor x, const torch::Tensor* add, torch::Tensor weight,
                   double eps) {
  check_rows(x, "x");
  TORCH_CHECK(weight.is_contiguous() && weight.dim() == 1 && weight.size(0) == x.size(1) &&
                  weight.scalar_type() == x.scalar_type(),
              "weight must be a dense [width] tensor of x's dtype");
  auto out = torch::empty({x.size(0), x.size(1)}, x.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    norm_rows<scalar_t>(x, add, weight, eps, out);
  });
  return out;
}

// Rotates one token's heads in place: x[:h] ← x[:h]·cos[:h] − x[h:]·sin[:h] and
// x[h:] ← x[h:]·cos[h:] + x[:h]·sin[h:], h = dim / 2.
template <typename scalar_t>
void rotate(scalar_t* x, int64_t heads, int64_t head_stride, const scalar_t* cos,
            const scalar_t* sin, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t h = 0; h < heads; ++h) {
    scalar_t* a = x + h * head_stride;
    scalar_t* b = a + half;
    int64_t i = 0;
#if defined(__AVX2__) && defined(__FMA__)
    if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
      for (; i + 8 <= half; i += 8) {  // fp32 products, one rounding, as below
        const __m256 lo = load8(a + i), hi = load8(b + i);
        store8(a + i, _mm256_fmsub_ps(lo, load8(cos + i), _mm256_mul_ps(hi, load8(sin + i))));
        store8(b + i, _mm256_fmadd_ps(hi, load8(cos + half + i),
                                      _mm256_mul_ps(lo, load8(sin + half + i))));
      }
    }
#endif
#pragma omp simd
    for (int64_t j = i; j < half; ++j) {
      const float lo = static_cast<float>(a[j]), hi = static_cast<float>(b[j]);
      a[j] = static_cast<scalar_t>(lo * static_cast<float>(cos[j]) -
                                   hi * static_cast<float>(sin[j]));
      b[j] = static_cast<scalar_t>(hi * static_cast<float>(cos[half + j]) +
                                   lo * static_cast<float>(sin[half + j]));
    }
  }
}

template <typename scalar_t>
void copy_heads(const scalar_t* src, int64_t heads, int64_t head_stride, int64_t dim,
                scalar_t* dst) {  // dst: dense [heads, dim]
  for (int64_t h = 0; h < heads; ++h)
    std::copy(src + h * head_stride, src + h * head_stride + dim, dst + h * dim);
}

template <typename scalar_t>
void rope_store_rows(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& v,
                     const torch::Tensor& cos, const torch::Tensor& sin,
                     torch::Tensor& k_cache, torch::Tensor& v_cache,
                     const torch::Tensor& slots) {
  const int64_t dim = q.size(2), hq = q.size(1), hkv = k.size(1);
  const int64_t* slot_p = slots.data_ptr<int64_t>();
  const int64_t row = k_cache.stride(1);  // one cache slot: [Hkv, D], dense
  at::parallel_for(0, q.size(0), grain_rows((hq + 2 * hkv) * dim), [&](int64_t b, int64_t e) {
    for (int64_t t = b; t < e; ++t) {
      const scalar_t* c = cos.data_ptr<scalar_t>() + t * cos.stride(0);
      const scalar_t* s = sin.data_ptr<scalar_t>() + t * sin.stride(0);
      rotate(q.data_ptr<scalar_t>() + t * q.stride(0), hq, q.stride(1), c, s, dim);
      scalar_t* kt = k.data_ptr<scalar_t>() + t * k.stride(0);
      rotate(kt, hkv, k.stride(1), c, s, dim);
      if (slot_p[t] < 0) continue;  // padding: nothing cached
      copy_heads(kt, hkv, k.stride(1), dim, k_cache.data_ptr<scalar_t>() + slot_p[t] * row);
      copy_heads(v.data_ptr<scalar_t>() + t * v.stride(0), hkv, v.stride(1), dim,
                 v_cache.data_ptr<scalar_t>() + slot_p[t] * row);
    }
  });
}

template <typename scalar_t>
void silu_mul_rows(const torch::Tensor& gu, torch::Tensor& out) {
  const int64_t n = out.size(1);
  at::parallel_for(0, gu.size(0), grain_rows(2 * n), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const scalar_t* g = gu.data_ptr<scalar_t>() + r * gu.stride(0);
      const scalar_t* u = g + n;
      scalar_t* o = out.data_ptr<scalar_t>() + r * n;
      int64_t i = 0;
#if defined(__AVX512F__)
      if constexpr (kVec8<scalar_t>) {  // the 8-wide forms' results, 16 lanes a step
        const __m512 one = _mm512_set1_ps(1.f), zero = _mm512_setzero_ps();
        for (; i + 16 <= n; i += 16) {
          const __m512 x = load16(g + i);
          const __m512 silu = round16<scalar_t>(
              _mm512_div_ps(x, _mm512_add_ps(one, exp512(_mm512_sub_ps(zero, x)))));
          store16(o + i, _mm512_mul_ps(silu, load16(u + i)));
        }
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if constexpr (std::is_same_v<scalar_t, float>) {
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {
          const __m256 x = _mm256_loadu_ps(g + i);
          const __m256 silu =
              _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, x))));
          _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
        }
      } else if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps();
        for (; i + 8 <= n; i += 8) {  // silu rounded to bfloat16, then the product
          const __m256 x = load8(g + i);
          const __m256 silu = round8<scalar_t>(
              _mm256_div_ps(x, _mm256_add_ps(one, exp256(_mm256_sub_ps(zero, x)))));
          store8(o + i, _mm256_mul_ps(silu, load8(u + i)));
        }
      }
#endif
      for (; i < n; ++i) {
        const float x = static_cast<float>(g[i]);
        const scalar_t silu = static_cast<scalar_t>(x / (1.f + std::exp(-x)));
        o[i] = static_cast<scalar_t>(static_cast<float>(silu) * static_cast<float>(u[i]));
      }
    }
  });
}

}  // namespace

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  return norm(x, nullptr, weight, eps);
}

torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            double eps) {
  check_rows(residual, "residual");
  TORCH_CHECK(x.sizes() == residual.sizes() && x.scalar_type() == residual.scalar_type(),
              "x and residual differ in shape or dtype");
  return norm(residual, &x, weight, eps);
}

torch::Tensor rope_store_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping) {
  for (const auto* t : {&q, &k, &v})
    TORCH_CHECK(t->device().is_cpu() && t->dim() == 3 && t->stride(2) == 1 &&
                    t->scalar_type() == q.scalar_type() && t->size(0) == q.size(0) &&
                    t->size(2) == q.size(2),
                "q, k and v must be CPU [T, heads, D] tensors of one dtype with dense heads");
  TORCH_CHECK(k.sizes() == v.sizes() && q.size(2) % 2 == 0, "k and v differ, or D is odd");
  check_rows(cos, "cos");
  check_rows(sin, "sin");
  TORCH_CHECK(cos.sizes() == sin.sizes() && cos.size(0) == q.size(0) &&
                  cos.size(1) == q.size(2) && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "cos and sin must be [T, D] in q's dtype");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.size(2) == k.size(1) &&
                  k_cache.size(3) == k.size(2) && k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(),
              "the caches must be dense [blocks, block_size, Hkv, D] of q's dtype");
  TORCH_CHECK(slot_mapping.scalar_type() == torch::kInt64 && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == q.size(0),
              "slot_mapping must be int64 [T]");
  const int64_t* slot_p = slot_mapping.data_ptr<int64_t>();
  const int64_t num_slots = k_cache.size(0) * k_cache.size(1);
  for (int64_t t = 0; t < q.size(0); ++t)  // the kernel writes memory at these
    TORCH_CHECK(slot_p[t] < num_slots, "slot ", slot_p[t], " out of range");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(), "rope_store_kv",
                                  [&] {
    rope_store_rows<scalar_t>(q, k, v, cos, sin, k_cache, v_cache, slot_mapping);
  });
  return q;
}

torch::Tensor silu_mul(torch::Tensor gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even width");
  auto out = torch::empty({gate_up.size(0), gate_up.size(1) / 2}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul",
                                  [&] { silu_mul_rows<scalar_t>(gate_up, out); });
  return out;
}
