"""The real embedded model: the engine's greedy output equals transformers', and
``loraplex generate`` answers with no argument but the question."""

from __future__ import annotations

import pytest
import torch
from loraplex import LLMEngine, SamplingParams
from loraplex.engine.embedded_model import ensure_default_model
from transformers import AutoModelForCausalLM

from tests.conftest import one_thread

QUESTIONS = ["What is the capital of France?", "Name three colours."]


@pytest.fixture(scope="module")
def smollm2():
    return ensure_default_model(progress=False)


def test_greedy_equals_transformers_on_smollm2(smollm2):
    engine = LLMEngine(model=smollm2, dtype="float32", max_model_len=512)
    tok = engine.tokenizer
    texts = [tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                     add_generation_prompt=True) for q in QUESTIONS]
    prompts = [tok(t, add_special_tokens=False).input_ids for t in texts]
    params = SamplingParams(temperature=0.0, max_new_tokens=8, min_new_tokens=8)
    outs = engine.generate(prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(smollm2, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        with one_thread():  # 1.6 s of CPU against 8.6-10.8 s on 2 threads (load ~7)
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8,
                              do_sample=False)[0, len(prompt):].tolist()
        assert out.token_ids == ref
    assert engine.block_manager.num_used_blocks == 0


def test_loraplex_generate_answers_with_the_default_model(capsys, smollm2):
    from loraplex.cli import main

    code = main(["generate", "What is the capital of France?", "--max-new-tokens", "16"])
    assert code in (0, None)
    assert "Paris" in capsys.readouterr().out
