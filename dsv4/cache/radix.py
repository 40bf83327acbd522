"""The prefix cache: a radix tree over token ids at page granularity, with an optional host tier
(torch-free; the host tier's copies are `dsv4.cache.hicache.HostTier`'s).

Each node is one full page of some request's tokens, under the node of the page before it: the
page's rows (compressed main rows and index-key rows of every layer) and a boundary snapshot, the
slot state (window rings, compressor partial state incl. CSA's overlap half) of a request that has
computed exactly the tokens up to the end of that page. A request whose first k pages match a path
shares those k pages and restores its slot from the k-th node's snapshot: it resumes at k * P
exactly where a recompute would be (docs/PREFIX_CACHE.md).

Tiers. A node holds its state on the device (a page and a snapshot unit), on the host (one host
unit: page and snapshot together, with the CRC-32 taken when it was written), or both. Device
copies form a top-closed part of the tree (a node leaves the device only once none of its children
is there), so a matched path is device nodes then host nodes. A host node is loaded back into
freshly taken device units by one copy job, started (`start_pending`) once the plan that hands
those units out has been applied; until its fence completes (`loading`) no forward may read it. A node being written to the host is not evicted from the device until that write
completes: eviction waits for the fence. `write_through` writes a node when it joins the cache
(device eviction then only drops the device copy); `write_back` writes it when it is evicted.

Ownership. A node's pages, snapshot and host unit belong to the cache (allocator owner
`CACHE_OWNER`). Every request that shares a node holds a reference to it and to each node above it,
so a referenced node never has an unreferenced ancestor and `refs == 0` means the whole subtree is
unreferenced. Only unreferenced nodes leave the device, least recently used first: a page a
running request reads is never freed. Every copy names the (id, generation) of each unit it
touches, and its completion is applied only if the node still holds exactly those units. A load
whose checksum does not match marks the node broken: the requests waiting for it fail, it is never
matched again, and it leaves the tree once nothing hangs below it.

The tree decides nothing about when to cache: the scheduler inserts pages, asks for evictions and
loads, and polls for completed copies.
"""

from __future__ import annotations

import heapq
import logging
from collections.abc import Sequence

from dsv4.memory.allocator import AllocatorError, GenerationalAllocator, Handle

log = logging.getLogger(__name__)

CACHE_OWNER = "prefix-cache"
COPY_WAIT_S = 60.0  # eviction waits this long at most for a copy in flight; then the copy thread is stuck
LOAD, WRITE = "hicache_load", "hicache_write"


class CopyTimeout(RuntimeError):
    """A host-tier copy did not complete within COPY_WAIT_S: the copy thread is stuck."""


class Copy:
    """A node's copy in flight: a load into `page`/`snapshot` from `unit`, or a write of them into `unit`
    (`fence`: None while a recorded load has not started)."""

    __slots__ = ("fence", "kind", "page", "snapshot", "unit")

    def __init__(self, kind: str, fence, page: Handle, snapshot: Handle, unit: Handle):
        self.kind, self.fence, self.page, self.snapshot, self.unit = kind, fence, page, snapshot, unit


class CacheNode:
    __slots__ = ("alive", "broken", "checksum", "children", "copy", "depth", "host", "key", "last_use", "page",
                 "parent", "refs", "snapshot")

    def __init__(self, key: tuple[int, ...], parent: CacheNode | None, page: Handle, snapshot: Handle):
        self.key = key  # the page's token ids
        self.parent = parent
        self.children: dict[tuple[int, ...], CacheNode] = {}
        self.page: Handle | None = page  # device copy: page and snapshot unit, or None
        self.snapshot: Handle | None = snapshot
        self.host: Handle | None = None  # host copy, with the CRC-32 it was written with
        self.checksum: int | None = None
        self.copy: Copy | None = None
        self.depth = 1 if parent is None else parent.depth + 1  # pages from the start of the prompt
        self.refs = 0
        self.last_use = 0
        self.alive = True
        self.broken = False

    @property
    def loading(self) -> bool:
        return self.copy is not None and self.copy.kind == LOAD

    @property
    def on_device(self) -> bool:
        """A forward may read it: its device copy is complete."""
        return self.page is not None and not self.loading

    def __repr__(self) -> str:
        page = None if self.page is None else tuple(self.page)
        host = None if self.host is None else tuple(self.host)
        return f"CacheNode(depth={self.depth}, page={page}, host={host}, refs={self.refs})"


