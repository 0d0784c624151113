"""A decode step on the Triton backend does no host work inside the layers: no .item(),
.tolist(), .cpu(), truth test of a tensor, or tensor built from host data, once the step's
metadata is built (what a GPU would pay a sync for, and what CUDA graphs will need)."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest
from loraplex import LLMEngine, SamplingParams
from torch.overrides import TorchFunctionMode

from tests.conftest import ALL_TARGETS, make_adapter

FORBIDDEN = {"item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "tensor",
             "as_tensor", "from_numpy"}


class HostWork(TorchFunctionMode):
    """Records forbidden torch calls made by loraplex code (Triton's interpreter copies
    tensors to the host by design; its own calls are not the engine's)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        caller = sys._getframe(1).f_globals.get("__name__", "")
        if name in FORBIDDEN and not caller.startswith("triton"):
            self.calls.append(f"{name} from {caller}:{sys._getframe(1).f_lineno}")
        return func(*args, **(kwargs or {}))


class ForwardSpy:
    """Runs the model's forward under HostWork when ``watch`` is set."""

    def __init__(self, model: Any) -> None:
        self.model, self.watch, self.mode = model, False, HostWork()

    def __call__(self, *args: Any) -> Any:
        if not self.watch:
            return self.model(*args)
        with self.mode:
            return self.model(*args)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.model, name)


def decode_step_host_work(tiny_llama: Path, tmp_path: Path) -> list[str]:
    """The forbidden calls of one decode step of three sequences (adapter and base mixed)."""
    adapter = make_adapter(tiny_llama, tmp_path / "all", r=8, target_modules=ALL_TARGETS)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=8, max_model_len=64,
                       lora_modules={"all": str(adapter)})
    params = SamplingParams(temperature=0.0, max_new_tokens=6, ignore_eos=True)
    spy = ForwardSpy(engine.runner.model)
    engine.runner.model = spy
    # the adapter's requests first, stepped until admitted (its load onto the device runs on
    # the loader thread: a base request would be admitted ahead of them, and their prefill,
    # the layers' first LoRA call, could land in the watched step); then the base's prefill
    # beside their first decode
    for prompt in ([5, 6, 7], [10, 11, 12, 13]):
        engine.add_request(prompt, params, adapter="all")
    for _ in range(6000):  # ~60 s: a tiny adapter's load takes milliseconds
        engine.step()
        if len(engine.scheduler.running) == 2:
            break
        time.sleep(0.01)
    engine.add_request([8, 9], params)
    engine.step()
    assert len(engine.scheduler.running) == 3 and not engine.scheduler.waiting
    assert all(s.num_computed_tokens == s.num_tokens - 1 for s in engine.scheduler.running)
    spy.watch = True
    engine.step()
    spy.watch = False
    while engine.has_unfinished_requests():
        engine.step()
    return spy.mode.calls


@pytest.mark.triton
def test_decode_step_does_no_host_work(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path,
                                       tmp_path: Path) -> None:
    monkeypatch.setenv("LORAPLEX_KERNELS", "triton")
    assert decode_step_host_work(tiny_llama, tmp_path) == []


def test_the_spy_sees_host_work(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path,
                                tmp_path: Path) -> None:
    """The torch backend, naive on purpose, syncs in its KV store and decode attention."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    calls = decode_step_host_work(tiny_llama, tmp_path)
    assert any("kernel_backends.torch.attention" in c for c in calls), calls
