"""An adapter's own embedding and head rows (issue 46 item 1, lora/token_rows.py): PEFT's
``trainable_token_indices`` and ``modules_to_save`` of ``embed_tokens`` / ``lm_head``, made
by PEFT itself (``get_peft_model``, the trained rows perturbed so that they differ from the
base's, ``save_pretrained``), served through LLMEngine mixed in one batch with a plain LoRA
adapter and the base model: greedy tokens equal PEFT's (``PeftModel``) and logprobs within
2e-3 in float32, on Llama (untied head), Qwen2 and Gemma 2 (tied; Gemma scales the
embedding by √hidden); refusals of what is not served; host bytes of a trainable-token
adapter are its rows."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.lora.peft_format import AdapterError, inspect_peft_adapter, read_peft_adapter
from peft import PeftModel
from transformers import AutoModelForCausalLM

from tests.adapter_dirs import edit_config, edit_tensors, shapes_of
from tests.conftest import greedy_logprobs
from tests.vocab_adapters import adapters_by_arch, make_peft_adapter

NEW = 6
TOKENS = [7, 120, 250, 301]  # the trainable token ids; the prompts use some of them
PROMPTS = [[5, 7, 33, 9, 120, 7], [44, 3, 250, 11], [300, 12, 64, 301, 8, 91, 2, 77, 15]]
KINDS: dict[str, dict] = {
    "tokens": {"trainable_token_indices": TOKENS},
    "head": {"modules_to_save": ["lm_head"]},
    "embed": {"modules_to_save": ["embed_tokens"]},
    "both": {"modules_to_save": ["embed_tokens", "lm_head"]},
}
DELTA = "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta"


def make_token_adapter(base: Path, out: Path, seed: int, **token_kwargs) -> Path:
    """A PEFT LoRA adapter on q/v with ``token_kwargs``, the rows of a saved table at the
    test tokens perturbed strongly (tests/vocab_adapters.py's make_peft_adapter)."""
    return make_peft_adapter(base, out, seed, strong_rows=TOKENS, **token_kwargs)


@pytest.fixture(scope="module")
def made(tiny_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
         ) -> Callable[[str], dict[str, Path]]:
    """made(arch) -> {kind: adapter dir} (plus "plain": a LoRA-only adapter)."""
    return adapters_by_arch(tiny_models, tmp_path_factory, "tokens", lambda arch: KINDS, 11,
                            make_token_adapter)


def peft_run(base: Path, adapter: Path | None, prompt: list[int]
             ) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and their logprobs (float32)."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return greedy_logprobs(model.eval(), prompt, NEW)


def greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW, logprobs=0)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_token_rows_mixed_in_one_batch_equal_peft(tiny_models, made, arch, monkeypatch,
                                                   tmp_path):
    """Every kind, a plain LoRA adapter and the base in one batch (each prompt on each;
    steps of 24 tokens, so prompts are split across steps): tokens equal PEFT's, logprobs
    within 2e-3; every kind changes the answer (its rows matter: PEFT without them, i.e.
    the plain LoRA of the same adapter, differs)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    base, adapters = tiny_models(arch), made(arch)
    engine = LLMEngine(model=base, dtype="float32", max_loras=len(adapters), max_lora_rank=8,
                       max_model_len=128, max_num_batched_tokens=24,  # prompts split
                       lora_modules={n: str(p) for n, p in adapters.items()})
    items = [(name, prompt) for prompt in PROMPTS for name in [*adapters, None]]
    outs = engine.generate([p for _, p in items], greedy(), adapters=[a for a, _ in items])
    want = {}
    for (name, prompt), out in zip(items, outs):
        want[name, tuple(prompt)] = peft_run(base, adapters[name] if name else None, prompt)
        tokens, logprobs = want[name, tuple(prompt)]
        assert out.token_ids == tokens, (arch, name, prompt)
        got = [lp.logprob for lp in out.logprobs]
        assert got == pytest.approx(logprobs, abs=2e-3), (arch, name, prompt)
    for kind in KINDS:  # the adapter's rows change PEFT's own answer on some prompt
        lora = _lora_only(adapters[kind], tmp_path / kind)
        moved = max(abs(a - b) for p in PROMPTS for a, b in
                    zip(peft_run(base, lora, p)[1], want[kind, tuple(p)][1]))
        assert moved > 0.05, (kind, "its rows change nothing: the test cannot see them")
    engine.check()


def test_prompt_logprobs_use_the_adapters_head_rows(tiny_models, made):
    """prompt_logprobs (every prompt position through the head, in chunks of its own)
    of each kind and the base in one batch equal PEFT's log-softmax over the prompt."""
    base, adapters = tiny_models("qwen2"), made("qwen2")
    engine = LLMEngine(model=base, dtype="float32", max_loras=4, max_lora_rank=8,
                       max_model_len=128, lora_modules={k: str(adapters[k]) for k in KINDS})
    prompt = PROMPTS[2]
    names = [*KINDS, None]
    params = SamplingParams(temperature=0.0, max_new_tokens=1, prompt_logprobs=0)
    outs = engine.generate([prompt] * len(names), params, adapters=names)
    for name, out in zip(names, outs):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        if name is not None:
            model = PeftModel.from_pretrained(model, adapters[name])
        with torch.no_grad():
            ref = torch.log_softmax(model.eval()(torch.tensor([prompt])).logits[0].float(), -1)
        want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
        got = [lp.logprob for lp in out.prompt_logprobs[1:]]
        assert got == pytest.approx(want, abs=2e-3), name


