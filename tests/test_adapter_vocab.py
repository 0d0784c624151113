"""An adapter that brings its own tokenizer (issue 46 item 1, lora/adapter_vocab.py): made
as a fine-tune that adds tokens makes it (tests/vocab_adapters.py), served through
LLMEngine mixed in one batch with a plain LoRA adapter and the base model. Text prompts
are tokenized with the adapter's tokenizer (its added tokens are single ids), greedy
tokens equal PeftModel's over the resized base token for token, logprobs within 2e-3 in
float32, the text is the adapter tokenizer's decode and shows the added tokens; the base
and plain rows of the same steps are unchanged (the base's vocabulary only). Bad input:
a tokenizer that moves a base id, tables that do not match the tokenizer, added tokens
without rows: clear errors."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import safetensors.torch
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.errors import InvalidRequestError
from loraplex.lora.peft_format import AdapterError, inspect_peft_adapter, read_peft_adapter
from transformers import AutoTokenizer

from tests.adapter_dirs import edit_config, edit_tensors, shapes_of
from tests.vocab_adapters import (
    ADDED,
    BASE_VOCAB,
    NEW_IDS,
    STEER,
    adapters_by_arch,
    extended_tokenizer,
    kinds,
    make_vocab_adapter,
    peft_oracle,
)

NEW = 6
TEXTS = [STEER, "paris france <|verdict|> capital river", "user name city one two"]
TIED = {"llama": False, "qwen2": True, "gemma2": True}


@pytest.fixture(scope="module")
def made(tiny_models: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
         ) -> Callable[[str], dict[str, Path]]:
    """made(arch) -> {kind: adapter dir} (plus "plain": a LoRA-only adapter)."""
    return adapters_by_arch(tiny_models, tmp_path_factory, "vocab",
                            lambda arch: kinds(TIED[arch]), 21, make_vocab_adapter)


def greedy(logprobs: int = 2) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=NEW, min_new_tokens=NEW,
                          logprobs=logprobs)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma2"])
def test_added_tokens_mixed_in_one_batch_equal_peft(tiny_models, made, arch, monkeypatch):
    """Both kinds, a plain adapter and the base, each on every text prompt, in one batch
    (steps of 24 tokens): prompt ids are each tokenizer's, tokens equal PEFT's, logprobs
    within 2e-3, the text is the adapter tokenizer's decode and holds the added tokens; top
    logprobs of adapter rows may name added ids, base rows never."""
    monkeypatch.setenv("LORAPLEX_KERNELS", "cpu")
    base, adapters = tiny_models(arch), made(arch)
    engine = LLMEngine(model=base, dtype="float32", max_loras=len(adapters), max_lora_rank=8,
                       max_model_len=128, max_num_batched_tokens=24,
                       lora_modules={n: str(p) for n, p in adapters.items()})
    base_tok, ext_tok = AutoTokenizer.from_pretrained(base), extended_tokenizer(base)
    items = [(name, text) for text in TEXTS for name in [*adapters, None]]
    outs = engine.generate([t for _, t in items], greedy(), adapters=[a for a, _ in items])
    shown = []
    for (name, text), out in zip(items, outs):
        own = name in ("both", "tokens")
        tok = ext_tok if own else base_tok
        prompt = tok(text).input_ids
        assert out.prompt_token_ids == prompt, (arch, name, text)
        tokens, logprobs = peft_oracle(base, adapters[name] if name else None, prompt, NEW,
                                       len(ext_tok) if own else None)
        assert out.token_ids == tokens, (arch, name, text)
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=2e-3), \
            (arch, name, text)
        assert out.text == tok.decode(tokens, skip_special_tokens=True)
        top_ids = {i for lp in out.logprobs for i, _ in lp.top}
        if own:
            shown.append(out.text)
        else:
            assert max(top_ids | set(out.token_ids)) < BASE_VOCAB, (arch, name)
    assert any(ADDED[0] in text for text in shown), shown
    engine.check()


def test_prompt_logprobs_and_limits_use_the_adapters_vocabulary(tiny_models, made):
    """prompt_logprobs over an added token equal PEFT's log-softmax over the adapter's
    vocabulary; logit_bias and stop_token_ids take added ids on the adapter and refuse
    them on the base; max_model_len counts the adapter's tokens (an added token is one)."""
    base, adapters = tiny_models("qwen2"), made("qwen2")
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=64, lora_modules={"both": str(adapters["both"])})
    ext = extended_tokenizer(base)
    prompt = ext(TEXTS[1]).input_ids
    assert NEW_IDS[1] in prompt
    out = engine.generate([TEXTS[1]], SamplingParams(temperature=0.0, max_new_tokens=1,
                                                     prompt_logprobs=0), adapters=["both"])[0]
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(len(ext))
    model = PeftModel.from_pretrained(model, adapters["both"]).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt])).logits[0].float(), -1)
    want = [ref[p - 1, prompt[p]].item() for p in range(1, len(prompt))]
    assert [lp.logprob for lp in out.prompt_logprobs[1:]] == pytest.approx(want, abs=2e-3)
    # logit_bias on an added id makes it the greedy choice on the adapter only
    bias = SamplingParams(temperature=0.0, max_new_tokens=2, logit_bias={NEW_IDS[1]: 100.0})
    biased = engine.generate([TEXTS[2]], bias, adapters=["both"])[0]
    assert biased.token_ids == [NEW_IDS[1]] * 2 and biased.text.count(ADDED[1]) == 2
    with pytest.raises(InvalidRequestError, match=r"logit_bias holds token id 385"):
        engine.generate([TEXTS[2]], bias)
    with pytest.raises(InvalidRequestError, match=r"the prompt holds token id 384"):
        engine.generate([prompt[:2] + [NEW_IDS[0]]], greedy())  # the base has no id 384
    # max_model_len in the adapter's tokens: 63 of them fit, 64 do not
    long = " ".join([ADDED[0]] * 63)
    assert len(engine.tokenize(long, "both")) == 63
    assert len(engine.tokenize(long)) > 63  # the base's tokenizer splits the added token
    engine.generate([long], SamplingParams(temperature=0.0, max_new_tokens=1),
                    adapters=["both"])
    with pytest.raises(InvalidRequestError, match="max_model_len is 64"):
        engine.generate([long + " " + ADDED[0]], SamplingParams(max_new_tokens=1),
                        adapters=["both"])


