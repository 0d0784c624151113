// CPU kernel of greedy sampling: the index of each row's first maximum, as torch.argmax
// (whose index-tracking reduction is the slower form on wide rows). Rows are
// split across threads; within a row eight lanes track their own maximum and the lane
// results are merged by (value, then lowest index). A row holding NaN gets an unspecified
// index: the sampler fails such rows. argmax_finite_rows also says, in the same read,
// whether each row is all finite (x - x is 0 for a finite x and NaN for ±inf or NaN).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <limits>
#include <vector>

#include "vec.h"

namespace {

template <bool kCheck>
int64_t row_argmax(const float* x, int64_t n, bool* finite) {
  int64_t i = 0, best = 0;
  float top = -std::numeric_limits<float>::infinity();
  float bad = 0.f;  // kCheck: the sum of x - x, NaN iff a value is not finite
#if defined(__AVX2__) && defined(__FMA__)
  if (n >= 8) {
    __m256 vmax = _mm256_loadu_ps(x);
    __m256 acc = _mm256_sub_ps(vmax, vmax);
    __m256i vidx = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), cur = vidx;
    const __m256i step = _mm256_set1_epi32(8);
    for (i = 8; i + 8 <= n; i += 8) {
      cur = _mm256_add_epi32(cur, step);
      const __m256 v = _mm256_loadu_ps(x + i);
      if constexpr (kCheck) acc = _mm256_add_ps(acc, _mm256_sub_ps(v, v));
      const __m256 gt = _mm256_cmp_ps(v, vmax, _CMP_GT_OQ);  // strictly greater: first wins
      vmax = _mm256_blendv_ps(vmax, v, gt);
      vidx = _mm256_castps_si256(
          _mm256_blendv_ps(_mm256_castsi256_ps(vidx), _mm256_castsi256_ps(cur), gt));
    }
    alignas(32) float vals[8];
    alignas(32) int32_t idxs[8];
    _mm256_store_ps(vals, vmax);
    if constexpr (kCheck) {
      alignas(32) float accs[8];
      _mm256_store_ps(accs, acc);
      for (float a : accs) bad += a;
    }
    _mm256_store_si256(reinterpret_cast<__m256i*>(idxs), vidx);
    best = idxs[0];
    top = vals[0];
    for (int lane = 1; lane < 8; ++lane)
      if (vals[lane] > top || (vals[lane] == top && idxs[lane] < best)) {
        top = vals[lane];
        best = idxs[lane];
      }
  }
#endif
  for (; i < n; ++i) {
    if constexpr (kCheck) bad += x[i] - x[i];
    if (x[i] > top || i == 0) {
      top = x[i];
      best = i;
    }
  }
  if constexpr (kCheck) *finite = bad == 0.f;
  return best;
}

void check_logits(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.stride(1) == 1 &&
                  logits.scalar_type() == torch::kFloat32 && logits.size(1) > 0,
              "logits must be a CPU float32 [rows, vocab] tensor with dense rows");
  TORCH_CHECK(logits.size(1) < (int64_t{1} << 31), "vocab too large for int32 lanes");
}

}  // namespace

torch::Tensor argmax_rows(torch::Tensor logits) {
  check_logits(logits);
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kInt64));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = row_argmax<false>(x + r * logits.stride(0), logits.size(1), nullptr);
  });
  return out;
}

std::vector<torch::Tensor> argmax_finite_rows(torch::Tensor logits) {
  check_logits(logits);
  auto out = torch::empty({logits.size(0)}, logits.options().dtype(torch::kInt64));
  auto finite = torch::empty({logits.size(0)}, logits.options().dtype(torch::kBool));
  const float* x = logits.data_ptr<float>();
  int64_t* o = out.data_ptr<int64_t>();
  bool* f = finite.data_ptr<bool>();
  at::parallel_for(0, logits.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      o[r] = row_argmax<true>(x + r * logits.stride(0), logits.size(1), f + r);
  });
  return {out, finite};
}
