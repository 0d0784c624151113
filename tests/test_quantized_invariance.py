"""Batch invariance on quantized bases (issue 45; docs/sampling.md's guarantee): a probe's
tokens and every logprob it reports are the same bits alone and in random batch
compositions (tests/invariance_draws.py: neighbours on other adapters and lengths, greedy
and seeded probes, n > 1, chunked prompts, prefix-cache hits), and decode logprobs equal an
echo re-score, on

- a GGUF file mixing K-quants (Q4_K, Q5_K, Q6_K) with Q8_0, Q4_0 and Q4_1 (its embedding
  and head quantized too) and keeping two tensors in F32, as llama.cpp may: v, a float
  slice of the fused q/k/v, and o_proj, a whole float linear (tests/gguf_files.py);
- ``--quantization int4`` and ``int8`` on the float checkpoint it was written from;

with two PEFT adapters on top (the CPU kernels' quantized linears:
kernel_backends/cpu/quantized_linear.py), in float32 activations everywhere and in bfloat16
where the CPU has native bf16 (AVX512-BF16 or AMX: ``isa.HALF_NATIVE``; elsewhere bf16 is
emulated, ``--dtype auto`` serves float32, and those cases skip). In bfloat16 the kernels
take their avx512_bf16 path (VDPBF16PS) and the GGUF's float tensors the bf16 packed
layout; on AMX, ``--batch-invariant off`` would send 8 bf16 rows or more to oneDNN
(``quantized_linear.MANY_ROWS_RULE``), whose rows follow the row count: on, they never go
there (test_on_never_sends_bf16_rows_to_onednn), and forcing that route under on makes the
re-score differ (test_the_onednn_many_rows_route_is_not_invariant: the checks can fail).
The GGUF's float tensors run packed whatever the head's format (a quantized head must not
keep the engine from packing a float linear: oneDNN's GEMM rows follow the row count).

The draws run on one intra-op thread (``one_thread``: on 2 loaded cores, 2 OpenMP threads
make these tiny steps 15-50x slower); tests/test_thread_invariance.py shows that the thread
count does not change a batch's bits, the GGUF's included. 10 draws a base, each base's
reaching every case (test_the_draws_cover_the_cases), bfloat16 drawn from other seeds;
the float bases' property test (12 draws a dtype, float32 and bfloat16) is
tests/test_batch_invariance.py."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine
from loraplex.engine.models.quant_modules import QuantizedLinear
from loraplex.kernel_backends import cpu as cpu_backend
from loraplex.kernel_backends.cpu import isa
from loraplex.kernel_backends.cpu import quantized_linear as cpu_quantized
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
BF16_SEED = 1000  # bfloat16's draws: the base's seed + this (other compositions)
DRAWS = 10
DTYPES = ["float32", pytest.param("bfloat16", marks=pytest.mark.skipif(
    not isa.HALF_NATIVE, reason="bfloat16 is emulated on this CPU (no AVX512-BF16 or AMX): "
    "--dtype auto serves float32 here, and these bf16 cases run where bf16 is native"))]
needs_native_bf16 = pytest.mark.skipif(not isa.HALF_NATIVE,
                                       reason="no native bfloat16 (AVX512-BF16 or AMX) here")


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


def make_engine(made: dict, base: str, dtype: str = "float32", **kw) -> LLMEngine:
    """An engine over ``base``: "gguf", "int4", "int8" (--quantization), or "float", its
    activations in ``dtype``."""
    model: Path = made["gguf"] if base == "gguf" else made["model"]
    if base in ("int4", "int8"):
        kw["quantization"] = base
    kw.setdefault("max_model_len", 256)
    return LLMEngine(model=str(model), dtype=dtype, max_lora_rank=16,
                     lora_modules=made["adapters"], **kw)


def base_draws(base: str, dtype: str = "float32") -> list[dict]:
    seed, budget = BASES[base]
    rng = random.Random(seed + (BF16_SEED if dtype == "bfloat16" else 0))
    return [draws.draw(rng, budgets=[budget]) for _ in range(DRAWS)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])  # drawn on any CPU
@pytest.mark.parametrize("base", BASES)
def test_the_draws_cover_the_cases(base, dtype):
    assert draws.covers_the_cases(base_draws(base, dtype)) == []


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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", BASES)
def test_quantized_probe_is_the_same_bits_in_every_batch(made, base, dtype, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    with one_thread():
        eng = make_engine(made, base, dtype)
        assert eng.base.kernels.name == "cpu" and eng.base.kernels.dtype == getattr(torch, dtype)
        qkv = eng.base.model.model.layers[0].self_attn.qkv_proj.base
        assert isinstance(qkv, QuantizedLinear) and qkv.weights  # served quantized
        assert draws.run_draws(lambda **kw: make_engine(made, base, dtype, **kw),
                               base_draws(base, dtype)) == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("base", BASES)
def test_quantized_decode_logprobs_equal_an_echo_rescore(made, base, dtype, monkeypatch):
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    with one_thread():
        assert draws.rescore_mismatches(make_engine(made, base, dtype,
                                                    max_num_batched_tokens=16)) == []


def onednn_calls(made: dict, monkeypatch, **kw) -> int:
    """How many times the int4 base's quantized linears took the oneDNN route
    (``dequantized_linear``) while re-scoring in bfloat16 (prompts of up to 80 rows)."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(1)
        return dequantized(*args, **kwargs)

    dequantized = cpu_quantized.dequantized_linear
    monkeypatch.setattr(cpu_quantized, "dequantized_linear", counted)
    draws.rescore_mismatches(make_engine(made, "int4", "bfloat16", **kw))
    monkeypatch.setattr(cpu_quantized, "dequantized_linear", dequantized)
    return len(calls)