def _lora_only(adapter: Path, out: Path) -> Path:
    """A copy of ``adapter`` without its token rows: its LoRA alone."""
    import shutil

    shutil.copytree(adapter, out)
    edit_config(out, modules_to_save=None, trainable_token_indices=None)
    edit_tensors(out, lambda t: [t.pop(k) for k in list(t) if ".lora_" not in k])
    return out


def test_rows_follow_their_adapter_through_one_slot(tiny_models, made, monkeypatch):
    """One device slot, max_cpu_loras 1: the trainable-token, head and plain adapters
    evict each other; every run equals PEFT (the rows go with the slot's adapter, the
    plain one gets the base's rows back)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "torch")
    base, adapters = tiny_models("qwen2"), made("qwen2")
    engine = LLMEngine(model=base, dtype="float32", max_loras=1, max_cpu_loras=1,
                       max_lora_rank=8, max_model_len=128,
                       lora_modules={n: str(adapters[n]) for n in ("tokens", "head", "plain")})
    prompt = PROMPTS[0]
    want = {n: peft_run(base, adapters[n], prompt)[0] for n in ("tokens", "head", "plain")}
    for name in ("tokens", "plain", "head", "tokens", "plain"):
        assert engine.generate([prompt], greedy(), adapters=[name])[0].token_ids == want[name]
    assert engine.lora.host.loads >= 5
    assert engine.runner.token_rows.slots.copies == {}  # dropped with "head" before "plain"
    engine.check()


def test_device_copies_one_per_slot_dropped_and_moved_with_it():
    """DeviceRows on another device (meta): one copy per slot, made once, replaced when
    another adapter takes the slot, moved by compaction, dropped on eviction; counted."""
    from loraplex.lora.token_rows import DeviceRows, ReplacedRows, TokenRows

    rows = ReplacedRows(torch.tensor([3, 9]), torch.ones(2, 64))
    a, b = TokenRows(rows, rows), TokenRows(None, ReplacedRows(None, torch.ones(384, 64)))
    copies = DeviceRows(torch.device("meta"))
    first = copies.get(0, a)
    assert first.embed.rows.device.type == "meta" and first.head is first.embed  # tied: once
    assert copies.get(0, a) is first and copies.nbytes == a.nbytes == 2 * 64 * 4 + 16
    assert copies.get(0, b) is not first and copies.nbytes == 384 * 64 * 4
    copies.move(0, 7)
    assert set(copies.copies) == {7} and copies.get(7, b).head.rows.shape == (384, 64)
    copies.drop(7)
    assert copies.copies == {} and copies.nbytes == 0


def test_host_bytes_of_trainable_tokens_are_their_rows(tiny_models, made):
    """size_bytes = the LoRA's A and B + the k rows (+ their int64 ids); the tensors held
    (distinct storages) are that many bytes: no base table, no copy of the file's data."""
    base = tiny_models("llama")
    shapes = shapes_of(base)
    plain = inspect_peft_adapter(made("llama")["plain"], shapes, 8)
    meta = inspect_peft_adapter(made("llama")["tokens"], shapes, 8)
    rows = len(TOKENS) * shapes.hidden_size * 4 + 8 * len(TOKENS)
    assert meta.size_bytes == plain.size_bytes + rows
    weights = read_peft_adapter(meta.path, shapes, 8)
    assert weights.tokens is not None and weights.tokens.embed is not None
    assert weights.tokens.head is None  # Llama's head is not tied: the base's
    held = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for ab in weights.layers.values() for t in ab}
    held.update({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                 for t in (weights.tokens.embed.rows, weights.tokens.embed.indices)})
    assert sum(held.values()) == meta.size_bytes
    full = inspect_peft_adapter(made("llama")["both"], shapes, 8)
    assert full.size_bytes == plain.size_bytes + 2 * 384 * 64 * 4  # two whole tables
    # the host tier counts what it holds: the whole tables of "both", the rows of "tokens"
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=64, lora_modules={"both": str(full.path),
                                                       "tokens": str(meta.path)})
    engine.generate([PROMPTS[0]] * 2, greedy(), adapters=["both", "tokens"])
    assert engine.lora.host.held_bytes == full.size_bytes + meta.size_bytes
    assert engine.memory_use().token_rows == 0  # on the CPU the host copies serve


