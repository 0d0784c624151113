// CPU kernel of the LoRA delta for decode-like steps: every token reads its own adapter's
// A and B straight from the slot buffers (no [T, r, in] weight copy), so a step with many
// distinct adapters runs near memory bandwidth. Built on first use by kernel_backends/cpu/extension.py.
//
// out[t, col_i : col_i + out_i] += B_i[s] @ (A_i[s] @ x[t]) for each lora row t = rows[j]
// with slot s = row_slots[j] and each slice i; only the first ranks[i][s] rows of A_i[s]
// and columns of B_i[s] are read (the slot buffers are overlapping views of rank-row pools:
// what lies past a slot's rank is the next adapter's). Accumulation in fp32, one rounding
// into out. bfloat16 on AVX512-BF16: h is rounded to bfloat16 (as PEFT's bf16 lora_A output
// is) and the expand's pairs of rank rows run on VDPBF16PS (lora_blocks.h).
// prefetch > 0: each thread requests the weights of its work item that many items ahead
// into L2 (a per-ISA choice, kernel_backends/cpu/lora_routes.py); the result is the same.
// A_i is a [units, r_max, in] view with unit stride along in (its slot and row strides are
// read from the tensor); B_i a [units, out_i, r_max] view with unit stride along out
// (r-major: [rows, out_i] pool storage, the engine's CPU slot layout, whose expand runs as
// vector FMAs over out_i) or along the rank ([out_i, rows] storage).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "lora_blocks.h"
#include "vec.h"

namespace {

using namespace lora_blocks;

// Requests `bytes` from p on into L2 (prefetcht1 on x86), a line at a time; reads nothing.
inline void prefetch_l2(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t o = 0; o < bytes; o += 64) __builtin_prefetch(c + o, 0, 2);
}

template <typename scalar_t>
void add_lora_rows(torch::Tensor& out, const torch::Tensor& x, const torch::Tensor& rows,
                   const torch::Tensor& row_slots, const std::vector<torch::Tensor>& lora_a,
                   const std::vector<torch::Tensor>& lora_b, const torch::Tensor& ranks,
                   int64_t prefetch) {
  const int64_t num_rows = rows.size(0), in = x.size(1), num_slices = lora_a.size();
  const int64_t units = ranks.size(1), ld_out = out.stride(0), ld_x = x.stride(0);
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* slot_p = row_slots.data_ptr<int64_t>();
  const int32_t* rank_p = ranks.data_ptr<int32_t>();
  const scalar_t* x_p = x.data_ptr<scalar_t>();
  scalar_t* out_p = out.data_ptr<scalar_t>();
  std::vector<const scalar_t*> a_p(num_slices), b_p(num_slices);
  std::vector<int64_t> width(num_slices), col(num_slices);
  std::vector<int64_t> a_slot_stride(num_slices), lda(num_slices);
  std::vector<int64_t> b_slot_stride(num_slices), ldb(num_slices);
  std::vector<bool> r_major(num_slices);  // B's outputs of one rank adjacent (see above)
  int64_t next_col = 0;
  for (int64_t i = 0; i < num_slices; ++i) {
    a_p[i] = lora_a[i].data_ptr<scalar_t>();
    b_p[i] = lora_b[i].data_ptr<scalar_t>();
    a_slot_stride[i] = lora_a[i].stride(0);
    lda[i] = lora_a[i].stride(1);  // between rank rows of A
    width[i] = lora_b[i].size(1);
    b_slot_stride[i] = lora_b[i].stride(0);
    r_major[i] = lora_b[i].stride(1) == 1 && width[i] > 1;
    ldb[i] = r_major[i] ? lora_b[i].stride(2) : lora_b[i].stride(1);  // between rank rows
    col[i] = next_col;                                                 // or output rows
    next_col += width[i];
  }
  // Rows are sorted by slot: up to kBlock consecutive rows of one slot form a block that
  // reads its adapter's A and B once (from memory) for all its rows.
  std::vector<int64_t> block_start;
  for (int64_t j = 0; j < num_rows; ++j)
    if (j == 0 || slot_p[j] != slot_p[j - 1] || j - block_start.back() == kBlock)
      block_start.push_back(j);
  const int64_t num_blocks = block_start.size();
  block_start.push_back(num_rows);
  // One work item = (block, slice); a thread's contiguous chunk of items keeps one
  // adapter's weights in cache across its blocks.
  at::parallel_for(0, num_blocks * num_slices, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> xf(kBlock * in), h(kBlock * 256);
    int64_t x_block = -1;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t blk = item / num_slices, i = item % num_slices;
      const int64_t j0 = block_start[blk], cnt = block_start[blk + 1] - j0;
      const int64_t s = slot_p[j0], r = rank_p[i * units + s];
      if (prefetch > 0 && item + prefetch < end) {  // a later item's cold A and B into L2
        const int64_t i2 = (item + prefetch) % num_slices;
        const int64_t s2 = slot_p[block_start[(item + prefetch) / num_slices]];
        const int64_t r2 = rank_p[i2 * units + s2], e = sizeof(scalar_t);
        if ((s2 != s || i2 != i) && r2 > 0) {  // (the same slot and slice: in cache)
          prefetch_l2(a_p[i2] + s2 * a_slot_stride[i2], ((r2 - 1) * lda[i2] + in) * e);
          if (r_major[i2])
            prefetch_l2(b_p[i2] + s2 * b_slot_stride[i2],
                        ((r2 - 1) * ldb[i2] + width[i2]) * e);
        }
      }
      if (r == 0) continue;
      if (r * kBlock > (int64_t)h.size()) h.resize(r * kBlock);
      bool shrunk = false;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) {
        if (in % 32 == 0) {
          const scalar_t* xs[kBlock];
          for (int64_t q = 0; q < cnt; ++q) xs[q] = x_p + row_p[j0 + q] * ld_x;
          shrink_block_bf16_512(a_p[i] + s * a_slot_stride[i], lda[i], in, xs, cnt, r,
                                h.data());
          shrunk = true;
        }
      }
#endif
      if (!shrunk) {
        if (x_block != blk) {  // the block's x rows in fp32, once per block
          for (int64_t q = 0; q < cnt; ++q)
            for (int64_t c = 0; c < in; ++c)
              xf[q * in + c] = static_cast<float>(x_p[row_p[j0 + q] * ld_x + c]);
          x_block = blk;
        }
        shrink_block(a_p[i] + s * a_slot_stride[i], lda[i], in, xf.data(), cnt, r, h.data());
      }
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<scalar_t, c10::BFloat16>) round_to_bf16(h.data(), cnt * r);
#endif
      const scalar_t* b = b_p[i] + s * b_slot_stride[i];
      if (r_major[i]) {
        scalar_t* outs[kBlock];
        for (int64_t q = 0; q < cnt; ++q) outs[q] = out_p + row_p[j0 + q] * ld_out + col[i];
        expand_block_t(b, ldb[i], h.data(), r, cnt, width[i], outs);
        continue;
      }
      for (int64_t n0 = 0; n0 < width[i]; n0 += kExpandChunk) {  // B chunk stays in L1
        const int64_t w = std::min(kExpandChunk, width[i] - n0);
        for (int64_t q = 0; q < cnt; ++q)
          expand_row(b + n0 * ldb[i], ldb[i], h.data() + q * r, r, w,
                     out_p + row_p[j0 + q] * ld_out + col[i] + n0);
      }
    }
  });
}

}  // namespace

