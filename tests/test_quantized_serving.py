"""Quantized bases with LoRA on top, exact against oracles nobody here wrote:

- GGUF files (written by gguf-py's GGUFWriter, quantized by ``gguf.quants.quantize`` to
  Q8_0 / Q4_0 / Q4_1, mixed in one file) served as they are, against transformers' own GGUF
  loader (it dequantizes) with PEFT adapters;
- ``--quantization int8|int4`` on a float32 checkpoint: tests/test_quantize_on_load.py
  (this file's workload and check, against the published formulas' weights);

greedy tokens equal and logprobs within 5e-3 in float32 activations, the base and adapters
mixed in one batch (chunked prefill included). The bad inputs at load (an unsupported
architecture or tensor type, a truncated file, --quantization on a GGUF) are in
tests/test_quantized_bad_input.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.models.quant_modules import QuantizedEmbedding, QuantizedLinear
from peft import PeftModel
from transformers import AutoConfig, AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, make_adapter, make_tiny_model
from tests.gguf_files import K_MIX, MIXED, write_gguf

NEW = 6
EOS = 2  # the tiny models' eos_token_id
ATOL = 5e-3
K = 3
ADAPTERS = {"qv": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
            "all": {"r": 8, "target_modules": ALL_TARGETS}}
MODELS = {"llama": {}, "qwen2": {}, "qwen3": {"hidden_size": 128},  # qwen3: head_dim 32
          "gemma2": {}, "gemma3": {}}


LENGTHS = (1, 7, 12, 20, 31, 9)
# On Triton (the interpreter: its programs are the test's time) three requests: the base,
# each adapter, one prompt split by the 24-token steps
TRITON_LENGTHS = (1, 31, 9)
# Phi-3's longrope switches past 32 tokens (original_max_position_embeddings), where
# loraplex and transformers part by design (engine/models/rope.py): its sequences stay short
PHI3_LENGTHS = (1, 7, 12, 20, 26, 9)


def workload(seed: int = 0, lengths: tuple[int, ...] = LENGTHS
             ) -> list[tuple[str | None, list[int]]]:
    rng = random.Random(seed)
    names = [None, *ADAPTERS]
    items = [(names[i % 3], [rng.randrange(4, 384) for _ in range(n)])
             for i, n in enumerate(lengths)]
    rng.shuffle(items)
    return items


class Oracle:
    """(adapter, token ids) -> [len, vocab] float32 log_softmax of ``load()`` (+ PEFT)."""

    def __init__(self, load, adapters: dict[str, Path]):
        self.load, self.adapters, self.models = load, adapters, {}

    def __call__(self, adapter: str | None, ids: list[int]) -> torch.Tensor:
        if adapter not in self.models:
            model = self.load()
            if adapter is not None:
                model = PeftModel.from_pretrained(model, self.adapters[adapter])
            self.models[adapter] = model.eval()
        with torch.no_grad():
            logits = self.models[adapter](torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)


def check_against(engine: LLMEngine, adapters: dict[str, Path], oracle: Oracle,
                  lengths: tuple[int, ...] = LENGTHS) -> None:
    for name, path in adapters.items():
        engine.add_adapter(name, path, weights=engine.read_adapter(str(path), name))
    items = workload(lengths=lengths)
    outs = engine.generate([p for _, p in items], SamplingParams(
        temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW, logprobs=K),
        adapters=[a for a, _ in items])
    for (adapter, prompt), out in zip(items, outs):
        ref = oracle(adapter, prompt + out.token_ids)  # row j predicts token j + 1
        assert len(out.token_ids) == NEW
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + j]
            allowed = row.clone()
            allowed[EOS] = -torch.inf  # min_new_tokens holds EOS back
            assert tok == int(allowed.argmax()), (adapter, len(prompt), j)  # greedy tokens
            assert lp.logprob == pytest.approx(row[tok].item(), abs=ATOL)
            vals, top = row.topk(K)
            assert [t for t, _ in lp.top] == top.tolist()
            assert [v for _, v in lp.top] == pytest.approx(vals.tolist(), abs=ATOL)


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    """arch -> (float model dir, its GGUF file, {adapter: PEFT dir})."""
    made: dict[str, tuple[Path, Path, dict[str, Path]]] = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(f"q_{arch}")
            model = make_tiny_model(root / "model", arch, **MODELS[arch])
            adapters = {name: make_adapter(model, root / name, seed=i, **kw)
                        for i, (name, kw) in enumerate(ADAPTERS.items())}
            made[arch] = (model, write_gguf(model, root / f"{arch}.gguf"), adapters)
        return made[arch]

    return get


@pytest.fixture(scope="module")
def gguf_oracles(family):
    """arch -> its GGUF oracle, made once: every kernels parametrization asks it the same."""
    made: dict[str, Oracle] = {}

    def get(arch: str) -> Oracle:
        if arch not in made:
            model_dir, path, adapters = family(arch)
            made[arch] = gguf_oracle(path, model_dir, adapters)
        return made[arch]

    return get


def gguf_oracle(path: Path, model_dir: Path, adapters: dict[str, Path]) -> Oracle:
    """transformers' GGUF loader; its config's head_dim taken from the float model, since
    transformers reads no ``attention.key_length`` from a GGUF (it keeps Qwen3's default)."""
    config = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name)
    written = AutoConfig.from_pretrained(model_dir)  # what the file was written from
    head_dim = getattr(written, "head_dim", None)
    if head_dim is not None:
        config.head_dim = head_dim
    if config.model_type.startswith("gemma"):  # what transformers reads of none of it
        config.query_pre_attn_scalar = head_dim  # llama.cpp's query scale (but for 27B)
        for key in ("attn_logit_softcapping", "final_logit_softcapping"):
            setattr(config, key, getattr(written, key, None))
    return Oracle(lambda: AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, config=config, dtype=torch.float32), adapters)