def test_tied_base_ties_the_trainable_rows_to_the_head(tiny_models, made):
    shapes = shapes_of(tiny_models("qwen2"))
    weights = read_peft_adapter(made("qwen2")["tokens"], shapes, 8)
    assert weights.tokens.head is weights.tokens.embed
    assert weights.tokens.embed.indices.tolist() == sorted(TOKENS)


# ---- refusals ------------------------------------------------------------------------------


def _grow(key: str, rows: int) -> Callable[[dict[str, torch.Tensor]], None]:
    def fn(t: dict[str, torch.Tensor]) -> None:
        t[key] = torch.cat([t[key], torch.zeros(rows, t[key].shape[1])])
    return fn


REFUSALS = {  # (kind, config changes, tensor edit) -> fragment of the message
    "norm": ("head", {"modules_to_save": ["lm_head", "norm"]}, None,
             "modules_to_save=['norm'] is not supported"),
    "score": ("head", {"modules_to_save": ["score"]}, None,
              "modules_to_save=['score'] is not supported"),
    "head_vocab": ("head", {}, _grow("base_model.model.lm_head.weight", 4),
                   "its vocabulary of 388 tokens differs from the base model's 384"),
    "embed_vocab": ("embed", {}, _grow("base_model.model.model.embed_tokens.weight", 2),
                    "vocabulary of 386 tokens differs"),
    "index_outside": ("tokens", {"trainable_token_indices": [7, 120, 250, 400]}, None,
                      "[400] lie outside the base model's vocabulary of 384 tokens"),
    "rows_count": ("tokens", {"trainable_token_indices": [7, 120]}, None,
                   "has shape [4, 64], expected [2, 64]"),
    "no_rows": ("tokens", {}, lambda t: t.pop(DELTA),
                "holds no trainable_tokens_delta of embed_tokens"),
    "no_table": ("both", {"modules_to_save": ["embed_tokens", "lm_head"]},
                 lambda t: t.pop("base_model.model.lm_head.weight"),
                 "modules_to_save=['lm_head'], but the file holds no lm_head.weight"),
    "unasked": ("head", {"modules_to_save": None}, None, "is not a LoRA weight"),
    "other_module_tokens": ("tokens", {"trainable_token_indices": {"lm_head": TOKENS}}, None,
                            "trainable_token_indices of ['lm_head'] is not supported"),
    "nan_rows": ("tokens", {}, lambda t: t[DELTA].__setitem__((0, 0), float("nan")), "NaN"),
}


