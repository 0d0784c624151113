// CPU kernel of the LoRA delta for decode-like steps: every token reads its own adapter's
// A and B straight from the slot buffers (no [T, r, in] weight copy), so a step with many
// distinct adapters runs near memory bandwidth. Built on first use by kernels/cpu_ext.py.
//
// out[t, col_i : col_i + out_i] += B_i[s] @ (A_i[s] @ x[t]) for each lora row t = rows[j]
// with slot s = row_slots[j] and each slice i; only the first ranks[i][s] rows of A_i[s]
// and columns of B_i[s] are read. Accumulation in fp32, one rounding into out.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#endif

namespace {

// o[n] += dot(b[n * ld : n * ld + r], h[:r]) for n < width: the expand of one token.
template <typename scalar_t>
void expand_row(const scalar_t* b, int64_t ld, const float* h, int64_t r, int64_t width,
                scalar_t* o) {
  int64_t n = 0;
#if defined(__AVX2__) && defined(__FMA__)
  if constexpr (std::is_same_v<scalar_t, float>) {
    // Eight output rows at a time: eight vector dot products over k, then one 8x8
    // transpose-and-sum (hadd) instead of eight horizontal sums.
    const int64_t r8 = r - r % 8;
    for (; r8 > 0 && n + 8 <= width; n += 8) {
      __m256 acc[8];
      for (int q = 0; q < 8; ++q) acc[q] = _mm256_setzero_ps();
      for (int64_t k = 0; k < r8; k += 8) {
        const __m256 hv = _mm256_loadu_ps(h + k);
        for (int q = 0; q < 8; ++q)
          acc[q] = _mm256_fmadd_ps(_mm256_loadu_ps(b + (n + q) * ld + k), hv, acc[q]);
      }
      const __m256 s01 = _mm256_hadd_ps(acc[0], acc[1]), s23 = _mm256_hadd_ps(acc[2], acc[3]);
      const __m256 s45 = _mm256_hadd_ps(acc[4], acc[5]), s67 = _mm256_hadd_ps(acc[6], acc[7]);
      const __m256 s03 = _mm256_hadd_ps(s01, s23), s47 = _mm256_hadd_ps(s45, s67);
      __m256 sum = _mm256_add_ps(_mm256_permute2f128_ps(s03, s47, 0x20),
                                 _mm256_permute2f128_ps(s03, s47, 0x31));  // [8] row sums
      alignas(32) float tail[8];
      for (int q = 0; q < 8; ++q) {  // ranks that are not a multiple of 8
        float t = 0.f;
        for (int64_t k = r8; k < r; ++k) t += b[(n + q) * ld + k] * h[k];
        tail[q] = t;
      }
      sum = _mm256_add_ps(sum, _mm256_load_ps(tail));
      _mm256_storeu_ps(o + n, _mm256_add_ps(_mm256_loadu_ps(o + n), sum));
    }
  }
#endif
  for (; n < width; ++n) {
    const scalar_t* b_n = b + n * ld;
    float acc = 0.f;
    for (int64_t k = 0; k < r; ++k) acc += static_cast<float>(b_n[k]) * h[k];
    o[n] = static_cast<scalar_t>(static_cast<float>(o[n]) + acc);
  }
}

template <typename scalar_t>
void add_lora_rows(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& rows,
                   const torch::Tensor& row_slots, const std::vector<torch::Tensor>& lora_a,
                   const std::vector<torch::Tensor>& lora_b, const torch::Tensor& ranks) {
  const int64_t num_rows = rows.size(0), in = x.size(1), num_slices = lora_a.size();
  const int64_t max_loras = ranks.size(1), ld_out = out.stride(0), ld_x = x.stride(0);
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* slot_p = row_slots.data_ptr<int64_t>();
  const int32_t* rank_p = ranks.data_ptr<int32_t>();
  const scalar_t* x_p = x.data_ptr<scalar_t>();
  scalar_t* out_p = out.data_ptr<scalar_t>();
  std::vector<const scalar_t*> a_p(num_slices), b_p(num_slices);
  std::vector<int64_t> r_max(num_slices), width(num_slices), col(num_slices);
  int64_t next_col = 0;
  for (int64_t i = 0; i < num_slices; ++i) {
    a_p[i] = lora_a[i].data_ptr<scalar_t>();
    b_p[i] = lora_b[i].data_ptr<scalar_t>();
    r_max[i] = lora_a[i].size(1);
    width[i] = lora_b[i].size(1);
    col[i] = next_col;
    next_col += width[i];
  }
  // One work item = (lora row, slice); rows are sorted by slot, so a thread's contiguous
  // chunk reuses an adapter's weights while they are in cache.
  at::parallel_for(0, num_rows * num_slices, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(in), h;
    int64_t x_row = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t j = item / num_slices, i = item % num_slices;
      const int64_t t = row_p[j], s = slot_p[j], r = rank_p[i * max_loras + s];
      if (r == 0) continue;
      if (x_row != t) {  // x[t] in fp32, once per row
        for (int64_t c = 0; c < in; ++c) xf[c] = static_cast<float>(x_p[t * ld_x + c]);
        x_row = t;
      }
      h.assign(r, 0.f);
      const scalar_t* a = a_p[i] + s * r_max[i] * in;  // [r_max, in]
      for (int64_t k = 0; k < r; ++k) {
        const scalar_t* a_k = a + k * in;
        float acc = 0.f;
#pragma omp simd reduction(+ : acc)
        for (int64_t c = 0; c < in; ++c) acc += static_cast<float>(a_k[c]) * xf[c];
        h[k] = acc;
      }
      const scalar_t* b = b_p[i] + s * width[i] * r_max[i];  // [out_i, r_max]
      expand_row(b, r_max[i], h.data(), r, width[i], out_p + t * ld_out + col[i]);
    }
  });
}

}  // namespace

