// CPU linears over weight-only quantized weights, read in their quantized bytes (Q8_0, Q4_0,
// Q4_1, Q4_K, Q5_K, Q6_K as in a GGUF file; int8 per channel; int4 in groups): y = x · Wᵀ
// (+ bias), x and y float32 or bfloat16, products and sums in float32. One path per ISA,
// chosen at run time (`isa`: "avx512_bf16", "avx512", "avx2", "scalar"; quant_isas() lists
// those this CPU runs): quant_gemm_avx512.cpp, quant_gemm_avx2.cpp and the plain C loop here
// share one loop (quant_gemm_body.h); "avx512_bf16" runs bfloat16 activations on VDPBF16PS
// (quant_gemm_avx512.cpp) and float32 ones as "avx512". Threads split the output columns
// (at::parallel_for).
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <string>
#include <vector>

#include "quant_gemm.h"

namespace lp_quant {
namespace {

// The plain C path: "vectors" of 32 floats (a whole chunk), loops the compiler may
// vectorise for the build's own ISA.
struct V {
  struct reg {
    float v[32];
  };
  static constexpr int W = 32;
  static inline reg zero() {
    reg r;
    for (float& f : r.v) f = 0.f;
    return r;
  }
  static inline reg load(const float* p) {
    reg r;
    std::memcpy(r.v, p, sizeof(r.v));
    return r;
  }
  static inline void store(float* p, const reg& r) { std::memcpy(p, r.v, sizeof(r.v)); }
  static inline reg set1(float s) {
    reg r;
    for (float& f : r.v) f = s;
    return r;
  }
  static inline reg add(reg a, const reg& b) {
    for (int i = 0; i < 32; ++i) a.v[i] += b.v[i];
    return a;
  }
  static inline reg mul(reg a, const reg& b) {
    for (int i = 0; i < 32; ++i) a.v[i] *= b.v[i];
    return a;
  }
  static inline reg fma(const reg& a, const reg& b, reg c) {
    for (int i = 0; i < 32; ++i) c.v[i] += a.v[i] * b.v[i];
    return c;
  }
  static inline float hsum(const reg& a) {
    float s = 0.f;
    for (float f : a.v) s += f;
    return s;
  }
};

inline void decode_nibbles(const uint8_t* q, V::reg* out) {
  for (int i = 0; i < 16; ++i) {
    out->v[i] = float(q[i] & 0x0F);
    out->v[16 + i] = float(q[i] >> 4);
  }
}

inline void decode_nibbles32(const uint8_t* q, int shift, V::reg* out) {
  for (int i = 0; i < 32; ++i) out->v[i] = float((q[i] >> shift) & 0x0F);
}

inline void decode_q5_k(const Chunk& ch, V::reg* out) {
  for (int i = 0; i < 32; ++i)
    out->v[i] = float(((ch.q[i] >> ch.shift) & 0x0F) | (((ch.qh[i] >> ch.hshift) & 1) << 4));
}

inline void decode_q6_k(const Chunk& ch, V::reg* out) {
  for (int i = 0; i < 32; ++i) {
    const int q = (((ch.q[i] >> ch.shift) & 0x0F) | (((ch.qh[i] >> ch.hshift) & 3) << 4)) - 32;
    out->v[i] = float(q) * (i < 16 ? ch.d : ch.d1);
  }
}

inline void decode_int8(const uint8_t* q, V::reg* out) {
  for (int i = 0; i < 32; ++i) out->v[i] = float(int8_t(q[i]));
}

#include "quant_gemm_body.h"

bool cpu_has(Isa isa) {
#if defined(__x86_64__) && defined(__GNUC__)
  if (isa == kAvx512Bf16)
    return built_avx512() && __builtin_cpu_supports("avx512f") &&
           __builtin_cpu_supports("avx512bf16");
  if (isa == kAvx512) return built_avx512() && __builtin_cpu_supports("avx512f");
  if (isa == kAvx2)
    return built_avx2() && __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
#endif
  return isa == kScalar;
}

Isa parse_isa(const std::string& name) {
  if (name == "avx512_bf16") return kAvx512Bf16;
  if (name == "avx512") return kAvx512;
  if (name == "avx2") return kAvx2;
  TORCH_CHECK(name == "scalar", "quant_linear: isa ", name,
              "; allowed: avx512_bf16, avx512, avx2, scalar");
  return kScalar;
}

}  // namespace

void run_scalar(const Problem& p, int64_t n0, int64_t n1) { run(p, n0, n1); }

}  // namespace lp_quant

