"""Mixed-adapter batches are exact against PEFT, whatever the cache pressure."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.errors import AdapterExistsError, AdapterNotFoundError
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, make_adapter, one_thread

NEW = 8
ADAPTER_SPECS = {  # name -> make_adapter kwargs
    "qv4": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
    "all8": {"r": 8, "target_modules": ALL_TARGETS},
    "mlp16": {"r": 16, "target_modules": ["gate_proj", "up_proj", "down_proj"]},
    "attn64": {"r": 64, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
    "rs8": {"r": 8, "target_modules": ALL_TARGETS, "use_rslora": True, "lora_alpha": 4},
    "pattern": {"r": 4, "target_modules": ALL_TARGETS, "rank_pattern": {"down_proj": 12},
                    "alpha_pattern": {"q_proj": 3}},
    "layer1": {"r": 8, "target_modules": ["k_proj", "o_proj"], "layers_to_transform": [1]},
    "regex": {"r": 6, "target_modules": r".*\.(up_proj|v_proj)"},
}


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(tiny_llama, root / name, seed=i, **kw)
            for i, (name, kw) in enumerate(ADAPTER_SPECS.items())}


def workload(names: list[str], per_adapter: int = 2, seed: int = 0):
    """(adapter or None, prompt) pairs, shuffled; base-model requests included."""
    rng = random.Random(seed)
    items = [(name, [rng.randrange(4, 384) for _ in range(rng.randrange(1, 40))])
             for name in [*names, None] for _ in range(per_adapter)]
    rng.shuffle(items)
    return items


@pytest.fixture(scope="module")
def peft_reference(tiny_llama, adapters):
    """(adapter, prompt) -> PEFT's greedy tokens, each adapter loaded alone."""
    cache: dict[tuple[str | None, tuple[int, ...]], list[int]] = {}

    def ref(adapter: str | None, prompt: list[int]) -> list[int]:
        key = (adapter, tuple(prompt))
        if key not in cache:
            model = AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32)
            if adapter is not None:
                model = PeftModel.from_pretrained(model, adapters[adapter])
            with one_thread():
                ids = model.eval().generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                            min_new_tokens=NEW, do_sample=False,
                                            pad_token_id=0)
            cache[key] = ids[0, len(prompt):].tolist()
        return cache[key]

    return ref


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW)


def assert_clean(engine: LLMEngine) -> None:
    assert engine.block_manager.num_used_blocks == 0
    assert engine.lora.slots_in_use == 0
    assert all(a.active_requests == 0 for a in engine.list_adapters())


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("max_loras, max_cpu_loras", [(8, 8), (3, 4)])
def test_mixed_batch_exact_against_peft(tiny_llama, adapters, peft_reference, max_loras,
                                        max_cpu_loras, kernels, monkeypatch):
    """On the CPU and torch kernel backends (Triton: test_engine_triton.py)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=max_loras,
                       max_cpu_loras=max_cpu_loras, max_lora_rank=64, max_model_len=128,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    items = workload(list(adapters))
    outs = engine.generate([p for _, p in items], greedy(), adapters=[a for a, _ in items])
    for (adapter, prompt), out in zip(items, outs):
        assert out.token_ids == peft_reference(adapter, prompt), adapter
    assert engine.base.kernels.name == kernels
    assert_clean(engine)


def test_staggered_with_swaps_and_reloads(tiny_llama, adapters, peft_reference):
    """2 slots and 3 host entries for 8 adapters: requests queue, slots swap, adapters are
    re-read from disk, and every output is still PEFT's."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_cpu_loras=3,
                       max_lora_rank=64, max_model_len=128, max_num_seqs=6,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    reads = []
    real_read = engine.lora.host._read
    engine.lora.host._read = lambda meta: reads.append(meta.name) or real_read(meta)
    items = workload(list(adapters), seed=1)
    pending, ids, done, step = list(items), [], {}, 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:
            adapter, prompt = pending.pop(0)
            ids.append(engine.add_request(prompt, greedy(), adapter=adapter))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.token_ids
        running = {s.adapter_id for s in engine.scheduler.running if s.adapter_id}
        assert len(running) <= 2
        step += 1
    for (adapter, prompt), rid in zip(items, ids):
        assert done[rid] == peft_reference(adapter, prompt), adapter
    assert reads, "no adapter was re-read from disk"
    assert_clean(engine)