@pytest.mark.parametrize("case", list(REFUSALS))
def test_refuses_what_is_not_served(tiny_models, made, tmp_path, case):
    """Each refusal names the problem, at inspection (where the values are not needed)
    and at the read alike; an engine refuses the load and keeps serving."""
    import shutil

    kind, changes, edit, fragment = REFUSALS[case]
    ad = tmp_path / case
    shutil.copytree(made("llama")[kind], ad)
    if changes:
        edit_config(ad, **changes)
    if edit is not None:
        edit_tensors(ad, edit)
    shapes = shapes_of(tiny_models("llama"))
    with pytest.raises(AdapterError) as at_read:
        read_peft_adapter(ad, shapes, 8)
    assert fragment in str(at_read.value)
    if case != "nan_rows":
        with pytest.raises(AdapterError) as at_inspect:
            inspect_peft_adapter(ad, shapes, 8)
        assert str(at_inspect.value) == str(at_read.value)


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_token_rows_over_a_quantized_gguf_base(arch, made, tiny_models, tmp_path, monkeypatch):
    """A GGUF base served as stored (Q8_0 embedding: the rows are replaced after the
    quantized lookup; llama's Q8_0 head, qwen2's head tied to the quantized embedding):
    each kind, mixed with the base in one batch, equals transformers' GGUF loader + PEFT,
    greedy tokens and logprobs within 5e-3 (the quantized suite's tolerance)."""
    from loraplex.engine.models.quant_modules import QuantizedEmbedding

    from tests.gguf_files import write_gguf
    from tests.test_quantized_serving import ATOL, gguf_oracle

    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    model_dir, adapters = tiny_models(arch), {k: made(arch)[k] for k in KINDS}
    path = write_gguf(model_dir, tmp_path / f"{arch}.gguf")
    engine = LLMEngine(model=str(path), dtype="float32", max_loras=4, max_lora_rank=8,
                       max_model_len=112,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    assert isinstance(engine.base.model.model.embed_tokens, QuantizedEmbedding)
    oracle = gguf_oracle(path, model_dir, adapters)
    items = [(name, prompt) for prompt in PROMPTS for name in [*adapters, None]]
    outs = engine.generate([p for _, p in items], greedy(), adapters=[a for a, _ in items])
    for (name, prompt), out in zip(items, outs):
        ref = oracle(name, prompt + out.token_ids)  # row j predicts token j + 1
        for j, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs)):
            row = ref[len(prompt) - 1 + j]
            allowed = row.clone()
            allowed[2] = -torch.inf  # min_new_tokens holds EOS back
            assert tok == int(allowed.argmax()), (arch, name, prompt, j)
            assert lp.logprob == pytest.approx(row[tok].item(), abs=ATOL), (arch, name, j)


def test_lora_scale_scales_the_lora_not_the_rows(tiny_models, made):
    """lora_scale 0.5 on a trainable-token adapter equals PEFT with its LoRA layers scaled
    by 0.5 (``scale_layer``) and its rows as trained; lora_scale 0 is the base model
    exactly, rows included (as the prefix cache keys it)."""
    from peft.tuners.lora import LoraLayer

    base, adapter = tiny_models("qwen2"), made("qwen2")["tokens"]
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=128, lora_modules={"tokens": str(adapter)})
    prompt = PROMPTS[0]

    def params(scale: float) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW,
                              logprobs=0, prompt_logprobs=0, lora_scale=scale)

    half, zero, plain, one = engine.generate(
        [prompt] * 4, [params(0.5), params(0.0), params(1.0), params(1.0)],
        adapters=["tokens", "tokens", None, "tokens"])  # one step: scales 0 and 1 together
    assert zero.token_ids == plain.token_ids
    assert [lp.logprob for lp in zero.logprobs] == [lp.logprob for lp in plain.logprobs]
    assert [lp.logprob for lp in zero.prompt_logprobs[1:]] == \
        [lp.logprob for lp in plain.prompt_logprobs[1:]]
    assert [lp.logprob for lp in one.prompt_logprobs[1:]] != \
        [lp.logprob for lp in plain.prompt_logprobs[1:]]
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(
        base, dtype=torch.float32), adapter).eval()
    for module in model.modules():
        if isinstance(module, LoraLayer):
            module.scale_layer(0.5)
    with torch.no_grad():
        ids = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                             do_sample=False, pad_token_id=0)
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    new = ids[0, len(prompt):]
    assert half.token_ids == new.tolist()
    want = torch.log_softmax(logits, -1).gather(1, new[:, None])[:, 0].tolist()
    assert [lp.logprob for lp in half.logprobs] == pytest.approx(want, abs=2e-3)
