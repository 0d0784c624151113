"""Adapters for training loops, in the engine: in-place versions (numbers, in-flight
requests on their own version, rows reused, no stale prefix KV), adapters given as tensors
(the same checks as a directory), and the prefix cache's reset. Exact against PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.errors import AdapterExistsError, AdapterNotFoundError
from loraplex.lora.peft_checks import AdapterError
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, make_adapter, make_tiny_model, one_thread

NEW = 6
PROMPT = list(range(10, 50))  # fills prefix-cache blocks (block size 16)


@pytest.fixture(scope="module")
def versions(tiny_llama: Path, tmp_path_factory) -> list[Path]:
    """Three versions of one rank-8 all-linear adapter (same shape, other weights)."""
    root = tmp_path_factory.mktemp("versions")
    return [make_adapter(tiny_llama, root / f"v{i}", r=8, target_modules=ALL_TARGETS, seed=i)
            for i in range(3)]


@pytest.fixture(scope="module")
def reference(tiny_llama: Path):
    cache: dict = {}

    def ref(adapter: Path, prompt: list[int]) -> list[int]:
        key = (str(adapter), tuple(prompt))
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
            model = PeftModel.from_pretrained(model, adapter).eval()
            with one_thread():
                ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                     min_new_tokens=NEW, do_sample=False, pad_token_id=0)
            cache[key] = ids[0, len(prompt):].tolist()
        return cache[key]

    return ref


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW)


def engine_for(model: Path, **kw) -> LLMEngine:
    return LLMEngine(model=model, dtype="float32", max_lora_rank=16, max_model_len=128, **kw)


def run_all(engine: LLMEngine) -> dict:
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    return outs


def assert_clean(engine: LLMEngine, adapters: int = 1) -> None:
    """No KV block held, one run per registered adapter at most, nothing retired kept."""
    assert engine.block_manager.num_used_blocks == 0
    assert engine.lora.slots_in_use == 0
    assert len(engine.lora.by_id) == len(engine.lora.names) == adapters
    assert engine.lora.resident_count <= adapters
    engine.check()


def test_versions_rise_and_in_flight_requests_keep_theirs(tiny_llama, versions, reference):
    engine = engine_for(tiny_llama)
    assert engine.add_adapter("x", versions[0]).version == 1
    old = engine.add_request(PROMPT, greedy(), adapter="x")
    engine.step()  # running on version 1
    with pytest.raises(AdapterExistsError, match="load_inplace"):
        engine.add_adapter("x", versions[1])
    assert engine.add_adapter("x", versions[1], replace=True).version == 2
    new = engine.add_request(PROMPT, greedy(), adapter="x")  # accepted after the load
    outs = run_all(engine)
    assert (outs[old].adapter_version, outs[new].adapter_version) == (1, 2)
    assert outs[old].token_ids == reference(versions[0], PROMPT)
    assert outs[new].token_ids == reference(versions[1], PROMPT)
    assert outs[new].num_cached_tokens == 0  # version 1's blocks are never reused
    engine.remove_adapter("x")
    assert engine.add_adapter("x", versions[2]).version == 3  # never a number twice
    assert [a.version for a in engine.list_adapters()] == [3]
    assert engine.generate([PROMPT], greedy(), adapters=[None])[0].adapter_version is None
    assert_clean(engine)


def test_a_request_built_before_a_load_in_place_runs_on_the_new_load(
        tiny_llama, versions, reference):
    """The server checks a request on its processor thread (its adapter looked up there),
    then hands it to the engine thread: a load in place in between (the old load idle, so dropped at once) moves the
    request to the new load; an unload in between refuses it with NOT_FOUND."""
    engine = engine_for(tiny_llama)
    engine.add_adapter("x", versions[0])
    early = engine.make_sequence(PROMPT, greedy(), adapter="x", request_id="early")
    engine.add_adapter("x", versions[1], replace=True)  # version 1 is dropped here
    engine.add_sequence(early)
    outs = run_all(engine)
    assert outs["early"].adapter_version == 2
    assert outs["early"].token_ids == reference(versions[1], PROMPT)
    late = engine.make_sequence(PROMPT, greedy(), adapter="x", request_id="late")
    engine.remove_adapter("x")
    with pytest.raises(AdapterNotFoundError, match="'x' was unloaded"):
        engine.add_sequence(late)
    assert not engine.has_unfinished_requests()
    assert_clean(engine, adapters=0)


def test_an_idle_replace_of_the_same_shape_reuses_the_rows(tiny_llama, versions, reference):
    engine = engine_for(tiny_llama, max_loras=2)
    engine.add_adapter("other", versions[2])
    engine.add_adapter("x", versions[0])
    engine.generate([PROMPT, PROMPT], greedy(), adapters=["other", "x"])
    slot, used = engine.lora.device.slot(engine.lora.names["x"]), engine.lora.pool.used_units
    ids = {engine.lora.names["x"].adapter_id}
    for v in (versions[1], versions[0], versions[1]):
        info = engine.add_adapter("x", v, replace=True, weights=engine.read_adapter(v, "x"))
        a = engine.lora.names["x"]
        # written in place
        assert engine.lora.device.slot(a) == slot and engine.lora.pool.used_units == used
        ids.add(a.adapter_id)
        out = engine.generate([PROMPT], greedy(), adapters=["x"])[0]
        assert out.token_ids == reference(v, PROMPT) and out.adapter_version == info.version
        assert out.num_cached_tokens == 0  # a new id for every load: no stale prefix KV
    assert len(ids) == 4 and engine.lora.counts["compactions"] == 0
    again = engine.generate([PROMPT], greedy(), adapters=["x"])[0]
    assert again.num_cached_tokens > 0  # the same version does reuse its own blocks
    assert_clean(engine, adapters=2)


def test_a_busy_replace_holds_two_copies_only_until_the_old_requests_end(
        tiny_llama, versions, reference):
    engine = engine_for(tiny_llama, max_loras=1)  # no room for both: the new one waits
    engine.add_adapter("x", versions[0])
    old = engine.add_request(PROMPT, greedy(), adapter="x")
    engine.step()
    engine.add_adapter("x", versions[1], replace=True,
                       weights=engine.read_adapter(versions[1], "x"))
    new = engine.add_request(PROMPT, greedy(), adapter="x")
    outs = run_all(engine)
    assert outs[old].token_ids == reference(versions[0], PROMPT)
    assert outs[new].token_ids == reference(versions[1], PROMPT)
    assert engine.lora.pool.used_units == engine.lora.pool.units_for(8)  # one copy left
    assert_clean(engine)


def peft_state(adapter: Path) -> tuple[dict, dict]:
    return load_file(str(adapter / "adapter_model.safetensors")), \
        json.loads((adapter / "adapter_config.json").read_text())


def test_tensors_in_memory_equal_the_same_adapter_from_disk(tiny_llama, versions, reference):
    engine = engine_for(tiny_llama)
    tensors, config = peft_state(versions[0])
    info = engine.add_adapter("mem", tensors=tensors, config=config)
    assert info.version == 1 and engine.uploads.owns(info.path)
    assert engine.generate([PROMPT], greedy(), adapters=["mem"])[0].token_ids == \
        reference(versions[0], PROMPT)
    from peft import LoraConfig  # a peft LoraConfig object works as well as its dict

    tensors, config = peft_state(versions[1])
    engine.add_adapter("mem", tensors=tensors, config=LoraConfig(**{
        k: v for k, v in config.items() if k in LoraConfig.__dataclass_fields__}), replace=True)
    out = engine.generate([PROMPT], greedy(), adapters=["mem"])[0]
    assert out.token_ids == reference(versions[1], PROMPT) and out.adapter_version == 2
    assert not Path(info.path).exists()  # version 1's upload went with it
    engine.remove_adapter("mem")
    assert list(engine.uploads.root.iterdir()) == []
    assert_clean(engine, adapters=0)


def test_bad_tensors_or_another_base_register_nothing(tiny_llama, versions, tmp_path):
    engine = engine_for(tiny_llama)
    tensors, config = peft_state(versions[0])
    engine.add_adapter("x", tensors=tensors, config=config)
    nan = {k: v.clone() for k, v in tensors.items()}
    next(iter(nan.values()))[0, 0] = float("nan")
    wide = make_tiny_model(tmp_path / "wide", hidden_size=128)
    cases = {
        "NaN or Inf": (nan, config),
        "differs from the served base": (tensors, {**config, "base_model_name_or_path":
                                                   str(wide)}),
        "peft_type": (tensors, {**config, "peft_type": "IA3"}),
        "shape": ({k: torch.zeros(3, 3) for k in tensors}, config),
    }
    for fragment, (t, c) in cases.items():
        with pytest.raises(AdapterError, match=fragment):
            engine.add_adapter("x", tensors=t, config=c, replace=True)
        with pytest.raises(AdapterError, match=fragment):
            engine.add_adapter("y", tensors=t, config=c)
    with pytest.raises(AdapterExistsError):
        engine.add_adapter("x", tensors=tensors, config=config)
    assert [(a.name, a.version) for a in engine.list_adapters()] == [("x", 1)]
    assert len(list(engine.uploads.root.iterdir())) == 1  # only x's own directory
    assert_clean(engine)


def test_reset_prefix_cache(tiny_llama):
    engine = engine_for(tiny_llama)
    engine.generate([PROMPT], greedy())
    assert engine.generate([PROMPT], greedy())[0].num_cached_tokens > 0
    engine.reset_prefix_cache()
    assert engine.generate([PROMPT], greedy())[0].num_cached_tokens == 0
    engine.check()
