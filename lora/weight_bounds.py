"""The load-time bound on what an adapter's weights do once applied: an adapter whose LoRA
delta would overflow the serving dtype is refused before it serves (``check_bounds``, run
by ``peft_format.read_peft_adapter`` on every read: the first load and every re-read after
an eviction).

The rule, per (layer, module), on A [r, in] and scaled B [out, r] as the pool holds them
(in the serving dtype ``dtype``, whose largest value is ``max``):

- every value is finite (a float32 value past float16's range becomes Inf when cast);
- the delta's gain ``g = max_i sum_k |B_ik| * ||A_k||_1`` is at most ``max ** (2/3)``
  (4.9e25 in float32 and bfloat16, 1625 in float16);
- the shrink's gain ``max_k ||A_k||_1`` is at most float32's ``max ** (2/3)`` (4.9e25): every
  backend holds ``h = x @ A^T`` in float32 (bf16 on the CPU's bf16 route: the same range).

Why: for an input row x, ``|h_k| <= ||A_k||_1 * ||x||_inf`` and ``|(B h)_i| <= sum_k
|B_ik| |h_k| <= g * ||x||_inf``: g bounds the induced infinity-norm of ``B @ A`` (the most the
delta multiplies an activation's largest value by). The delta is a product of three
magnitudes, the input, A and B; giving each a third of the dtype's exponent range, every
input whose values are at most ``max ** (1/3)`` (7e12 in float32 and bfloat16, 40 in
float16: activations are of order 1 to 100) gives a finite delta. An even split between
input and gain (sqrt(max)) would allow float16 a gain of only 256, which a large-rank
adapter can reach and still serve well (g is a worst case over the input's signs).
Computing g costs O(r * (in + out)) per module (a row sum of |A|, one matrix-vector product
with |B|), never the out x in product itself. Real adapters are far below it (loraplex's
demo adapters: g <= 17; the tests' random rsLoRA one: 269); one with every weight 1e30, or
A = B = 1e20, is far above it.

The bound is per module: activations the rule does not foresee (a large gain in several
layers compounding) can still overflow at run time; the engine then fails that request
alone, naming the adapter (engine/llm_engine.py).
"""

from __future__ import annotations

import torch

from .peft_checks import AdapterError, module_key

Layers = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]  # -> (A [r, in], B [out, r])

EXPONENT = 2 / 3  # of the dtype's largest value: the gain's share (the module docstring)


def gain_limit(dtype: torch.dtype) -> float:
    """The largest delta gain an adapter served in ``dtype`` may have."""
    return torch.finfo(dtype).max ** EXPONENT


SHRINK_LIMIT = gain_limit(torch.float32)  # h is float32 in every backend


def check_bounds(name: str, layers: Layers, dtype: torch.dtype) -> None:
    """AdapterError (a 400 at load) naming the adapter, the first module that breaks the
    module docstring's rule, and the bound; ``layers`` as read, in ``dtype``."""
    limit = gain_limit(dtype)
    for (layer, module), (a, b) in layers.items():
        # float64: no finite float32 input overflows it, so the numbers reported are real
        shrink = torch.linalg.vector_norm(a, 1, dim=1, dtype=torch.float64)  # [r] ||A_k||_1
        gain = torch.mv(b.abs().to(torch.float64), shrink)  # [out] sum_k |B_ik| ||A_k||_1
        worst_shrink, worst = float(shrink.max()), float(gain.max())
        # ``not <=``: NaN (an Inf times a zero) fails too
        if not (worst_shrink <= SHRINK_LIMIT and worst <= limit):
            raise AdapterError(_message(name, module_key(layer, module), a, b, dtype,
                                        worst_shrink, worst, limit))


def _message(name: str, where: str, a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype,
             shrink: float, gain: float, limit: float) -> str:
    head = f"adapter {name!r}: {where}"
    tail = ("LoRA weights this large overflow on ordinary inputs: retrain or rescale the "
            "adapter")
    for half, t in (("lora_A", a), ("lora_B", b)):
        if not bool(torch.isfinite(t).all()):
            top = torch.finfo(dtype).max
            return (f"{head}.{half} holds values beyond the range of {_dtype(dtype)} (largest "
                    f"{top:.4g}) once scaled and cast to the serving dtype; {tail}")
    if not shrink <= SHRINK_LIMIT:
        return (f"{head}.lora_A has a row whose absolute values sum to {shrink:.3g}, above "
                f"the bound {SHRINK_LIMIT:.3g} (float32's largest value to the power 2/3: "
                f"x @ A^T is float32); {tail}")
    return (f"{head} would overflow {_dtype(dtype)} once applied: its delta can multiply an "
            f"activation by up to {gain:.3g} (the gain max_i sum_k |scaling * B_ik| * "
            f"||A_k||_1), above the bound {limit:.3g} ({_dtype(dtype)}'s largest value to the "
            f"power 2/3); {tail}")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
