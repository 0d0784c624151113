"""DoRA (PEFT's ``use_dora=True``), issue 46 item 2: adapters made by PEFT itself (random
non-zero A, B and magnitudes) are greedy-equal to PEFT token for token in float32 and their
logprobs within 2e-3, mixed in one batch with a plain LoRA adapter and the base, on Llama,
Qwen2 and Gemma2 and on the cpu, torch and Triton (interpreted) backends; the DoRA gains
follow their slot through eviction, reload and compaction; refusals name what is wrong."""

from __future__ import annotations

import functools
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.lora.peft_format import AdapterError, inspect_peft_adapter, read_peft_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.adapter_dirs import edit_tensors, shapes_of
from tests.conftest import ALL_TARGETS, greedy_logprobs, make_adapter

NEW = 8
PROMPTS = [[5, 17, 33, 9, 120, 7], [44, 3, 250, 11], [300, 12, 64, 8, 8, 91, 2, 77, 15]]
TRITON = pytest.param("triton", marks=[
    pytest.mark.triton, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                           reason="Triton on CPU tensors needs the interpreter")])


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dora")
    return {"dora": make_adapter(tiny_llama, root / "dora", r=8, target_modules=ALL_TARGETS,
                                 seed=5, scale=0.3, use_dora=True),
            "dora_qv": make_adapter(tiny_llama, root / "dora_qv", r=4, seed=7, scale=0.3,
                                    use_dora=True),
            "plain": make_adapter(tiny_llama, root / "plain", r=8, target_modules=ALL_TARGETS,
                                  seed=6, scale=0.3)}


def peft_run(base: Path, adapter: Path | None, prompt: list[int],
             plain: bool = False) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and their logprobs (``plain``: the DoRA adapter's A and B as
    plain LoRA, its magnitudes ignored, to show they matter); computed once per argument
    set (each kernels parametrization asks the same)."""
    tokens, logprobs = _peft_run(base, adapter, tuple(prompt), plain)
    return list(tokens), list(logprobs)


@functools.cache
def _peft_run(base: Path, adapter: Path | None, prompt: tuple[int, ...],
              plain: bool) -> tuple[tuple[int, ...], tuple[float, ...]]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
        if plain:
            for module in model.modules():
                getattr(module, "lora_variant", {}).clear()  # vanilla LoRA's forward
    tokens, logprobs = greedy_logprobs(model.eval(), list(prompt), NEW)
    return tuple(tokens), tuple(logprobs)


def greedy(scale: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW,
                          lora_scale=scale, logprobs=0)


def check_against_peft(engine: LLMEngine, model: Path, paths: dict[str, Path],
                       names: list[str | None], prompts: list[list[int]]) -> float:
    """Every (adapter, prompt) in one batch equals PEFT; returns how far the DoRA rows'
    logprobs lie from the same A and B served as plain LoRA (inf: other tokens)."""
    items = [(name, prompt) for prompt in prompts for name in names]
    outs = engine.generate([p for _, p in items], [greedy()] * len(items),
                           adapters=[a for a, _ in items])
    dora_matters = 0.0
    for (name, prompt), out in zip(items, outs):
        path = paths[name] if name else None
        tokens, logprobs = peft_run(model, path, prompt)
        assert out.token_ids == tokens, (name, prompt)
        got = [lp.logprob for lp in out.logprobs]
        assert got == pytest.approx(logprobs, abs=2e-3), (name, prompt)
        if name and name.startswith("dora"):
            as_plain = peft_run(model, path, prompt, plain=True)
            dora_matters = max(dora_matters, float("inf") if as_plain[0] != tokens else
                               max(abs(a - b) for a, b in zip(as_plain[1], logprobs)))
    return dora_matters


def test_peft_saves_a_magnitude_per_module_and_it_is_read(tiny_llama, adapters):
    """PEFT's file holds one ``lora_magnitude_vector`` [out] per module; read as float32,
    counted in the adapter's bytes."""
    from safetensors.torch import load_file

    tensors = load_file(adapters["dora"] / "adapter_model.safetensors")
    assert len([k for k in tensors if k.endswith("lora_magnitude_vector")]) == 2 * 7
    base = shapes_of(tiny_llama)
    weights = read_peft_adapter(adapters["dora"], base, max_lora_rank=16,
                                dtype=torch.bfloat16)
    assert weights.meta.use_dora and len(weights.magnitudes) == 2 * 7
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_magnitude_vector"
    assert weights.magnitudes[(1, "up_proj")].dtype == torch.float32
    torch.testing.assert_close(weights.magnitudes[(1, "up_proj")], tensors[key])
    plain = inspect_peft_adapter(adapters["plain"], base, max_lora_rank=16)
    assert not plain.use_dora
    dora = inspect_peft_adapter(adapters["dora"], base, max_lora_rank=16)
    assert dora.size_bytes == plain.size_bytes + 4 * 2 * sum(out for _, out in
                                                             base.modules.values())


