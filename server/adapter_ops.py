"""Load, unload and list adapters: the admin operations, front-neutral. The gRPC
AdapterAdmin servicer and HTTP's /v1/load_lora_adapter and /v1/unload_lora_adapter call
these, so the name rules, the ``--adapter-root`` confinement and the engine calls are one
code path. ``LocalAdapters`` is what the HTTP front calls on one server; a Ray replica gives
it ``ClusterAdapters`` (server/ray/admin.py), which commits each change to every replica.

Every load (a path, an upload, the resolver) passes ``load_adapter``, which decides, once
per source, the adapter's confinement root (every file it reads, now and after an
eviction, lies under it: lora/adapter_files.py) and how messages name it: the path the
client gave, ``<upload NAME>``, ``<resolver NAME>``; never the server's directories.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, Protocol

from ..lora.cached_adapter import AdapterInfo
from .adapter_paths import check_adapter_name, check_path_loading, confine
from .state import ServerState


def source_files(state: ServerState, name: str, path: str, source: str,
                 root: Path | None = None) -> tuple[Path, Path | None, str]:
    """(the adapter dir, its confinement root, how messages name it) of a load from
    ``source``: "path" (a client's path: allowed by ``check_path_loading``, confined to the
    ``--adapter-root`` it lies under), "upload" (a directory this server wrote: confined to
    itself) or "resolver" (a directory the resolver found under ``root``)."""
    if source == "path":
        check_path_loading(state.options, state.exposed)
        resolved, under = confine(path, state.options.adapter_roots)
        return resolved, under, path
    if source == "upload":
        own = Path(path).resolve()
        return own, own, f"<upload {name}>"
    if source == "resolver":
        assert root is not None, "the resolver gives its root"
        return Path(path), root, f"<resolver {name}>"
    raise ValueError(f"unknown adapter source {source!r}")


async def load_adapter(state: ServerState, name: str, path: str, replace: bool = False,
                       pin: bool = False, source: str = "path", root: Path | None = None
                       ) -> AdapterInfo:
    """Register the PEFT dir ``path`` as ``name``; INVALID_ARGUMENT for a bad name or
    adapter, PERMISSION_DENIED outside the adapter roots (or a file that leads out of its
    root), ALREADY_EXISTS without replace. ``source`` and ``root``: ``source_files``. An
    upload's directory (not in a shared ``--upload-dir``) is removed once dropped."""
    engine = state.require_engine()
    options = state.options
    name = check_adapter_name(name, state.served_model_name)
    resolved, confined_to, shown = source_files(state, name, path, source, root)
    # Reading and validating the weights is slow (disk): it happens here, off the engine
    # thread, so running requests keep stepping; registering is quick, between steps.
    weights = await asyncio.to_thread(engine.engine.read_adapter, str(resolved), name,
                                      root=confined_to, shown=shown)
    extra: dict[str, Any] = {}
    if source == "upload" and options.upload_dir is None:
        extra["owned"] = True  # the engine's private store: gone with the adapter
    return await engine.run(lambda e: e.add_adapter(
        name, str(resolved), replace=replace, pin=pin, weights=weights, **extra))


async def unload_adapter(state: ServerState, name: str) -> None:
    """New requests for ``name`` get NOT_FOUND at once; in-flight ones finish first."""
    engine = state.require_engine()
    if not name:
        raise ValueError("adapter name is empty: give the name of a loaded adapter "
                         "(the base model cannot be unloaded)")
    await engine.run(lambda e: e.remove_adapter(name))


async def reset_prefix_cache(state: ServerState) -> None:
    """Forget every cached prefix block (vLLM's /reset_prefix_cache)."""
    engine = state.require_engine()
    await engine.run(lambda e: e.reset_prefix_cache())


async def list_adapters(state: ServerState, while_draining: bool = False
                        ) -> list[AdapterInfo]:
    engine = state.require_engine(while_draining=while_draining)
    return await engine.run(lambda e: e.list_adapters())


class AdapterOps(Protocol):
    """What HTTP's load and unload routes call: ``LocalAdapters`` or Ray's ``ClusterAdapters``."""

    async def load(self, name: str, path: str, replace: bool = False, pin: bool = False,
                   source: str = "path") -> AdapterInfo: ...

    async def unload(self, name: str) -> None: ...


class LocalAdapters:
    """load / unload on this process's engine: the admin operations of one server."""

    def __init__(self, state: ServerState):
        self.state = state

    async def load(self, name: str, path: str, replace: bool = False, pin: bool = False,
                   source: str = "path") -> AdapterInfo:
        return await load_adapter(self.state, name, path, replace=replace, pin=pin,
                                  source=source)

    async def unload(self, name: str) -> None:
        await unload_adapter(self.state, name)
