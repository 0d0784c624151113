"""Activated LoRA (PEFT's aLoRA, ``alora_invocation_tokens``): greedy-equal to PEFT's aLoRA
model token for token in float32 (logprobs within 2e-3), mixed in one batch with a plain
LoRA and the base model, on Llama, Qwen2 and Gemma 2; the prefix cache serves an aLoRA
request the base model's blocks before its invocation, so only the new tokens are
computed."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.activation import NEVER, activation_start
from loraplex.engine.block_manager import block_hash
from loraplex.lora.base_shapes import BaseShapes
from loraplex.lora.peft_checks import AdapterError
from loraplex.lora.peft_format import inspect_peft_adapter
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.variants import calculate_alora_offsets
from transformers import AutoConfig, AutoModelForCausalLM

from tests.adapter_dirs import edit_config
from tests.conftest import ALL_TARGETS, make_adapter, one_thread

NEW = 6
TRITON_NEW = 3  # the interpreter (~20 s a run in `make test`): fewer decode steps on Triton
INVOKE = [41, 42, 43]  # "cat dog sql" in the tiny tokenizer
CONVERSATION = [5, 17, 33, 9, 120, 7, 44, 3, 250, 11, 300, 12, 64, 8]
PROMPTS = {
    "middle": CONVERSATION + INVOKE + [60, 61],
    "twice": [70] + INVOKE + CONVERSATION + INVOKE + [62],  # the last occurrence counts
    "at_end": CONVERSATION + INVOKE,
    "at_start": INVOKE + CONVERSATION,  # the adapter everywhere: plain LoRA
    "absent": CONVERSATION + [41, 42],  # never invoked: the base model throughout
}


def make_alora(base_dir: Path, out_dir: Path, seed: int = 5, scale: float = 0.3,
               invocation: list[int] = INVOKE) -> Path:
    """A real PEFT aLoRA adapter (LoraConfig(alora_invocation_tokens=...)) with random,
    non-zero A and B on every linear of the decoder."""
    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=ALL_TARGETS, lora_dropout=0.0,
                        alora_invocation_tokens=invocation, task_type="CAUSAL_LM")
    model = get_peft_model(base, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, scale)
    model.save_pretrained(out_dir)
    return out_dir


class Oracle:
    """PEFT's model of one adapter (or the base model): greedy tokens and their logprobs
    from ``generate``, which computes aLoRA's offsets from the prompt as PEFT does."""

    def __init__(self, base: Path, adapter: Path | None):
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        self.model = (PeftModel.from_pretrained(model, adapter) if adapter else model).eval()

    def greedy(self, prompt: list[int], new: int = NEW) -> tuple[list[int], list[float]]:
        with one_thread():
            out = self.model.generate(torch.tensor([prompt]), max_new_tokens=new,
                                      min_new_tokens=new, do_sample=False, pad_token_id=0,
                                      output_logits=True, return_dict_in_generate=True)
        tokens = out.sequences[0, len(prompt):].tolist()
        lps = [torch.log_softmax(lg[0].double(), -1)[t].item()
               for lg, t in zip(out.logits, tokens)]
        return tokens, lps


def params(logprobs: int | None = 0, new: int = NEW) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=new, min_new_tokens=new,
                          logprobs=logprobs)


@pytest.fixture(scope="module")
def adapters(tiny_models, tmp_path_factory) -> dict[str, dict[str, Path]]:
    """arch -> {"alora": its aLoRA, "plain": a plain LoRA}, made once per module."""
    root = tmp_path_factory.mktemp("alora")
    made: dict[str, dict[str, Path]] = {}
    for arch in ("llama", "qwen2", "gemma2"):
        base = tiny_models(arch)
        made[arch] = {"alora": make_alora(base, root / arch / "alora"),
                      "plain": make_adapter(base, root / arch / "plain", seed=9, scale=0.3,
                                            target_modules=ALL_TARGETS)}
    return made


def test_activation_start_follows_peft(tiny_llama, tmp_path):
    """The start is PEFT's alora_offsets counted from the front (len - offset), NEVER where
    PEFT's offset is None; a plain adapter applies from 0."""
    ad = make_alora(tiny_llama, tmp_path / "a")
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(tiny_llama, dtype=torch.float32), ad)
    for prompt in PROMPTS.values():
        (offset,) = calculate_alora_offsets(model.peft_config, "default", torch.tensor([prompt]))
        want = NEVER if offset is None else len(prompt) - offset
        assert activation_start(prompt, INVOKE) == want, prompt
    assert activation_start(PROMPTS["middle"], None) == 0
    assert activation_start([41], [41, 42]) == NEVER