@pytest.mark.parametrize("kernels", ["cpu", "torch", TRITON])
def test_dora_mixed_in_one_batch_equals_peft(tiny_llama, adapters, kernels, monkeypatch):
    """Two DoRA adapters (every linear; q/v only), a plain adapter and the base in one
    batch: each row equals PEFT token for token, logprobs within 2e-3; the magnitudes
    change the answer (the same A and B as plain LoRA differ)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=4, max_lora_rank=16,
                       max_model_len=128, lora_modules={n: str(p) for n, p in adapters.items()})
    prompts = PROMPTS if kernels != "triton" else PROMPTS[:1]
    matters = check_against_peft(engine, tiny_llama, adapters,
                                 ["dora", "plain", None, "dora_qv"], prompts)
    assert matters > 0.05, "the magnitudes change nothing: the test cannot see them"


@pytest.mark.parametrize("arch", ["qwen2", "gemma2", "phi3"])
def test_dora_on_other_families_equals_peft(arch, tiny_models, tmp_path):
    """Qwen2 (whose q/k/v have a base bias, which DoRA leaves unscaled), Gemma2 and Phi-3
    (fused qkv_proj / gate_up_proj: one magnitude over the fused rows): a DoRA adapter on
    every linear beside a plain one and the base in one batch equal PEFT."""
    model = tiny_models(arch)
    paths = {"dora": make_adapter(model, tmp_path / "dora", r=8, target_modules="all-linear",
                                  seed=8, scale=0.3, use_dora=True),
             "plain": make_adapter(model, tmp_path / "plain", r=8, target_modules="all-linear",
                                   seed=9, scale=0.3)}
    engine = LLMEngine(model=model, dtype="float32", max_lora_rank=8, max_model_len=128,
                       lora_modules={n: str(p) for n, p in paths.items()})
    matters = check_against_peft(engine, model, paths, ["dora", "plain", None], PROMPTS[2:])
    assert matters > 0.05


def test_dora_survives_eviction_reload_and_a_load_in_place(tiny_llama, adapters):
    """One device slot: DoRA and plain adapters evict each other; each run equals PEFT
    (the gains are written with their adapter and cleared with it); a load in place of the
    plain adapter by a DoRA one serves DoRA, and back."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_lora_rank=16,
                       max_model_len=128, max_cpu_loras=1,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    prompt = PROMPTS[0]

    def run(name: str) -> list[int]:
        return engine.generate([prompt], greedy(), adapters=[name])[0].token_ids

    want = {n: peft_run(tiny_llama, adapters[n], prompt)[0] for n in adapters}
    for name in ("dora", "plain", "dora_qv", "dora", "plain"):
        assert run(name) == want[name], name
    assert engine.lora.device.loads >= 5 and engine.lora.host.loads >= 5
    engine.add_adapter("plain", adapters["dora"], replace=True)
    assert run("plain") == want["dora"]
    engine.add_adapter("plain", adapters["plain"], replace=True)
    assert run("plain") == want["plain"]
    engine.check()


def _dora_reference(base: torch.nn.Linear, weights: dict, magnitudes: dict, x: torch.Tensor,
                    slices: list[tuple[str, int]]) -> torch.Tensor:
    """PEFT's DoraLinearLayer on the rows of a fused linear, slice by slice: the
    magnitude over the row norm of (W + B A) (B scaled), times (W x + B A x), plus bias."""
    outs, offset = [], 0
    for name, size in slices:
        w = base.weight[offset:offset + size]
        a, b = weights[name]
        norm = torch.linalg.norm(w + b @ a, dim=1)
        outs.append((magnitudes[name] / norm) * (x @ w.t() + x @ a.t() @ b.t()))
        offset += size
    out = torch.cat(outs, dim=-1)
    return out if base.bias is None else out + base.bias


