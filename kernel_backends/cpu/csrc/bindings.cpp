// The loraplex CPU kernels as one Python extension module (built by kernel_backends/cpu/extension.py).
#include <torch/extension.h>

#include <string>
#include <vector>

void add_lora_gather(torch::Tensor out, torch::Tensor x, torch::Tensor rows,
                     torch::Tensor row_slots, std::vector<torch::Tensor> lora_a,
                     std::vector<torch::Tensor> lora_b, torch::Tensor ranks, int64_t prefetch);
torch::Tensor paged_attention_decode(torch::Tensor q, torch::Tensor k_cache,
                                     torch::Tensor v_cache, torch::Tensor block_tables,
                                     torch::Tensor context_lens, double scale, double softcap,
                                     int64_t window);
torch::Tensor paged_attention_prefill(torch::Tensor q, torch::Tensor k_cache,
                                      torch::Tensor v_cache, torch::Tensor block_tables,
                                      torch::Tensor query_start_loc, torch::Tensor context_lens,
                                      double scale, double softcap, int64_t window);
torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor add_rms_norm_(torch::Tensor x, torch::Tensor residual, torch::Tensor weight,
                            double eps);
torch::Tensor rope_store_kv(torch::Tensor q, torch::Tensor k, torch::Tensor v,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor k_cache,
                            torch::Tensor v_cache, torch::Tensor slot_mapping);
torch::Tensor silu_mul(torch::Tensor gate_up);
std::vector<std::string> quant_isas();
torch::Tensor quant_dequantize_bf16(torch::Tensor data, c10::optional<torch::Tensor> scales,
                                    c10::optional<torch::Tensor> zeros, int64_t format,
                                    int64_t group, int64_t K, int64_t n0, int64_t n1);
torch::Tensor quant_linear(torch::Tensor x, torch::Tensor data, c10::optional<torch::Tensor> scales,
                           c10::optional<torch::Tensor> zeros, c10::optional<torch::Tensor> bias,
                           int64_t format, int64_t group, const std::string& isa);
torch::Tensor quant_linear_parts(torch::Tensor x, std::vector<torch::Tensor> datas,
                                 std::vector<c10::optional<torch::Tensor>> scales,
                                 std::vector<c10::optional<torch::Tensor>> zeros,
                                 c10::optional<torch::Tensor> bias, int64_t format,
                                 int64_t group, const std::string& isa);
torch::Tensor argmax_rows(torch::Tensor logits);
std::vector<torch::Tensor> argmax_finite_rows(torch::Tensor logits);
std::vector<torch::Tensor> logprob_rows(torch::Tensor logits, torch::Tensor tokens, int64_t k,
                                        bool normalize);
bool panel_gemm_available();
torch::Tensor pack_panels(torch::Tensor weight);
torch::Tensor panel_linear(torch::Tensor x, torch::Tensor panels,
                           c10::optional<torch::Tensor> bias, int64_t N);
bool bf16_panel_gemm_available();
torch::Tensor pack_panels_bf16(torch::Tensor weight);
torch::Tensor panel_linear_bf16(torch::Tensor x, torch::Tensor panels,
                                c10::optional<torch::Tensor> bias, int64_t N);
bool amx_gemm_bf16_available();
torch::Tensor pack_amx_bf16(torch::Tensor weight);
torch::Tensor amx_linear_bf16(torch::Tensor x, torch::Tensor panels,
                              c10::optional<torch::Tensor> bias, int64_t N);

