"""The decoder layer's elementwise C++ kernels (kernel_backends/cpu/csrc/layer_ops.cpp) against
their torch twins in kernel_backends/torch/layer_ops.py, and the engine's use of them through the
cpu backend (no silent fallback to the torch backend's ops)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.kernel_backends import backend_name, select_backend
from loraplex.kernel_backends.cpu import extension, packed_linear
from loraplex.kernel_backends.cpu.isa import cpu_isa
from loraplex.kernel_backends.torch import TorchBackend
from loraplex.kernel_backends.torch import attention as torch_attention
from loraplex.kernel_backends.torch import layer_ops as reference

TOL = {torch.float32: {"rtol": 1e-5, "atol": 1e-5}, torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
       torch.float16: {"rtol": 2e-3, "atol": 2e-3}}
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
WIDTHS = [576, 100, 7]  # the vector body only, body and tail, tail only


@pytest.fixture(scope="module")
def kernels():
    assert extension.available(), "the C++ CPU kernels did not build on this machine"
    return extension.load()


def _randn(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_rms_norm_matches_twin(kernels, dtype: torch.dtype, width: int) -> None:
    x = _randn(33, width, dtype=dtype, seed=0, scale=3.0)
    w = _randn(width, dtype=dtype, seed=1)
    got = kernels.rms_norm(x, w, 1e-5)
    torch.testing.assert_close(got, reference.rms_norm(x, w, 1e-5), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", WIDTHS)
def test_add_rms_norm_updates_the_residual_in_place(kernels, dtype: torch.dtype,
                                                   width: int) -> None:
    x = _randn(5, width, dtype=dtype, seed=0)
    residual = _randn(5, width, dtype=dtype, seed=1, scale=4.0)
    w = _randn(width, dtype=dtype, seed=2)
    twin_residual = residual.clone()
    want = reference.add_rms_norm_(x, twin_residual, w, 1e-6)
    got = kernels.add_rms_norm_(x, residual, w, 1e-6)
    torch.testing.assert_close(residual, twin_residual, rtol=0, atol=0)  # one rounding
    torch.testing.assert_close(got, want, **TOL[dtype])


def test_rms_norm_of_strided_rows(kernels) -> None:
    """Rows of a wider tensor (a slice of a fused projection) are read in place."""
    wide = _randn(6, 300, dtype=torch.float32, seed=0)
    x = wide[:, 100:228]
    w = _randn(128, dtype=torch.float32, seed=1)
    torch.testing.assert_close(kernels.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))


def _qkv(tokens: int, hq: int, hkv: int, dim: int, dtype: torch.dtype):
    """q, k, v as the model makes them: strided views of one fused projection."""
    fused = _randn(tokens, (hq + 2 * hkv) * dim, dtype=dtype, seed=3)
    q, k, v = fused.split([hq * dim, hkv * dim, hkv * dim], dim=-1)
    return (q.reshape(tokens, hq, dim), k.reshape(tokens, hkv, dim),
            v.reshape(tokens, hkv, dim))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("hq", "hkv", "dim"), [(9, 3, 64), (4, 4, 32), (2, 1, 6)])
def test_rope_store_kv_matches_twin(kernels, dtype: torch.dtype, hq: int, hkv: int,
                                    dim: int) -> None:
    tokens, blocks, block_size = 7, 4, 4
    angles = _randn(tokens, dim // 2, dtype=torch.float32, seed=4, scale=3.0)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(dtype)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(dtype)
    slots = torch.tensor([3, 0, 15, -1, 8, 9, 4], dtype=torch.int64)  # -1: not cached
    caches = [torch.full((blocks, block_size, hkv, dim), 7.0, dtype=dtype) for _ in range(4)]
    q, k, v = _qkv(tokens, hq, hkv, dim, dtype)
    want = reference.rope_store_kv(q.clone(), k.clone(), v.clone(), cos, sin, caches[0],
                                   caches[1], slots)
    got = kernels.rope_store_kv(q, k, v, cos, sin, caches[2], caches[3], slots)
    torch.testing.assert_close(got, want, **TOL[dtype])
    torch.testing.assert_close(caches[2], caches[0], **TOL[dtype])
    torch.testing.assert_close(caches[3], caches[1], rtol=0, atol=0)  # v is copied as is
    assert bool((caches[2].view(-1, hkv, dim)[[1, 2, 5, 6, 7, 10]] == 7.0).all())  # untouched


def test_rope_store_kv_refuses_a_slot_past_the_cache(kernels) -> None:
    q, k, v = _qkv(2, 2, 1, 8, torch.float32)
    cache = torch.zeros(2, 4, 1, 8)
    ones = torch.ones(2, 8)
    with pytest.raises(RuntimeError, match="slot 8 out of range"):
        kernels.rope_store_kv(q, k, v, ones, ones, cache, cache.clone(),
                              torch.tensor([0, 8], dtype=torch.int64))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 36, 24, 5])  # 24: 16-wide then 8-wide vectors
def test_silu_mul_matches_twin(kernels, dtype: torch.dtype, width: int) -> None:
    gate_up = _randn(9, 2 * width, dtype=dtype, seed=5, scale=4.0)
    gate_up[0, :4] = torch.tensor([-100.0, -87.0, 0.0, 90.0]).to(dtype)  # exp's range ends
    torch.testing.assert_close(kernels.silu_mul(gate_up), reference.silu_mul(gate_up),
                               **TOL[dtype])


KERNELS = ["rms_norm", "add_rms_norm_", "rope_store_kv", "silu_mul", "paged_attention_decode",
           "paged_attention_prefill", "argmax_finite_rows", "pack_panels", "panel_linear"]
WITHOUT_TWIN = {"argmax_finite_rows", "pack_panels", "panel_linear"}  # torch's own ops are theirs
TWIN_MODULES = {"paged_attention_decode": torch_attention,
                "paged_attention_prefill": torch_attention}  # the rest: reference (layer_ops)


def test_the_engine_runs_every_layer_kernel(kernels, tiny_models: Callable[[str], Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """A strided view or another layout the cpu backend does not take would fall back to
    the (much slower) torch backend's op without a word: the engine's steps must call each
    kernel and no twin of them. The linears are packed in the panel layout (the rule of
    AVX2 CPUs; GEMM_LAYOUT keeps oneDNN elsewhere) so that its kernels are counted too."""
    calls: Counter[str] = Counter()

    def counted(name: str):
        real = getattr(kernels, name)
        return staticmethod(lambda *a: calls.update([name]) or real(*a))

    proxy = type("Counted", (), {name: counted(name) for name in KERNELS})
    proxy.panel_gemm_available = staticmethod(kernels.panel_gemm_available)
    monkeypatch.setattr(extension, "load", lambda: proxy)
    monkeypatch.setitem(packed_linear.GEMM_LAYOUT, cpu_isa(), "panels")
    twins = [k for k in KERNELS if k not in WITHOUT_TWIN]
    for name in twins:
        fail = (lambda *a, name=name: pytest.fail(f"the twin of {name} ran"))
        monkeypatch.setattr(TWIN_MODULES.get(name, reference), name, fail)
        monkeypatch.setattr(TorchBackend, name, fail)  # the cpu backend's super() calls
    # --batch-invariant off: the decode kernel serves decodes (else the tiled kernel does)
    engine = LLMEngine(model=tiny_models("qwen3"), dtype="float32", max_model_len=128,
                       batch_invariant="off")
    assert engine.base.kernels.name == "cpu"
    outs = engine.generate([[5, 6, 7], [9, 10]], SamplingParams(temperature=0.0,
                                                                max_new_tokens=3))
    assert all(len(o.token_ids) == 3 for o in outs)
    assert set(calls) == set(KERNELS), calls


def test_the_engine_without_the_kernels_gives_the_same_tokens(
        tiny_models: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """No compiler (or LORAPLEX_CPU_KERNEL=0): the engine serves with the torch backend,
    whose ops are the twins, and greedy decoding is unchanged."""
    prompts = [[5, 6, 7, 8], [9, 10], list(range(20, 60))]
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)

    def run(backend: str) -> list[list[int]]:
        engine = LLMEngine(model=tiny_models("llama"), dtype="float32", max_model_len=128)
        assert engine.base.kernels.name == backend
        return [o.token_ids for o in engine.generate(prompts, params)]

    with_kernels = run("cpu")
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL", "0")
    with pytest.raises(extension.KernelBuildError):
        extension.load()
    assert backend_name(torch.device("cpu")) == "torch"
    ops = select_backend(torch.device("cpu"), torch.float32)
    assert type(ops) is TorchBackend
    x = _randn(4, 64, dtype=torch.float32, seed=0)
    w = _randn(64, dtype=torch.float32, seed=1)
    assert torch.equal(ops.rms_norm(x, w, 1e-5), reference.rms_norm(x, w, 1e-5))
    assert torch.equal(ops.silu_mul(x), reference.silu_mul(x))
    assert run("torch") == with_kernels
