"""Page and slot allocation with generation numbers (torch-free; ARCHITECTURE.md invariant 2).

Every allocation bumps the resource's generation, so a (id, generation) pair names one tenancy:
a reference kept past a free is detectably stale. The free list is FIFO so a freed id is reused
as late as possible, which gives a stale reference the longest chance to be caught.
"""

from __future__ import annotations

from collections import deque
from typing import NamedTuple


class AllocatorError(RuntimeError):
    """Ownership was violated: a bug in the caller, never a normal condition."""


class DoubleFree(AllocatorError):
    pass


class StaleGeneration(AllocatorError):
    pass


class OutOfResources(AllocatorError):
    pass


class Handle(NamedTuple):
    id: int
    generation: int


class GenerationalAllocator:
    """A fixed set of ids (pages or slots), each free or held by one named owner."""

    def __init__(self, kind: str, capacity: int):
        if capacity <= 0:
            raise ValueError(f"{kind} capacity must be positive, got {capacity}")
        self.kind = kind
        self.capacity = capacity
        self._free: deque[int] = deque(range(capacity))
        self._generation = [0] * capacity
        self._owner: list[str | None] = [None] * capacity
        self._handouts: list[Handle] = []  # since the last `drain_handouts`


    @property
    def num_free(self) -> int:
        return len(self._free)

    def allocate(self, owner: str, count: int = 1) -> list[Handle]:
        """All `count` ids or none."""
        if count > len(self._free):
            raise OutOfResources(f"{owner} asked for {count} {self.kind}s, {len(self._free)} free")
        handles = []
        for _ in range(count):
            i = self._free.popleft()
            self._generation[i] += 1
            self._owner[i] = owner
            handles.append(Handle(i, self._generation[i]))
        self._handouts += handles
        return handles

    def drain_handouts(self) -> list[Handle]:
        """Every (id, generation) allocated since the last call: the tenancies the pools must learn
        before any reader or writer names them (they accept only an id's current generation)."""
        handouts, self._handouts = self._handouts, []
        return handouts

    def free(self, handle: Handle) -> None:
        self.check(handle)
        self._owner[handle.id] = None
        self._free.append(handle.id)

    def reassign(self, handle: Handle, owner: str) -> None:
        """Hands a held id to another owner (a request's full page to the prefix cache), same tenancy."""
        self.check(handle)
        self._owner[handle.id] = owner

    def check(self, handle: Handle) -> None:
        """Raises unless `handle` names the current tenancy of a held id."""
        i, generation = handle
        if not 0 <= i < self.capacity:
            raise AllocatorError(f"{self.kind} {i} out of range 0..{self.capacity - 1}")
        if generation != self._generation[i]:
            raise StaleGeneration(f"{self.kind} {i} generation {generation} is stale (now {self._generation[i]})")
        if self._owner[i] is None:
            raise DoubleFree(f"{self.kind} {i} generation {generation} is already free")

    def holders(self) -> dict[str, list[int]]:
        """Owner -> ids it holds, in id order (for /debug/requests)."""
        held: dict[str, list[int]] = {}
        for i, owner in enumerate(self._owner):
            if owner is not None:
                held.setdefault(owner, []).append(i)
        return held


class PageSlotAllocator:
    """The pages of the KV pools and the per-request state slots of one instance, and the prefix
    cache's boundary snapshots (slot-sized units after the slots in the pools; docs/PREFIX_CACHE.md)."""

    def __init__(self, num_pages: int, num_slots: int, num_snapshots: int = 0):
        self.pages = GenerationalAllocator("page", num_pages)
        self.slots = GenerationalAllocator("slot", num_slots)
        self.snapshots = GenerationalAllocator("snapshot", num_snapshots) if num_snapshots else None

    def drain_handouts(self) -> tuple[tuple[Handle, ...], tuple[Handle, ...]]:
        """(pages, slot units) allocated since the last call; snapshots as the slot-sized units they
        are in the pools, after the slots."""
        slots = self.slots.drain_handouts()
        if self.snapshots is not None:
            slots += [Handle(self.snapshot_unit(h), h.generation) for h in self.snapshots.drain_handouts()]
        return tuple(self.pages.drain_handouts()), tuple(slots)

    def snapshot_unit(self, snapshot: Handle) -> int:
        """The pools' slot-sized unit of a snapshot: snapshot units follow the slots."""
        return self.slots.capacity + snapshot.id

    def snapshot(self) -> dict:
        return {
            "free_pages": self.pages.num_free,
            "total_pages": self.pages.capacity,
            "free_slots": self.slots.num_free,
            "total_slots": self.slots.capacity,
        }