void add_lora_gather(torch::Tensor out, torch::Tensor x, torch::Tensor rows,
                     torch::Tensor row_slots, std::vector<torch::Tensor> lora_a,
                     std::vector<torch::Tensor> lora_b, torch::Tensor ranks) {
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "rows must be dense");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x differ in dtype");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && row_slots.scalar_type() == torch::kInt64,
              "rows and row_slots must be int64");
  TORCH_CHECK(ranks.scalar_type() == torch::kInt32 && ranks.is_contiguous(), "ranks: int32");
  TORCH_CHECK(lora_a.size() == lora_b.size() && (int64_t)lora_a.size() == ranks.size(0),
              "one A, one B and one ranks row per slice");
  int64_t total = 0;
  for (size_t i = 0; i < lora_a.size(); ++i) {
    TORCH_CHECK(lora_a[i].is_contiguous() && lora_b[i].is_contiguous(), "slot buffers dense");
    TORCH_CHECK(lora_a[i].scalar_type() == x.scalar_type() &&
                    lora_b[i].scalar_type() == x.scalar_type(),
                "slot buffers must have x's dtype");
    TORCH_CHECK(lora_a[i].size(2) == x.size(1) && lora_b[i].size(2) == lora_a[i].size(1),
                "slot buffer shapes do not match x");
    total += lora_b[i].size(1);
  }
  TORCH_CHECK(out.size(1) == total && out.size(0) == x.size(0), "out is not [T, sum(out_i)]");
  TORCH_CHECK(rows.is_contiguous() && row_slots.is_contiguous() &&
                  rows.size(0) == row_slots.size(0), "one slot per row");
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* slot_p = row_slots.data_ptr<int64_t>();
  for (int64_t j = 0; j < rows.size(0); ++j) {  // the kernel indexes memory with these
    TORCH_CHECK(row_p[j] >= 0 && row_p[j] < x.size(0), "row ", row_p[j], " out of range");
    TORCH_CHECK(slot_p[j] >= 0 && slot_p[j] < ranks.size(1), "slot ", slot_p[j],
                " out of range");
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_lora_gather",
                                  [&] {
    add_lora_rows<scalar_t>(out, x, rows, row_slots, lora_a, lora_b, ranks);
  });
}

