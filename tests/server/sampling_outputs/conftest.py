"""The sampling-outputs tests' shared set-up (test_http.py: the HTTP front with the
``openai`` SDK; test_grpc.py: the gRPC front with loraplex's clients): one real server per
module serving adapter "a", the clients users run, and the oracle (PEFT's or transformers'
float32 ``log_softmax`` of the same tokens, never the engine's own numbers)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch

from tests.conftest import one_thread

ATOL = 2e-4  # float32 engine vs float32 transformers: summation order only
PROMPT = "the cat is on the table with a dog"
CHAT = [{"role": "user", "content": "the cat is on the table"}]
GREEDY = {"temperature": 0.0}
IGNORE_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tiny_adapters: Callable[[str], Path]) -> Any:
    return serve(lambda: make_engine(tiny_llama, lora_modules={"a": str(tiny_adapters("a0"))}),
                 http_port=0)


@pytest.fixture(scope="module")
def oai(server: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.http_url}/v1", api_key="none", max_retries=0,
                         timeout=120)


@pytest.fixture(scope="module")
def grpc_client(server: Any):
    with server.client() as c:
        yield c


@pytest.fixture(scope="module")
def oracle(tiny_llama: Path, tiny_adapters: Callable[[str], Path]
           ) -> Callable[[str, list[int]], torch.Tensor]:
    """oracle(model, ids)[j] = log p(. | ids[:j+1]) in float32, from transformers (base)
    or PEFT (adapter "a")."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    models: dict[str, Any] = {}

    def get(model: str) -> Any:
        if model not in models:
            hf = AutoModelForCausalLM.from_pretrained(tiny_llama, torch_dtype=torch.float32)
            if model == "a":
                hf = PeftModel.from_pretrained(hf, tiny_adapters("a0"))
            models[model] = hf.eval()
        return models[model]

    def logprobs(model: str, ids: list[int]) -> torch.Tensor:
        with torch.no_grad(), one_thread():
            logits = get(model)(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, dim=-1)

    return logprobs


def model_name(server: Any, name: str) -> str:
    return server.server.state.model_name if name == "base" else name


def ids_of(server: Any, text: str) -> list[int]:
    return list(server.engine.tokenizer(text).input_ids)


def chat_ids(server: Any) -> list[int]:
    r = httpx.post(f"{server.http_url}/tokenize", json={"messages": CHAT}, timeout=60)
    return r.json()["tokens"]


def word_of(server: Any, token_id: int) -> str:
    return server.engine.tokenizer.decode([token_id])