class RadixCache:
    def __init__(self, page_size: int, pages: GenerationalAllocator, snapshots: GenerationalAllocator,
                 host=None):
        """`host`: a HostTier (dsv4/cache/hicache.py), or None for a device-only cache."""
        self.page_size = page_size
        self._pages = pages
        self._snapshots = snapshots
        self.host = host
        self._roots: dict[tuple[int, ...], CacheNode] = {}
        self._pending: list[CacheNode] = []  # nodes with a load recorded, its copy not started yet
        self._in_flight: list[CacheNode] = []  # nodes with a copy started, not yet applied
        self._use = 0  # a logical clock for LRU: no wall clock in the scheduler's decisions
        self.num_nodes = 0  # nodes with a device copy (complete or loading)
        self.num_unreferenced = 0  # of those, refs == 0: each one's page can be evicted
        self.num_host = 0  # nodes with a host copy
        # Cumulative, for metrics.
        self.hit_pages = 0  # pages shared by a request, either tier
        self.hit_pages_host = 0  # of those, loaded from the host tier
        self.evicted_pages = 0  # device copies dropped to free room
        self.evicted_host_pages = 0  # host copies dropped to free room
        self.inserted_pages = 0
        self.loaded_pages = 0
        self.written_pages = 0
        self.load_failures = 0  # loads whose checksum (or copy) failed
        self.stale_completions = 0  # completions rejected: the node no longer held the units they name

    # -- lookups -------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_pages: int) -> list[CacheNode]:
        """The longest cached path of whole pages that `tokens` starts with, at most `max_pages` long,
        on either tier (never through a broken node). Marks it used (LRU); takes no reference."""
        path: list[CacheNode] = []
        children = self._roots
        P = self.page_size
        while len(path) < max_pages:
            node = children.get(tuple(tokens[len(path) * P : (len(path) + 1) * P]))
            if node is None or node.broken:
                break
            path.append(node)
            children = node.children
        self._use += 1
        for node in path:
            node.last_use = self._use
        return path

    # -- references ----------------------------------------------------------------------------------
    def acquire(self, path: Sequence[CacheNode]) -> None:
        """One more holder of every node of `path` (a root-first chain): a request shares (hits) it."""
        for node in path:
            if not node.alive or node.broken:
                raise AllocatorError(f"{node} was evicted; it cannot be shared")
            if node.refs == 0 and node.page is not None:
                self.num_unreferenced -= 1
            node.refs += 1
        self.hit_pages += len(path)
        self.hit_pages_host += sum(1 for node in path if not node.on_device)

    def release(self, path: Sequence[CacheNode]) -> None:
        """Drops one reference to every node of `path`, exactly once per `acquire` or `insert`."""
        for node in path:
            if not node.alive or node.refs <= 0:
                raise AllocatorError(f"{node} released more often than it was held")
        self._use += 1
        for node in reversed(path):
            node.refs -= 1
            node.last_use = self._use
            if node.refs == 0 and node.page is not None:
                self.num_unreferenced += 1
            if node.refs == 0 and node.broken:
                self._remove_if_empty(node)

    def insert(self, parent: CacheNode | None, key: tuple[int, ...], page: Handle, snapshot: Handle
               ) -> CacheNode | None:
        """Caches `page` (whose tokens are `key`, right after `parent`'s page; None: the first page)
        with its boundary `snapshot`; the caller holds `parent` and keeps one reference to the new
        node. None when that page is cached already: the caller keeps its page and snapshot. (A page
        cached on the host tier only takes the caller's page and snapshot as its device copy.)"""
        if len(key) != self.page_size:
            raise ValueError(f"a cached page holds {self.page_size} tokens, got {len(key)}")
        if parent is not None and (not parent.alive or parent.refs <= 0):
            raise AllocatorError(f"insert under {parent}, which the caller does not hold")
        siblings = self._roots if parent is None else parent.children
        node = siblings.get(key)
        if node is not None and (node.page is not None or node.copy is not None or node.broken):
            return None
        self._pages.reassign(page, CACHE_OWNER)
        self._snapshots.reassign(snapshot, CACHE_OWNER)
        if node is None:
            node = CacheNode(key, parent, page, snapshot)
            siblings[key] = node
            self.inserted_pages += 1
        else:  # on the host only, unreferenced: the caller's computed copy is its device copy now
            node.page, node.snapshot = page, snapshot
        node.refs = 1
        self._use += 1
        node.last_use = self._use
        self.num_nodes += 1
        if self.host is not None and self.host.write_policy == "write_through" and node.host is None:
            self._start_write(node)
        return node

    # -- the host tier ---------------------------------------------------------------------------------
    def load(self, node: CacheNode, page: Handle, snapshot: Handle) -> None:
        """Records a load of host node `node` (held by the caller) into `page` and `snapshot`, which
        become the cache's; `node.loading` until `poll` sees the copy complete. The copy starts at
        `start_pending`: `page` and `snapshot` were just taken, and the pools accept them only once
        the plan that hands them out has been applied."""
        if node.page is not None or node.host is None or node.copy is not None or node.refs <= 0:
            raise AllocatorError(f"{node} cannot be loaded (held, on the host only, no copy in flight)")
        self._pages.reassign(page, CACHE_OWNER)
        self._snapshots.reassign(snapshot, CACHE_OWNER)
        node.page, node.snapshot = page, snapshot
        self.num_nodes += 1
        node.copy = Copy(LOAD, None, page, snapshot, node.host)
        self._pending.append(node)

    def start_pending(self) -> None:
        """Starts the copies of the loads recorded since the last call. Call it once the pools know
        the units those loads name: after the plan that handed them out was applied."""
        for node in self._pending:
            copy = node.copy
            copy.fence = self.host.load(copy.unit, node.checksum, copy.page, copy.snapshot)
            self._in_flight.append(node)
        self._pending.clear()

    def poll(self) -> None:
        """Applies every copy that has completed (non-blocking)."""
        for node in [n for n in self._in_flight if n.copy.fence.done()]:
            self._complete(node)

    def _start_write(self, node: CacheNode) -> bool:
        unit = self._take_host_unit()
        if unit is None:
            return False
        node.copy = Copy(WRITE, self.host.write(node.page, node.snapshot, unit), node.page, node.snapshot, unit)
        self._in_flight.append(node)
        return True

    def _complete(self, node: CacheNode) -> None:
        copy, node.copy = node.copy, None
        self._in_flight.remove(node)
        fence = copy.fence
        self.host.observe(fence)
        current = (node.page, node.snapshot) == (copy.page, copy.snapshot) and (
            copy.kind == WRITE or node.host == copy.unit)
        if not current:
            self.stale_completions += 1
            log.error("rejected a stale %s completion for %s (the copy named %s)", copy.kind, node,
                      (copy.page, copy.snapshot, copy.unit))
        if copy.kind == WRITE:
            if fence.error is None and current:
                node.host, node.checksum = copy.unit, fence.checksum
                self.num_host += 1
                self.written_pages += 1
            else:
                self.host.units.free(copy.unit)
            return
        if fence.error is None and current:
            self.loaded_pages += 1
            return
        self.load_failures += 1
        log.error("loading %s from the host tier failed: %s", node, fence.error or "stale completion")
        node.broken = True  # its waiting requests fail (the scheduler); never matched again
        self._drop_device(node, evicted=False)
        self._drop_host(node)
        self._remove_if_empty(node)

    def _wait(self, nodes: list[CacheNode]) -> None:
        """Until every copy in flight of `nodes` has completed and been applied (bounded); a load that
        never started is dropped instead (the node keeps its host copy)."""
        for node in nodes:
            if node in self._pending:
                self._pending.remove(node)
                node.copy = None
                self._drop_device(node, evicted=False)
            elif node.copy is not None:
                if not node.copy.fence.wait(COPY_WAIT_S):
                    raise CopyTimeout(f"the host-tier {node.copy.kind} of {node} did not complete in {COPY_WAIT_S} s")
                self._complete(node)

    def _take_host_unit(self) -> Handle | None:
        """A free host unit, dropping the least recently used host copy nobody needs if none is free:
        no copy in flight, and either a device copy remains or the node is an unreferenced leaf."""
        units = self.host.units
        if units.num_free == 0 and not self.evict_host(1):
            return None
        return units.allocate(CACHE_OWNER)[0]

    def evict_host(self, count: int) -> int:
        """Drops up to `count` host copies nobody needs, least recently used first: no copy in flight,
        and either the device copy remains or the node is an unreferenced leaf (which then leaves the
        tree). Returns how many."""
        evicted = 0
        while evicted < count:
            victims = [n for n in self._nodes() if n.host is not None and n.copy is None
                       and (n.page is not None or (n.refs == 0 and not n.children))]
            if not victims:
                break
            victim = min(victims, key=lambda n: n.last_use)
            self._drop_host(victim)
            self._remove_if_empty(victim)
            evicted += 1
        self.evicted_host_pages += evicted
        return evicted

    # -- eviction ------------------------------------------------------------------------------------
    def evict(self, count: int) -> int:
        """Frees the device pages and snapshots of up to `count` unreferenced nodes, least recently
        used first, a node only once none of its children is on the device. With a host tier each
        one keeps (or first gets: write_back, or a write_through write that found no room) its host
        copy; a copy in flight is waited for (bounded) before its device units are freed. Returns how
        many were freed."""
        heap = [(n.last_use, id(n), n) for n in self._nodes() if self._device_evictable(n, ())]
        heapq.heapify(heap)
        victims: list[CacheNode] = []
        while heap and len(victims) < count:
            _, _, node = heapq.heappop(heap)
            victims.append(node)
            parent = node.parent
            if parent is not None and self._device_evictable(parent, victims):
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        self._wait(victims)  # loads nobody waits for any more, write_through writes
        if self.host is not None:
            self._wait([v for v in victims if v.page is not None and v.host is None and self._start_write(v)])
        for node in victims:
            if node.page is not None:  # (a failed load freed it already)
                self._drop_device(node, evicted=True)
            if node.host is None and node.alive:
                self._discard(node)
        return len(victims)

    def _device_evictable(self, node: CacheNode, leaving: Sequence[CacheNode]) -> bool:
        return (node.page is not None and node.refs == 0
                and all(c.page is None or c in leaving for c in node.children.values()))

    def _drop_device(self, node: CacheNode, evicted: bool) -> None:
        self._pages.free(node.page)
        self._snapshots.free(node.snapshot)
        node.page = node.snapshot = None
        self.num_nodes -= 1
        if node.refs == 0:
            self.num_unreferenced -= 1
        if evicted:
            self.evicted_pages += 1

    def _drop_host(self, node: CacheNode) -> None:
        if node.host is not None:
            self.host.units.free(node.host)
            node.host = node.checksum = None
            self.num_host -= 1

    def _discard(self, node: CacheNode) -> None:
        """Removes `node`, which has no device copy, and its subtree (host copies only, unreferenced)."""
        for below in list(node.children.values()):
            self._discard(below)
        self._drop_host(node)
        self._remove(node)

    def _remove_if_empty(self, node: CacheNode | None) -> None:
        """Removes `node`, and then its ancestors, while it holds nothing and nothing hangs below it."""
        while (node is not None and node.alive and node.page is None and node.host is None and node.copy is None
               and not node.children and node.refs == 0):
            self._remove(node)
            node = node.parent

    def _remove(self, node: CacheNode) -> None:
        siblings = self._roots if node.parent is None else node.parent.children
        del siblings[node.key]
        node.alive = False

    def _nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def snapshot(self) -> dict:
        """For /debug/requests: cached pages on the device, how many of them no request holds, and
        the host tier's."""
        debug = {"cached_pages": self.num_nodes, "evictable_pages": self.num_unreferenced}
        if self.host is not None:
            debug.update(host_cached_pages=self.num_host, host_free_pages=self.host.units.num_free,
                         host_total_pages=self.host.units.capacity,
                         loads_in_flight=len(self._pending) + sum(1 for n in self._in_flight if n.loading),
                         writes_in_flight=sum(1 for n in self._in_flight if not n.loading))
        return debug
