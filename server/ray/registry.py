"""AdapterRegistry: the cluster's one list of adapters, held by a named Ray actor.

Every replica is a *member*: it follows the registry through ``watch`` (a long poll on the
actor: the call returns as soon as the registry's version passes the one the member has
applied, or after ``timeout`` seconds with None), and it acknowledges what it has applied by
passing that version back on its next call.

Consistency (what LoadAdapter / UnloadAdapter through any replica guarantee):

- Every change (register, unregister) gets the next version; versions only grow.
- The launch is the first change when it registers adapters (``--lora-modules``): they hold
  version ``LAUNCH_VERSION`` (1), the number each replica's engine gives a name's first
  load, so the first load after them (an in-place load of a preloaded adapter included)
  is 2 or more, and a name's version never repeats on any replica.
- ``wait_applied(v)`` returns once every *live* member has acknowledged a version >= v. The
  admin path calls it before answering, so once LoadAdapter returns OK no live replica
  answers NOT_FOUND for that name, and once UnloadAdapter returns no live replica starts a
  new request for it (in-flight ones finish, as on one server).
- A replica joins with its first ``watch`` (``applied=-1``), which hands it the whole list
  atomically with its joining; it finishes applying that list inside its ``__init__``,
  before Ray Serve routes anything to it. So a replica that starts later (autoscaling, a
  restart) comes up with every registered adapter, and a change committed while it starts
  waits for it too.
- A member is live while its watch is outstanding or it was heard from within ``lease_s``
  seconds. A dead replica stops calling, so a change made right after a replica dies waits
  at most ``lease_s`` for it before that member is dropped.

Restarts: with a ``store``, every change and every member joining or leaving is saved
before it is acknowledged, and a registry made again over the same store (Ray restarting
the actor) resumes: the same version, adapters and members. A resumed member counts as
having applied nothing until it watches again (its follower retries every second), so a
change committed right after a restart still waits for every replica that was live.

This module imports no ray: the class is a plain object (unit-testable); ``launch.py``
makes it a named actor (``ray.remote(AdapterRegistry).options(name=...)``) over the GCS
store of registry_store.py.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

DEFAULT_LEASE_S = 10.0
LAUNCH_VERSION = 1  # the preloaded adapters' version: a name's first load (lora/cache.py)


@dataclass(frozen=True)
class Entry:
    """One registered adapter; ``version`` is the registry version that set it."""

    name: str
    path: str
    pin: bool = False
    preloaded: bool = False  # given at launch (--lora-modules)
    version: int = 0
    token: str = ""  # the register call that set it (a retried call is recognised)
    root: str | None = None  # every file read lies under it (lora/adapter_files.py)
    shown: str = ""  # how messages name it (server/adapter_ops.py source_files)


@dataclass(frozen=True)
class Snapshot:
    version: int
    entries: dict[str, Entry] = field(default_factory=dict)


@dataclass(frozen=True)
class Change:
    """The outcome of register / unregister: the new version, or why it was refused."""

    version: int
    refused: str | None = None


class RegistryStore(Protocol):
    """Where a registry keeps its state across restarts (a JSON-able dict)."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, state: dict[str, Any]) -> None: ...


@dataclass
class _Member:
    applied: int
    seen: float
    watching: int = 0  # outstanding watch calls