def test_sampled_penalised_and_stopped_rows_with_added_tokens(tiny_models, made):
    """Sampling (seeded), penalties, bad_words and stop strings on an adapter with added
    tokens, beside base rows: stop strings and bad words see the adapter's tokens; the base
    rows never sample an added id."""
    base, adapters = tiny_models("qwen2"), made("qwen2")
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=64, lora_modules={"both": str(adapters["both"])})
    sampled = SamplingParams(temperature=1.0, max_new_tokens=8, seed=5, logprobs=1,
                             repetition_penalty=1.3, presence_penalty=0.5)
    outs = engine.generate([STEER] * 4, [sampled, sampled, greedy(),
                                          SamplingParams(temperature=0.0, max_new_tokens=8,
                                                         stop=[ADDED[0]])],
                           adapters=[None, "both", None, "both"])
    assert max(outs[0].token_ids + outs[2].token_ids) < BASE_VOCAB
    assert ADDED[0] not in outs[3].text and outs[3].finish_reason == "stop"
    banned = SamplingParams(temperature=0.0, max_new_tokens=4, bad_words=[ADDED[0]])
    out = engine.generate([STEER], banned, adapters=["both"])[0]
    assert NEW_IDS[0] not in out.token_ids


def test_structured_outputs_on_such_an_adapter_are_refused(tiny_models, made):
    from loraplex.structured.constraint import StructuredOutputs

    base, adapters = tiny_models("qwen2"), made("qwen2")
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=64, lora_modules={"both": str(adapters["both"])})
    params = SamplingParams(max_new_tokens=4, structured_outputs=StructuredOutputs(
        regex="(cat|dog)"))
    with pytest.raises(InvalidRequestError, match="brings its own tokenizer"):
        engine.generate([STEER], params, adapters=["both"])


def test_the_tokenizer_is_held_once_and_tables_are_counted(tiny_models, made, tmp_path):
    """The host bytes of the tables count the adapter's vocabulary; two adapters with the
    same tokenizer files share one tokenizer object; an adapter whose tokenizer equals the
    base's keeps none (served with the base's)."""
    base, adapters = tiny_models("llama"), made("llama")
    shapes = shapes_of(base)
    from dataclasses import replace

    shapes = replace(shapes, tokenizer=AutoTokenizer.from_pretrained(base))
    both = inspect_peft_adapter(adapters["both"], shapes, 8)
    plain = inspect_peft_adapter(adapters["plain"], shapes, 8)
    assert both.vocab is not None and both.vocab.size == BASE_VOCAB + 2
    assert both.size_bytes - plain.size_bytes == 2 * (BASE_VOCAB + 2) * 64 * 4
    again = inspect_peft_adapter(adapters["both"], shapes, 8)
    assert again.vocab.tokenizer is both.vocab.tokenizer
    weights = read_peft_adapter(adapters["tokens"], shapes, 8)
    assert weights.tokens.vocab == BASE_VOCAB + 2
    assert weights.tokens.head.rows.shape[0] == BASE_VOCAB + 2  # Llama: the head saved whole
    same = tmp_path / "same"
    shutil.copytree(adapters["plain"], same)
    AutoTokenizer.from_pretrained(base).save_pretrained(same)
    assert inspect_peft_adapter(same, shapes, 8).vocab is None


# ---- bad input -----------------------------------------------------------------------------


def _moved(ad: Path) -> None:
    """The adapter's tokenizer swaps two base tokens' ids."""
    path = ad / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab = data["model"]["vocab"]
    vocab["cat"], vocab["dog"] = vocab["dog"], vocab["cat"]
    path.write_text(json.dumps(data))