@pytest.mark.parametrize("name", ["torch", "cpu", TRITON])
def test_lora_linear_applies_dora_on_every_backend(name: str) -> None:
    """One fused LoRALinear with a base bias, a DoRA adapter, a plain one and base rows,
    at several lora_scales: DoRA rows equal PEFT's formula (scale s: the base plus s times
    DoRA's delta; 0: the base exactly), plain and base rows are untouched; compaction moves
    the gains; clearing the slot ends DoRA."""
    from loraplex.kernel_backends import select_backend
    from loraplex.lora.layers import LoRALinear

    from tests.kernel_fixtures import step_segments

    backend = select_backend(torch.device("cpu"), torch.float32, name)
    g = torch.Generator().manual_seed(3)
    base = torch.nn.Linear(64, 48, bias=True)
    slices = [("q_proj", 32), ("v_proj", 16)]
    layer = LoRALinear(base, ("q_proj", "v_proj"), [32, 16], num_units=64, max_rank=16,
                       backend=backend)
    weights = {slot: {n: (torch.randn(8, 64, generator=g) * 0.3,
                          torch.randn(out, 8, generator=g) * 0.3) for n, out in slices}
               for slot in (16, 32)}
    with torch.no_grad():
        norms = {n: torch.linalg.norm(base.weight[o:o + s], dim=1)
                 for (n, s), o in zip(slices, (0, 32))}
        magnitudes = {n: norms[n] * (1 + 0.3 * torch.randn(norms[n].shape, generator=g))
                      for n in norms}
        layer.set_slot(16, weights[16], magnitudes=magnitudes)
        layer.set_slot(32, weights[32])
        assert set(layer.dora.slots) == {16}
        layer.move_slot(16, 0, 8)
    weights[0] = weights.pop(16)
    assert set(layer.dora.slots) == {0}

    def check(slots: list[int], scales: list[float]) -> None:
        x = torch.randn(len(slots), 64, generator=g)
        seg = step_segments(backend, slots)
        seg.fill(slots, scales)
        layer.step = SimpleNamespace(lora=seg)
        with torch.no_grad():
            got, plain = layer(x), base(x)
            for t, (slot, s) in enumerate(zip(slots, scales)):
                want = plain[t]
                if slot == 0:
                    want = want + s * (_dora_reference(base, weights[0], magnitudes, x[t],
                                                       slices) - plain[t])
                elif slot > 0:
                    want = want + s * torch.cat([x[t] @ a.t() @ b.t() for a, b in
                                                 weights[slot].values()])
                torch.testing.assert_close(got[t], want, rtol=1e-4, atol=1e-4)
                if s == 0 or slot < 0:
                    assert torch.equal(got[t], plain[t])

    check([0, -1, 32, 0, 32, -1, 0], [0.5, 1.0, 2.0, 1.0, 1.0, 1.0, 0.0])
    check([0, 0, -1, 32], [1.0, 1.0, 1.0, 1.0])  # every scale 1: no row_scales
    layer.clear_slot(0)
    assert not layer.dora.slots
    check([32, -1], [1.0, 1.0])


def test_dora_adapter_refusals(tiny_llama, adapters, tmp_path):
    """A DoRA adapter missing one module's magnitude, or with a magnitude of the wrong
    shape, is refused naming the file and the module."""
    import shutil

    base = shapes_of(tiny_llama)
    q0 = "base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector"
    missing = Path(shutil.copytree(adapters["dora_qv"], tmp_path / "missing"))
    edit_tensors(missing, lambda t: t.pop(q0))
    with pytest.raises(AdapterError, match="model.layers.0.self_attn.q_proj has no "
                                           "lora_magnitude_vector, but adapter_config.json "
                                           "has use_dora=true"):
        inspect_peft_adapter(missing, base, max_lora_rank=16)
    wrong = Path(shutil.copytree(adapters["dora_qv"], tmp_path / "wrong"))
    edit_tensors(wrong, lambda t: t.__setitem__(q0, torch.ones(63)))
    with pytest.raises(AdapterError, match=r"has shape \[63\], expected \[64\]"):
        inspect_peft_adapter(wrong, base, max_lora_rank=16)


def test_dora_over_a_quantized_base_is_refused(tiny_llama, adapters):
    """Over a quantized base (no float weight, whose norms DoRA needs) a DoRA adapter is
    refused at registration, naming it; a plain adapter is served beside."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=16,
                       max_model_len=128, quantization="int8")
    with pytest.raises(AdapterError, match="DoRA \\(use_dora=true\\) is not served over a "
                                           "quantized base") as refused:
        engine.add_adapter("dora", adapters["dora"])
    assert str(adapters["dora"]) in str(refused.value)
    engine.add_adapter("plain", adapters["plain"])
    assert [a.name for a in engine.list_adapters()] == ["plain"]


def test_a_dora_adapter_given_as_tensors_is_served(tiny_llama, adapters):
    """``add_adapter(tensors=..., config=...)`` with PEFT's own state dict of a DoRA model
    (``get_peft_model_state_dict``: the magnitudes' names as PEFT saves them) serves DoRA,
    equal to PEFT."""
    from peft import get_peft_model_state_dict

    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), adapters["dora"])
    tensors = get_peft_model_state_dict(model)
    assert any(k.endswith("lora_magnitude_vector") for k in tensors)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_lora_rank=16, max_model_len=128)
    engine.add_adapter("up", tensors=tensors, config=model.peft_config["default"])
    prompt = PROMPTS[1]
    out = engine.generate([prompt], greedy(), adapters=["up"])[0]
    tokens, logprobs = peft_run(tiny_llama, adapters["dora"], prompt)
    assert out.token_ids == tokens
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=2e-3)
