"""The device-tier prefix cache: a radix tree over token ids at page granularity (torch-free).

Each node is one full page of some request's tokens, under the node of the page before it: the
page's rows (compressed main rows and index-key rows of every layer) and a boundary snapshot, the
slot state (window rings, compressor partial state incl. CSA's overlap half) of a request that has
computed exactly the tokens up to the end of that page. A request whose first k pages match a path
shares those k pages and restores its slot from the k-th node's snapshot: it resumes at k * P
exactly where a recompute would be (docs/PREFIX_CACHE.md).

Ownership. A node's page and snapshot belong to the cache (allocator owner `CACHE_OWNER`). Every
request that shares a node holds a reference to it and to each node above it, so a referenced node
never has an unreferenced ancestor and `refs == 0` means the whole subtree is unreferenced. Only
unreferenced nodes are evicted, leaves first, least recently used first: a page a running request
reads is never freed. A node keeps the generations its page and snapshot were allocated under; the
allocator rejects a free of a stale one, and the runner's pools reject a stale read.

The tree decides nothing about when to cache: the scheduler inserts pages and asks for evictions.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from dsv4.memory.allocator import AllocatorError, GenerationalAllocator, Handle

CACHE_OWNER = "prefix-cache"


class CacheNode:
    __slots__ = ("alive", "children", "depth", "key", "last_use", "page", "parent", "refs", "snapshot")

    def __init__(self, key: tuple[int, ...], parent: CacheNode | None, page: Handle, snapshot: Handle):
        self.key = key  # the page's token ids
        self.parent = parent
        self.children: dict[tuple[int, ...], CacheNode] = {}
        self.page = page
        self.snapshot = snapshot
        self.depth = 1 if parent is None else parent.depth + 1  # pages from the start of the prompt
        self.refs = 0
        self.last_use = 0
        self.alive = True

    def __repr__(self) -> str:
        return f"CacheNode(depth={self.depth}, page={tuple(self.page)}, refs={self.refs})"


class RadixCache:
    def __init__(self, page_size: int, pages: GenerationalAllocator, snapshots: GenerationalAllocator):
        self.page_size = page_size
        self._pages = pages
        self._snapshots = snapshots
        self._roots: dict[tuple[int, ...], CacheNode] = {}
        self._use = 0  # a logical clock for LRU: no wall clock in the scheduler's decisions
        self.num_nodes = 0
        self.num_unreferenced = 0  # nodes with refs == 0: each one's page can be evicted
        # Cumulative, for metrics: pages shared by a request (hits), evicted, and cached.
        self.hit_pages = 0
        self.evicted_pages = 0
        self.inserted_pages = 0

    # -- lookups -------------------------------------------------------------------------------------
    def match(self, tokens: Sequence[int], max_pages: int) -> list[CacheNode]:
        """The longest cached path of whole pages that `tokens` starts with, at most `max_pages` long.
        Marks it used (LRU); takes no reference."""
        path: list[CacheNode] = []
        children = self._roots
        P = self.page_size
        while len(path) < max_pages:
            node = children.get(tuple(tokens[len(path) * P : (len(path) + 1) * P]))
            if node is None:
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
            if not node.alive:
                raise AllocatorError(f"{node} was evicted; it cannot be shared")
            if node.refs == 0:
                self.num_unreferenced -= 1
            node.refs += 1
        self.hit_pages += len(path)

    def release(self, path: Sequence[CacheNode]) -> None:
        """Drops one reference to every node of `path`, exactly once per `acquire` or `insert`."""
        for node in path:
            if not node.alive or node.refs <= 0:
                raise AllocatorError(f"{node} released more often than it was held")
        self._use += 1
        for node in path:
            node.refs -= 1
            node.last_use = self._use
            if node.refs == 0:
                self.num_unreferenced += 1

    def insert(self, parent: CacheNode | None, key: tuple[int, ...], page: Handle, snapshot: Handle
               ) -> CacheNode | None:
        """Caches `page` (whose tokens are `key`, right after `parent`'s page; None: the first page)
        with its boundary `snapshot`; the caller holds `parent` and keeps one reference to the new
        node. None when that page is cached already: the caller keeps its page and snapshot."""
        if len(key) != self.page_size:
            raise ValueError(f"a cached page holds {self.page_size} tokens, got {len(key)}")
        if parent is not None and (not parent.alive or parent.refs <= 0):
            raise AllocatorError(f"insert under {parent}, which the caller does not hold")
        siblings = self._roots if parent is None else parent.children
        if key in siblings:
            return None
        self._pages.reassign(page, CACHE_OWNER)
        self._snapshots.reassign(snapshot, CACHE_OWNER)
        node = CacheNode(key, parent, page, snapshot)
        node.refs = 1
        self._use += 1
        node.last_use = self._use
        siblings[key] = node
        self.num_nodes += 1
        self.inserted_pages += 1
        return node

    # -- eviction ------------------------------------------------------------------------------------
    def evict(self, count: int) -> int:
        """Frees the pages and snapshots of up to `count` unreferenced nodes, least recently used
        leaves first (a parent becomes a leaf once its children are gone). Returns how many."""
        heap = [(n.last_use, id(n), n) for n in self._nodes() if n.refs == 0 and not n.children]
        heapq.heapify(heap)
        evicted = 0
        while heap and evicted < count:
            _, _, node = heapq.heappop(heap)
            siblings = self._roots if node.parent is None else node.parent.children
            del siblings[node.key]
            node.alive = False
            self._pages.free(node.page)
            self._snapshots.free(node.snapshot)
            self.num_nodes -= 1
            self.num_unreferenced -= 1
            evicted += 1
            parent = node.parent
            if parent is not None and parent.refs == 0 and not parent.children:
                heapq.heappush(heap, (parent.last_use, id(parent), parent))
        self.evicted_pages += evicted
        return evicted

    def _nodes(self):
        stack = list(self._roots.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def snapshot(self) -> dict:
        """For /debug/requests: cached pages, how many of them no request holds."""
        return {"cached_pages": self.num_nodes, "evictable_pages": self.num_unreferenced}
