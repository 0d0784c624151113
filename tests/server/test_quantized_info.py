"""A GGUF file served as it is: GetServerInfo, GET /v1/models and the start-up log say what
the weights are (format, bits, bytes), and a request runs on them."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.gguf_files import write_gguf


@pytest.fixture(scope="module")
def server(serve, make_engine, tiny_llama: Path, tmp_path_factory) -> Any:
    path = write_gguf(tiny_llama, tmp_path_factory.mktemp("gguf") / "tiny.gguf")
    return serve(lambda: make_engine(path), http_port=0)


def test_server_info_describes_the_quantized_weights(server: Any) -> None:
    weights = server.engine.base.weights
    assert weights.format == "Q8_0+Q4_1+Q4_0" and 4 < weights.bits < 8.5
    with server.client() as client:
        info = client.server_info()
        reply = client.generate(prompt_token_ids=[5, 6, 7], temperature=0.0, max_new_tokens=3)
    assert (info.weights_format, info.weights_bytes) == (weights.format, weights.bytes)
    assert info.weights_bits == pytest.approx(weights.bits)
    assert info.model.endswith("tiny.gguf") and len(reply.token_ids) == 3


def test_models_card_describes_the_quantized_weights(server: Any) -> None:
    cards = httpx.get(f"{server.http_url}/v1/models", timeout=30).json()["data"]
    weights = server.engine.base.weights
    assert cards[0]["weights"] == {"format": weights.format, "dtype": "float32",
                                   "bits": round(weights.bits, 3), "bytes": weights.bytes}


def test_start_up_log_names_the_format(make_engine, tiny_llama: Path, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    path = write_gguf(tiny_llama, tmp_path / "tiny.gguf")
    with caplog.at_level(logging.INFO, logger="loraplex"):
        make_engine(path)
    assert any("Q8_0+Q4_1+Q4_0 weights" in r.getMessage() and "bits a weight" in r.getMessage()
               for r in caplog.records)


def test_a_gptq_checkpoint_is_named_gptq(serve, make_engine, tiny_llama: Path,
                                         tmp_path_factory, caplog: pytest.LogCaptureFixture
                                         ) -> None:
    """A GPTQ checkpoint (repacked into int4 at load): "gptq:int4" in GetServerInfo, the
    /v1/models card and the start-up log, 4 to 5 bits a weight (int4 + its group scales)."""
    from tests.gptq_awq_files import Scheme, write_quantized

    root = tmp_path_factory.mktemp("gptq")
    quant, _ = write_quantized(tiny_llama, root / "quant", root / "ref", Scheme("gptq", 32))
    with caplog.at_level(logging.INFO, logger="loraplex"):
        server = serve(lambda: make_engine(quant), http_port=0)
        weights = server.engine.base.weights
    assert weights.format == "gptq:int4" and 4 < weights.bits < 6
    with server.client() as client:
        info = client.server_info()
    assert (info.weights_format, info.weights_bytes) == ("gptq:int4", weights.bytes)
    cards = httpx.get(f"{server.http_url}/v1/models", timeout=30).json()["data"]
    assert cards[0]["weights"]["format"] == "gptq:int4"
    assert any("gptq:int4 weights" in r.getMessage() for r in caplog.records)
