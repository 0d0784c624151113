"""An activated LoRA through both fronts: a base conversation, then the same conversation
with the adapter's invocation on the aLoRA; the base model's blocks are reused (gRPC: the
reply's cached prompt tokens; HTTP: the engine's computed prompt tokens), and the answer
equals PEFT's aLoRA model."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

INVOKE = [41, 42, 43]
NEW = 5
BLOCK = 16  # the engine's default block size


def make_alora(base_dir: Path, out_dir: Path) -> Path:
    torch.manual_seed(5)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj", "down_proj"],
                   lora_dropout=0.0, alora_invocation_tokens=INVOKE, task_type="CAUSAL_LM"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0.0, 0.3)
    model.save_pretrained(out_dir)
    return out_dir


def peft_greedy(base_dir: Path, adapter: Path, prompt: list[int]) -> list[int]:
    model = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32), adapter).eval()
    out = model.generate(torch.tensor([prompt]), max_new_tokens=NEW, min_new_tokens=NEW,
                         do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.fixture(scope="module")
def alora(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_alora(tiny_llama, tmp_path_factory.mktemp("alora") / "judge")


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, alora: Path) -> Any:
    return serve(lambda: make_engine(tiny_llama, lora_modules={"judge": str(alora)}),
                 http_port=0)


def conversation(seed: int) -> list[int]:
    return [(seed * 31 + 7 * i) % 300 + 50 for i in range(5 * BLOCK + 3)]  # 5 full blocks


def test_grpc_reuses_the_base_conversation(server: Any, tiny_llama: Path, alora: Path):
    talk = conversation(1)
    with server.client() as client:
        base = client.generate(prompt_token_ids=talk, max_new_tokens=1, temperature=0.0)
        assert base.usage.cached_prompt_tokens == 0
        prompt = talk + INVOKE + [60, 61]
        reply = client.generate(prompt_token_ids=prompt, adapter="judge",
                                max_new_tokens=NEW, min_new_tokens=NEW, temperature=0.0)
    assert reply.usage.cached_prompt_tokens == 5 * BLOCK
    assert list(reply.token_ids) == peft_greedy(tiny_llama, alora, prompt)


def test_http_reuses_the_base_conversation(server: Any, tiny_llama: Path, alora: Path):
    talk = conversation(2)
    url = f"{server.http_url}/v1/completions"
    base = httpx.post(url, json={"model": "", "prompt": talk, "max_tokens": 1,
                                 "temperature": 0}, timeout=60).json()
    assert base["usage"]["prompt_tokens"] == len(talk)
    prompt = talk + INVOKE + [62]
    before = server.engine.stats()["prompt_tokens_computed"]  # HTTP's usage has no cache
    body = httpx.post(url, json={"model": "judge", "prompt": prompt, "max_tokens": NEW,
                                 "min_tokens": NEW, "temperature": 0}, timeout=60).json()
    assert body["usage"]["prompt_tokens"] == len(prompt), body
    computed = server.engine.stats()["prompt_tokens_computed"] - before
    assert computed == len(prompt) - 5 * BLOCK
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    want = tokenizer.decode(peft_greedy(tiny_llama, alora, prompt))
    assert body["choices"][0]["text"].strip() == want.strip()
