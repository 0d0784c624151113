"""The logits head served int8 (``--quantize-lm-head`` with ``--quantization int8|int4``).

``--quantization int8|int4`` quantizes the decoder linears and keeps the embedding and the
head float, as vLLM's on-the-fly weight-only methods do. On a 1B model the head is a large
share of the bytes read per decoded token (Llama-3.2-1B's tied 128256 x 2048 head: 1.05 GB
in float32, against ~0.52 GB for all its int4 linears), so the flag serves it in int8 per
output channel too: kernel_backends/weight_quantization.py's ``quantize_int8`` (symmetric,
``scale[o] = max_i |W[o, i]| / 127``), whatever ``--quantization`` the linears take (int8
is llama.cpp's choice too: its Q4_K_M files keep the output tensor in Q6_K).

- An untied ``lm_head`` is swapped for a QuantizedLinear on meta (``head_modules``) and
  quantized from the checkpoint tensor as it is read (loader.load_weights): no float copy
  of it is ever allocated.
- A tied head gets its own int8 copy (``quantize_tied_head``), quantized from the embedding
  as loaded (in the serving dtype: the checkpoint's values where that dtype holds them);
  the embedding stays float, for lookups.

Either becomes the model's ``logits_head`` (a QuantizedLinear), which every backend's
``prepare_model`` leaves alone and runs through its ``quantized_linear``; weights_info
counts its bytes (the tied copy beside the float embedding).
"""

from __future__ import annotations

from torch import nn

from ...kernel_backends.backend import KernelBackend
from ...kernel_backends.weight_quantization import quantize_weight
from .quant_modules import QuantizedLinear

HEAD_QUANTIZATION = "int8"  # the head's format, whatever the linears' (int8 or int4)
HEAD_MODULE = "lm_head"  # an untied head's module (and its checkpoint tensor's prefix)


def head_modules(model: nn.Module) -> set[str]:
    """The head's module to swap for a QuantizedLinear on meta: ``lm_head`` when untied,
    none when tied (the tied head is quantized after load: quantize_tied_head)."""
    return set() if model.tie_word_embeddings else {HEAD_MODULE}


def quantize_tied_head(model: nn.Module, ops: KernelBackend) -> None:
    """A tied model's ``logits_head``: an int8 QuantizedLinear of the loaded embedding's
    table (a copy: the embedding keeps its float table for lookups)."""
    embed = model.model.embed_tokens
    head = QuantizedLinear(embed.embedding_dim, embed.num_embeddings, False, ops)
    head.set_rows(None, quantize_weight(embed.weight.detach(), HEAD_QUANTIZATION))
    model.logits_head = head
