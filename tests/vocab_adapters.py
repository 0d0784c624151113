"""Adapters that bring their own tokenizer, made as a fine-tune that adds tokens makes
them (issue 46 item 1): the base's tokenizer plus ADDED (``add_tokens``), the base model
resized to it (``resize_token_embeddings``: transformers' random init of the new rows),
a PEFT LoRA with ``modules_to_save=[embed_tokens, lm_head]`` or ``trainable_token_indices``
over the new ids, saved by PEFT's ``save_pretrained`` with its defaults (which, for a resized
vocabulary, also saves its copies of the base layers) and ``tokenizer.save_pretrained``.

The head row of the first added token is steered (1.5 × the row of the token the adapter
would pick after STEER) so that greedy answers hold added tokens: the text the engine
detokenizes must show them. The oracle (``peft_oracle``) is PeftModel over the base resized
to the adapter's tokenizer, as its user serves it with transformers."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import greedy_logprobs, make_adapter

ADDED = ["<|judge|>", "<|verdict|>"]
BASE_VOCAB = 384  # tests/conftest.py's TINY_COMMON
NEW_IDS = [BASE_VOCAB, BASE_VOCAB + 1]
STEER = "the cat <|judge|> sql"


def kinds(tied: bool) -> dict[str, dict]:
    """PEFT's two ways to train the added tokens: whole tables, or trainable tokens (on an
    untied base with the head saved whole, as the new tokens' head rows must be trained)."""
    tokens: dict = {"trainable_token_indices": [7, *NEW_IDS]}
    if not tied:
        tokens["modules_to_save"] = ["lm_head"]
    return {"both": {"modules_to_save": ["embed_tokens", "lm_head"]}, "tokens": tokens}


def extended_tokenizer(base: Path):
    tok = AutoTokenizer.from_pretrained(base)
    tok.add_tokens(ADDED)
    return tok


def make_vocab_adapter(base: Path, out: Path, seed: int, **token_kwargs) -> Path:
    return make_peft_adapter(base, out, seed, extended_tokenizer(base), **token_kwargs)


def make_peft_adapter(base: Path, out: Path, seed: int, tokenizer=None,
                      strong_rows: list[int] | None = None, **token_kwargs) -> Path:
    """A PEFT LoRA adapter on q/v with ``token_kwargs`` (trainable_token_indices /
    modules_to_save), saved by PEFT: with ``tokenizer`` (which adds tokens), over the base
    resized to it, its head steered (``_steer``) and the tokenizer saved beside; every
    trainable parameter perturbed (``_perturb``)."""
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if tokenizer is not None:
        model.resize_token_embeddings(len(tokenizer))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        lora_dropout=0.0, task_type="CAUSAL_LM", **token_kwargs)
    model = get_peft_model(model, config)
    with torch.no_grad():
        _perturb(model, strong_rows)
        if tokenizer is not None:
            _steer(model, tokenizer, token_kwargs)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def _perturb(model: PeftModel, strong_rows: list[int] | None) -> None:
    """LoRA weights ~ N(0, 0.15); the trained rows (trainable tokens' rows, a
    modules_to_save copy) moved off the base's by N(0, 0.05), and with ``strong_rows`` by a
    further N(0, 0.6) (a table's rows at those ids; trainable tokens' rows all), so that
    greedy choices move."""
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.normal_(0.0, 0.15)
        elif p.requires_grad:
            p.add_(torch.randn_like(p) * 0.05)
            if strong_rows is None:
                continue
            if p.shape[0] > len(strong_rows):
                p[strong_rows] += torch.randn(len(strong_rows), p.shape[1]) * 0.6
            else:
                p.add_(torch.randn_like(p) * 0.6)


def adapters_by_arch(tiny_models: Callable[[str], Path], tmp_path_factory, name: str,
                     kinds_of: Callable[[str], dict[str, dict]], first_seed: int,
                     make: Callable[..., Path]) -> Callable[[str], dict[str, Path]]:
    """A module's ``made(arch) -> {kind: adapter dir}`` (plus "plain": a LoRA-only
    adapter), each arch's made once: ``make(base, dir, seed, **kinds_of(arch)[kind])``, the
    seeds counted from ``first_seed``."""
    cache: dict[str, dict[str, Path]] = {}

    def get(arch: str) -> dict[str, Path]:
        if arch not in cache:
            base, root = tiny_models(arch), tmp_path_factory.mktemp(f"{name}_{arch}")
            cache[arch] = {kind: make(base, root / kind, seed, **kw) for seed, (kind, kw)
                           in enumerate(kinds_of(arch).items(), first_seed)}
            cache[arch]["plain"] = make_adapter(base, root / "plain", r=4, seed=3, scale=0.15)
        return cache[arch]

    return get


def _steer(model: PeftModel, tok, token_kwargs: dict) -> None:
    """The head row of ADDED[0] := 1.5 × the head row of STEER's greedy next token."""
    ids = torch.tensor([tok(STEER).input_ids])
    top = int(model.eval()(ids).logits[0, -1].argmax())
    indices = token_kwargs.get("trainable_token_indices")
    params = dict(model.named_parameters())
    head = [p for n, p in params.items() if "lm_head.modules_to_save" in n]
    if head:  # the head is saved whole
        head[0][NEW_IDS[0]] = 1.5 * head[0][top]
        return
    row = model.get_input_embeddings()(torch.tensor([top]))[0]  # tied: the head's row
    delta = next(p for n, p in params.items() if "trainable_tokens_delta" in n)
    delta[indices.index(NEW_IDS[0])] = 1.5 * row


def peft_oracle(base: Path, adapter: Path | None, prompt: list[int], new: int,
                vocab: int | None = None) -> tuple[list[int], list[float]]:
    """PEFT's greedy tokens and logprobs (float32); ``vocab``: the base resized first."""
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if vocab is not None:
        model.resize_token_embeddings(vocab)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    return greedy_logprobs(model.eval(), prompt, new)