@pytest.mark.parametrize("arch,kernels", [
    ("llama", "cpu"), ("llama", "torch"), ("qwen2", "cpu"), ("gemma2", "cpu"),
    pytest.param("llama", "triton", marks=pytest.mark.triton)])  # Triton's interpreter
def test_mixed_batch_equals_peft(tiny_models, adapters, arch, kernels, monkeypatch):
    """Every prompt on the aLoRA, the plain LoRA and the base model, in one batch: each
    equals PEFT's model of it token for token, logprobs within 2e-3 (NEW tokens; TRITON_NEW
    on Triton's interpreter)."""
    monkeypatch.setenv("LORAPLEX_KERNELS", kernels)
    new = TRITON_NEW if kernels == "triton" else NEW
    base = tiny_models(arch)
    ads = adapters[arch]
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=128, block_size=4,
                       lora_modules={n: str(p) for n, p in ads.items()})
    items = [(a, k) for k in PROMPTS for a in ("alora", "plain", None)]
    outs = engine.generate([PROMPTS[k] for _, k in items], params(new=new),
                           adapters=[a for a, _ in items])
    oracles = {a: Oracle(base, ads[a] if a else None) for a in ("alora", "plain", None)}
    got = {}
    for (a, k), out in zip(items, outs):
        tokens, lps = oracles[a].greedy(PROMPTS[k], new)
        assert out.token_ids == tokens, (arch, a, k)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(lps, abs=2e-3)
        got[a, k] = out.token_ids
    # the oracle tells the cases apart: aLoRA is neither the base nor the plain LoRA's
    # delta everywhere, but is exactly the base without its invocation
    assert got["alora", "absent"] == got[None, "absent"]
    assert any(got["alora", k] != got[None, k] for k in ("middle", "twice", "at_end"))
    alora_only = Oracle(base, ads["alora"])
    for module in alora_only.model.modules():  # the same weights as a plain LoRA
        if hasattr(module, "lora_variant"):
            module.lora_variant.clear()
    plain_everywhere, _ = alora_only.greedy(PROMPTS["middle"], new)
    assert got["alora", "at_start"] == alora_only.greedy(PROMPTS["at_start"], new)[0]
    assert got["alora", "middle"] != plain_everywhere


def test_base_conversation_then_invocation_reuses_base_kv(tiny_llama, tmp_path):
    """A base request with a long prompt, then the aLoRA on that prompt + its invocation:
    the base's blocks before the invocation are prefix-cache hits, only the new tokens
    are computed, and the answer still equals PEFT's."""
    ad = make_alora(tiny_llama, tmp_path / "a")
    bs = 4
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=256, block_size=bs, lora_modules={"judge": str(ad)})
    conversation = [(7 * i) % 300 + 4 for i in range(97)]  # 24 full blocks and 1 token
    engine.generate([conversation], params(None))  # the base model
    stats = engine.stats()
    prompt = conversation + INVOKE + [60]
    (out,) = engine.generate([prompt], params(), adapters=["judge"])
    after = engine.stats()
    # the 24 full blocks of the conversation; the partial one holds the invocation's start
    assert after["prefix_cache_hits"] - stats["prefix_cache_hits"] == 24
    computed = after["prompt_tokens_computed"] - stats["prompt_tokens_computed"]
    assert computed == len(prompt) - 24 * bs == 1 + len(INVOKE) + 1
    tokens, lps = Oracle(tiny_llama, ad).greedy(prompt)
    assert out.token_ids == tokens
    assert [lp.logprob for lp in out.logprobs] == pytest.approx(lps, abs=2e-3)
    # a plain LoRA on the same prompt reuses nothing of the base's
    plain = make_adapter(tiny_llama, tmp_path / "p", target_modules=ALL_TARGETS)
    engine.add_adapter("plain", str(plain))
    before = engine.stats()["prefix_cache_hits"]
    engine.generate([prompt], params(None), adapters=["plain"])
    assert engine.stats()["prefix_cache_hits"] == before


def test_alora_blocks_are_keyed_by_adapter_and_start(tiny_llama, tmp_path):
    """From the invocation's block on, blocks are the adapter's: a second aLoRA request on
    the same prompt reuses them, the base model does not, and the same tokens activated
    at another position do not share them."""
    ad = make_alora(tiny_llama, tmp_path / "a")
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=256, block_size=4, lora_modules={"judge": str(ad)})
    prompt = [5, 6, 7, 8, 9, 10] + INVOKE + list(range(100, 120))  # start 6, 29 tokens

    def hits(adapter: str | None, ids: list[int]) -> int:
        before = engine.block_manager.prefix_hits
        engine.generate([ids], params(None), adapters=[adapter])
        return engine.block_manager.prefix_hits - before

    assert hits("judge", prompt) == 0
    assert hits("judge", prompt) == 7  # every full block, its own
    assert hits(None, prompt) == 1  # only the block before the invocation
    assert hits("judge", prompt) == 7
    assert block_hash(b"", 3, [1, 2]) == block_hash(b"", 3, [1, 2], 1.0, 0)
    assert block_hash(b"", 3, [1, 2], 1.0, 5) != block_hash(b"", 3, [1, 2], 1.0, 6)


