"""PEFT's ``lora_bias=True`` (a bias on lora_B; the delta is ``scaling·(B(Ax) + b)``),
issue 46 item 3: adapters made by PEFT itself with random non-zero biases are greedy-equal
to PEFT token for token in float32 and their logprobs within 2e-3, mixed in one batch with a
plain LoRA adapter, other ``lora_scale``s of the same adapter and the base; the bias follows
its adapter through eviction and reload and a load in place; LoRALinear adds it on every
backend (the path is shared)."""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from transformers import AutoModelForCausalLM

from tests.conftest import ALL_TARGETS, greedy_logprobs, make_adapter

NEW = 8
PROMPTS = [[5, 17, 33, 9, 120, 7], [44, 3, 250, 11], [300, 12, 64, 8, 8, 91, 2, 77, 15]]


@pytest.fixture(scope="module")
def adapters(tiny_llama: Path, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("biased")
    return {"biased": make_adapter(tiny_llama, root / "biased", r=8, target_modules=ALL_TARGETS,
                                   seed=5, scale=0.3, lora_bias=True),
            "plain": make_adapter(tiny_llama, root / "plain", r=8, target_modules=ALL_TARGETS,
                                  seed=6, scale=0.3)}


def peft_run(base: Path, adapter: Path | None, scale: float, prompt: list[int],
             zero_bias: bool = False) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and their logprobs, every LoRA layer's scaling × ``scale``
    (``zero_bias``: with lora_B's biases set to 0, to show they matter); computed once per
    argument set (each kernels parametrization asks the same)."""
    tokens, logprobs = _peft_run(base, adapter, scale, tuple(prompt), zero_bias)
    return list(tokens), list(logprobs)


@functools.cache
def _peft_run(base: Path, adapter: Path | None, scale: float, prompt: tuple[int, ...],
              zero_bias: bool) -> tuple[tuple[int, ...], tuple[float, ...]]:
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
        for module in model.modules():
            if isinstance(module, LoraLayer):
                module.scale_layer(scale)
                if zero_bias:
                    for b in module.lora_B.values():
                        torch.nn.init.zeros_(b.bias)
    tokens, logprobs = greedy_logprobs(model.eval(), list(prompt), NEW)
    return tuple(tokens), tuple(logprobs)


def greedy(scale: float = 1.0) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW,
                          lora_scale=scale, logprobs=0)


def test_peft_saves_a_bias_on_every_lora_b(adapters):
    from safetensors.torch import load_file

    tensors = load_file(adapters["biased"] / "adapter_model.safetensors")
    biases = [k for k in tensors if k.endswith("lora_B.bias")]
    assert len(biases) == 2 * len(ALL_TARGETS)  # 2 layers
    assert all(tensors[k].abs().sum() > 0 for k in biases)


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_lora_bias_mixed_in_one_batch_equals_peft(tiny_llama, adapters, kernels, monkeypatch):
    """The biased adapter at scales 1 and 0.5, the plain adapter and the base, one batch:
    each row equals PEFT token for token, logprobs within 2e-3; the bias changes the
    answer (PEFT with the biases zeroed differs)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=4, max_lora_rank=16,
                       max_model_len=128, lora_modules={n: str(p) for n, p in adapters.items()})
    items = [(name, scale, prompt) for prompt in PROMPTS
             for name, scale in (("biased", 1.0), ("plain", 1.0), (None, 1.0), ("biased", 0.5))]
    outs = engine.generate([p for _, _, p in items], [greedy(s) for _, s, _ in items],
                           adapters=[a for a, _, _ in items])
    bias_matters = 0.0
    for (name, scale, prompt), out in zip(items, outs):
        path = adapters[name] if name else None
        tokens, logprobs = peft_run(tiny_llama, path, scale, prompt)
        assert out.token_ids == tokens, (name, scale, prompt)
        got = [lp.logprob for lp in out.logprobs]
        assert got == pytest.approx(logprobs, abs=2e-3), (name, scale, prompt)
        if name == "biased":
            unbiased = peft_run(tiny_llama, path, scale, prompt, zero_bias=True)
            if unbiased[0] != tokens:
                bias_matters = float("inf")
            else:
                bias_matters = max(bias_matters, *(abs(a - b) for a, b in
                                                   zip(unbiased[1], logprobs)))
    assert bias_matters > 0.05, "the biases change nothing: the test cannot see them"


def test_lora_bias_survives_eviction_reload_and_a_load_in_place(tiny_llama, adapters):
    """One device slot: the biased and plain adapters evict each other; each run equals
    the first (the bias is written with its adapter, cleared with it); a load in place of
    the plain adapter by the biased one serves the bias; one without a bias after it clears
    it."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=1, max_lora_rank=16,
                       max_model_len=128, max_cpu_loras=1,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    prompt = PROMPTS[0]

    def run(name: str) -> list[int]:
        return engine.generate([prompt], greedy(), adapters=[name])[0].token_ids

    want = {n: peft_run(tiny_llama, adapters[n], 1.0, prompt)[0] for n in adapters}
    for name in ("biased", "plain", "biased", "plain", "biased"):
        assert run(name) == want[name], name
    assert engine.lora.device.loads >= 5 and engine.lora.host.loads >= 5  # evicted, reread
    engine.add_adapter("plain", adapters["biased"], replace=True)
    assert run("plain") == want["biased"]
    engine.add_adapter("plain", adapters["plain"], replace=True)
    assert run("plain") == want["plain"]
    engine.check()


@pytest.mark.parametrize("name", ["torch", "cpu", pytest.param("triton", marks=[
    pytest.mark.triton, pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                           reason="Triton on CPU tensors needs the interpreter")])])
def test_lora_linear_adds_the_bias_on_every_backend(name: str) -> None:
    """One LoRALinear, a biased adapter (bias on q only) and a plain one, rows at several
    scales and base rows: each row gets base(x) + s·(delta + bias); moving and clearing a
    slot carry its bias; a step without a biased slot adds none."""
    from types import SimpleNamespace

    from loraplex.kernel_backends import select_backend
    from loraplex.lora.layers import LoRALinear

    from tests.kernel_fixtures import step_segments

    backend = select_backend(torch.device("cpu"), torch.float32, name)
    g = torch.Generator().manual_seed(3)
    base = torch.nn.Linear(64, 48, bias=False)
    layer = LoRALinear(base, ("q_proj", "v_proj"), [32, 16], num_units=64, max_rank=16,
                       backend=backend)
    weights = {}
    for slot in (16, 32):
        weights[slot] = {n: (torch.randn(8, 64, generator=g) * 0.3,
                             torch.randn(out, 8, generator=g) * 0.3)
                         for n, out in (("q_proj", 32), ("v_proj", 16))}
    bias_q = torch.randn(32, generator=g)
    layer.set_slot(16, weights[16], {"q_proj": bias_q})
    layer.set_slot(32, weights[32])
    assert layer.bias_slots == {16}
    layer.move_slot(16, 0, 8)  # compaction: the bias moves with its rows
    weights[0] = weights.pop(16)
    assert layer.bias_slots == {0}
    bias = {0: torch.cat([bias_q, torch.zeros(16)]), 32: torch.zeros(48)}

    def check(slots: list[int], scales: list[float]) -> None:
        x = torch.randn(len(slots), 64, generator=g)
        seg = step_segments(backend, slots)
        seg.fill(slots, scales)
        layer.step = SimpleNamespace(lora=seg)
        with torch.no_grad():
            got, want = layer(x), base(x)
        for t, (slot, s) in enumerate(zip(slots, scales)):
            if slot >= 0:
                ab = weights[slot]
                delta = torch.cat([x[t] @ a.t() @ b.t() for a, b in (ab["q_proj"],
                                                                     ab["v_proj"])])
                want[t] += s * (delta + bias[slot])
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)

    check([0, -1, 32, 0, 32, -1, 0], [0.5, 1.0, 2.0, 1.0, 1.0, 1.0, 3.0])
    check([0, 0, -1], [1.0, 1.0, 1.0])  # every scale 1: no row_scales
    layer.clear_slot(0)
    assert not layer.bias_slots  # the plain adapter's steps pay nothing
    check([32, -1], [1.0, 1.0])


@pytest.mark.parametrize("arch", ["qwen2", "gemma2"])
def test_lora_bias_on_other_families_equals_peft(arch, tiny_models, tmp_path):
    """Qwen (whose q/k/v have a base bias too) and Gemma: a lora_bias adapter on every
    linear beside a plain one, a scale of 0.5 and the base in one batch equal PEFT."""
    model = tiny_models(arch)
    paths = {"biased": make_adapter(model, tmp_path / "biased", r=8, target_modules="all-linear",
                                    seed=8, scale=0.3, lora_bias=True),
             "plain": make_adapter(model, tmp_path / "plain", r=8, target_modules="all-linear",
                                   seed=9, scale=0.3)}
    engine = LLMEngine(model=model, dtype="float32", max_lora_rank=8, max_model_len=128,
                       lora_modules={n: str(p) for n, p in paths.items()})
    prompt = PROMPTS[2]
    items = [("biased", 1.0), ("plain", 1.0), (None, 1.0), ("biased", 0.5)]
    outs = engine.generate([prompt] * len(items), [greedy(s) for _, s in items],
                           adapters=[a for a, _ in items])
    for (name, scale), out in zip(items, outs):
        tokens, logprobs = peft_run(model, paths[name] if name else None, scale, prompt)
        assert out.token_ids == tokens, (name, scale)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=2e-3)


def test_a_file_of_mixed_dtypes_reads_its_biases(tiny_llama, adapters, tmp_path):
    """A file whose tensors have different dtypes (each converted on its own): the biases
    read are the file's, scaled like B, as from a file of one dtype."""
    import shutil

    from loraplex.lora.peft_format import read_peft_adapter
    from safetensors.torch import load_file, save_file

    from tests.adapter_dirs import shapes_of

    mixed = Path(shutil.copytree(adapters["biased"], tmp_path / "mixed"))
    tensors = load_file(mixed / "adapter_model.safetensors")
    tensors = {k: v.to(torch.bfloat16) if i % 3 == 0 else v
               for i, (k, v) in enumerate(sorted(tensors.items()))}
    save_file(tensors, mixed / "adapter_model.safetensors")
    base = shapes_of(tiny_llama)
    got = read_peft_adapter(mixed, base, max_lora_rank=16)
    assert len(got.biases) == 2 * len(ALL_TARGETS)
    prefix = "base_model.model.model.layers.{}.{}.{}.lora_B.bias"
    parent = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
              "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
    for (layer, module), bias in got.biases.items():
        stored = tensors[prefix.format(layer, parent[module], module)].float()
        torch.testing.assert_close(bias, stored * 2.0)  # lora_alpha 16 / r 8
    plain = read_peft_adapter(adapters["biased"], base, max_lora_rank=16)
    assert got.meta.size_bytes == plain.meta.size_bytes