// The quantized paths this CPU runs, fastest first.
std::vector<std::string> quant_isas() {
  using namespace lp_quant;
  std::vector<std::string> isas;
  if (cpu_has(kAvx512Bf16)) isas.push_back("avx512_bf16");
  if (cpu_has(kAvx512)) isas.push_back("avx512");
  if (cpu_has(kAvx2)) isas.push_back("avx2");
  isas.push_back("scalar");
  return isas;
}

namespace {

// The weight's tensors match the format and K (TORCH_CHECK otherwise).
void check_weight(int64_t K, const torch::Tensor& data, const c10::optional<torch::Tensor>& scales,
                  const c10::optional<torch::Tensor>& zeros, int64_t format, int64_t group) {
  using namespace lp_quant;
  TORCH_CHECK(format >= kQ8_0 && format <= kQ6_K, "quant_linear: unknown format ", format);
  const int64_t N = data.size(0);
  static const int64_t block_bytes[] = {34, 18, 20};
  TORCH_CHECK(data.dim() == 2 && data.is_contiguous() && data.element_size() == 1,
              "quant_linear: data must be a contiguous 2-D byte tensor");
  if (format == kQ4_K || format == kQ5_K || format == kQ6_K) {
    const int64_t super_bytes = format == kQ4_K ? 144 : format == kQ5_K ? 176 : 210;
    TORCH_CHECK(K % 256 == 0 && data.size(1) == K / 256 * super_bytes,
                "quant_linear: K-quant data does not match K");
  } else if (format <= kQ4_1) {
    TORCH_CHECK(K % 32 == 0 && data.size(1) == K / 32 * block_bytes[format],
                "quant_linear: GGUF data does not match K");
  } else if (format == kInt8) {
    TORCH_CHECK(data.size(1) == K && scales && scales->scalar_type() == torch::kFloat &&
                    scales->is_contiguous() && scales->numel() == N,
                "quant_linear: int8 wants data [N, K] and float32 scales [N]");
  } else {
    TORCH_CHECK((group == 32 || group == 64 || group == 128) && K % group == 0 &&
                    data.size(1) == K / 2 && scales && zeros &&
                    scales->scalar_type() == torch::kFloat && scales->is_contiguous() &&
                    scales->numel() == N * (K / group) && zeros->is_contiguous() &&
                    zeros->scalar_type() == torch::kByte && zeros->numel() == N * (K / group),
                "quant_linear: int4 wants data [N, K / 2], float32 scales and uint8 zeros "
                "[N, K / group]");
  }
}

int group_shift(int64_t format, int64_t group) {
  return format == lp_quant::kInt4 ? (group == 32 ? 5 : group == 64 ? 6 : 7) : 5;
}

// x [M, K] (K % 32 == 0) in the int4 kernels' order, a plain copy loop (four torch ops, the
// permute's ~5 us a call, before): words, each 128 as (a, b, k) -> (k, a, b), the nibbles'
// order in the 16-bit words (int4_word_order); else each 32-chunk's evens then odds, as the
// nibbles decode.
template <class T>
void int4_x_order(const T* x, T* out, int64_t M, int64_t K, bool words) {
  at::parallel_for(0, M, 64, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const T* src = x + m * K;
      T* dst = out + m * K;
      if (words) {
        for (int64_t g = 0; g < K; g += 128)
          for (int k = 0; k < 4; ++k)
            for (int ab = 0; ab < 32; ++ab) dst[g + 32 * k + ab] = src[g + 4 * ab + k];
      } else {
        for (int64_t c = 0; c < K; c += 32)
          for (int j = 0; j < 2; ++j)
            for (int i = 0; i < 16; ++i) dst[c + 16 * j + i] = src[c + 2 * i + j];
      }
    }
  });
}

}  // namespace

