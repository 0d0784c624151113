"""GET /v1/models and POST /v1/load_lora_adapter, /v1/unload_lora_adapter: model cards
for the base model and every adapter, and the admin operations of server/adapter_ops.py
(``app.state.adapters``: the AdapterAdmin RPCs' code path, the same name rules, adapter
roots and admin token)
with vLLM's bodies: a plain-text success message, or an error body (400 / 404).
``load_inplace`` (vLLM's) swaps a loaded name for a new version; without it a loaded name is
a 400. Adapter cards and the load answer carry the adapter's version (``version``, the
``loraplex-adapter-version`` header)."""

from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import PlainTextResponse

from ...lora.cached_adapter import AdapterInfo
from .. import adapter_ops
from ..auth import Scope
from ..state import ServerState
from .protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .route_auth import require, server_state

OWNED_BY = "loraplex"
router = APIRouter()


VERSION_HEADER = "loraplex-adapter-version"  # the adapter version a response ran on


def _card(state: ServerState, model_id: str, root: str, parent: str | None, created: int
          ) -> dict[str, Any]:
    engine = state.require_engine(while_draining=True).engine
    return {"id": model_id, "object": "model", "created": created, "owned_by": OWNED_BY,
            "root": root, "parent": parent, "max_model_len": engine.max_model_len,
            "permission": []}


def _adapter_card(state: ServerState, a: AdapterInfo, created: int) -> dict[str, Any]:
    """An adapter's card: the base's fields plus ``version`` (loraplex's)."""
    return {**_card(state, a.name, str(a.path), state.model_name, created),
            "version": a.version}


def model_cards(state: ServerState, adapters: list[AdapterInfo]) -> list[dict[str, Any]]:
    """The base model first (parent null), then each adapter (parent = the base's id)."""
    created = int(time.time())
    base_root = str(state.require_engine(while_draining=True).engine.base.path)
    base = _card(state, state.model_name, base_root, None, created)
    # loraplex's: what the base weights are (format, bits, bytes; quant_modules.WeightsInfo)
    base["weights"] = state.require_engine(while_draining=True).engine.base.weights.as_dict()
    cards = [base]
    cards += [_adapter_card(state, a, created) for a in adapters]
    return cards


@router.get("/v1/models", dependencies=[Depends(require(Scope.API))])
async def list_models(request: Request) -> dict[str, Any]:
    state = server_state(request)
    adapters = await adapter_ops.list_adapters(state, while_draining=True)
    return {"object": "list", "data": model_cards(state, adapters)}


@router.post("/v1/load_lora_adapter", dependencies=[Depends(require(Scope.ADMIN))])
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request
                            ) -> PlainTextResponse:
    info = await request.app.state.adapters.load(body.lora_name, body.lora_path,
                                                 replace=body.load_inplace)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.",
                             headers={VERSION_HEADER: str(info.version)})


@router.post("/reset_prefix_cache", dependencies=[Depends(require(Scope.ADMIN))])
async def reset_prefix_cache(request: Request) -> PlainTextResponse:
    """vLLM's route: forget every cached prefix block."""
    await adapter_ops.reset_prefix_cache(server_state(request))
    return PlainTextResponse("Success: prefix cache reset.")


@router.post("/v1/unload_lora_adapter", dependencies=[Depends(require(Scope.ADMIN))])
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request
                              ) -> PlainTextResponse:
    await request.app.state.adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
