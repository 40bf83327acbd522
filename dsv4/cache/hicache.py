"""The prefix cache's host tier (HiCache): the host pool, its allocator and the fenced copies between
it and the device pools. The radix tree (dsv4/cache/radix.py) decides what moves; this moves it.

A node moves as one unit: its device page (every layer's compressed and index-key rows) and its
boundary snapshot unit go into, or come back from, one host unit, by one copy job with one fence.
Writes record the CRC-32 of what landed on the host; with `verify` (`--verify-transfers`) a load
fails unless what landed on the device has that same CRC-32.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Sequence

from dsv4.config import CopyDelay
from dsv4.memory.allocator import GenerationalAllocator, Handle
from dsv4.memory.copier import CopyEngine, Fence
from dsv4.memory.host import HostPool
from dsv4.memory.pools import StatePools

COPY_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0, 5.0)
WRITE_POLICIES = ("write_through", "write_back")


def host_units(unit_bytes: int, device_pages: int, ratio: float, size_gb: float) -> int:
    """`--hicache-size` GB of units when given, else `--hicache-ratio` x the device pages (at least one)."""
    if size_gb > 0:
        return max(1, int(size_gb * 1e9) // unit_bytes)
    return max(1, math.floor(ratio * device_pages))


class CopyLatency:
    """A histogram of copy seconds (submission to completion), kept for the Prometheus collector."""

    def __init__(self) -> None:
        self.counts = [0] * (len(COPY_SECONDS_BUCKETS) + 1)
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        self.counts[bisect_left(COPY_SECONDS_BUCKETS, seconds)] += 1
        self.total += seconds

    def buckets(self) -> list[tuple[str, int]]:
        cumulative, out = 0, []
        for le, n in zip((*map(str, COPY_SECONDS_BUCKETS), "+Inf"), self.counts, strict=True):
            cumulative += n
            out.append((le, cumulative))
        return out


class HostTier:
    def __init__(self, pools: StatePools, num_units: int, *, snapshot_unit: Callable[[Handle], int],
                 write_policy: str = "write_through", verify: bool = False, delays: Sequence[CopyDelay] = (),
                 on_copy: Callable[[], None] | None = None):
        """`snapshot_unit`: the pools' unit of a snapshot (`PageSlotAllocator.snapshot_unit`); `on_copy`: called
        on the copy thread as each copy's fence is set."""
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        self.write_policy = write_policy
        self.verify = verify
        self._pools = pools
        self._snapshot_unit = snapshot_unit
        self.pool = HostPool(pools, num_units, pin=pools.device.type == "cuda")
        self.units = GenerationalAllocator("host unit", num_units)
        self._copies = CopyEngine(pools.device, delays, on_complete=on_copy)
        # For metrics, by copy kind (radix.LOAD, radix.WRITE).
        self.copy_bytes: dict[str, int] = {}
        self.copy_seconds: dict[str, CopyLatency] = {}

    def _device(self, page: Handle, snapshot: Handle):
        return (self._pools.page_view(page.id, page.generation),
                self._pools.slot_view(self._snapshot_unit(snapshot), snapshot.generation))

    def write(self, page: Handle, snapshot: Handle, unit: Handle) -> Fence:
        """Copies a device page and snapshot into host `unit`; the fence carries the host bytes' CRC-32."""
        host = self.pool.unit(unit.id, unit.generation)
        return self._copies.submit("hicache_write", list(zip(host, self._device(page, snapshot), strict=True)),
                                   checksum=True)

    def load(self, unit: Handle, checksum: int, page: Handle, snapshot: Handle) -> Fence:
        """Copies host `unit` into a device page and snapshot; with `verify`, the job fails unless the
        device bytes have `checksum` (taken when the unit was written). The page's index-key rows are
        fingerprinted as written (`--verify-indexer`) before the fence is set."""
        host = self.pool.unit(unit.id, unit.generation)
        return self._copies.submit("hicache_load", list(zip(self._device(page, snapshot), host, strict=True)),
                                   expect=checksum if self.verify else None,
                                   then=lambda: self._pools.record_page_index_keys(page.id))

    def observe(self, fence: Fence) -> None:
        self.copy_bytes[fence.kind] = self.copy_bytes.get(fence.kind, 0) + fence.nbytes
        self.copy_seconds.setdefault(fence.kind, CopyLatency()).observe(fence.seconds)

    def close(self) -> None:
        self._copies.close()
