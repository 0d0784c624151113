"""Tiny GGUF models for the quantized-serving tests: a tiny Hugging Face model (conftest's
``make_tiny_model``) written to GGUF with gguf-py's ``GGUFWriter`` as llama.cpp's
``convert_hf_to_gguf.py`` writes it (its metadata keys, tensor names and, for llama, its
Q/K row permutation), the 2-D weights quantized by ``gguf.quants.quantize``. transformers'
GGUF loader reads these files back (it dequantizes): the oracle."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
from safetensors.torch import load_file
from transformers import AutoConfig

LAYER = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight", "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias", "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}
GEMMA_LAYER = {**LAYER, "post_attention_layernorm.weight": "post_attention_norm.weight",
               "pre_feedforward_layernorm.weight": "ffn_norm.weight",
               "post_feedforward_layernorm.weight": "post_ffw_norm.weight"}
GLOBAL = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
          "output_norm.weight", "lm_head.weight": "output.weight"}

# the GGUF name -> its ggml type: Q8_0 embedding (as SmolLM2's file), a mix in the layers
MIXED: dict[str, str] = {"token_embd": "Q8_0", "attn_q": "Q4_0", "attn_k": "Q8_0",
                         "attn_v": "Q4_1", "attn_output": "Q4_1", "ffn_gate": "Q4_0",
                         "ffn_up": "Q4_1", "ffn_down": "Q8_0", "output": "Q8_0"}


# K-quants (gguf-py dequantizes them but cannot quantize): random blocks, their fp16 scale
# fields (byte offsets, ggml-common.h) small enough for weights of a model's size
K_SCALES = {"Q4_K": ([0, 2], 3e-4), "Q5_K": ([0, 2], 1.5e-4), "Q6_K": ([208], 3e-5)}
# a Q4_K_M-like mix (llama.cpp's: Q4_K, with Q6_K for v and down and the head)
K_MIX: dict[str, str] = {"token_embd": "Q4_K", "attn_q": "Q4_K", "attn_k": "Q4_K",
                         "attn_v": "Q6_K", "attn_output": "Q5_K", "ffn_gate": "Q4_K",
                         "ffn_up": "Q4_K", "ffn_down": "Q6_K", "output": "Q6_K"}


def k_quant_blocks(qtype: str, out: int, inp: int, rng: np.random.Generator) -> np.ndarray:
    block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]]
    n = out * inp // block
    blocks = rng.integers(0, 256, size=(n, size), dtype=np.uint8)
    offsets, scale = K_SCALES[qtype]
    for at in offsets:
        d = np.abs(rng.standard_normal(n) * scale).astype(np.float16)
        blocks[:, at:at + 2] = d.view(np.uint8).reshape(n, 2)
    return blocks.reshape(out, inp // block * size)


def gguf_name(hf: str, arch: str = "llama") -> str:
    if hf in GLOBAL:
        return GLOBAL[hf]
    parts = hf.split(".")  # model.layers.N.<module>.<param>
    layer = GEMMA_LAYER if arch.startswith("gemma") else LAYER
    return f"blk.{parts[2]}.{layer['.'.join(parts[3:])]}"


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf's ``LlamaModel.permute`` (n_head: the kv heads for K)."""
    return (w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:])
            .swapaxes(1, 2).reshape(w.shape))


def write_gguf(model_dir: Path, out: Path, types: Callable[[str], str] | dict[str, str] = MIXED,
               arch: str | None = None, extra: dict[str, np.ndarray] | None = None) -> Path:
    """The tiny model in ``model_dir`` as a GGUF file ``out``; ``types``: the ggml type of
    each 2-D tensor by its GGUF name's kind (``attn_q``, ``token_embd``, ...; missing: F32);
    ``extra``: more tensors, written as they are."""
    config = AutoConfig.from_pretrained(model_dir)
    arch = arch or config.model_type.removesuffix("_text")  # gemma3_text: llama.cpp's gemma3
    kind_type = types if callable(types) else (lambda kind: types.get(kind, "F32"))
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w = gguf.GGUFWriter(str(out), arch)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_block_count(config.num_hidden_layers)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_layer_norm_rms_eps(config.rms_norm_eps)
    rope = getattr(config, "rope_parameters", None) or {}
    rope = rope.get("full_attention", rope)  # Gemma 3: the global layers' base
    w.add_rope_freq_base(float(getattr(config, "rope_theta", None) or rope["rope_theta"]))
    w.add_rope_dimension_count(head_dim)
    w.add_vocab_size(config.vocab_size)
    w.add_bos_token_id(config.bos_token_id)
    w.add_eos_token_id(config.eos_token_id)
    if arch.startswith("gemma"):  # as convert_hf_to_gguf's Gemma2Model / Gemma3Model
        w.add_sliding_window(config.sliding_window)
        if arch == "gemma2":
            w.add_float32(f"{arch}.attn_logit_softcapping", config.attn_logit_softcapping)
            w.add_float32(f"{arch}.final_logit_softcapping", config.final_logit_softcapping)
    rng = np.random.default_rng(0)
    state = load_file(str(model_dir / "model.safetensors"))
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf, tensor in state.items():
        name = gguf_name(hf, arch)
        a = tensor.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            a = a + 1  # llama.cpp's norm_shift: Gemma's (1 + w) stored as such
        if arch == "llama" and ".attn_q." in name:
            a = _permute(a, heads)
        elif arch == "llama" and ".attn_k." in name:
            a = _permute(a, kv)
        kind = name.split(".")[-2] if name.startswith("blk.") else name.split(".")[0]
        qtype = kind_type(kind) if a.ndim == 2 else "F32"
        if qtype == "F32":
            w.add_tensor(name, np.ascontiguousarray(a))
        else:
            t = gguf.GGMLQuantizationType[qtype]
            if qtype in K_SCALES:
                q = k_quant_blocks(qtype, *a.shape, rng)
            else:
                try:
                    q = gguf.quants.quantize(a, t)
                except (NotImplementedError, gguf.quants.QuantError):  # a type gguf-py
                    # cannot make: zero blocks (the row rounded up to whole blocks), for
                    # the tests of a refused type
                    block, size = gguf.GGML_QUANT_SIZES[t]
                    q = np.zeros((a.shape[0], -(-a.shape[1] // block) * size), np.uint8)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=t)
    for name, a in (extra or {}).items():
        w.add_tensor(name, a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
