"""AdapterResolver: adapters found by name on first use (vLLM's filesystem resolver,
``--lora-resolver-dir DIR``; and ``--lora-resolver-hf-cache DIR``, a local Hugging Face Hub
cache read offline). A request naming an adapter that is not registered loads ``DIR/<name>``
(else the cached snapshot of the Hub repo ``<name>``) with LoadAdapter's checks, then runs
on it.

Invariants: names are LoadAdapter's (canonical: server/adapter_paths.py), and a resolved
directory lies inside DIR once symlinks are resolved (else the name is unknown: NOT_FOUND);
every file of it is confined to DIR (or to the Hub cache) when opened, now and after an
eviction, so a file that links out of it is refused (PERMISSION_DENIED, as LoadAdapter's);
concurrent first requests for a name share one read (one task per name, on the server's
event loop); the first request waits for the read, and a broken directory fails it with
LoadAdapter's error for that directory (naming it ``<resolver NAME>``, never DIR). A name
loaded meanwhile by LoadAdapter is used as it is.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from ..errors import AdapterExistsError, AdapterNotFoundError
from . import adapter_ops
from .adapter_paths import check_adapter_name
from .state import ServerState


def attach_resolver(state: ServerState) -> None:
    """With ``--lora-resolver-dir`` or ``--lora-resolver-hf-cache``: requests resolve
    unknown names through them."""
    o = state.options
    if o.lora_resolver_dir is not None or o.lora_resolver_hf_cache is not None:
        state.resolver = AdapterResolver(state, o.lora_resolver_dir, o.lora_resolver_hf_cache)


def hf_cached_snapshot(cache: Path, repo: str) -> Path | None:
    """The local snapshot of the Hub repo ``repo`` in ``cache`` (offline: no download),
    or None when the cache does not hold it."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError

    try:
        return Path(snapshot_download(repo, cache_dir=cache, local_files_only=True))
    except (LocalEntryNotFoundError, HFValidationError, FileNotFoundError):
        return None


class AdapterResolver:
    def __init__(self, state: ServerState, root: Path | None, hf_cache: Path | None = None):
        self.state = state
        self.root = root.resolve() if root is not None else None
        self.hf_cache = hf_cache.resolve() if hf_cache is not None else None
        self._reads: dict[str, asyncio.Future] = {}  # name -> its one load in flight
        self.reads = 0  # loads started, ever (tests: concurrent first uses share one)

    def registered(self, name: str) -> bool:
        engine = self.state.require_engine().engine
        return name in engine.lora.names  # one dict read: safe beside the engine thread

    async def ensure(self, name: str) -> None:
        """Return once ``name`` is registered, loading it from the resolver dir if it is
        not; NOT_FOUND when the dir has no such adapter."""
        if self.registered(name):
            return
        read = self._reads.get(name)
        if read is None:
            read = asyncio.ensure_future(self._load(name))
            self._reads[name] = read
            read.add_done_callback(lambda _: self._reads.pop(name, None))
        await asyncio.shield(read)  # a waiter that leaves does not cancel the others' read

    def path_of(self, name: str) -> tuple[Path, Path]:
        """(``DIR/name`` resolved, DIR), else (the Hub cache's snapshot of ``name``, the
        cache); NOT_FOUND when neither holds it (or ``DIR/name`` leads outside DIR).
        Messages name neither directory."""
        unknown = f"unknown adapter {name!r}: not loaded, and"
        try:
            check_adapter_name(name, None)
        except ValueError:
            raise AdapterNotFoundError(f"{unknown} not a name the resolver looks up") from None
        where = []
        if self.root is not None:
            path = Path(os.path.realpath(self.root / name))  # a loop: a path, not an error
            if not path.is_relative_to(self.root) or path == self.root:
                raise AdapterNotFoundError(f"{unknown} the resolver's {name!r} leads outside "
                                           "its directory (--lora-resolver-dir)")
            if path.is_dir():
                return path, self.root
            where.append(f"the resolver directory (--lora-resolver-dir) holds no directory "
                         f"{name!r}")
        if self.hf_cache is not None:
            snapshot = hf_cached_snapshot(self.hf_cache, name)
            if snapshot is not None and \
                    Path(os.path.realpath(snapshot)).is_relative_to(self.hf_cache):
                return snapshot, self.hf_cache
            where.append(f"the Hugging Face cache holds no repo {name!r}")
        raise AdapterNotFoundError(f"{unknown} {'; '.join(where)}")

    async def _load(self, name: str) -> None:
        path, root = self.path_of(name)
        self.reads += 1
        try:
            await adapter_ops.load_adapter(self.state, name, str(path), source="resolver",
                                           root=root)
        except AdapterExistsError:
            pass  # loaded meanwhile (LoadAdapter): use that
