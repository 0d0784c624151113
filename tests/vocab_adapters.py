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

from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import greedy_logprobs

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
    tok = extended_tokenizer(base)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.resize_token_embeddings(len(tok))
    config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                        lora_dropout=0.0, task_type="CAUSAL_LM", **token_kwargs)
    model = get_peft_model(model, config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.15)
            elif p.requires_grad:
                p.add_(torch.randn_like(p) * 0.05)
        _steer(model, tok, token_kwargs)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


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
