"""CacheReport (mixed into AdapterCache): what the adapter cache reports, read on the
engine thread: each adapter's state and info, the lookup and load counts, how many
adapters each tier holds, and ``check``, which asserts the cache's invariants (lora/cache.py's
docstring). It reads the cache's records and tiers; it changes nothing."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

from .cached_adapter import FAILED, LOADING, ON_CPU, ON_DEVICE, ON_DISK, AdapterInfo, CachedAdapter

if TYPE_CHECKING:
    from .device_tier import DeviceTier
    from .host_tier import HostTier


class CacheReport:
    names: dict[str, CachedAdapter]
    by_id: dict[int, CachedAdapter]
    lookups: Counter[str]
    device: DeviceTier
    host: HostTier

    def state_of(self, a: CachedAdapter) -> str:
        if a.error is not None:
            return FAILED
        if self.device.slot(a) is not None:
            return ON_DEVICE
        if self.host.weights(a) is not None:
            return ON_CPU
        return LOADING if self.host.reading(a) else ON_DISK

    def _info(self, a: CachedAdapter) -> AdapterInfo:
        return a.info(self.state_of(a), self.device.slot(a))

    def list(self) -> list[AdapterInfo]:
        return [self._info(a) for a in sorted(self.names.values(), key=lambda a: a.name)]

    @property
    def counts(self) -> Counter[str]:
        """lookups_<tier>, loads_host, loads_device, compactions: a snapshot."""
        counts = Counter({f"lookups_{tier}": n for tier, n in self.lookups.items()})
        counts.update(loads_host=self.host.loads, loads_device=self.device.loads,
                      compactions=self.device.compactions)
        return counts

    @property
    def slots_in_use(self) -> int:
        """Device-resident adapters pinned by a running sequence."""
        return self.device.in_use

    @property
    def resident_count(self) -> int:
        return len(self.device.resident)

    @property
    def host_count(self) -> int:
        return self.host.held

    def check(self) -> None:
        """Assert the invariants of the module docstring (debug mode: after every step)."""
        self.device.check()
        self.host.check()
        assert self.device.slots.keys() <= self.host.copies.keys(), "on the device, not host"
        assert self.host.copies.keys() <= set(self.by_id.values()), "held, but dropped"
        for a in self.by_id.values():
            assert a.running <= a.active, f"{a.name}: more running than active"
            assert a.running == 0 or a in self.device.slots, f"{a.name} runs off the device"
