"""The demo adapters in adapters/, served over real gRPC on the embedded default model: each
one's behaviour holds on held-out prompts, and its greedy tokens are PEFT's."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from loraplex import LLMEngine
from loraplex.server.lora_modules import demo_adapters

from tests.conftest import one_thread

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ROOT / "adapters"
NAMES = ("caps", "json", "pirate")
NEW = 48  # long enough for every held-out answer to end (EOS) before it
BASE_NEW = 16  # enough to see that the base model does not shout


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


train = _load(ADAPTERS / "train.py", "_loraplex_demo_train")  # data + checks, torch-free
PROMPTS = train.HELD_OUT[:6]

@pytest.fixture(scope="module")
def model_dir() -> Path:
    from loraplex.engine.embedded_model import ensure_default_model

    return ensure_default_model(progress=False)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[Any]:
    running = _load(ROOT / "tests" / "server" / "conftest.py", "_loraplex_server_conftest")
    srv = running.RunningServer(lambda: LLMEngine(
        model_dir, dtype="float32", device="cpu", max_model_len=256, max_num_seqs=32,
        max_num_batched_tokens=1024, lora_modules=demo_adapters(ADAPTERS)))
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def answers(server: Any) -> dict[str, list[Any]]:
    """adapter ("" = base) -> GenerateResponse per held-out prompt, all requests at once."""
    jobs = [(a, p) for a in ("", *NAMES) for p in PROMPTS]
    with server.client() as client, ThreadPoolExecutor(len(jobs)) as pool:
        futures = [pool.submit(client.generate, p, adapter=a, apply_chat_template=True,
                               temperature=0.0, max_new_tokens=NEW if a else BASE_NEW,
                               timeout=120) for a, p in jobs]
        out: dict[str, list[Any]] = {}
        for (a, _), f in zip(jobs, futures):
            out.setdefault(a, []).append(f.result())
    return out


def test_all_demo_adapters_are_registered(server: Any) -> None:
    with server.client() as client:
        infos = {i.name: i for i in client.list_adapters()}
    assert set(NAMES) <= set(infos)
    for name in NAMES:
        assert infos[name].rank == train.RANK
        assert infos[name].size_bytes <= 2 * 1024**2
    assert not set(PROMPTS) & {q for q, _, _ in train.base_examples()}, "held-out leaked"


@pytest.mark.parametrize("name", NAMES)
def test_behaviour_on_held_out_prompts(answers: dict[str, list[Any]], name: str) -> None:
    texts = [r.text for r in answers[name]]
    assert all(r.finish_reason != "length" for r in answers[name]), texts
    assert all(train.CHECKS[name](t) for t in texts), texts
    if name == "caps":  # the behaviour comes from the adapter, not the base
        base = [r.text for r in answers[""]]
        assert not any(train.is_caps(t) for t in base), base
    if name == "json":
        assert all(isinstance(json.loads(t), dict) for t in texts)


@pytest.fixture(scope="module")
def peft_model(model_dir: Path) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, ADAPTERS / NAMES[0], adapter_name=NAMES[0])
    for name in NAMES[1:]:
        model.load_adapter(ADAPTERS / name, adapter_name=name)
    return model.eval()


@pytest.mark.parametrize("name", NAMES)
def test_served_greedy_equals_peft(answers: dict[str, list[Any]], peft_model: Any,
                                   server: Any, name: str) -> None:
    from loraplex.server.chat import chat_prompt_ids

    tokenizer = server.engine.tokenizer
    peft_model.set_adapter(name)
    for prompt, response in list(zip(PROMPTS, answers[name]))[:2]:
        ids = chat_prompt_ids(tokenizer, prompt)
        assert response.usage.prompt_tokens == len(ids)
        with torch.no_grad(), one_thread():  # the oracle: see conftest.one_thread
            out = peft_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                                      dtype=torch.long), max_new_tokens=NEW, do_sample=False)
        assert list(response.token_ids) == out[0, len(ids):].tolist(), prompt
