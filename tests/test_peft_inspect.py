"""inspect_peft_adapter: an adapter's metadata from its config and safetensors header alone
(refusals: test_peft_refusals.py, which checks inspect and read refuse alike); the parse
cache (lora/peft_files.py); read_peft_adapter given that metadata; the one-read load of
lora/tensor_layout.py across dtypes."""

from __future__ import annotations

import dataclasses
import json
import shutil
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loraplex.lora.base_shapes import BaseShapes
from loraplex.lora.peft_checks import parse_name
from loraplex.lora.peft_files import PARSED, config_key, header_key
from loraplex.lora.peft_format import (
    AdapterError,
    AdapterMeta,
    inspect_peft_adapter,
    read_peft_adapter,
)
from safetensors.torch import load_file

from tests.adapter_dirs import Q0, V1, edit_config, edit_tensors, shapes_of
from tests.test_peft_format import PARITY_CASES

WEIGHTS = "adapter_model.safetensors"


def _public(meta: AdapterMeta) -> dict:
    return {f.name: getattr(meta, f.name) for f in dataclasses.fields(meta) if f.compare}


@pytest.mark.parametrize("case", list(PARITY_CASES))
def test_inspect_describes_what_read_loads(tiny_models: Callable[[str], Path],
                                           adapter_factory: Callable[..., Path],
                                           case: str) -> None:
    base_dir = tiny_models("llama")
    adapter = adapter_factory(base_dir, case, **PARITY_CASES[case])
    meta = inspect_peft_adapter(adapter, shapes_of(base_dir), max_lora_rank=16, name="x")
    w = read_peft_adapter(adapter, shapes_of(base_dir), max_lora_rank=16, name="x")
    assert _public(w.meta) == _public(meta)
    assert (meta.name, meta.path, meta.dtypes) == ("x", adapter, ("F32",))
    assert meta.ranks == {pair: a.shape[0] for pair, (a, _) in w.layers.items()}
    assert all(b.shape[1] == meta.ranks[pair] for pair, (_, b) in w.layers.items())
    assert meta.rank == max(meta.ranks.values()) and meta.target_modules == w.target_modules
    assert meta.size_bytes == sum(a.nbytes + b.nbytes for a, b in w.layers.values())
    assert meta.file_bytes == (adapter / WEIGHTS).stat().st_size
    with pytest.raises(dataclasses.FrozenInstanceError):
        meta.rank = 1  # type: ignore[misc]


def _write_data(ad: Path, fill: bytes) -> None:
    """Overwrite every byte of the data section, keeping the header as it is."""
    path = ad / WEIGHTS
    data_start = 8 + int.from_bytes(path.read_bytes()[:8], "little")
    with path.open("r+b") as f:
        f.seek(data_start)
        f.write(fill * (path.stat().st_size - data_start))


def test_inspect_reads_no_tensor_data(ad: Path, llama: BaseShapes) -> None:
    """Data bytes of all 0xFF (NaN in every float dtype) under an intact header: inspecting
    passes and describes the adapter as before; reading refuses it."""
    before = inspect_peft_adapter(ad, llama, 8)
    _write_data(ad, b"\xff")
    PARSED.clear()
    assert _public(inspect_peft_adapter(ad, llama, 8)) == _public(before)
    with pytest.raises(AdapterError, match="holds NaN or Inf"):
        read_peft_adapter(ad, llama, 8)


def test_parse_cache_hits_until_a_file_changes(ad: Path, llama: BaseShapes) -> None:
    edit_config(ad)  # written as edit_config writes (PEFT indents)
    PARSED.clear()
    inspect_peft_adapter(ad, llama, 8)
    assert (PARSED.hits, PARSED.misses) == (0, 2)  # adapter_config.json, the header
    w = read_peft_adapter(ad, llama, 8)  # registration, then the loader: parsed once
    assert (PARSED.hits, PARSED.misses) == (2, 2)
    # same size, rewritten at once (mtimes tick in jiffies): the content key sees it
    edit_config(ad, lora_alpha=32)
    assert config_key(ad / "adapter_config.json")[1] == w.meta.config[1]
    assert read_peft_adapter(ad, llama, 8).lora_alpha == 32
    assert (PARSED.hits, PARSED.misses) == (3, 3)  # the config again, the header as it was
    edit_tensors(ad, lambda t: [t.pop(f"{V1}.lora_{x}.weight") for x in "AB"])  # a new header
    assert (1, "v_proj") not in inspect_peft_adapter(ad, llama, 8).ranks
    assert (PARSED.hits, PARSED.misses) == (4, 4)


def test_new_values_under_the_same_header_are_read(ad: Path, llama: BaseShapes) -> None:
    edit_tensors(ad, lambda t: None)  # saved as edit_tensors saves (PEFT adds metadata)
    first = read_peft_adapter(ad, llama, 8)
    key = header_key(ad / WEIGHTS)
    edit_tensors(ad, lambda t: t[f"{Q0}.lora_A.weight"].fill_(0.25))
    assert header_key(ad / WEIGHTS) == key  # a cache hit, rightly: the header is the same
    again = read_peft_adapter(ad, llama, 8, meta=first.meta)
    assert torch.all(again.layers[(0, "q_proj")][0] == 0.25)
    assert not torch.equal(first.layers[(0, "q_proj")][0], again.layers[(0, "q_proj")][0])


