"""POST /tokenize and /detokenize (vLLM's): the served tokenizer, for clients that count or
build prompts in token ids. ``model``, when given, must name the base model or an adapter
(they share the tokenizer)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request

from .. import adapter_ops
from ..auth import Scope
from ..prompt import resolve_prompt
from ..state import ServerState
from .fields import check_fields
from .protocol import DetokenizeRequest, TokenizeRequest
from .request_convert import chat_turns
from .route_auth import require, server_state

router = APIRouter(dependencies=[Depends(require(Scope.API))])


async def _tokenizer(state: ServerState, model: str | None) -> Any:
    engine = state.require_engine()
    adapter = state.adapter_of(model or "")
    if adapter is not None:
        names = {a.name for a in await adapter_ops.list_adapters(state)}
        if adapter not in names:
            raise engine.engine.unknown_adapter(adapter)
    tokenizer = engine.engine.tokenizer_for(adapter)  # an adapter's own, if it brings one
    if tokenizer is None:
        raise ValueError("this model has no tokenizer")
    return tokenizer


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> dict[str, Any]:
    state = server_state(request)
    check_fields(body, {})
    tokenizer = await _tokenizer(state, body.model)
    # on the engine's InputProcessor thread: a long prompt does not stall the loop
    ids = await state.require_engine().processor.run(_token_ids, body, tokenizer)
    return {"count": len(ids), "max_model_len": state.require_engine().engine.max_model_len,
            "tokens": ids, "token_strs": None}


def _token_ids(body: TokenizeRequest, tokenizer: Any) -> list[int]:
    if body.messages is not None:
        ids = resolve_prompt(tokenizer, turns=chat_turns(body.messages))
        assert isinstance(ids, list)
        return ids
    if body.prompt is not None:
        return list(tokenizer(body.prompt, add_special_tokens=body.add_special_tokens).input_ids)
    raise ValueError("give prompt (text) or messages (chat) to tokenize")


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> dict[str, str]:
    state = server_state(request)
    tokenizer = await _tokenizer(state, body.model)
    engine = state.require_engine().engine
    vocab = engine.base.hf_config.vocab_size
    if tokenizer is not engine.tokenizer:  # an adapter's own: the base's and its added ids
        vocab = max(vocab, len(tokenizer))
    bad = [t for t in body.tokens if t >= vocab]
    if bad:
        raise ValueError(f"token id {bad[0]} is out of range: ids must be in [0, {vocab})")
    return {"prompt": tokenizer.decode(body.tokens)}