def _no_tokenizer(ad: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (ad / name).unlink()


def _grow_tokenizer(ad: Path) -> None:
    tok = AutoTokenizer.from_pretrained(ad)
    tok.add_tokens(["<|extra|>"])
    tok.save_pretrained(ad)


BAD = {
    "moved_base_id": ("both", _moved, "its tokenizer does not extend the base model's: token"),
    "tables_without_tokenizer": ("both", _no_tokenizer,
                                 "its vocabulary of 386 tokens differs from the base model's 384"),
    "tokenizer_larger_than_tables": ("both", _grow_tokenizer,
                                     "differs from its tokenizer's 387"),
    "indices_not_the_rows": ("tokens", lambda ad: edit_config(
        ad, trainable_token_indices=[7, NEW_IDS[0]]), "has shape [3, 64], expected [2, 64]"),
    "rows_missing_for_added": ("tokens", lambda ad: (
        edit_config(ad, trainable_token_indices=[7, 300, NEW_IDS[0]])),
        "holds no embedding rows for ids [385]"),
    "no_head_rows": ("both", lambda ad: (
        edit_config(ad, modules_to_save=["embed_tokens"]),
        edit_tensors(ad, lambda t: [t.pop(k) for k in list(t) if "lm_head" in k])),
        "holds no logits-head rows for them"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_vocabularies_are_refused(tiny_models, made, tmp_path, case):
    """Each refusal names the problem; an engine refuses the load and keeps serving its
    other adapters."""
    kind, edit, fragment = BAD[case]
    ad = tmp_path / case
    shutil.copytree(made("qwen2")[kind], ad)
    edit(ad)
    base = tiny_models("qwen2")
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=64, lora_modules={"both": str(made("qwen2")["both"])})
    with pytest.raises(AdapterError) as err:
        engine.add_adapter("bad", ad)
    assert fragment in str(err.value), str(err.value)
    assert "bad" not in engine.lora.names
    out = engine.generate([STEER], greedy(0), adapters=["both"])[0]
    assert out.finish_reason == "length" and len(out.token_ids) == NEW


def test_constrained_base_row_beside_an_adapter_with_added_tokens(tiny_models, made):
    """A grammar-constrained base request in a step widened by an adapter's added tokens
    samples and reports exactly what it does alone (its bitmask covers the base's
    vocabulary; the added columns are -inf for it before the mask)."""
    from loraplex.structured.constraint import StructuredOutputs

    base, adapters = tiny_models("qwen2"), made("qwen2")
    engine = LLMEngine(model=base, dtype="float32", max_loras=2, max_lora_rank=8,
                       max_model_len=64, lora_modules={"both": str(adapters["both"])})
    params = SamplingParams(temperature=0.0, max_new_tokens=3, logprobs=2,
                            structured_outputs=StructuredOutputs(regex="(cat|dog)"))
    alone = engine.generate([STEER], params)[0]
    mixed, steered = engine.generate([STEER, STEER], [params, greedy()],
                                     adapters=[None, "both"])
    assert mixed.token_ids == alone.token_ids and mixed.text in ("cat", "dog")
    assert [[i for i, _ in lp.top] for lp in mixed.logprobs] == \
        [[i for i, _ in lp.top] for lp in alone.logprobs]
    assert [lp.logprob for lp in mixed.logprobs] == \
        pytest.approx([lp.logprob for lp in alone.logprobs], abs=1e-5)
    assert ADDED[0] in steered.text  # the step was a wide one


def test_trainable_tokens_only_on_an_untied_base_equals_peft(tiny_models, tmp_path):
    """Llama (untied head), ``trainable_token_indices`` over the added ids and no lm_head in
    ``modules_to_save``: PEFT's ``save_pretrained`` saves the resized head whole
    (``save_embedding_layers="auto"``), which PeftModel serves; so does the engine."""
    base = tiny_models("llama")
    ad = make_vocab_adapter(base, tmp_path / "tokens_only", 41,
                            trainable_token_indices=[7, *NEW_IDS])
    saved = safetensors.torch.load_file(ad / "adapter_model.safetensors")
    assert "base_model.model.lm_head.weight" in saved, sorted(saved)  # the resized head
    engine = LLMEngine(model=base, dtype="float32", max_loras=1, max_lora_rank=8,
                       max_model_len=128, lora_modules={"t": str(ad)})
    ext = extended_tokenizer(base)
    outs = engine.generate(TEXTS, greedy(), adapters=["t"] * len(TEXTS))
    for text, out in zip(TEXTS, outs):
        prompt = ext(text).input_ids
        assert out.prompt_token_ids == prompt
        tokens, logprobs = peft_oracle(base, ad, prompt, NEW, len(ext))
        assert out.token_ids == tokens, text
        assert [lp.logprob for lp in out.logprobs] == pytest.approx(logprobs, abs=2e-3), text
        assert out.text == ext.decode(tokens, skip_special_tokens=True)
    engine.check()
