"""tests/triton_interpreter.py (installed by conftest.py) changes the interpreter's cost, never
its results: the attention kernels (whose @triton.jit helpers are called per tile) give the
same bits with it and with triton's own interpreter, it patches triton.language once per
launch instead of once per helper call, and every launch still restores the language."""

from __future__ import annotations

import os

import pytest
import torch

from tests.kernel_fixtures import make_paged_cache

pytestmark = [pytest.mark.triton, pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter's shortcut")]


def attention_outputs() -> list[torch.Tensor]:
    """Decode (default and batch-invariant: split, aligned) and prefill of one paged cache."""
    from loraplex.kernel_backends.triton import attention, attention_prefill

    gen = torch.Generator().manual_seed(0)
    lens, d = [70, 23], 16
    k, v, tables = make_paged_cache(lens, 16, 2, d, torch.float32, torch.device("cpu"))
    q = torch.randn(len(lens), 4, d, generator=gen)
    cl = torch.tensor(lens, dtype=torch.int32)
    outs = [attention.paged_attention_decode(q, k, v, tables, cl, d**-0.5,
                                             max_context_len=max(lens), batch_invariant=inv)
            for inv in (False, True)]
    new = 5
    qp = torch.randn(len(lens) * new, 4, d, generator=gen)
    qsl = torch.arange(0, len(lens) * new + 1, new, dtype=torch.int32)
    outs.append(attention_prefill.paged_attention_prefill(qp, k, v, tables, qsl, cl, d**-0.5,
                                                          max_q_len=new))
    return outs


def test_same_bits_with_and_without_the_shortcut() -> None:
    import triton.language as tl
    from triton.runtime import interpreter

    from tests import triton_interpreter

    assert getattr(interpreter._patch_lang, "_skips_nested", False), "conftest installs it"
    triton_interpreter.uninstall()
    real, patches = interpreter._patch_lang, []

    def counted(fn):  # triton's _patch_lang, counting the patches it makes
        patches.append(fn.__name__)
        return real(fn)

    try:
        interpreter._patch_lang = counted
        plain, plain_patches = attention_outputs(), len(patches)
        patches.clear()
        assert triton_interpreter.install()  # over `counted`: counts what it lets through
        fast = attention_outputs()
    finally:
        triton_interpreter.uninstall()
        interpreter._patch_lang = real
        assert triton_interpreter.install()
    assert all(torch.equal(a, b) for a, b in zip(plain, fast, strict=True))
    assert 3 <= len(patches) < plain_patches / 10, (len(patches), plain_patches)
    assert not hasattr(tl.tensor, "__index__")  # every launch restored triton.language
    assert tl.core.is_builtin(tl.load)