// x [M, K] float32 / bfloat16 -> y [M, N] in x's dtype, y's columns the parts' outputs side
// by side (q, k, v as the file stores them): each part a weight of the same format, group
// and K, one conversion of x and one split of all the columns over the threads (a call a
// part cost ~10 us more each, and a small part's columns split badly). format: 0 Q8_0,
// 1 Q4_0, 2 Q4_1, 5 Q4_K, 6 Q5_K, 7 Q6_K (data: the blocks' bytes [N, K / block * block
// bytes]), 3 int8 (data int8 [N, K], scales float32 [N]), 4 int4 (data [N, K / 2], weight 2j
// in the low nibble; scales float32 and zeros uint8 [N, K / group]). bias: [N] of all parts.
torch::Tensor quant_linear_parts(torch::Tensor x, std::vector<torch::Tensor> datas,
                                 std::vector<c10::optional<torch::Tensor>> scales,
                                 std::vector<c10::optional<torch::Tensor>> zeros,
                                 c10::optional<torch::Tensor> bias, int64_t format,
                                 int64_t group, const std::string& isa_name) {
  using namespace lp_quant;
  const Isa isa = parse_isa(isa_name);
  TORCH_CHECK(cpu_has(isa), "quant_linear: this CPU (or build) cannot run the ", isa_name,
              " path");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat ||
                               x.scalar_type() == torch::kBFloat16),
              "quant_linear: x must be 2-D float32 or bfloat16");
  TORCH_CHECK(!datas.empty() && scales.size() == datas.size() && zeros.size() == datas.size(),
              "quant_linear: one or more parts, each with its data, scales and zeros");
  const int64_t M = x.size(0), K = x.size(1);
  std::vector<int64_t> offset{0};  // part i's first column of y
  for (size_t i = 0; i < datas.size(); ++i) {
    check_weight(K, datas[i], scales[i], zeros[i], format, group);
    offset.push_back(offset.back() + datas[i].size(0));
  }
  const int64_t N = offset.back();
  TORCH_CHECK(!bias || (bias->scalar_type() == torch::kFloat && bias->is_contiguous() &&
                        bias->numel() == N),
              "quant_linear: bias must be float32 [N]");
  const bool bf16_path = isa == kAvx512Bf16 && x.scalar_type() == torch::kBFloat16;
  auto xf = bf16_path ? x.contiguous() : x.to(torch::kFloat).contiguous();
  const bool words = int4_word_order(int(format), int(group), bf16_path);
  if (format == kInt4) {  // K % group == 0 (check_weight): whole chunks, whole words
    auto ordered = torch::empty_like(xf);
    if (bf16_path)
      int4_x_order(reinterpret_cast<const uint16_t*>(xf.data_ptr()),
                   reinterpret_cast<uint16_t*>(ordered.data_ptr()), M, K, words);
    else
      int4_x_order(xf.data_ptr<float>(), ordered.data_ptr<float>(), M, K, words);
    xf = ordered;
  }
  torch::Tensor xsum;
  const bool avx2_sums = format == kQ4_K || format == kQ5_K;  // quant_gemm_avx2.cpp's offsets
  if (has_offset(int(format)) && !bf16_path && (isa != kAvx2 || avx2_sums))
    xsum = xf.view({M, K / 32, 32}).sum(2).contiguous();
  // the bf16 path writes y in bfloat16 itself (rounded as .to(bfloat16) rounds): no copy
  auto y = torch::empty({M, N}, x.options().dtype(bf16_path ? torch::kBFloat16 : torch::kFloat));
  if (M > 0 && N > 0) {
    std::vector<Problem> parts;
    for (size_t i = 0; i < datas.size(); ++i) {
      const int64_t at = offset[i];
      Problem p{bf16_path ? nullptr : xf.data_ptr<float>(),
                bf16_path ? reinterpret_cast<const uint16_t*>(xf.data_ptr()) : nullptr,
                xsum.defined() ? xsum.data_ptr<float>() : nullptr,
                M, K, datas[i].size(0),
                static_cast<const uint8_t*>(datas[i].data_ptr()), datas[i].size(1),
                scales[i] ? scales[i]->data_ptr<float>() : nullptr,
                zeros[i] ? zeros[i]->data_ptr<uint8_t>() : nullptr,
                group_shift(format, group), int(format),
                bias ? bias->data_ptr<float>() + at : nullptr,
                bf16_path ? nullptr : y.data_ptr<float>() + at, words,
                bf16_path ? reinterpret_cast<uint16_t*>(y.data_ptr()) + at : nullptr, N};
      parts.push_back(p);
    }
    // columns in ranges of at least 16 (a thread's share of small linears stays whole), each
    // range cut at the parts' edges
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      for (size_t i = 0; i < parts.size(); ++i) {
        const int64_t a = std::max(n0, offset[i]) - offset[i];
        const int64_t b = std::min(n1, offset[i + 1]) - offset[i];
        if (a >= b) continue;
        const Problem& p = parts[i];
        if (bf16_path) run_avx512_bf16(p, a, b);
        else if (isa == kAvx512 || isa == kAvx512Bf16) run_avx512(p, a, b);
        else if (isa == kAvx2) run_avx2(p, a, b);
        else run_scalar(p, a, b);
      }
    });
  }
  return y.scalar_type() == x.scalar_type() ? y : y.to(x.scalar_type());
}