def engine_for(model: Path | str, **kw) -> LLMEngine:
    return LLMEngine(model=str(model), **{
        "dtype": "float32", "max_num_seqs": 8, "max_num_batched_tokens": 24,
        "max_model_len": 112, "max_lora_rank": 8, "max_loras": 4, **kw})


# On Triton a GGUF's linears are the torch backend's (TritonBackend.quantized_linear: only
# int4 has a Triton kernel), so per family Triton adds only its attention and LoRA kernels:
# llama's in `make test` here, gemma2's and gemma3's in test_new_families.py; the other
# families on Triton (the interpreter: 15-40 s a run on 2 cores) are marked slow.
ARCH_KERNELS = [pytest.param(arch, kernels, id=f"{arch}-{kernels}", marks=(
    [] if kernels != "triton" else
    [pytest.mark.triton] if arch == "llama" else [pytest.mark.triton, pytest.mark.slow]))
    for kernels in ("cpu", "torch", "triton") for arch in MODELS]


@pytest.mark.parametrize(("arch", "kernels"), ARCH_KERNELS)
def test_gguf_served_as_stored_equals_transformers(arch, kernels, family, gguf_oracles,
                                                   monkeypatch):
    """Q8_0 embedding, Q4_0/Q8_0/Q4_1 q/k/v in one fused linear, Q4_0/Q4_1 gate/up; llama
    untied (Q8_0 head) with llama.cpp's Q/K permutation, qwen2 tied with q/k/v biases,
    qwen3 with q/k norms; gemma2 / gemma3 with their (1 + w) norms stored shifted, scaled
    embedding, soft-caps (gemma2) and sliding windows."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    _, path, adapters = family(arch)
    engine = engine_for(path)
    assert engine.base.kernels.name == kernels
    model = engine.base.model
    qkv = model.model.layers[0].self_attn.qkv_proj.base  # LoRA wraps the quantized linear
    assert [w.format.name for w in qkv.weights] == ["Q4_0", "Q8_0", "Q4_1"]
    assert isinstance(model.model.embed_tokens, QuantizedEmbedding)
    assert isinstance(model.logits_head, QuantizedLinear)
    assert engine.base.weights.format == "Q8_0+Q4_1+Q4_0"
    check_against(engine, adapters, gguf_oracles(arch),
                  TRITON_LENGTHS if kernels == "triton" else LENGTHS)


def test_k_quants_q4_k_m_mix_equals_transformers(tmp_path):
    """A Q4_K_M-like file (Q4_K, Q5_K o_proj, Q6_K v / down / head; rows of 256 weights):
    each q/k/v slice keeps its own format (Q4_K, Q4_K, Q6_K in one fused linear); K-quant
    blocks are random (gguf-py cannot make them), dequantized by transformers as by us."""
    model_dir = make_tiny_model(tmp_path / "model", "llama", hidden_size=256,
                                intermediate_size=256)
    path = write_gguf(model_dir, tmp_path / "k.gguf", K_MIX)
    adapters = {name: make_adapter(model_dir, tmp_path / name, seed=i, **kw)
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    engine = engine_for(path)
    qkv = engine.base.model.model.layers[0].self_attn.qkv_proj.base
    assert [w.format.name for w in qkv.weights] == ["Q4_K", "Q4_K", "Q6_K"]
    assert engine.base.weights.format.startswith("Q4_K+")
    check_against(engine, adapters, gguf_oracle(path, model_dir, adapters))


def test_float_slice_in_a_quantized_fused_linear(tmp_path):
    """A file keeping v in F32 beside Q4_0 q and Q8_0 k (llama.cpp may keep a tensor
    unquantized): the fused q/k/v holds two quantized parts and one float part."""
    model_dir = make_tiny_model(tmp_path / "model", "llama")
    types = {k: v for k, v in MIXED.items() if k != "attn_v"}  # attn_v: F32
    path = write_gguf(model_dir, tmp_path / "v32.gguf", types)
    adapters = {name: make_adapter(model_dir, tmp_path / name, seed=i, **kw)
                for i, (name, kw) in enumerate(ADAPTERS.items())}
    engine = engine_for(path)
    qkv = engine.base.model.model.layers[0].self_attn.qkv_proj.base
    assert [w.format.name for w in qkv.weights] == ["Q4_0", "Q8_0"]
    assert qkv.float_bytes == 32 * 64 * 4  # v: [kv heads 2 x head_dim 16, hidden 64] fp32
    check_against(engine, adapters, gguf_oracle(path, model_dir, adapters))


def test_no_float_copy_of_a_quantized_weight(family):
    """Every linear of the decoder and the embedding hold QuantizedWeights only: the model's
    float parameters are the norms (and biases), and the tied head shares the embedding's
    weight."""
    _, path, _ = family("qwen2")
    model = engine_for(path).base.model
    floats = {n for n, _ in model.named_parameters()}
    assert all("norm" in n or n.endswith(".bias") for n in floats), floats
    assert model.logits_head.weights[0] is model.model.embed_tokens.qweight


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_bfloat16_activations(kernels, family, monkeypatch):
    """The GGUF served in bf16 activations (the quantized weights dequantized into bf16):
    its logprobs within bf16's rounding of the float32 oracle's; and int8 in bf16 keeps its
    scales in float32 (a QuantizedWeight is no tensor of the model's ``.to(dtype)``)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    model_dir, path, adapters = family("qwen2")
    oracle = gguf_oracle(path, model_dir, adapters)
    engine = engine_for(path, dtype="bfloat16")
    for adapter, prompt in workload()[:3]:
        if adapter is not None:
            engine.add_adapter(adapter, adapters[adapter])
        out = engine.generate([prompt], SamplingParams(
            temperature=0.0, max_new_tokens=NEW, logprobs=0), adapters=[adapter])[0]
        ref = oracle(adapter, prompt + out.token_ids)
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            assert lp.logprob == pytest.approx(ref[len(prompt) - 1 + j, tok].item(), abs=0.1)
    int8 = engine_for(model_dir, quantization="int8", dtype="bfloat16").base.model
    qkv = int8.model.layers[0].self_attn.qkv_proj.base
    assert all(w.scales.dtype == torch.float32 for w in qkv.weights)
    assert qkv.bias.dtype == torch.bfloat16  # qwen2's q/k/v biases: the serving dtype


@pytest.mark.parametrize("quantization", [None, "auto", "none"])
def test_quantization_none_is_the_float_model(family, quantization):
    """A float checkpoint is served in float with the default (auto: as stored) and none."""
    model_dir, _, _ = family("llama")
    kw = {} if quantization is None else {"quantization": quantization}
    engine = engine_for(model_dir, **kw)
    assert engine.config.quantization == (quantization or "auto")
    assert engine.base.weights.format == "float" and engine.base.weights.bits == 0
    assert not any(isinstance(m, QuantizedLinear) for m in engine.base.model.modules())


def test_quantization_none_on_a_gguf_serves_its_float32_conversion(family, tmp_path,
                                                                     monkeypatch):
    """--quantization none on a .gguf: transformers' dequantization, written once under
    $LORAPLEX_HOME and served in float32; exact against transformers' GGUF loader + PEFT."""
    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    model_dir, path, adapters = family("llama")
    engine = engine_for(path, quantization="none")
    assert engine.base.path.is_dir() and engine.base.path.is_relative_to(tmp_path)
    assert engine.base.weights.format == "float" and engine.base.weights.bits == 0
    assert not any(isinstance(m, (QuantizedLinear, QuantizedEmbedding))
                   for m in engine.base.model.modules())
    check_against(engine, adapters, gguf_oracle(path, model_dir, adapters))


def test_rope_freqs_is_skipped_with_a_warning(family, tmp_path, caplog):
    """llama.cpp's rope_freqs (Llama 3) is not applied, as transformers does not: the
    tokens stay transformers' (the same weights as the llama test's file), and a warning
    names it."""
    model_dir, plain, _ = family("llama")
    factors = np.linspace(1.0, 8.0, 8, dtype=np.float32)  # head_dim 16 / 2
    path = write_gguf(model_dir, tmp_path / "rf.gguf", extra={"rope_freqs.weight": factors})
    prompt = [5, 17, 33, 99, 200, 7]
    params = SamplingParams(temperature=0.0, max_new_tokens=NEW)
    with caplog.at_level("WARNING", logger="loraplex"):
        got = engine_for(path).generate([prompt], params)[0].token_ids
    assert got == engine_for(plain).generate([prompt], params)[0].token_ids
    assert any("rope_freqs.weight" in r.getMessage() for r in caplog.records)


def test_serve_takes_a_gguf_file(family):
    """``loraplex serve --model FILE.gguf`` passes the command line's model check (the
    engine then serves it as above); a missing file is refused there."""
    from loraplex.serve_command import check_model_arg

    _, path, _ = family("llama")
    check_model_arg(str(path))
    with pytest.raises(ValueError, match="a .gguf file"):
        check_model_arg(str(path.with_name("missing.gguf")))


def test_gguf_auto_dtype_is_a_16_bit_checkpoints(family, monkeypatch):
    """--dtype auto serves a GGUF as a 16-bit checkpoint (its weights are fp16 scales times
    small integers): bf16 activations where the CPU has native bf16, else float32."""
    from loraplex.kernel_backends.cpu import isa

    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    _, path, _ = family("llama")
    expected = torch.bfloat16 if isa.HALF_NATIVE else torch.float32
    assert engine_for(path, dtype="auto").base.dtype == expected


def test_gguf_config_is_kept_and_serves_the_same(family, tmp_path, monkeypatch):
    """A GGUF's config (and tokenizer, when it has one) is kept as HF files after the first
    load (engine/gguf_metadata.py); a load from the kept copy has the same config and is
    exact against transformers' GGUF loader + PEFT."""
    from loraplex.engine.default_gguf import gguf_cache_dir

    monkeypatch.setenv("LORAPLEX_HOME", str(tmp_path))
    model_dir, path, adapters = family("llama")
    first = engine_for(path).base.hf_config.to_dict()
    assert (gguf_cache_dir(path, "gguf-meta") / "config.json").is_file()
    engine = engine_for(path)
    second = engine.base.hf_config.to_dict()
    for config in (first, second):
        config.pop("_name_or_path", None)
    assert second == first
    check_against(engine, adapters, gguf_oracle(path, model_dir, adapters))
