// CPU kernel of paged decode attention: one query token per sequence reads its context's
// keys and values in place through the block table (no gathered copy of the context), so
// the step reads each cached K/V row once. Built on first use by kernels/cpu_ext.py.
//
// out[b, h] = softmax(scale · q[b, h] · K[b]ᵀ) · V[b] over the first context_lens[b]
// positions; positions past a context are never read (they may hold another request's or
// stale, even non-finite, values). Query heads h share KV head h / (Hq / Hkv).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

namespace {

template <typename scalar_t>
void decode_heads(const torch::Tensor& q, const torch::Tensor& k_cache,
                  const torch::Tensor& v_cache, const torch::Tensor& block_tables,
                  const torch::Tensor& context_lens, double scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv_heads = k_cache.size(2);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t cb = k_cache.stride(0), co = k_cache.stride(1), ch = k_cache.stride(2);
  const scalar_t* q_p = q.data_ptr<scalar_t>();
  const scalar_t* k_p = k_cache.data_ptr<scalar_t>();
  const scalar_t* v_p = v_cache.data_ptr<scalar_t>();
  const int32_t* table_p = block_tables.data_ptr<int32_t>();
  const int32_t* len_p = context_lens.data_ptr<int32_t>();
  scalar_t* out_p = out.data_ptr<scalar_t>();
  const float sc = static_cast<float>(scale);
  // One work item = (sequence, KV head): its `group` query heads share every K/V row read.
  at::parallel_for(0, batch * num_kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qf, scores, acc;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / num_kv_heads, kvh = item % num_kv_heads;
      const int64_t len = len_p[b];
      const int32_t* table = table_p + b * max_blocks;
      qf.resize(group * head_dim);
      for (int64_t g = 0; g < group; ++g)
        for (int64_t d = 0; d < head_dim; ++d)
          qf[g * head_dim + d] =
              static_cast<float>(q_p[(b * num_heads + kvh * group + g) * head_dim + d]) * sc;
      scores.assign(group * len, 0.f);
      for (int64_t p = 0; p < len; ++p) {  // scores[g, p] = q_g · k_p
        const scalar_t* k = k_p + table[p / block_size] * cb + (p % block_size) * co + kvh * ch;
        for (int64_t g = 0; g < group; ++g) {
          const float* qg = qf.data() + g * head_dim;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * static_cast<float>(k[d]);
          scores[g * len + p] = dot;
        }
      }
      std::vector<float> denom(group);
      for (int64_t g = 0; g < group; ++g) {  // softmax over p, in place
        float* s = scores.data() + g * len;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t p = 0; p < len; ++p) top = std::max(top, s[p]);
        float sum = 0.f;
        for (int64_t p = 0; p < len; ++p) {
          s[p] = std::exp(s[p] - top);
          sum += s[p];
        }
        denom[g] = sum;
      }
      acc.assign(group * head_dim, 0.f);
      for (int64_t p = 0; p < len; ++p) {  // acc[g] += w[g, p] · v_p
        const scalar_t* v = v_p + table[p / block_size] * cb + (p % block_size) * co + kvh * ch;
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + p];
          float* a = acc.data() + g * head_dim;
#pragma omp simd
          for (int64_t d = 0; d < head_dim; ++d) a[d] += w * static_cast<float>(v[d]);
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        scalar_t* o = out_p + (b * num_heads + kvh * group + g) * head_dim;
        for (int64_t d = 0; d < head_dim; ++d)
          o[d] = static_cast<scalar_t>(acc[g * head_dim + d] / denom[g]);
      }
    }
  });
}

}  // namespace

torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale) {
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && q.is_contiguous(), "q must be a dense [B, Hq, D]");
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.strides() == v_cache.strides() &&
                  k_cache.sizes() == v_cache.sizes() && k_cache.stride(3) == 1,
              "k and v caches must share a [NB, bs, Hkv, D] layout with dense rows");
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() &&
                  v_cache.scalar_type() == q.scalar_type(), "q and the caches differ in dtype");
  TORCH_CHECK(q.size(2) == k_cache.size(3) && q.size(1) % k_cache.size(2) == 0,
              "q heads do not match the cache");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt32 && block_tables.is_contiguous() &&
                  context_lens.scalar_type() == torch::kInt32 && context_lens.is_contiguous() &&
                  block_tables.size(0) == q.size(0) && context_lens.size(0) == q.size(0),
              "block_tables [B, max_blocks] and context_lens [B] must be int32");
  const int32_t* len_p = context_lens.data_ptr<int32_t>();
  const int32_t* table_p = block_tables.data_ptr<int32_t>();
  const int64_t block_size = k_cache.size(1), max_blocks = block_tables.size(1);
  for (int64_t b = 0; b < q.size(0); ++b) {  // the kernel indexes memory with these
    TORCH_CHECK(len_p[b] >= 1 && (len_p[b] + block_size - 1) / block_size <= max_blocks,
                "context length ", len_p[b], " does not fit the block table");
    for (int64_t j = 0; j < (len_p[b] + block_size - 1) / block_size; ++j)
      TORCH_CHECK(table_p[b * max_blocks + j] >= 0 &&
                      table_p[b * max_blocks + j] < k_cache.size(0),
                  "block ", table_p[b * max_blocks + j], " out of range");
  }
  auto out = torch::empty_like(q);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, q.scalar_type(),
                                  "paged_attention_decode", [&] {
    decode_heads<scalar_t>(q, k_cache, v_cache, block_tables, context_lens, scale, out);
  });
  return out;
}