void add_lora_gather(torch::Tensor out, torch::Tensor x, torch::Tensor rows,
                     torch::Tensor row_slots, std::vector<torch::Tensor> lora_a,
                     std::vector<torch::Tensor> lora_b, torch::Tensor ranks, int64_t prefetch) {
  TORCH_CHECK(out.device().is_cpu() && x.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && out.stride(1) == 1, "rows must be dense");
  TORCH_CHECK(out.scalar_type() == x.scalar_type(), "out and x differ in dtype");
  TORCH_CHECK(rows.scalar_type() == torch::kInt64 && row_slots.scalar_type() == torch::kInt64,
              "rows and row_slots must be int64");
  TORCH_CHECK(ranks.scalar_type() == torch::kInt32 && ranks.is_contiguous(), "ranks: int32");
  TORCH_CHECK(lora_a.size() == lora_b.size() && (int64_t)lora_a.size() == ranks.size(0),
              "one A, one B and one ranks row per slice");
  const int64_t units = ranks.size(1);
  int64_t total = 0;
  for (size_t i = 0; i < lora_a.size(); ++i) {
    const auto& a = lora_a[i];
    const auto& b = lora_b[i];
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.stride(2) == 1 &&
                    (b.stride(1) == 1 || b.stride(2) == 1),
                "slot buffers: A [units, r, in] with unit stride along in, B [units, out, r] "
                "with unit stride along out or r");
    TORCH_CHECK(a.scalar_type() == x.scalar_type() && b.scalar_type() == x.scalar_type(),
                "slot buffers must have x's dtype");
    TORCH_CHECK(a.size(2) == x.size(1) && b.size(2) == a.size(1),
                "slot buffer shapes do not match x");
    TORCH_CHECK(a.size(0) == units && b.size(0) == units,
                "slot buffers must have one slot per column of ranks");
    total += b.size(1);
  }
  TORCH_CHECK(out.size(1) == total && out.size(0) == x.size(0), "out is not [T, sum(out_i)]");
  TORCH_CHECK(rows.is_contiguous() && row_slots.is_contiguous() &&
                  rows.size(0) == row_slots.size(0), "one slot per row");
  const int64_t* row_p = rows.data_ptr<int64_t>();
  const int64_t* slot_p = row_slots.data_ptr<int64_t>();
  const int32_t* rank_p = ranks.data_ptr<int32_t>();
  for (int64_t j = 0; j < rows.size(0); ++j) {  // the kernel indexes memory with these
    TORCH_CHECK(row_p[j] >= 0 && row_p[j] < x.size(0), "row ", row_p[j], " out of range");
    TORCH_CHECK(slot_p[j] >= 0 && slot_p[j] < units, "slot ", slot_p[j], " out of range");
    if (j > 0 && slot_p[j] == slot_p[j - 1]) continue;
    for (size_t i = 0; i < lora_a.size(); ++i) {
      const int32_t r = rank_p[i * units + slot_p[j]];
      TORCH_CHECK(r >= 0 && r <= lora_a[i].size(1), "rank ", r, " of slot ", slot_p[j],
                  " out of range");
    }
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "add_lora_gather",
                                  [&] {
    add_lora_rows<scalar_t>(out, x, rows, row_slots, lora_a, lora_b, ranks, prefetch);
  });
}

