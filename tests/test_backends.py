"""Every kernel backend available here (torch; cpu where the C++ kernels build; triton
under TRITON_INTERPRET=1 on CPU) behind the one KernelBackend interface: the same LoRA
delta as the torch backend's, each over its own pools (``lora_pool``: its rank unit and B
layout) and segments; and the choice of backend by ``LORAPLEX_KERNELS``."""

from __future__ import annotations

import os

import pytest
import torch
from loraplex.kernel_backends import backend_class, backend_name, select_backend
from loraplex.kernel_backends.cpu import CPUBackend
from loraplex.kernel_backends.cpu.cpu_lora_segments import CPULoRASegments
from loraplex.kernel_backends.torch import TorchBackend
from loraplex.kernel_backends.triton import TritonBackend

from tests.kernel_fixtures import make_lora_pools, step_segments

CPU = torch.device("cpu")
ADAPTERS = [3, -1, 0, 2, 3, 1, -1, 0, 4, 2, 3, 0, 5]  # unsorted, no adapter (-1) mixed in
ADAPTER_RANKS = [[8, 1, 16, 5, 0, 13], [16, 8, 0, 1, 4, 3]]  # [slice][adapter], rank 0 too
OUTS = [48, 24]


def _delta(name: str, dtype: torch.dtype) -> torch.Tensor:
    """The delta (over ones) of the adapters packed back to back in the backend's own
    pools, from unit 40 on with a free unit after each: sparse slot ids."""
    backend = select_backend(CPU, dtype, name)
    assert backend.name == name
    pools = make_lora_pools(64, OUTS, ADAPTER_RANKS, 16, dtype, seed=5, backend=backend,
                            first_unit=40, gap_units=1)
    slots = pools.token_slots(ADAPTERS)
    x = torch.randn(len(slots), 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    seg = step_segments(backend, slots)
    assert isinstance(seg, CPULoRASegments) == (name == "cpu")
    out = torch.ones(len(slots), sum(OUTS), dtype=dtype)
    backend.add_lora(out, x, pools.lora_a, pools.lora_b, pools.ranks, seg)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["torch", "cpu", pytest.param("triton", marks=[
    pytest.mark.triton, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                           reason="Triton on CPU tensors needs the interpreter")])])
def test_every_backend_gives_the_torch_backends_add_lora(name: str,
                                                         dtype: torch.dtype) -> None:
    want = _delta("torch", dtype)
    got = _delta(name, dtype)
    tol = {"rtol": 1e-4, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2,
                                                                       "atol": 2e-2}
    torch.testing.assert_close(got, want, **tol)
    assert (got[[1, 6]] == 1).all()  # slot -1 untouched
    if dtype == torch.float32:  # and the torch backend's is the adapters' own formula
        pools = make_lora_pools(64, OUTS, ADAPTER_RANKS, 16, dtype, seed=5)
        x = torch.randn(len(ADAPTERS), 64, generator=torch.Generator().manual_seed(6))
        torch.testing.assert_close(want, 1 + pools.oracle(x, pools.token_slots(ADAPTERS)),
                                   **tol)


@pytest.mark.parametrize(("name", "unit", "r_major"), [("torch", 1, False), ("cpu", 1, True),
                                                       ("triton", 8, True)])
def test_lora_pool_views_overlap_by_the_rank_unit(name: str, unit: int, r_major: bool) -> None:
    """Slot s is unit s: A[s, j] is pool row s · unit + j, B[s, :, j] its column, so a slot's
    rows past its rank are the next slot's; the pools' zero tail keeps the last view in
    bounds. Triton's unit of 8 rows keeps every slot's rows 16-byte aligned in bf16."""
    cls = backend_class(name)
    assert cls.rank_unit == unit and cls.r_major_b == r_major
    backend = cls(CPU, torch.bfloat16)
    a, b = backend.lora_pool(6, 16, 40, 24)
    assert a.shape == (6, 16, 40) and b.shape == (6, 24, 16)
    assert a.stride() == (unit * 40, 40, 1)
    rows = 6 * unit + 16 - unit
    assert b.stride() == ((unit * 24, 1, 24) if r_major else (unit, rows, 1))
    assert a.untyped_storage().nbytes() == rows * 40 * 2
    assert b.untyped_storage().nbytes() == rows * 24 * 2
    a[2, :unit] = 1.0
    b[2, :, :unit] = 2.0
    assert (a[1, unit : 2 * unit] == 1).all() and (b[1, :, unit : 2 * unit] == 2).all()
    assert not a[5, unit:].any() and not b[5, :, unit:].any()  # the zero tail
    if name == "triton":  # bf16 vector loads: every slot starts 16 bytes aligned
        assert all(t[s].data_ptr() % 16 == 0 for t in (a, b) for s in range(6))


@pytest.mark.parametrize(("env", "cls"), [("triton", TritonBackend), ("torch", TorchBackend),
                                          ("cpu", CPUBackend), ("TORCH", TorchBackend)])
def test_loraplex_kernels_picks_the_backend(monkeypatch: pytest.MonkeyPatch, env: str,
                                            cls: type) -> None:
    monkeypatch.setenv("LORAPLEX_KERNELS", env)
    assert backend_name(CPU) == env.lower()
    assert backend_class(env.lower()) is cls
    backend = select_backend(CPU, torch.float32)
    assert type(backend) is cls and backend.dtype == torch.float32


def test_default_backends(monkeypatch: pytest.MonkeyPatch) -> None:
    """Unset: triton on CUDA, cpu on CPU where the kernels build, torch where they don't."""
    monkeypatch.delenv("LORAPLEX_KERNELS", raising=False)
    assert backend_name(torch.device("cuda")) == "triton"
    assert backend_name(CPU) == "cpu"
    monkeypatch.setenv("LORAPLEX_CPU_KERNEL", "0")
    assert backend_name(CPU) == "torch"


def test_cpu_backend_refuses_other_devices() -> None:
    with pytest.raises(ValueError, match="CPU tensors only"):
        CPUBackend(torch.device("cuda"), torch.float32)


def test_bad_backend_name_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORAPLEX_KERNELS", "cuda")
    with pytest.raises(ValueError,
                       match=r"LORAPLEX_KERNELS='cuda'; allowed: triton, cpu, torch, or unset"):
        select_backend(CPU, torch.float32)


def test_no_cpu_only_code_receives_a_cuda_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """CUDA devices get the Triton backend by default; the CPU backend refuses any other
    device when it is built (never per call), and the torch backend, which serves
    LORAPLEX_KERNELS=torch on CUDA too, reaches no CPU-only code (tests/test_layering.py)."""
    monkeypatch.delenv("LORAPLEX_KERNELS", raising=False)
    assert backend_name(torch.device("cuda")) == "triton"
    with pytest.raises(ValueError, match="CPU tensors only"):
        select_backend(torch.device("cuda"), torch.float32, "cpu")
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    assert backend_name(torch.device("cuda")) == "torch"