def test_invocation_tokens_outside_the_vocabulary_are_refused(tiny_llama, tmp_path):
    ad = make_alora(tiny_llama, tmp_path / "a")
    base = BaseShapes.from_hf_config(AutoConfig.from_pretrained(tiny_llama), str(tiny_llama))
    assert inspect_peft_adapter(ad, base, 8).invocation_tokens == tuple(INVOKE)
    edit_config(ad, alora_invocation_tokens=[41, 100000])
    with pytest.raises(AdapterError, match="alora_invocation_tokens"):
        inspect_peft_adapter(ad, base, 8)


def test_choices_keep_the_activation(tiny_llama, adapters):
    """n = 2 greedy choices fork from the first: a prompt without the invocation stays the
    base model in both, one with it the aLoRA in both (PEFT's tokens)."""
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=128, lora_modules={"judge": str(adapters["llama"]["alora"])})
    many = SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW, n=2)
    outs = engine.generate([PROMPTS["absent"], PROMPTS["middle"]], many,
                           adapters=["judge", "judge"])
    base, alora = Oracle(tiny_llama, None), Oracle(tiny_llama, adapters["llama"]["alora"])
    for choices, (oracle, key) in zip(outs, [(base, "absent"), (alora, "middle")]):
        want, _ = oracle.greedy(PROMPTS[key])
        assert [c.token_ids for c in choices] == [want, want]


def test_a_load_in_place_between_check_and_engine_moves_the_start(tiny_llama, tmp_path):
    """The start is computed once as the request is checked, for the load it names; a load
    in place before the request reaches the engine thread recomputes it for the new load
    (aLoRA -> plain LoRA: from 0; plain -> aLoRA: from the invocation)."""
    alora = make_alora(tiny_llama, tmp_path / "a")
    plain = make_adapter(tiny_llama, tmp_path / "p", target_modules=ALL_TARGETS)
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=128, lora_modules={"x": str(alora)})
    prompt = PROMPTS["middle"]
    seq = engine.make_sequence(prompt, params(None), "x")
    assert seq.adapter_start == len(CONVERSATION)
    engine.add_adapter("x", str(plain), replace=True)
    engine.add_sequence(seq)
    assert seq.adapter_start == 0
    seq = engine.make_sequence(prompt, params(None), "x")
    assert seq.adapter_start == 0
    engine.add_adapter("x", str(alora), replace=True)
    engine.add_sequence(seq)
    assert seq.adapter_start == len(CONVERSATION)
    while engine.has_unfinished_requests():
        engine.step()


def test_lora_scale_multiplies_the_activated_delta(tiny_llama, adapters):
    """lora_scale on an aLoRA: PEFT's aLoRA with its scaling multiplied (scale_layer) from
    the invocation on; scale 0 is the base model throughout."""
    from peft.tuners.lora import LoraLayer

    ad = adapters["llama"]["alora"]
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=128, lora_modules={"judge": str(ad)})
    prompt = PROMPTS["middle"]
    scales = (2.0, 0.0)
    outs = engine.generate([prompt] * 2, [
        SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW, lora_scale=s)
        for s in scales], adapters=["judge"] * 2)
    scaled = Oracle(tiny_llama, ad)
    for module in scaled.model.modules():
        if isinstance(module, LoraLayer):
            module.scale_layer(2.0)
    assert outs[0].token_ids == scaled.greedy(prompt)[0]
    assert outs[0].token_ids != Oracle(tiny_llama, ad).greedy(prompt)[0]
    assert outs[1].token_ids == Oracle(tiny_llama, None).greedy(prompt)[0]


def test_chunked_prefill_splits_at_the_invocation(tiny_llama, adapters):
    """Prompts prefilled in chunks of 5 tokens, the invocation's start inside a chunk:
    still PEFT's tokens and logprobs."""
    ad = adapters["llama"]["alora"]
    engine = LLMEngine(model=tiny_llama, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=128, block_size=4, max_num_batched_tokens=5,
                       max_num_seqs=2, lora_modules={"judge": str(ad)})
    keys = ["middle", "twice"]
    outs = engine.generate([PROMPTS[k] for k in keys], params(), adapters=["judge"] * 2)
    oracle = Oracle(tiny_llama, ad)
    for key, out in zip(keys, outs):
        tokens, lps = oracle.greedy(PROMPTS[key])
        assert out.token_ids == tokens, key
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(lps, abs=2e-3)
