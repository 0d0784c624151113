"""KernelBackend: the one interface through which the model and the LoRA layers run their
kernels. Three backends implement it (``kernel_backends/torch``, ``kernel_backends/triton``,
``kernel_backends/cpu``); ``kernels.select_backend`` picks one when the engine is built, and the
engine hands that object to the model, the LoRA layers and the sampler. No call chooses
again.

Shapes: T tokens of the flat batch, B decoding sequences, S prefilling sequences, Hq/Hkv
query/KV heads of D dims, caches [num_blocks, block_size, Hkv, D], U = pool units (slot
ids, which may be sparse and large) of up to r_max rank, slices i of a fused linear with
out_i outputs each. Slot buffers are views of rank-row pools (``lora_pool``): slot s reads
its first ranks[i, s] rows only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar

import torch
from torch import nn

from . import host_pages
from .lora_segments import LoRASegments
from .quantized_weight import QuantizedWeight


class KernelBackend(ABC):
    name: ClassVar[str]
    segments_type: ClassVar[type[LoRASegments]] = LoRASegments  # what add_lora reads
    r_major_b: ClassVar[bool] = False  # B pools stored [rows, out] (else [out, rows])

    def __init__(self, device: torch.device, dtype: torch.dtype):
        self.device = device
        self.dtype = dtype
        # --batch-invariant (docs/sampling.md): a backend that keeps a row's bits whatever its
        # batch reads it (the CPU backend: prepare_model's layout, the attention kernel);
        # the engine sets it (set_batch_invariant) from EngineConfig before prepare_model
        self.batch_invariant = True

    def set_batch_invariant(self, setting: str) -> None:
        """EngineConfig.batch_invariant ("auto", "on", "off"), before prepare_model: here
        "auto" is "on" (a backend with another default overrides this)."""
        self.batch_invariant = setting != "off"

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.device}, {self.dtype})"

    # ---- set-up -------------------------------------------------------------------------
    @classmethod
    def auto_dtype(cls, native: torch.dtype, device: torch.device) -> torch.dtype:
        """The dtype ``--dtype auto`` serves a checkpoint stored in ``native`` at."""
        return native

    def prepare_model(self, model: nn.Module, max_tokens: int, max_seqs: int) -> None:
        """Last changes to a loaded model (weights repacked, say) before it serves: up to
        ``max_tokens`` rows reach the decoder's linears, ``max_seqs`` the logits head."""

    rank_unit: ClassVar[int] = 1  # rank rows per pool unit (a slot id is a unit index)

    def lora_pool(self, num_units: int, max_rank: int, in_features: int,
                  out: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed rank-row pools of one LoRA slice, seen as slot buffers:
        (A [num_units, max_rank, in], B [num_units, out, max_rank]).

        The pools hold ``num_units · rank_unit`` rank rows plus a zero tail of
        ``max_rank - rank_unit`` rows (so every view below stays in bounds). Slot ``s`` is
        unit ``s``: A[s, j] is pool row ``s · rank_unit + j``, and B[s, :, j] its column, so
        the views overlap. An adapter of rank r owns the ``ceil(r / rank_unit)`` units from
        its slot on, and its rows are A[s, :r]; rows past a slot's rank belong to the next
        adapter (they are not zero): kernels read the first ``ranks[i, s]`` rows of a slot
        only. A is stored [rows, in]; B [out, rows], or [rows, out] with ``r_major_b``.

        On the CPU the pools commit memory as rows are written (``host_pages``): with
        ``r_major_b`` an adapter's rows are contiguous in both pools, so the pools cost what
        the adapters placed so far wrote, not their size."""
        unit = self.rank_unit
        rows = num_units * unit + max(max_rank - unit, 0)
        a_pool = host_pages.zeros((rows, in_features), self.dtype, self.device)
        a = a_pool.as_strided((num_units, max_rank, in_features), (unit * in_features,
                                                                   in_features, 1))
        if self.r_major_b:
            b_pool = host_pages.zeros((rows, out), self.dtype, self.device)
            b = b_pool.as_strided((num_units, out, max_rank), (unit * out, 1, out))
        else:
            b_pool = host_pages.zeros((out, rows), self.dtype, self.device)
            b = b_pool.as_strided((num_units, out, max_rank), (unit, rows, 1))
        return a, b

    def lora_segments(self, max_tokens: int, max_segments: int) -> LoRASegments:
        """Empty per-step LoRA segments for up to ``max_tokens`` tokens in ``max_segments``
        runs of one slot, in the form this backend's add_lora reads; refilled in place by
        ``fill`` every step."""
        return self.segments_type(max_tokens, max_segments, self.device)

    # ---- LoRA ---------------------------------------------------------------------------
    @abstractmethod
    def add_lora(self, out: torch.Tensor, x: torch.Tensor, lora_a: list[torch.Tensor],
                 lora_b: list[torch.Tensor], ranks: torch.Tensor, seg: LoRASegments) -> None:
        """out[t, off_i:off_i+out_i] += (x[t] @ A_i[s, :r]ᵀ) @ B_i[s, :, :r]ᵀ, s = token t's
        slot, r = ranks[i, s]; tokens of slot -1 untouched. out [T, Σ out_i], x [T, in],
        A_i [U, r_max, in], B_i [U, out_i, r_max] (views of ``lora_pool``'s pools, or any
        strided buffers with a unit stride along in / along out or rank), ranks
        [num_slices, U] int32. Nothing past ranks[i, s] is read, nor assumed zero; per-step
        cost follows the slots in use, never the largest slot id. ``seg`` is what this
        backend's ``lora_segments`` built (a backend refuses another backend's)."""

    # ---- attention ----------------------------------------------------------------------
    @abstractmethod
    def store_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k_cache.flat[slot_mapping[t]] = key[t], likewise v; slot -1 skipped. key, value
        [T, Hkv, D], slot_mapping [T] int64 (block · block_size + offset)."""

    @abstractmethod
    def paged_attention_decode(self, q: torch.Tensor, k_cache: torch.Tensor,
                               v_cache: torch.Tensor, block_tables: torch.Tensor,
                               context_lens: torch.Tensor, scale: float, softcap: float = 0.0,
                               window: int = 0, max_context_len: int = 0) -> torch.Tensor:
        """out[b] = softmax(cap(scale · q[b] K_bᵀ)) V_b over the context_lens[b] cached
        positions of sequence b, or only its last ``window`` ones when window > 0;
        cap(s) = softcap · tanh(s / softcap) when softcap > 0 (Gemma 2), else s.
        q [B, Hq, D] -> [B, Hq, D]; block_tables [B, max_blocks] int32, context_lens [B]
        int32. ``max_context_len``: max(context_lens) as the host knows it (0: unknown), so
        a backend may size its launch without reading the device."""

    @abstractmethod
    def paged_attention_prefill(self, q: torch.Tensor, k_cache: torch.Tensor,
                                v_cache: torch.Tensor, block_tables: torch.Tensor,
                                query_start_loc: torch.Tensor, context_lens: torch.Tensor,
                                scale: float, softcap: float = 0.0, window: int = 0,
                                max_q_len: int = 0) -> torch.Tensor:
        """Causal attention of S sequences' new tokens, which sit at positions
        context_lens[s] - q_len_s .. context_lens[s] - 1 and see every earlier position; with
        window > 0, a token at position p sees positions p - window + 1 .. p only (a sliding
        window, as transformers' ``sliding_window``). Scores soft-capped as in decode.
        q [T, Hq, D] -> [T, Hq, D]; query_start_loc [S + 1] int32; context_lens [S] int32.
        ``max_q_len``: the most new tokens of one sequence, as the host knows it (0:
        unknown)."""

    # ---- quantized weights ----------------------------------------------------------------
    @abstractmethod
    def quantized_linear(self, x: torch.Tensor, weight: QuantizedWeight,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ Wᵀ + bias with W stored quantized (kernel_backends/quantized_weight.py),
        activations and result in x's dtype: x [..., in] -> [..., out]
        (kernel_backends/torch/quantized_linear.py)."""

    def quantized_linear_parts(self, x: torch.Tensor, weights: list[QuantizedWeight],
                               bias: torch.Tensor | None = None) -> torch.Tensor:
        """quantized_linear of each part, outputs side by side: x [..., in] -> [..., sum of
        out] (bias: all the parts' rows). A backend may do it in one call (cpu)."""
        return linear_per_part(self.quantized_linear, x, weights, bias)

    @abstractmethod
    def quantized_embedding(self, ids: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """The rows ``ids`` of an embedding table stored quantized, dequantized into the
        backend's dtype: ids [...] -> [..., embedding_dim]."""

    # ---- decoder-layer elementwise ops --------------------------------------------------
    @abstractmethod
    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """weight · (x / sqrt(mean(x²) + eps)) over the last dim, statistics in fp32 and
        rounded to x's dtype before the weight (transformers' LlamaRMSNorm). x [..., H]."""

    @abstractmethod
    def add_rms_norm_(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> torch.Tensor:
        """residual += x in place, then rms_norm(residual). x, residual [T, H]."""

    @abstractmethod
    def rope_store_kv(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE on q and k; rotated k and v stored in the caches; returns the
        rotated q (q and k may be rotated in place). q [T, Hq, D], k, v [T, Hkv, D],
        cos, sin [T, D]."""

    @abstractmethod
    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) · up of a fused projection: [T, 2I] -> [T, I]."""

    @abstractmethod
    def gelu_tanh_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """gelu_tanh(gate) · up of a fused projection (Gemma's GeGLU, transformers'
        ``gelu_pytorch_tanh``): [T, 2I] -> [T, I]."""

    @abstractmethod
    def argmax_rows(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first maximum, as torch.argmax: [N, vocab] -> [N] int64."""

    def argmax_finite_rows(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``argmax_rows`` and whether each row holds only finite values ([N] bool): the
        greedy sampler's one read of untouched logits."""
        return self.argmax_rows(logits), torch.isfinite(logits).all(dim=-1)

    @abstractmethod
    def logprob_rows(self, logits: torch.Tensor, tokens: torch.Tensor, k: int,
                     normalize: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor]:
        """The sampled tokens' logprobs: logits [R, vocab] float32, tokens [R] int64, k in
        [0, vocab] -> (chosen [R], ranks [R] int64, top values [R, k] descending, top ids
        [R, k]); ``normalize``: log_softmax's values, else the logits
        (kernel_backends/torch/logprob_rows.py)."""


def linear_per_part(linear: Callable[[torch.Tensor, QuantizedWeight, torch.Tensor | None],
                                     torch.Tensor],
                    x: torch.Tensor, weights: list[QuantizedWeight],
                    bias: torch.Tensor | None) -> torch.Tensor:
    """``linear(x, W, its bias rows)`` of each part W, the outputs side by side."""
    outs, start = [], 0
    for w in weights:
        outs.append(linear(x, w, None if bias is None else bias[start:start + w.shape[0]]))
        start += w.shape[0]
    return torch.cat(outs, dim=-1)