@needs_native_bf16
def test_on_never_sends_bf16_rows_to_onednn(made, monkeypatch):
    """--batch-invariant on: every bf16 row count runs the quantized kernel, whatever
    MANY_ROWS_RULE says for this CPU; off, where the rule (or LORAPLEX_QUANT_MANY_ROWS)
    names oneDNN, many rows go there (the count above can see it)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    with one_thread():
        assert onednn_calls(made, monkeypatch, batch_invariant="on") == 0
        if cpu_quantized.many_rows_route() == "onednn":
            assert onednn_calls(made, monkeypatch, batch_invariant="off") > 0


@needs_native_bf16
def test_the_onednn_many_rows_route_is_not_invariant(made, monkeypatch):
    """The route on never takes, forced under on (the backend's quantized linears called
    as off calls them, LORAPLEX_QUANT_MANY_ROWS=onednn): oneDNN's bf16 blocking follows
    the row count, so an int8 base's decode logprobs (one row) differ from their re-score
    (a prefill's rows): the engine tests above can fail. On a CPU with AVX512-BF16 but no
    AMX, where oneDNN's bf16 GEMMs may give a row the same bits whatever the row count,
    equal bits break no promise: skipped there."""
    if "avx512_bf16" not in cpu_quantized.isas(cpu_backend.extension.load()):
        pytest.skip("the oneDNN route needs the kernels' avx512_bf16 path")
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    monkeypatch.setenv("LORAPLEX_QUANT_MANY_ROWS", "onednn")

    def as_off(self, x, weight, bias=None):
        return cpu_quantized.quantized_linear(self.ext, x, weight, bias, batch_invariant=False)

    monkeypatch.setattr(cpu_backend.CPUBackend, "quantized_linear", as_off)
    with one_thread():
        bad = draws.rescore_mismatches(make_engine(made, "int8", "bfloat16",
                                                   max_num_batched_tokens=16))
    if not bad and isa.cpu_isa() != "AMX":
        pytest.skip("oneDNN's bf16 GEMMs give a row the same bits at every row count here")
    assert bad  # on AMX all four re-scores differed (2026-12-07, Sapphire Rapids)