class AdapterRegistry:
    def __init__(self, preloaded: dict[str, str] | None = None,
                 lease_s: float = DEFAULT_LEASE_S, store: RegistryStore | None = None):
        self.lease_s = lease_s
        self.store = store
        self._changed: asyncio.Condition | None = None  # made on the actor's loop
        self.members: dict[str, _Member] = {}
        saved = store.load() if store is not None else None
        self.resumed = saved is not None
        if saved is not None:
            self.version = int(saved["version"])
            self.entries = {e["name"]: Entry(**e) for e in saved["entries"]}
            now = time.monotonic()
            self.members = {m: _Member(-1, now) for m in saved["members"]}
        else:
            self.version = LAUNCH_VERSION if preloaded else 0
            self.entries = {name: Entry(name, path, preloaded=True, version=LAUNCH_VERSION)
                            for name, path in (preloaded or {}).items()}
            self._save()

    def _save(self) -> None:
        if self.store is not None:
            self.store.save({"version": self.version,
                             "entries": [asdict(e) for e in self.entries.values()],
                             "members": sorted(self.members)})

    def _cond(self) -> asyncio.Condition:
        if self._changed is None:
            self._changed = asyncio.Condition()
        return self._changed

    async def _notify(self) -> None:
        cond = self._cond()
        async with cond:
            cond.notify_all()

    # ---- members ----------------------------------------------------------------------
    async def watch(self, member: str, applied: int, timeout: float = 2.0) -> Snapshot | None:
        """Acknowledge ``applied`` and wait for a newer version: the snapshot, or None
        after ``timeout`` seconds. ``applied=-1`` joins and returns the snapshot at once."""
        m = self.members.get(member)
        if m is None:
            m = self.members[member] = _Member(applied, time.monotonic())
            self._save()
        m.applied, m.seen = applied, time.monotonic()
        m.watching += 1
        await self._notify()  # wake wait_applied
        cond = self._cond()
        try:
            async with cond:
                if self.version <= applied:
                    try:
                        await asyncio.wait_for(cond.wait_for(lambda: self.version > applied),
                                               timeout)
                    except asyncio.TimeoutError:
                        return None
            return self.snapshot()
        finally:
            m.watching -= 1
            m.seen = time.monotonic()

    def touch(self, member: str) -> None:
        """A member busy applying a long snapshot is still alive."""
        if member in self.members:
            self.members[member].seen = time.monotonic()

    async def leave(self, member: str) -> None:
        if self.members.pop(member, None) is not None:
            self._save()
        await self._notify()

    def live_members(self) -> dict[str, int]:
        """member -> applied version, for the members alive now (the dead are dropped)."""
        now = time.monotonic()
        dead = [k for k, m in self.members.items()
                if not m.watching and now - m.seen > self.lease_s]
        for k in dead:
            del self.members[k]
        if dead:
            self._save()
        return {k: m.applied for k, m in self.members.items()}

    async def wait_applied(self, version: int, timeout: float = 60.0) -> list[str]:
        """Wait until every live member has applied ``version``; the members still behind
        after ``timeout`` seconds (empty: all have it)."""
        deadline = time.monotonic() + timeout
        cond = self._cond()
        while True:
            behind = [k for k, v in self.live_members().items() if v < version]
            left = deadline - time.monotonic()
            if not behind or left <= 0:
                return behind
            async with cond:
                try:  # wake on any ack, and at least every second to expire leases
                    await asyncio.wait_for(cond.wait(), min(left, 1.0))
                except asyncio.TimeoutError:
                    pass

    # ---- the list -----------------------------------------------------------------------
    def snapshot(self) -> Snapshot:
        return Snapshot(self.version, dict(self.entries))

    async def register(self, name: str, path: str, replace: bool = False,
                       pin: bool = False, token: str = "", root: str | None = None,
                       shown: str = "") -> Change:
        """Register (or with ``replace`` swap) ``name``. A call repeated with the same
        non-empty ``token`` (a retry after the actor restarted: the first may or may not
        have run) answers what the first did."""
        done = self.entries.get(name)
        if token and done is not None and done.token == token:
            return Change(done.version)
        if name in self.entries and not replace:
            return Change(self.version, f"adapter {name!r} already exists; pass replace to "
                                        "swap it")
        self.version += 1
        self.entries[name] = Entry(name, path, pin, False, self.version, token, root, shown)
        self._save()
        await self._notify()
        return Change(self.version)

    async def unregister(self, name: str) -> Change:
        """Remove ``name``; refused if it is not registered (so a retry is harmless)."""
        if name not in self.entries:
            return Change(self.version, f"adapter {name!r} is not registered")
        self.version += 1
        del self.entries[name]
        self._save()
        await self._notify()
        return Change(self.version)