def test_read_takes_meta_while_the_files_are_unchanged(ad: Path, llama: BaseShapes) -> None:
    meta = inspect_peft_adapter(ad, llama, 8, name="x")
    assert read_peft_adapter(ad, llama, 8, meta=meta).meta is meta
    assert read_peft_adapter(ad, llama, 8, name="y", meta=meta).name == "y"
    expected = read_peft_adapter(ad, llama, 8).layers
    edit_config(ad, lora_alpha=4)  # scaling 16/8 -> 4/8: a changed config is inspected again
    w = read_peft_adapter(ad, llama, 8, meta=meta)
    assert (w.name, w.lora_alpha) == ("x", 4)
    torch.testing.assert_close(w.layers[(0, "q_proj")][1], expected[(0, "q_proj")][1] / 4)


def test_read_sees_weights_replaced_after_inspect(ad: Path, llama: BaseShapes) -> None:
    """Only the header changed (rank 4 tensors; the config still says 8): read inspects again."""
    meta = inspect_peft_adapter(ad, llama, 8)
    edit_tensors(ad, lambda t: t.update({k: (v[:4] if ".lora_A." in k else v[:, :4]).contiguous()
                                         for k, v in t.items()}))
    with pytest.raises(AdapterError, match=r"has shape \[4, 64\], expected \[8, 64\]"):
        read_peft_adapter(ad, llama, 8, meta=meta)


@pytest.mark.parametrize(("a_dtype", "b_dtype"), [
    (torch.bfloat16, torch.bfloat16), (torch.float16, torch.bfloat16),
    (torch.float64, torch.float32)])
def test_reads_every_float_dtype_as_float32(ad: Path, llama: BaseShapes, a_dtype: torch.dtype,
                                            b_dtype: torch.dtype) -> None:
    """One dtype (one conversion) or A and B in different ones (tensor by tensor): float32
    A, scaled B, equal to converting each stored tensor."""
    names = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32",
             torch.float64: "F64"}
    edit_tensors(ad, lambda t: t.update({k: v.to(a_dtype if ".lora_A." in k else b_dtype)
                                         for k, v in t.items()}))
    stored = load_file(ad / WEIGHTS)
    scale = json.loads((ad / "adapter_config.json").read_text())["lora_alpha"] / 8
    w = read_peft_adapter(ad, llama, 8)
    assert w.meta.dtypes == tuple(sorted({names[a_dtype], names[b_dtype]}))
    for (layer, module), (a, b) in w.layers.items():
        key = f"base_model.model.model.layers.{layer}.self_attn.{module}"
        assert a.dtype == b.dtype == torch.float32 and a.is_contiguous() and b.is_contiguous()
        assert torch.equal(a, stored[f"{key}.lora_A.weight"].float())
        assert torch.equal(b, stored[f"{key}.lora_B.weight"].float() * scale)


def test_huge_finite_values_are_read(ad: Path, llama: BaseShapes) -> None:
    """Finite values whose sum overflows to Inf: the layout's one-sum check looks closer,
    finds none, and reads them; the adapter is then refused by the overflow bound
    (lora/weight_bounds.py: x @ A^T would overflow), not as NaN or Inf."""
    edit_tensors(ad, lambda t: t[f"{Q0}.lora_A.weight"].fill_(3e38))
    meta = inspect_peft_adapter(ad, llama, 8)
    layers = meta.layout.load(meta.files, dict, meta.dtype)
    assert torch.all(layers[(0, "q_proj")][0] == 3e38)
    with pytest.raises(AdapterError, match="q_proj.lora_A has a row whose absolute values"):
        read_peft_adapter(ad, llama, 8)


def test_threads_inspect_and_read_at_once(good: Path, llama: BaseShapes, tmp_path: Path) -> None:
    """Eight threads through a cache smaller than the files they read: the results of one."""
    dirs = [Path(shutil.copytree(good, tmp_path / f"a{i}")) for i in range(4)]
    for i, d in enumerate(dirs):
        edit_config(d, lora_alpha=8 * (i + 1))
    expected = {d: read_peft_adapter(d, llama, 8).layers for d in dirs}
    failures: list[BaseException] = []

    def work(k: int) -> None:
        try:
            for i in range(12):
                d = dirs[(k + i) % len(dirs)]
                meta = inspect_peft_adapter(d, llama, 8)
                layers = read_peft_adapter(d, llama, 8, meta=meta if i % 2 else None).layers
                assert all(torch.equal(layers[p][1], expected[d][p][1]) for p in layers)
        except BaseException as exc:  # noqa: BLE001  # reported below
            failures.append(exc)

    maxsize, PARSED.maxsize = PARSED.maxsize, 3
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        PARSED.maxsize = maxsize
    assert not failures, failures[0]


@pytest.mark.parametrize(("name", "parsed"), [
    ("base_model.model.model.layers.3.mlp.up_proj.lora_B.weight", (3, "up_proj", "B", None)),
    ("model.layers.0.self_attn.q_proj.lora_A.default.weight", (0, "q_proj", "A", "default")),
    ("layers.1.self_attn.qkv_proj.lora_A.weight", (1, "qkv_proj", "A", None)),
    ("a.layers.0.layers.2.self_attn.o_proj.lora_B.x.weight", (2, "o_proj", "B", "x")),
])
def test_parse_name(name: str, parsed: tuple) -> None:
    assert parse_name(name, Path("w")) == parsed


@pytest.mark.parametrize(("name", "fragment"), [
    ("x.lora_y.layers.0.self_attn.q_proj.lora_A.weight", "adapts 'x'"),
    ("model.layers.0.mlp.q_proj.lora_A.weight", "is not under layers.<i>.self_attn.q_proj"),
    ("model.layers.0.self_attn.q_proj.lora_A.a.b.weight", "is not a lora_A / lora_B weight"),
    ("model.layers.0.self_attn.q_proj.lora_C.weight", "is not a lora_A / lora_B weight"),
])
def test_parse_name_refuses(name: str, fragment: str) -> None:
    with pytest.raises(AdapterError, match=fragment):
        parse_name(name, Path("w"))