// All release the GIL while they run (arguments are converted before, the result after),
// as torch's own ops do: the gRPC loop and the adapter loader thread keep running.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_lora_gather", &add_lora_gather,
        "out[rows] += per-row LoRA delta of the row's slot (CPU, fp32 accumulation); "
        "prefetch > 0: each thread prefetches the weights that many work items ahead",
        py::arg("out"), py::arg("x"), py::arg("rows"), py::arg("row_slots"), py::arg("lora_a"),
        py::arg("lora_b"), py::arg("ranks"), py::arg("prefetch") = 0,
        py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention_decode", &paged_attention_decode,
        "one-token-per-sequence attention over the paged KV cache (CPU, fp32 softmax); "
        "softcap > 0 soft-caps the scores, window > 0 keeps the last `window` positions",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("context_lens"), py::arg("scale"), py::arg("softcap") = 0.0,
        py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("paged_attention_prefill", &paged_attention_prefill,
        "causal attention of new tokens over the paged KV cache, query tiles x key chunks, "
        "online softmax (CPU, float32 and bfloat16; one-token sequences too, decodes "
        "included, each row's sums in the same order whatever the batch); "
        "softcap and window as paged_attention_decode",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"),
        py::arg("query_start_loc"), py::arg("context_lens"), py::arg("scale"),
        py::arg("softcap") = 0.0, py::arg("window") = 0, py::call_guard<py::gil_scoped_release>());
  m.def("rms_norm", &rms_norm, "RMSNorm of each row, fp32 statistics",
        py::call_guard<py::gil_scoped_release>());
  m.def("add_rms_norm_", &add_rms_norm_, "residual += x in place; RMSNorm of the new residual",
        py::call_guard<py::gil_scoped_release>());
  m.def("rope_store_kv", &rope_store_kv,
        "rotate q and k in place (rotate-half RoPE); write k and v to the paged cache",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_rows", &argmax_rows, "index of each row's first maximum (float32 logits)",
        py::call_guard<py::gil_scoped_release>());
  m.def("argmax_finite_rows", &argmax_finite_rows,
        "argmax_rows, and whether each row is all finite, in one read",
        py::call_guard<py::gil_scoped_release>());
  m.def("logprob_rows", &logprob_rows,
        "per row: the chosen token's value, its rank, the k largest (values, ids); minus "
        "log-sum-exp where normalize (float32 logits)",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_gemm_available", &panel_gemm_available,
        "whether panel_linear was built (AVX2 and FMA)");
  m.def("pack_panels", &pack_panels, "a [N, K] weight as [ceil(N/16), K, 16] float32 panels",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_linear", &panel_linear, "x · Wᵀ (+ bias) over W's 16-column panels (float32)",
        py::call_guard<py::gil_scoped_release>());
  m.def("bf16_panel_gemm_available", &bf16_panel_gemm_available,
        "whether panel_linear_bf16 was built (AVX512-BF16)");
  m.def("pack_panels_bf16", &pack_panels_bf16,
        "a [N, K] weight as [ceil(N/32), ceil(K/2), 64] bfloat16 panels (k in pairs)",
        py::call_guard<py::gil_scoped_release>());
  m.def("panel_linear_bf16", &panel_linear_bf16,
        "x · Wᵀ (+ float32 bias) over W's 32-column bfloat16 panels (VDPBF16PS)",
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_gemm_bf16_available", &amx_gemm_bf16_available,
        "whether amx_linear_bf16 was built (AMX-BF16) and the process may use AMX tiles");
  m.def("pack_amx_bf16", &pack_amx_bf16,
        "a [N, K] weight as [ceil(N/32), ceil(K/32), 2, 16, 32] bfloat16 AMX B tiles",
        py::call_guard<py::gil_scoped_release>());
  m.def("amx_linear_bf16", &amx_linear_bf16,
        "x · Wᵀ (+ float32 bias) over W's AMX B tiles (bfloat16, TDPBF16PS; a row's bits "
        "do not depend on its batch)",
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_isas", &quant_isas,
        "the quantized linear's paths this CPU runs, fastest first (avx512, avx2, scalar)");
  m.def("quant_dequantize_bf16", &quant_dequantize_bf16,
        "rows n0..n1 of a quantized W as bfloat16 [n1 - n0, K] (the avx512_bf16 path's "
        "weights), for a bf16 GEMM library to take many rows");
  m.def("quant_linear", &quant_linear,
        "x · Wᵀ (+ bias) with W in its quantized bytes (0 Q8_0, 1 Q4_0, 2 Q4_1, 3 int8, "
        "4 int4, 5 Q4_K), x float32 or bfloat16, float32 products and sums, on the `isa` path",
        py::arg("x"), py::arg("data"), py::arg("scales"), py::arg("zeros"), py::arg("bias"),
        py::arg("format"), py::arg("group"), py::arg("isa"),
        py::call_guard<py::gil_scoped_release>());
  m.def("quant_linear_parts", &quant_linear_parts,
        "quant_linear over several weights of one format and K, their outputs side by side "
        "in y (one conversion of x, one split of the columns over the threads)",
        py::arg("x"), py::arg("datas"), py::arg("scales"), py::arg("zeros"), py::arg("bias"),
        py::arg("format"), py::arg("group"), py::arg("isa"),
        py::call_guard<py::gil_scoped_release>());
  m.def("silu_mul", &silu_mul, "silu(gate) * up of a fused [T, 2I] gate_up",
        py::call_guard<py::gil_scoped_release>());
}
