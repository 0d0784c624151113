"""Gemma 2, Gemma 3 (text), Phi-3 and a windowed Mistral: greedy tokens equal transformers
(base) and PEFT (adapters) in float32, in mixed batches with chunked prefill and preemption,
on every kernel backend (Triton through the interpreter). Every prompt but the shortest runs
past the 8-token sliding window."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.conftest import make_adapter, make_tiny_model, one_thread

NEW = 6
GEMMA_ADAPTERS = {  # name -> make_adapter kwargs; "all" targets every linear
    "qv": {"r": 4, "target_modules": ["q_proj", "v_proj"]},
    "all": {"r": 8, "target_modules": "all-linear"},
    "mlp": {"r": 6, "target_modules": ["gate_proj", "down_proj", "o_proj"]},
}
PHI3_ADAPTERS = {  # PEFT sees Phi-3's fused modules
    "qkv": {"r": 4, "target_modules": ["qkv_proj"]},
    "all": {"r": 8, "target_modules": "all-linear"},
    "od": {"r": 6, "target_modules": ["o_proj", "down_proj", "gate_up_proj"]},
}
ADAPTERS = {"gemma2": GEMMA_ADAPTERS, "gemma3": GEMMA_ADAPTERS, "phi3": PHI3_ADAPTERS,
            "mistral_window": {}}
ARCHS = list(ADAPTERS)


# Phi-3's longrope switches at 32 tokens (original_max_position_embeddings): its sequences
# stay within them, where loraplex matches transformers (rope.py states the rule past them).
LENGTHS = {"phi3": (1, 7, 12, 20, 26, 27)}


def prompts(arch: str, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = LENGTHS.get(arch, (1, 7, 12, 20, 31, 40))
    return [[rng.randrange(4, 384) for _ in range(n)] for n in lengths]


def workload(arch: str, second_set: bool = True) -> list[tuple[str | None, list[int]]]:
    """(adapter or None, prompt): each prompt with the base and each adapter, shuffled; the
    first set alone (``second_set=False``) still holds every adapter, the base and every
    length."""
    names = [None, *ADAPTERS[arch]]
    items = [(names[i % len(names)], p) for i, p in enumerate(prompts(arch))]
    if second_set:
        items += [(names[(i + 1) % len(names)], p)
                  for i, p in enumerate(prompts(arch, 1)[1:])]
    random.Random(2).shuffle(items)
    return items


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory):
    """arch -> (model dir, {adapter: dir}, {(adapter, prompt): reference tokens})."""
    made: dict[str, tuple[Path, dict[str, Path], dict]] = {}

    def get(arch: str):
        if arch not in made:
            root = tmp_path_factory.mktemp(arch)
            model = make_tiny_model(root / "model", arch)
            adapters = {name: make_adapter(model, root / name, seed=i, **kw)
                        for i, (name, kw) in enumerate(ADAPTERS[arch].items())}
            made[arch] = (model, adapters, references(model, adapters, workload(arch)))
        return made[arch]

    return get


def references(model_dir: Path, adapters: dict[str, Path], items) -> dict:
    out = {}
    for name in {a for a, _ in items}:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        model.eval()
        for adapter, prompt in items:
            if adapter == name:
                with one_thread():
                    ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW,
                                         min_new_tokens=NEW, do_sample=False, pad_token_id=0)
                out[(adapter, tuple(prompt))] = ids[0, len(prompt):].tolist()
    return out


# Triton (the interpreter: 15-30 s a run on 2 cores) in `make test` on gemma2, whose
# attention runs the most Triton kernel code (soft-caps, alternating windows) and LoRA on
# every Gemma module. The others run on Triton paths covered in `make test`, so are marked
# slow: phi3 (longrope: a torch op), mistral_window (a window without soft-cap: Triton's
# kernels in test_kernels_softcap_window.py, the engine's path in gemma2's run) and gemma3
# (the same Triton kernels as gemma2 with soft-cap 0 (that window case: as mistral_window);
# its q/k norms and local RoPE are torch ops, run in its cpu and torch parametrizations).
TRITON_SLOW = ("phi3", "mistral_window", "gemma3")
ARCH_KERNELS = [pytest.param(arch, kernels, id=f"{arch}-{kernels}", marks=(
    [] if kernels != "triton" else
    [pytest.mark.triton, pytest.mark.slow] if arch in TRITON_SLOW else [pytest.mark.triton]))
    for kernels in ("cpu", "torch", "triton") for arch in ARCHS]


@pytest.mark.parametrize(("arch", "kernels"), ARCH_KERNELS)
def test_mixed_batch_exact(arch, kernels, family, monkeypatch):
    """24-token steps split the long prompts; 7 blocks of 16 tokens force preemption (on
    Triton with the first prompt set alone)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    model, adapters, refs = family(arch)
    engine = LLMEngine(model=model, dtype="float32", max_num_seqs=8, max_num_batched_tokens=24,
                       max_model_len=112, num_kv_blocks=7, max_lora_rank=8, max_loras=4)
    for name, path in adapters.items():  # read now: no disk read races the steps, so the
        # schedule (and the preemption it forces) is the same on every run
        engine.add_adapter(name, path, weights=engine.read_adapter(str(path), name))
    assert engine.base.kernels.name == kernels
    seqs, chunked = [], []
    real_add, real_run = engine.add_sequence, engine.runner.run
    engine.add_sequence = lambda seq: seqs.append(seq) or real_add(seq)

    def spy(batch, adapter_slots):
        chunked.extend(n for s, n in batch.entries if s.num_computed_tokens + n < s.num_tokens)
        return real_run(batch, adapter_slots)

    engine.runner.run = spy
    # Triton (the interpreter, ~20 s a run in `make test`, most of it the prefill steps):
    # the first prompt set only, 6 of the 11 requests: still every adapter and the base,
    # chunked and preempted (asserted below)
    items = workload(arch, second_set=kernels != "triton")
    assert {a for a, _ in items} == {None, *ADAPTERS[arch]}
    outs = engine.generate([p for _, p in items], SamplingParams(
        temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW),
        adapters=[a for a, _ in items])
    for (adapter, prompt), out in zip(items, outs):
        assert out.token_ids == refs[(adapter, tuple(prompt))], (adapter, len(prompt))
    assert chunked, "no prompt was split"
    assert sum(s.num_preemptions for s in seqs) > 0, "nothing was preempted"
    assert engine.block_manager.num_used_blocks == 0


def test_context_past_the_window_is_not_capped(family):
    """max_model_len is the model's, not the 8-token window."""
    model, _, _ = family("gemma2")
    engine = LLMEngine(model=model, dtype="float32")
    assert engine.max_model_len == 512


def test_longrope_tables_switch_at_the_boundary(family):
    """Positions below original_max_position_embeddings rotate with transformers' short
    factors, positions from it on with its long ones (the per-position rule of rope.py)."""
    from loraplex.engine.models.rope import RotaryEmbedding
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    model, _, _ = family("phi3")
    config = AutoConfig.from_pretrained(model)
    rope = RotaryEmbedding(config, 64)
    short, scale = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu")
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, "cpu", seq_len=33)
    assert not torch.equal(short, long)
    for pos, inv in ((0, short), (31, short), (32, long), (63, long)):
        freqs = pos * inv
        torch.testing.assert_close(rope.cos[pos], torch.cat((freqs, freqs)).cos() * scale)
