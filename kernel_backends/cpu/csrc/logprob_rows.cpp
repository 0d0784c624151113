// CPU kernel of the sampled tokens' logprobs: per row, in one read of the row, the chosen
// token's value, its rank (the number of values >= it: vLLM's rank, ties ahead) and the k
// largest values with their ids; then, where asked, log-sum-exp over the row (still in
// cache) is subtracted from the chosen and top values (log_softmax of only k + 1 values).
// The torch twin is kernel_backends/torch/logprob_rows.py.
//
// Top-k order: descending values, ties by lower index (a stable sort's order). The first k
// values of a row enter the list whatever they are (-inf included); afterwards a value
// enters only when strictly above the k-th, so only a few dozen of a row's values are ever
// inserted. Rows are split across threads. A row holding NaN gets unspecified values: the
// sampler has already failed such rows.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <cmath>
#include <limits>
#include <vector>

#include "vec.h"

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();

struct TopK {
  int64_t k, size = 0;
  float* val;
  int64_t* idx;

  // Insert (v, i), i above every index seen so far: after the values >= v (ties stay in
  // index order); the last one falls off a full list.
  void insert(float v, int64_t i) {
    if (k == 0) return;
    int64_t p = size < k ? size : k - 1;
    if (size == k && !(v > val[k - 1])) return;
    while (p > 0 && val[p - 1] < v) {
      val[p] = val[p - 1];
      idx[p] = idx[p - 1];
      --p;
    }
    val[p] = v;
    idx[p] = i;
    if (size < k) ++size;
  }
  float threshold() const {  // what a value must beat to enter (k = 0: nothing enters)
    if (k == 0) return std::numeric_limits<float>::infinity();
    return size < k ? kNegInf : val[k - 1];
  }
};

// One row: returns (max, rank); fills top.
void scan_row(const float* x, int64_t n, float chosen, TopK& top, float& mx, int64_t& rank) {
  int64_t i = 0, count = 0;
  for (; i < n && top.size < top.k; ++i) top.insert(x[i], i);  // fill: the first k values
  mx = kNegInf;
  for (int64_t j = 0; j < i; ++j) {
    mx = std::max(mx, x[j]);
    count += x[j] >= chosen;
  }
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 c = _mm256_set1_ps(chosen);
  __m256 vmax = _mm256_set1_ps(mx);
  __m256i vcount = _mm256_setzero_si256();
  __m256 thr = _mm256_set1_ps(top.threshold());
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    vmax = _mm256_max_ps(vmax, v);
    vcount = _mm256_sub_epi32(vcount, _mm256_castps_si256(_mm256_cmp_ps(v, c, _CMP_GE_OQ)));
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(v, thr, _CMP_GT_OQ));
    if (mask) {  // rare once the list holds large values
      for (int lane = 0; lane < 8; ++lane)
        if (mask >> lane & 1) top.insert(x[i + lane], i + lane);
      thr = _mm256_set1_ps(top.threshold());
    }
  }
  alignas(32) float m8[8];
  alignas(32) int32_t c8[8];
  _mm256_store_ps(m8, vmax);
  _mm256_store_si256(reinterpret_cast<__m256i*>(c8), vcount);
  for (int lane = 0; lane < 8; ++lane) {
    mx = std::max(mx, m8[lane]);
    count += c8[lane];
  }
#endif
  for (; i < n; ++i) {
    mx = std::max(mx, x[i]);
    count += x[i] >= chosen;
    top.insert(x[i], i);
  }
  rank = count;
}

// log(sum(exp(x - mx))) + mx; mx itself where it is not finite (all -inf: -inf).
float log_sum_exp(const float* x, int64_t n, float mx) {
  if (!std::isfinite(mx)) return mx;
  int64_t i = 0;
  double total = 0.0;
#if defined(__AVX2__) && defined(__FMA__)
  const __m256 m = _mm256_set1_ps(mx);
  __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    s0 = _mm256_add_ps(s0, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i), m)));
    s1 = _mm256_add_ps(s1, exp256(_mm256_sub_ps(_mm256_loadu_ps(x + i + 8), m)));
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, _mm256_add_ps(s0, s1));
  for (float lane : lanes) total += lane;
#endif
  for (; i < n; ++i) total += std::exp(x[i] - mx);
  return static_cast<float>(std::log(total)) + mx;
}

}  // namespace

std::vector<torch::Tensor> logprob_rows(torch::Tensor logits, torch::Tensor tokens, int64_t k,
                                        bool normalize) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.scalar_type() == torch::kFloat32 && logits.size(1) > 0,
              "logits must be a CPU float32 [rows, vocab] tensor with dense rows");
  TORCH_CHECK(tokens.dim() == 1 && tokens.size(0) == logits.size(0) &&
                  tokens.scalar_type() == torch::kInt64 && tokens.is_contiguous(),
              "tokens must be a contiguous int64 [rows] tensor");
  const int64_t rows = logits.size(0), n = logits.size(1);
  TORCH_CHECK(k >= 0 && k <= n, "k must be in [0, vocab]");
  auto chosen = torch::empty({rows}, logits.options());
  auto ranks = torch::empty({rows}, tokens.options());
  auto top_vals = torch::empty({rows, k}, logits.options());
  auto top_ids = torch::empty({rows, k}, tokens.options());
  const float* x = logits.data_ptr<float>();
  const int64_t* tok = tokens.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(tok[r] >= 0 && tok[r] < n, "token id ", tok[r], " out of the vocabulary");
  float* cv = chosen.data_ptr<float>();
  int64_t* rk = ranks.data_ptr<int64_t>();
  float* tv = top_vals.data_ptr<float>();
  int64_t* ti = top_ids.data_ptr<int64_t>();
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* row = x + r * logits.stride(0);
      const float c = row[tok[r]];
      TopK top{k, 0, tv + r * k, ti + r * k};
      float mx;
      scan_row(row, n, c, top, mx, rk[r]);
      const float lse = normalize ? log_sum_exp(row, n, mx) : 0.f;
      cv[r] = c - lse;
      for (int64_t j = 0; j < k; ++j) top.val[j] -= lse;
    }
  });
  return {chosen, ranks, top_vals, top_ids};
}
