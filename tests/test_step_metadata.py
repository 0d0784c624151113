"""The step metadata (kernel_backends/step_metadata.py) is allocated once per engine and refilled in
place: every tensor the layers read keeps its address over steps of different batch sizes
(prefill, mixed, decode, a batch growing and shrinking), on every backend; and a refill
leaves nothing of a larger earlier step behind (each backend's LoRA segments after a
refill equal freshly built ones)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.kernel_backends import select_backend
from loraplex.kernel_backends.lora_segments import LoRASegments
from loraplex.kernel_backends.step_metadata import StepMetadata

from tests.conftest import ALL_TARGETS, make_adapter
from tests.kernel_fixtures import step_segments

CPU = torch.device("cpu")
TRITON = pytest.param("triton", marks=[
    pytest.mark.triton, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                           reason="Triton on CPU tensors needs the interpreter")])
BACKENDS = ["torch", "cpu", TRITON]


def _tensors(obj: Any) -> dict[str, torch.Tensor]:
    """The public tensor fields of ``obj`` (what the layers and kernels read)."""
    return {k: v for k, v in vars(obj).items()
            if isinstance(v, torch.Tensor) and not k.startswith("_")}


def _addresses(meta: StepMetadata) -> dict[str, tuple[int, int]]:
    """(storage address, view address) of every tensor of the step metadata (data_ptr()
    reads 0 for an empty view; the storage offset does not)."""
    fields = {**_tensors(meta), **{f"attn.{k}": v for k, v in _tensors(meta.attn).items()},
              **{f"lora.{k}": v for k, v in _tensors(meta.lora).items()}}
    return {k: (v.untyped_storage().data_ptr(),
                v.untyped_storage().data_ptr() + v.storage_offset() * v.element_size())
            for k, v in fields.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_step_metadata_keeps_its_addresses(monkeypatch: pytest.MonkeyPatch, tiny_llama: Path,
                                           tmp_path: Path, backend: str) -> None:
    monkeypatch.setenv("LORAPLEX_KERNELS", backend)
    adapter = make_adapter(tiny_llama, tmp_path / "all", r=8, target_modules=ALL_TARGETS)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=8, max_model_len=64,
                       max_num_batched_tokens=16, lora_modules={"all": str(adapter)})
    runner = engine.runner
    meta = runner.meta
    start = _addresses(meta)
    assert {"input_ids", "positions", "attn.slot_mapping", "attn.decode_block_tables",
            "lora.token_indices", "lora.seg_starts", "lora.seg_slots"} <= set(start)
    seen: list[tuple[int, int, int]] = []  # (tokens, prefill sequences, decode sequences)
    prepare = runner.prepare

    def checked_prepare(*args: Any) -> Any:
        inputs = prepare(*args)
        assert runner.meta is meta
        now, attn = _addresses(meta), meta.attn
        p, row = attn.prefill_context_lens.shape[0], attn.decode_block_tables.stride(0) * 4
        for name, (storage, view) in now.items():
            assert storage == start[name][0], name
            offset = p * (row if name == "attn.decode_block_tables" else 4) \
                if name.startswith("attn.decode_") else 0  # decode rows follow prefill rows
            assert view == storage + offset, name
        seen.append((meta.input_ids.shape[0], p, attn.decode_context_lens.shape[0]))
        return inputs

    runner.prepare = checked_prepare
    for i, (prompt, name, new) in enumerate((([5, 6, 7], "all", 6), ([8, 9], None, 3),
                                             (list(range(10, 30)), "all", 4))):
        engine.add_request(prompt, SamplingParams(temperature=0.0, max_new_tokens=new,
                                                  ignore_eos=True), adapter=name)
        engine.step()
        engine.step()
    while engine.has_unfinished_requests():
        engine.step()
    assert len({t for t, _, _ in seen}) >= 4, seen  # batches of many sizes
    assert any(p and d for _, p, d in seen) and any(p == 0 for _, p, _ in seen), seen


SLOT_SEQUENCES = [
    [3, -1, 0, 2, 3, 1, -1, 0, 4, 2, 3, 0, 5] * 3,  # big first: a later step leaves less
    [7],
    [-1, -1],
    [4000, 7, -1, 4000, 7],
    [0, 0, 1, 1, 1, 3],
    [],
    list(range(20)),
]


@pytest.mark.parametrize("backend", BACKENDS)
def test_refilled_segments_equal_fresh_ones(backend: str) -> None:
    kernels = select_backend(CPU, torch.float32, backend)
    seg = kernels.lora_segments(64, 32)
    first = {k: v.untyped_storage().data_ptr() for k, v in _tensors(seg).items()}
    for slots in SLOT_SEQUENCES:
        seg.fill(slots)
        fresh = step_segments(kernels, slots)
        assert type(seg) is type(fresh)
        assert _fields(seg) == _fields(fresh), slots
        assert {k: v.untyped_storage().data_ptr() for k, v in _tensors(seg).items()} == first
        assert all(v.storage_offset() == 0 for v in _tensors(seg).values())


def _fields(seg: LoRASegments) -> dict[str, Any]:
    """Every public field, tensors as lists (route_memo: emptied by every fill)."""
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v
            for k, v in vars(seg).items() if not k.startswith("_")
            and k not in ("max_tokens", "max_segments")}


def test_a_step_larger_than_the_metadata_is_refused() -> None:
    seg = select_backend(CPU, torch.float32, "torch").lora_segments(4, 2)
    with pytest.raises(ValueError, match="hold 4 tokens and 2 segments"):
        seg.fill([0, 1, 2])
    with pytest.raises(ValueError, match="hold 4 tokens"):
        seg.fill([0] * 5)
