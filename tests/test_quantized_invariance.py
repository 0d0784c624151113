"""Batch invariance on quantized bases (issue 45; docs/sampling.md's guarantee): a probe's
tokens and every logprob it reports are the same bits alone and in random batch
compositions (tests/invariance_draws.py: neighbours on other adapters and lengths, greedy
and seeded probes, n > 1, chunked prompts, prefix-cache hits), and decode logprobs equal an
echo re-score, on

- a GGUF file mixing K-quants (Q4_K, Q5_K, Q6_K) with Q8_0, Q4_0 and Q4_1 (its embedding
  and head quantized too) and keeping two tensors in F32, as llama.cpp may: v, a float
  slice of the fused q/k/v, and o_proj, a whole float linear (tests/gguf_files.py);
- ``--quantization int4`` and ``int8`` on the float checkpoint it was written from;

with two PEFT adapters on top, in float32 activations (the CPU kernels' quantized linears:
kernel_backends/cpu/quantized_linear.py). The GGUF's float tensors were not invariant
before session 26 (a quantized head kept the engine from packing any float linear: they
ran oneDNN's GEMM, whose rows follow the row count).

The draws run on one intra-op thread (``one_thread``: on 2 loaded cores, 2 OpenMP threads
make these tiny steps 15-50x slower); tests/test_thread_invariance.py shows that the thread
count does not change a batch's bits, the GGUF's included. 10 draws a base, each base's
reaching every case (test_the_draws_cover_the_cases); the float bases' property test (12
draws a dtype, float32 and bfloat16) is tests/test_batch_invariance.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from loraplex import LLMEngine
from loraplex.engine.models.quant_modules import QuantizedLinear
from loraplex.kernel_backends import cpu as cpu_backend
from loraplex.kernel_backends.cpu.packed_linear import PackedLinear

from tests import invariance_draws as draws
from tests.conftest import ALL_TARGETS, make_adapter, make_tiny_model, one_thread
from tests.gguf_files import write_gguf

pytestmark = pytest.mark.skipif(not cpu_backend.available(),
                                reason="the CPU kernels do not build here")

# every GGUF type the CPU kernels read, in one file (K-quants: rows of 256 weights); attn_v
# and attn_output left out: F32
GGUF_MIX = {"token_embd": "Q8_0", "attn_q": "Q4_K", "attn_k": "Q8_0", "ffn_gate": "Q4_0",
            "ffn_up": "Q5_K", "ffn_down": "Q6_K", "output": "Q4_1"}
# base -> (its seed for the draws, the step token budget of its busy engine)
BASES = {"gguf": (4501, 16), "int4": (4609, 33), "int8": (4700, 7)}
DRAWS = 10


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> dict[str, object]:
    """The float checkpoint (64-wide heads in groups of two), its GGUF, two adapters."""
    root = tmp_path_factory.mktemp("qinv")
    model = make_tiny_model(root / "model", "llama", hidden_size=256, intermediate_size=256)
    adapters = {"a0": str(make_adapter(model, root / "a0", r=8, seed=1)),
                "a1": str(make_adapter(model, root / "a1", r=16, seed=2,
                                       target_modules=ALL_TARGETS))}
    return {"model": model, "gguf": write_gguf(model, root / "mix.gguf", GGUF_MIX),
            "adapters": adapters}


def make_engine(made: dict, base: str, **kw) -> LLMEngine:
    """An engine over ``base``: "gguf", "int4", "int8" (--quantization), or "float"."""
    model: Path = made["gguf"] if base == "gguf" else made["model"]
    if base in ("int4", "int8"):
        kw["quantization"] = base
    kw.setdefault("max_model_len", 256)
    return LLMEngine(model=str(model), dtype="float32", max_lora_rank=16,
                     lora_modules=made["adapters"], **kw)


def base_draws(base: str) -> list[dict]:
    seed, budget = BASES[base]
    rng = random.Random(seed)
    return [draws.draw(rng, budgets=[budget]) for _ in range(DRAWS)]


@pytest.mark.parametrize("base", BASES)
def test_the_draws_cover_the_cases(base):
    assert draws.covers_the_cases(base_draws(base)) == []


def test_a_ggufs_float_tensors_are_packed_beside_its_quantized_head(made, monkeypatch):
    """The engine packs the GGUF's float linears (o_proj whole, v's slice of q/k/v) in the
    invariant layout, and leaves its quantized head to the quantized kernel."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    with one_thread():
        model = make_engine(made, "gguf").base.model
    attention = model.model.layers[0].self_attn
    qkv = attention.qkv_proj.base
    assert [w.format.name for w in qkv.weights] == ["Q4_K", "Q8_0"]
    assert isinstance(qkv.float_rows_384, PackedLinear)  # v: after q (256 rows), k (128)
    assert isinstance(attention.o_proj.base, PackedLinear)
    assert isinstance(model.logits_head, QuantizedLinear)


@pytest.mark.triton
def test_the_triton_backends_invariant_mode_takes_the_float_tensors_too(made, monkeypatch):
    """The Triton backend's invariant mode swaps the same float linears for its invariant
    ones and leaves the quantized head to its quantized linear (no engine step is run)."""
    from loraplex.kernel_backends.triton.invariant_matmul import InvariantLinear

    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    with one_thread():
        model = make_engine(made, "gguf", batch_invariant="on").base.model
    attention = model.model.layers[0].self_attn
    assert isinstance(attention.qkv_proj.base.float_rows_384, InvariantLinear)
    assert isinstance(attention.o_proj.base, InvariantLinear)
    assert isinstance(model.logits_head, QuantizedLinear)


@pytest.mark.parametrize("base", BASES)
def test_quantized_probe_is_the_same_bits_in_every_batch(made, base, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    with one_thread():
        eng = make_engine(made, base)
        assert eng.base.kernels.name == "cpu"
        qkv = eng.base.model.model.layers[0].self_attn.qkv_proj.base
        assert isinstance(qkv, QuantizedLinear) and qkv.weights  # served quantized
        assert draws.run_draws(lambda **kw: make_engine(made, base, **kw),
                               base_draws(base)) == []


@pytest.mark.parametrize("base", BASES)
def test_quantized_decode_logprobs_equal_an_echo_rescore(made, base, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    with one_thread():
        assert draws.rescore_mismatches(make_engine(made, base,
                                                    max_num_batched_tokens=16)) == []