// quant_linear_parts of one part.
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scales,
                           c10::optional<torch::Tensor> zeros, c10::optional<torch::Tensor> bias,
                           int64_t format, int64_t group, const std::string& isa_name) {
  return quant_linear_parts(x, {data}, {scales}, {zeros}, bias, format, group, isa_name);
}

// Rows n0 .. n1 of W (format and tensors as quant_linear's) as bfloat16 [n1 - n0, K], the
// avx512_bf16 path's own weights (int8: s q rounded once): for a bf16 GEMM library (AMX)
// to take many rows. K must be a multiple of 32; threads split the rows.
torch::Tensor quant_dequantize_bf16(torch::Tensor data, c10::optional<torch::Tensor> scales,
                                    c10::optional<torch::Tensor> zeros, int64_t format,
                                    int64_t group, int64_t K, int64_t n0, int64_t n1) {
  using namespace lp_quant;
  TORCH_CHECK(cpu_has(kAvx512Bf16), "quant_dequantize_bf16: this CPU (or build) has no "
              "AVX512-BF16");
  check_weight(K, data, scales, zeros, format, group);
  TORCH_CHECK(K % 32 == 0 && 0 <= n0 && n0 <= n1 && n1 <= data.size(0),
              "quant_dequantize_bf16: K must be a multiple of 32 and 0 <= n0 <= n1 <= N");
  auto out = torch::empty({n1 - n0, K}, torch::dtype(torch::kBFloat16));
  Problem p{nullptr, nullptr, nullptr, 0, K, data.size(0),
            static_cast<const uint8_t*>(data.data_ptr()), data.size(1),
            scales ? scales->data_ptr<float>() : nullptr,
            zeros ? zeros->data_ptr<uint8_t>() : nullptr,
            group_shift(format, group), int(format), nullptr, nullptr};
  uint16_t* o = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  at::parallel_for(n0, n1, 16, [&](int64_t a, int64_t b) {
    dequantize_avx512_bf16(p, a, b, o + (a - n0) * K);
  });
  return out;
}
