"""lora/weight_bounds.py: an adapter whose LoRA delta would overflow the serving dtype once
applied is refused when its weights are read (AdapterError naming the adapter, the module
and the bound), while every real adapter passes: the ones the tests build in every shape
(ranks, rsLoRA, patterns, all targets) and the demo adapters in adapters/, in float32,
bfloat16 and float16. The gain the rule bounds really bounds the delta."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from loraplex.lora.base_shapes import BaseShapes
from loraplex.lora.peft_format import AdapterError, read_peft_adapter
from loraplex.lora.weight_bounds import SHRINK_LIMIT, check_bounds, gain_limit

from tests.adapter_dirs import Q0, edit_tensors, shapes_of
from tests.conftest import ALL_TARGETS, make_adapter

ROOT = Path(__file__).resolve().parents[1]
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _fill(key_kind: str, value: float, key: str | None = None):
    """Set every lora_A (or lora_B) tensor, or only ``key``'s, to ``value``."""
    def edit(t: dict[str, torch.Tensor]) -> None:
        for k, old in list(t.items()):
            if key_kind in k and (key is None or k.startswith(key)):
                t[k] = torch.full_like(old, value)
    return edit


def refusal(path: Path, base: BaseShapes, dtype: torch.dtype = torch.float32,
            name: str = "tenant") -> str:
    with pytest.raises(AdapterError) as info:
        read_peft_adapter(path, base, 16, name=name, dtype=dtype)
    return str(info.value)


# ---- real adapters pass -------------------------------------------------------------------
@pytest.mark.parametrize("kwargs", [
    {}, {"r": 16, "target_modules": ALL_TARGETS}, {"use_rslora": True, "lora_alpha": 64},
    {"rank_pattern": {"v_proj": 2}, "alpha_pattern": {"q_proj": 48}},
    {"scale": 0.3, "target_modules": ["q_proj", "v_proj", "down_proj"]},
], ids=["default", "all-targets", "rslora", "patterns", "scale-0.3"])
def test_the_tests_adapters_pass_in_every_dtype(tiny_models, tmp_path: Path, kwargs: dict
                                                ) -> None:
    model = tiny_models("llama")
    path = make_adapter(model, tmp_path / "a", **kwargs)
    for dtype in DTYPES:
        read_peft_adapter(path, shapes_of(model), 16, dtype=dtype)


@pytest.mark.parametrize("demo", ["caps", "json", "pirate"])
def test_the_demo_adapters_pass_in_every_dtype(demo: str) -> None:
    from loraplex.engine.embedded_model import ensure_default_model

    base = shapes_of(ensure_default_model(progress=False))
    for dtype in DTYPES:
        weights = read_peft_adapter(ROOT / "adapters" / demo, base, 64, dtype=dtype)
        assert weights.layers


# ---- overflowing adapters are refused -----------------------------------------------------
def test_every_weight_1e30_is_refused_naming_adapter_module_and_bound(
        ad: Path, llama: BaseShapes) -> None:
    edit_tensors(ad, lambda t: [_fill(k, 1e30)(t) for k in ("lora_A", "lora_B")])
    message = refusal(ad, llama)
    assert "adapter 'tenant'" in message
    assert "model.layers.0.self_attn.q_proj" in message
    assert f"{SHRINK_LIMIT:.3g}" in message and "float32" in message
    assert str(ad) not in message  # names the adapter, not the server's path


def test_a_product_that_overflows_is_refused_though_each_value_is_small(
        ad: Path, llama: BaseShapes) -> None:
    """A = B = 1e20: each value fits float32 (and bf16) and each factor's own sums stay under
    float32's range, but the delta's gain (~1e42) does not."""
    edit_tensors(ad, lambda t: [_fill(k, 1e20, Q0)(t) for k in ("lora_A", "lora_B")])
    for dtype in (torch.float32, torch.bfloat16):
        message = refusal(ad, llama, dtype)
        assert "model.layers.0.self_attn.q_proj would overflow" in message, message
        assert f"above the bound {gain_limit(dtype):.3g}" in message


def test_a_huge_shrink_with_a_tiny_expand_is_refused(ad: Path, llama: BaseShapes) -> None:
    """A = 1e30, B = 1e-30: the delta's gain is modest, but x @ A^T (float32 in every
    backend) overflows for inputs over ~1e7."""
    edit_tensors(ad, lambda t: (_fill("lora_A", 1e30, Q0)(t), _fill("lora_B", 1e-30, Q0)(t)))
    message = refusal(ad, llama)
    assert "q_proj.lora_A has a row whose absolute values sum to" in message, message


def test_values_past_float16_are_refused_only_when_served_in_float16(
        ad: Path, llama: BaseShapes) -> None:
    """1e5 fits float32 and bfloat16, not float16 (largest 65504): the cast would make it Inf."""
    edit_tensors(ad, lambda t: t[f"{Q0}.lora_B.weight"].__setitem__((0, 0), 1e5))
    read_peft_adapter(ad, llama, 16, dtype=torch.float32)
    read_peft_adapter(ad, llama, 16, dtype=torch.bfloat16)
    message = refusal(ad, llama, torch.float16)
    assert "q_proj.lora_B holds values beyond the range of float16 (largest 6.55e+04)" \
        in message, message


def test_the_bound_is_the_gain_at_its_limit(ad: Path, llama: BaseShapes) -> None:
    """One module with a known gain: every A value a, every scaled B value b, so
    g = r * b * (in * a). Just under sqrt(max) passes, just over is refused, per dtype."""
    r, d_in = 8, llama.modules["q_proj"][0]
    scaling = 16 / 8  # make_adapter's lora_alpha = 2r
    a = 1.0 / d_in  # ||A_k||_1 = 1
    for dtype, factor, ok in ((torch.float32, 0.99, True), (torch.float32, 1.01, False),
                              (torch.float16, 0.9, True), (torch.float16, 1.1, False)):
        b = factor * gain_limit(dtype) / r / scaling  # stored B; scaled: gain_limit / r each
        edit_tensors(ad, lambda t, b=b: (_fill("lora_A", a, Q0)(t), _fill("lora_B", b, Q0)(t)))
        if ok:
            read_peft_adapter(ad, llama, 16, dtype=dtype)
        else:
            assert "would overflow" in refusal(ad, llama, dtype)


def test_nan_in_the_held_tensors_is_refused() -> None:
    """NaN (not ``<=`` anything) fails the rule, wherever it sits."""
    a, b = torch.ones(2, 4), torch.ones(3, 2)
    for t in (a, b):
        t[0, 0] = math.nan
        with pytest.raises(AdapterError, match="beyond the range"):
            check_bounds("x", {(0, "q_proj"): (a, b)}, torch.float32)
        t[0, 0] = 1.0


def test_the_gain_bounds_the_delta() -> None:
    """For random adapters and inputs: |B A x|_inf <= g |x|_inf, with g the rule's gain."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        r, d_in, d_out = (int(v) for v in torch.randint(1, 40, (3,), generator=gen))
        a = torch.randn(r, d_in, generator=gen, dtype=torch.float64)
        b = torch.randn(d_out, r, generator=gen, dtype=torch.float64)
        gain = float((b.abs() @ a.abs().sum(1)).max())
        x = torch.randn(d_in, 64, generator=gen, dtype=torch.float64)
        delta = b @ (a @ x)
        assert bool((delta.abs().amax(0) <= gain * x.abs().amax(0) * (1 + 1e-12)).all())
        assert gain >= float((b @ a).abs().sum(1).max()) * (1 - 1e-12)  # >= ||BA||_inf
