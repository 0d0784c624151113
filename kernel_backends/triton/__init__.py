"""The Triton backend (CUDA; on CPU through ``TRITON_INTERPRET=1`` in tests): segmented-
gather LoRA shrink/expand (sgmv.py), the paged KV store and decode (attention.py) and
prefill (attention_prefill.py), the W4A16 linear of int4 weights (w4a16.py: GPTQ / AWQ
checkpoints and ``--quantization int4``; the other quantized formats run the torch twin).
The decoder layer's elementwise ops run as the torch backend's (RoPE in torch, the store by
the Triton kernel).

Batch-invariant modes (``TritonBackend(..., invariance="batch" | "rescore")``, or the
environment variable ``LORAPLEX_BATCH_INVARIANT=1`` (= batch) or ``=rescore``, read here
when the argument is left out): every kernel gives a row the same bits whatever else is in
the batch. The LoRA kernels are so in every mode (fixed tiles, no split-K, one program per
row block of one segment); "batch" fixes the decode splits (INVARIANT_SPLIT_LEN absolute
positions, reduced in order) and the prefill tile rows (INVARIANT_BLOCK_M), and replaces
torch's M-dependent reductions: the linears and the logits head (cuBLAS) by
invariant_matmul.py, RMSNorm and the logprobs' log-sum-exp by invariant_rows.py.
"rescore" also decodes through the prefill kernel (a decode step is a one-token prefill),
so a sampled token's logprob is bitwise the one a re-score of the sequence (``echo`` with
``prompt_logprobs``) reports. In these modes every quantized format, int4 included, runs
the torch twin's dequantized weight through invariant_matmul.py. See docs/kernels.md."""

from __future__ import annotations

import os

import torch
from torch import nn

from ..lora_segments import LoRASegments
from ..quantized_weight import QuantizedWeight
from ..torch import TorchBackend, quantized_linear
from ..torch.logprob_rows import logprob_rows
from . import attention, attention_prefill, invariant_rows, sgmv, w4a16
from .invariant_matmul import invariant_linear, use_invariant_linears
from .triton_lora_segments import TritonLoRASegments

ENV_BATCH_INVARIANT = "LORAPLEX_BATCH_INVARIANT"
INVARIANCE_MODES = ("off", "batch", "rescore")


def invariance_from_env() -> str:
    """``LORAPLEX_BATCH_INVARIANT``: 1/true/yes/on/batch -> "batch"; rescore -> "rescore";
    unset, empty, 0/false/no/off -> "off"; anything else is refused (a typo must not
    silently serve another mode)."""
    value = os.environ.get(ENV_BATCH_INVARIANT, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return "off"
    if value in ("1", "true", "yes", "on", "batch"):
        return "batch"
    if value == "rescore":
        return "rescore"
    raise ValueError(f"{ENV_BATCH_INVARIANT}={value!r}; allowed: 1 (or true, yes, on, "
                     "batch), rescore, 0 (or false, no, off), or unset")


class TritonBackend(TorchBackend):
    name = "triton"
    segments_type = TritonLoRASegments  # with the SGMV work list
    r_major_b = True  # an expand tile's lanes read neighbouring outputs
    rank_unit = 8  # slots 8 rank rows apart: 16-byte aligned in bf16 (vector loads)

    def __init__(self, device: torch.device, dtype: torch.dtype,
                 invariance: str | None = None):
        super().__init__(device, dtype)
        if invariance is None:
            invariance = invariance_from_env()
        if invariance not in INVARIANCE_MODES:
            raise ValueError(f"invariance={invariance!r}; allowed: "
                             f"{', '.join(INVARIANCE_MODES)}")
        self._set_invariance(invariance)

    def set_batch_invariant(self, setting: str) -> None:
        """--batch-invariant: "auto" keeps the mode given (or LORAPLEX_BATCH_INVARIANT's: off
        when unset, as the invariant kernels cost speed on a GPU); "on" turns "off" into
        "batch" (a "rescore" asked for stays); "off" turns every mode off."""
        if setting == "off":
            self._set_invariance("off")
        elif setting == "on" and self.invariance == "off":
            self._set_invariance("batch")

    def _set_invariance(self, invariance: str) -> None:
        self.invariance = invariance
        self.batch_invariant = invariance != "off"  # every op's rows independent
        self.decode_as_prefill = invariance == "rescore"  # decode = a re-score's bits

    def __repr__(self) -> str:
        mode = "" if self.invariance == "off" else f", invariance={self.invariance}"
        return f"{type(self).__name__}({self.device}, {self.dtype}{mode})"

    def prepare_model(self, model: nn.Module, max_tokens: int, max_seqs: int) -> None:
        if self.batch_invariant:  # cuBLAS's tiles and split-K follow M: not invariant
            use_invariant_linears(model)

    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.batch_invariant:  # the torch twin's dequantized tiles, multiplied invariantly
            return quantized_linear.quantized_linear(x, weight, bias, linear=invariant_linear)
        if weight.format.name == "int4":
            return w4a16.w4a16_linear(x, weight, bias)
        return super().quantized_linear(x, weight, bias)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        if self.batch_invariant:
            return invariant_rows.rms_norm(x, weight, eps)
        return super().rms_norm(x, weight, eps)

    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        if self.batch_invariant:
            residual.add_(x)  # elementwise: invariant as it is
            return invariant_rows.rms_norm(residual, weight, eps)
        return super().add_rms_norm_(x, residual, weight, eps)

    def logprob_rows(self, logits: torch.Tensor, tokens: torch.Tensor, k: int,
                     normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
        if not (self.batch_invariant and normalize):
            return super().logprob_rows(logits, tokens, k, normalize)
        # gather, compare-and-count and top-k are exact; only the log-sum-exp reduces
        chosen, ranks, top_vals, top_ids = logprob_rows(logits, tokens, k, False)
        lse = invariant_rows.logsumexp_rows(logits)  # [R, 1]
        return chosen - lse[:, 0], ranks, top_vals - lse, top_ids

    def add_lora(self, out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                 lora_b: list[torch.Tensor], ranks: torch.Tensor, seg: LoRASegments) -> None:
        if not isinstance(seg, TritonLoRASegments):
            raise TypeError(f"{type(seg).__name__}: the {self.name} backend reads the "
                            "TritonLoRASegments its lora_segments builds")
        sgmv.add_lora(out, x, lora_a, lora_b, ranks, seg)

    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        attention.store_kv(key, value, k_cache, v_cache, slot_mapping)

    def paged_attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                               window: int = 0, max_context_len: int = 0) -> torch.Tensor:
        if self.decode_as_prefill:
            return attention_prefill.decode_as_prefill(q, k_cache, v_cache, block_tables,
                                                       context_lens, scale, softcap, window)
        return attention.paged_attention_decode(q, k_cache, v_cache, block_tables,
                                                context_lens, scale, softcap, window,
                                                max_context_len=max_context_len,
                                                batch_invariant=self.batch_invariant)

    def paged_attention_prefill(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, softcap: float = 0.0,
                                window: int = 0, max_q_len: int = 0) -> torch.Tensor:
        return attention_prefill.paged_attention_prefill(
            q, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale, softcap,
            window, max_q_len=max_q_len, batch_invariant=self.batch_invariant)
