"""Load, unload and list adapters: the admin operations, front-neutral. The gRPC
AdapterAdmin servicer and HTTP's /v1/load_lora_adapter and /v1/unload_lora_adapter call
these, so the name rules, the ``--adapter-root`` confinement and the engine calls are one
code path. ``LocalAdapters`` is what the HTTP front calls on one server; a Ray replica gives
it ``ClusterAdapters`` (server/ray/admin.py), which commits each change to every replica."""

from __future__ import annotations

import asyncio
from typing import Protocol

from ..lora.cached_adapter import AdapterInfo
from .adapter_paths import check_adapter_name, confine
from .state import ServerState


async def load_adapter(state: ServerState, name: str, path: str, replace: bool = False,
                       pin: bool = False) -> AdapterInfo:
    """Register the PEFT dir ``path`` as ``name``; INVALID_ARGUMENT for a bad name or
    adapter, PERMISSION_DENIED outside the adapter roots, ALREADY_EXISTS without replace."""
    engine = state.require_engine()
    options = state.options
    name = check_adapter_name(name, options.served_model_name)
    resolved = confine(path, options.adapter_roots)
    # Reading and validating the weights is slow (disk): it happens here, off the engine
    # thread, so running requests keep stepping; registering is quick, between steps.
    weights = await asyncio.to_thread(engine.engine.read_adapter, str(resolved), name)
    return await engine.run(lambda e: e.add_adapter(
        name, str(resolved), replace=replace, pin=pin, weights=weights))


async def unload_adapter(state: ServerState, name: str) -> None:
    """New requests for ``name`` get NOT_FOUND at once; in-flight ones finish first."""
    engine = state.require_engine()
    if not name:
        raise ValueError("adapter name is empty: give the name of a loaded adapter "
                         "(the base model cannot be unloaded)")
    await engine.run(lambda e: e.remove_adapter(name))


async def list_adapters(state: ServerState, while_draining: bool = False
                        ) -> list[AdapterInfo]:
    engine = state.require_engine(while_draining=while_draining)
    return await engine.run(lambda e: e.list_adapters())


class AdapterOps(Protocol):
    """What HTTP's load and unload routes call: ``LocalAdapters`` or Ray's ``ClusterAdapters``."""

    async def load(self, name: str, path: str, replace: bool = False, pin: bool = False
                   ) -> AdapterInfo: ...

    async def unload(self, name: str) -> None: ...


class LocalAdapters:
    """load / unload on this process's engine: the admin operations of one server."""

    def __init__(self, state: ServerState):
        self.state = state

    async def load(self, name: str, path: str, replace: bool = False, pin: bool = False
                   ) -> AdapterInfo:
        return await load_adapter(self.state, name, path, replace=replace, pin=pin)

    async def unload(self, name: str) -> None:
        await unload_adapter(self.state, name)
