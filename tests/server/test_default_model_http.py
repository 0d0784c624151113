"""`loraplex serve` with no --model, as `make serve` runs it: the embedded default served
from its own GGUF (Q4_1 linears, a Q8_0 tied embedding; --quantization auto) with the demo
adapters, asked through the official ``openai`` client. Its greedy tokens and logprobs equal
transformers + PEFT on transformers' own dequantization of the same GGUF (the float32
conversion, ``--quantization none``'s model, whose logits equal transformers' GGUF loader
bit for bit: tests/test_embedded_model.py), base and adapters asked at once."""

from __future__ import annotations

import re
import signal
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from loraplex.client import Client
from loraplex.engine.embedded_model import ensure_default_gguf, ensure_default_model
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import one_thread
from tests.server.conftest import launch_serve, wait_until

ADAPTERS = Path(__file__).resolve().parents[2] / "adapters"
NAMES = ("", "caps", "json", "pirate")  # the README's four requests: base, then each
QUESTION = "What is the capital of France?"
NEW = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str]]:
    """(the HTTP base URL, the served model's name) of `loraplex serve` with no --model."""
    ensure_default_gguf(progress=False)  # fetched once per machine, outside the timeouts
    log_path = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [sys.executable, "-m", "loraplex.cli", "serve", "--port", "0", "--http-port", "0",
           "--device", "cpu", "--dtype", "float32", "--max-model-len", "256"]
    proc, port = launch_serve(cmd, log_path, timeout=300)  # the real model, 2 cores
    try:
        wait_until(lambda: "OpenAI-compatible HTTP on" in log_path.read_text(), timeout=60,
                   what="the HTTP front")
        http_port = re.search(r"HTTP on http://127\.0\.0\.1:(\d+)", log_path.read_text())[1]
        with Client(f"127.0.0.1:{port}") as client:
            client.wait_until_serving(timeout=120)
            info = client.server_info(timeout=30)
        assert info.weights_format == "Q4_1+Q8_0" and info.weights_bytes < 100 * 2**20, info
        assert "weights of " in log_path.read_text() and "Q4_1+Q8_0 weights" in \
            log_path.read_text()  # the start-up log says what is served
        oai = openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none",
                            max_retries=0, timeout=120)
        yield f"http://127.0.0.1:{http_port}/v1", oai.models.list().data[0].id
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except Exception:  # noqa: BLE001 - a server that will not drain is killed
            proc.kill()


def _ask(url: str, model: str) -> Any:
    oai = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=120)
    return oai.chat.completions.create(
        model=model, messages=[{"role": "user", "content": QUESTION}], temperature=0.0,
        max_tokens=NEW, logprobs=True,
        extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})


def _peft_oracle(ref_dir: Path) -> PeftModel:
    """The float32 conversion loaded once, every demo adapter on it by its name (PEFT's
    ``load_adapter``; ``set_adapter`` picks one, ``disable_adapter`` gives the base)."""
    base = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, ADAPTERS / NAMES[1], adapter_name=NAMES[1])
    for name in NAMES[2:]:
        model.load_adapter(ADAPTERS / name, adapter_name=name)
    return model.eval()


def _oracle_logits(model: PeftModel, name: str, prompt: list[int],
                   tokens: list[int]) -> torch.Tensor:
    """The oracle's float32 logits of each of ``tokens`` after ``prompt`` (row j predicts
    token j; ignore_eos: EOS may be among them), under adapter ``name`` ("" = the base)."""
    ids = torch.tensor([prompt + tokens])
    # one thread: bit-equal logprobs to 2 threads, 0.3 s of CPU against 1-4.4 s a forward
    # with 2 OpenMP threads on 2 busy cores (load ~6)
    with torch.no_grad(), one_thread():
        if not name:
            with model.disable_adapter():
                logits = model(ids).logits
        else:
            model.set_adapter(name)
            logits = model(ids).logits
    return logits[0, len(prompt) - 1:-1].float()


def test_default_model_card_says_quantized(server: tuple[str, str]) -> None:
    url, base = server
    oai = openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=60)
    cards = {m.id: m.model_dump() for m in oai.models.list().data}
    assert set(NAMES[1:]) <= set(cards)
    weights = cards[base]["weights"]
    assert weights["format"] == "Q4_1+Q8_0" and weights["dtype"] == "float32"
    assert 4 < weights["bits"] < 6 and weights["bytes"] < 100 * 2**20  # 538 MB as float32


def test_default_served_quantized_equals_transformers_peft(server: tuple[str, str]) -> None:
    url, base = server
    with ThreadPoolExecutor(len(NAMES)) as pool:  # base and adapters in the same batches
        replies = list(pool.map(lambda a: _ask(url, a or base), NAMES))
    ref_dir = ensure_default_model(progress=False)
    tok = AutoTokenizer.from_pretrained(ref_dir)
    text = tok.apply_chat_template([{"role": "user", "content": QUESTION}],
                                   add_generation_prompt=True, tokenize=False)
    prompt = tok(text, add_special_tokens=False).input_ids
    model = _peft_oracle(ref_dir)
    for name, reply in zip(NAMES, replies):
        assert reply.usage.prompt_tokens == len(prompt), name
        got = reply.choices[0].logprobs.content
        tokens = [int(c.token.removeprefix("token_id:")) for c in got]
        assert len(tokens) == NEW, name
        ref = torch.log_softmax(_oracle_logits(model, name, prompt, tokens), -1)
        assert tokens == ref.argmax(-1).tolist(), name  # greedy: each the oracle's argmax
        assert [c.logprob for c in got] == pytest.approx(
            ref.gather(1, torch.tensor(tokens)[:, None])[:, 0].tolist(), abs=5e-3), name
