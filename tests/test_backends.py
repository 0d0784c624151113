"""Every kernel backend available here (torch; cpu where the C++ kernels build; triton
under TRITON_INTERPRET=1 on CPU) behind the one KernelBackend interface: the same LoRA
delta as the torch backend's, each over its own B layout and segments; and the choice of
backend by ``LORAPLEX_KERNELS``."""

from __future__ import annotations

import os

import pytest
import torch
from loraplex.kernels import backend_class, backend_name, select_backend
from loraplex.kernels.cpu import CPUBackend
from loraplex.kernels.cpu.segments import CPULoRASegments
from loraplex.kernels.testing import dense_lora_oracle, make_lora_weights
from loraplex.kernels.torch import TorchBackend
from loraplex.kernels.triton import TritonBackend

CPU = torch.device("cpu")
SLOTS = [3, -1, 0, 2, 3, 1, -1, 0, 4, 2, 3, 0]  # unsorted, slot -1 mixed in
SLOT_RANKS = [[8, 1, 16, 4, 0], [16, 8, 0, 1, 4]]  # [slice][slot]: mixed ranks, rank 0 too
OUTS = [48, 24]


def _delta(name: str, dtype: torch.dtype) -> torch.Tensor:
    backend = select_backend(CPU, dtype, name)
    assert backend.name == name
    lora_a, lora_b, ranks = make_lora_weights(64, OUTS, SLOT_RANKS, 16, dtype, seed=5,
                                              r_major_b=name == "cpu")
    if name == "cpu":  # the backend's own slot layout for B
        assert backend.lora_b_buffer(5, OUTS[0], 16).stride() == lora_b[0].stride()
    x = torch.randn(len(SLOTS), 64, generator=torch.Generator().manual_seed(6)).to(dtype)
    seg = backend.lora_segments(SLOTS)
    assert isinstance(seg, CPULoRASegments) == (name == "cpu")
    out = torch.ones(len(SLOTS), sum(OUTS), dtype=dtype)
    backend.add_lora(out, x, lora_a, lora_b, ranks, seg)
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
    if dtype == torch.float32:  # and the torch backend's is the dense oracle's
        lora_a, lora_b, ranks = make_lora_weights(64, OUTS, SLOT_RANKS, 16, dtype, seed=5)
        x = torch.randn(len(SLOTS), 64, generator=torch.Generator().manual_seed(6))
        torch.testing.assert_close(want, 1 + dense_lora_oracle(x, lora_a, lora_b, ranks,
                                                               SLOTS), **tol)


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
