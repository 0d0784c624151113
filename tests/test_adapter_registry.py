"""The cluster's adapter registry (server/ray/registry.py) as a plain object: versions,
refusals, what ``wait_applied`` waits for, and a registry made again over the same store
(Ray restarting the actor) resuming its adapters, version and members."""

from __future__ import annotations

import asyncio
from typing import Any

from loraplex.server.ray.registry import AdapterRegistry


class DictStore:
    """A RegistryStore in memory (the cluster's is GcsStore, tested through Ray)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None
        self.saves = 0

    def load(self) -> dict[str, Any] | None:
        return self.state

    def save(self, state: dict[str, Any]) -> None:
        self.state, self.saves = state, self.saves + 1


def test_changes_get_growing_versions_and_refusals_say_why() -> None:
    async def run() -> None:
        reg = AdapterRegistry({"base-a": "/a"})
        # the launch is change 1: preloaded adapters hold the version each replica's engine
        # gave their first load, so no later load of theirs repeats it (issue 42, item 11)
        launch = reg.snapshot().entries["base-a"]
        assert launch.preloaded and launch.version == reg.version == 1
        assert (await reg.register("base-a", "/a2", replace=True)).version == 2
        assert AdapterRegistry().version == 0  # nothing preloaded: the first load is 1
        assert (await reg.register("x", "/x")).version == 3
        refused = await reg.register("x", "/y")
        assert refused.refused == "adapter 'x' already exists; pass replace to swap it"
        assert (await reg.register("x", "/y", replace=True)).version == 4
        assert reg.snapshot().entries["x"].path == "/y"
        assert (await reg.unregister("x")).version == 5
        assert (await reg.unregister("x")).refused == "adapter 'x' is not registered"
        # a register retried with its token (the actor restarted under the first) is the same
        first = await reg.register("t", "/t", token="call-1")
        assert await reg.register("t", "/t", token="call-1") == first and reg.version == 6
        assert (await reg.register("t", "/t", token="call-2")).refused is not None

    asyncio.run(run())


def test_wait_applied_waits_for_every_live_member() -> None:
    async def run() -> None:
        reg = AdapterRegistry()
        assert await reg.watch("r1", -1, 0.0) is not None  # joins
        assert await reg.watch("r2", -1, 0.0) is not None
        version = (await reg.register("x", "/x")).version
        r1 = asyncio.ensure_future(reg.watch("r1", 0))  # r1 sees the change...
        assert (await r1).version == version
        asyncio.ensure_future(reg.watch("r1", version, 5.0))  # ...and acknowledges it
        assert await reg.wait_applied(version, timeout=0.3) == ["r2"]
        asyncio.ensure_future(reg.watch("r2", version, 5.0))
        assert await reg.wait_applied(version, timeout=2.0) == []

    asyncio.run(run())


def test_a_registry_made_again_over_its_store_resumes() -> None:
    async def run() -> None:
        store = DictStore()
        reg = AdapterRegistry({"pre": "/pre"}, store=store)
        await reg.watch("r1", -1, 0.0)
        await reg.watch("r2", -1, 0.0)
        await reg.register("hot", "/hot", pin=True)
        version = (await reg.register("gone", "/gone")).version
        version = (await reg.unregister("gone")).version
        assert not reg.resumed

        again = AdapterRegistry({"pre": "/other"}, store=store)  # Ray's restart: same args
        assert again.resumed and again.version == version
        assert again.snapshot().entries == reg.snapshot().entries  # "hot" kept, pinned
        assert set(again.live_members()) == {"r1", "r2"}
        # the resumed members count as behind until they watch again
        assert await again.wait_applied(version, timeout=0.2) == ["r1", "r2"]
        for member in ("r1", "r2"):
            asyncio.ensure_future(again.watch(member, version, 5.0))
        assert await again.wait_applied(version, timeout=2.0) == []
        assert (await again.register("next", "/next")).version == version + 1

    asyncio.run(run())


def test_members_leaving_or_expiring_are_saved() -> None:
    async def run() -> None:
        store = DictStore()
        reg = AdapterRegistry(store=store, lease_s=0.0)
        await reg.watch("r1", -1, 0.0)
        await reg.watch("r2", -1, 0.0)
        assert store.state is not None and store.state["members"] == ["r1", "r2"]
        await reg.leave("r1")
        assert store.state["members"] == ["r2"]
        assert reg.live_members() == {}  # r2's lease (0 s) has passed
        assert store.state["members"] == []

    asyncio.run(run())