def test_cache_eviction_order_and_pins(tiny_llama, adapters):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_cpu_loras=2,
                       max_lora_rank=64, max_model_len=128)
    engine.add_adapter("a", adapters["qv4"], pin=True)
    engine.add_adapter("b", adapters["all8"])
    engine.add_adapter("c", adapters["mlp16"])
    states = {a.name: a.state for a in engine.list_adapters()}
    assert states == {"a": "ON_DISK", "b": "ON_DISK", "c": "ON_DISK"}  # registered: metadata
    for name in ("a", "c"):
        engine.generate([[5, 6]], greedy(), adapters=[name])
    states = {a.name: a.state for a in engine.list_adapters()}
    assert states["a"] == "ON_DEVICE" and states["c"] == "ON_DEVICE"
    out = engine.generate([[5, 6]], greedy(), adapters=["b"])[0]  # reload b; evicts c, not a
    assert len(out.token_ids) == NEW
    states = {a.name: a.state for a in engine.list_adapters()}
    assert states["a"] == "ON_DEVICE" and states["b"] == "ON_DEVICE" and states["c"] != "ON_DEVICE"
    assert_clean(engine)


def test_engine_waits_for_a_slow_read_instead_of_spinning(tiny_llama, adapters):
    """While every request waits on an adapter read, step() blocks briefly on the loader
    instead of returning at once: a spinning engine thread holds the GIL and starves the
    loader thread (reads took seconds under serving load before this)."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_cpu_loras=1,
                       max_lora_rank=64, max_model_len=128)
    engine.add_adapter("a", adapters["qv4"])
    engine.add_adapter("b", adapters["all8"])
    read = engine.lora.host._read

    def slow_read(meta):
        time.sleep(0.5)
        return read(meta)

    engine.lora.host._read = slow_read
    engine.add_request([5, 6], greedy(), adapter="a")
    steps, start = 0, time.monotonic()
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    assert time.monotonic() - start >= 0.5
    assert steps < 100 + NEW, f"{steps} steps: the engine spun while the adapter was read"
    assert_clean(engine)


def test_in_use_slot_is_never_evicted(tiny_llama, adapters):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_cpu_loras=2,
                       max_lora_rank=64, max_model_len=128)
    engine.add_adapter("a", adapters["qv4"])
    engine.add_adapter("b", adapters["all8"])
    long = engine.add_request([5, 6], SamplingParams(temperature=0, max_new_tokens=20,
                                                     ignore_eos=True), adapter="a")
    short = engine.add_request([7, 8], greedy(), adapter="b")
    spans: dict[str, list[int]] = {}  # request id -> steps it ran in
    step = 0
    while engine.has_unfinished_requests():
        running = [s.adapter_name for s in engine.scheduler.running]
        assert not ("a" in running and "b" in running)
        engine.step()
        step += 1
        for s in engine.scheduler.running:
            spans.setdefault(s.request_id, []).append(step)
    first, second = sorted((long, short), key=lambda r: spans[r][0])  # whose read landed first
    assert spans[first][-1] < spans[second][0]  # it kept its slot until it was done
    assert_clean(engine)


def test_replace_never_serves_stale_weights_or_kv(tiny_llama, adapters, peft_reference):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_lora_rank=64,
                       max_model_len=128)
    prompt = list(range(10, 50))  # long enough to fill prefix-cache blocks
    engine.add_adapter("x", adapters["qv4"])
    first = engine.generate([prompt], greedy(), adapters=["x"])[0]
    assert first.token_ids == peft_reference("qv4", prompt)
    with pytest.raises(AdapterExistsError):
        engine.add_adapter("x", adapters["all8"])
    engine.add_adapter("x", adapters["all8"], replace=True)
    second = engine.generate([prompt], greedy(), adapters=["x"])[0]
    assert second.num_cached_tokens == 0  # a new adapter id never reuses the old KV
    assert second.token_ids == peft_reference("all8", prompt)
    assert_clean(engine)


def test_unload_lets_in_flight_finish(tiny_llama, adapters, peft_reference):
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=64, max_model_len=128)
    engine.add_adapter("x", adapters["all8"])
    prompt = [5, 6, 7]
    rid = engine.add_request(prompt, greedy(), adapter="x")
    engine.step()
    engine.remove_adapter("x")
    with pytest.raises(AdapterNotFoundError):
        engine.add_request(prompt, greedy(), adapter="x")
    outs = {}
    while engine.has_unfinished_requests():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert outs[rid].token_ids == peft_reference("all8", prompt)
    assert engine.list_adapters() == [] and not engine.lora.by_id
    assert engine.lora.resident_count == 0 and engine.lora.pool.used_units == 0
    assert_clean(engine)


def test_adapter_broken_on_disk_fails_only_its_requests(tiny_llama, adapters, tmp_path):
    import shutil

    copy = shutil.copytree(adapters["qv4"], tmp_path / "fragile")
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_cpu_loras=1,
                       max_lora_rank=64, max_model_len=128)
    engine.add_adapter("fragile", copy)
    engine.add_adapter("other", adapters["all8"])  # pushes "fragile" back to disk
    (copy / "adapter_model.safetensors").write_bytes(b"garbage")
    outs = engine.generate([[5, 6], [5, 6]], greedy(), adapters=["fragile", "other"])
    assert outs[0].finish_reason == "error" and "fragile" in (outs[0].error or "")
    assert outs[1].finish_reason == "length"
    assert_clean(engine)


@pytest.mark.parametrize("hot_load", [False, True])
def test_host_copies_are_held_in_the_pool_dtype(tiny_llama, adapters, hot_load):
    """A bfloat16 engine reads adapters into host memory in bfloat16 (half the bytes, as
    ListAdapters' size_bytes says), and the rows it puts on the device are the bits that
    copying the float32 read into the pool gives."""
    from loraplex.lora.peft_format import read_peft_adapter

    engine = LLMEngine(model=tiny_llama, dtype="bfloat16", max_lora_rank=64, max_model_len=128)
    path = adapters["pattern"]
    if hot_load:  # LoadAdapter's path: read and checked first, then registered
        engine.add_adapter("p", path, weights=engine.read_adapter(path, "p"))
    else:  # --lora-modules' path: registered from its header, read on first use
        engine.add_adapter("p", path)
    rid = engine.add_request([5, 6, 7], greedy(), adapter="p")
    while engine.has_unfinished_requests():
        engine.step()
    full = read_peft_adapter(path, engine.base_shapes, 64)
    held = engine.lora.host.weights(engine.lora.names["p"])
    assert engine.lora_dtype == torch.bfloat16 and held.meta.dtype == torch.bfloat16
    [info] = engine.list_adapters()
    assert info.size_bytes * 2 == full.size_bytes
    assert info.size_bytes == sum(a.nbytes + b.nbytes for a, b in held.layers.values())
    slot = engine.lora.slot_of(engine.lora.names["p"].adapter_id)
    pooled = 0
    for (idx, _), layer in engine.slot_buffers.layers.items():
        for i, name in enumerate(layer.slices):
            if (idx, name) not in full.layers:
                continue
            a, b = full.layers[(idx, name)]
            r = a.shape[0]
            assert int(layer.ranks[i, slot]) == r
            assert torch.equal(layer.lora_a[i][slot, :r], a.to(torch.bfloat16))
            assert torch.equal(layer.lora_b[i][slot, :, :r], b.to(torch.bfloat16))
            pooled += 1
    assert pooled == len(full.layers) and rid
    assert_clean(engine)


def test_the_base_model_has_one_set_of_names(tiny_llama, adapters, peft_reference):
    """``names_base_model`` is the engine's rule and the servers' (server/state.py):
    empty, the served model name, and ``model_name`` (the --model argument here) all run
    the base model, and none of them can name an adapter."""
    from loraplex.engine.base_model_names import names_base_model
    from loraplex.errors import InvalidRequestError

    engine = LLMEngine(model=tiny_llama, dtype="float32", max_model_len=128)
    assert engine.model_name == str(tiny_llama)
    prompt = [5, 6, 7]
    for name in (None, "", engine.model_name):
        out = engine.generate([prompt], greedy(), adapters=[name])[0]
        assert out.token_ids == peft_reference(None, prompt) and out.adapter_version is None
        with pytest.raises(InvalidRequestError, match="base model"):
            engine.add_adapter(name, adapters["qv4"])  # type: ignore[arg-type]
    assert names_base_model("alias", "alias", "m") and not names_base_model("x", "alias", "m")
    assert_clean(engine)
