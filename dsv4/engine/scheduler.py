"""Continuous batching with chunked prefill and preemption by retraction (torch-free, pure: no
clock, no I/O).

Budget. Each tick has a token budget (`--chunked-prefill-size`). Running decodes take one token
each and always run; what is left goes to prefill chunks, first to requests already prefilling,
then to admissions in arrival order (FCFS: the head of the queue is never overtaken, so a large
prompt cannot starve).

Admission. A request is admitted when a slot is free and the free pages cover its rows plus a
reserve for growth: ceil(ratio x the pages that the running requests and itself still need to
reach max_new_tokens), each request counted for at most RESERVE_CLIP_TOKENS more tokens (the chat
route's default max_tokens is the rest of the context). `ratio` is SGLang's new-token ratio:
requests usually stop before max_new_tokens, so it starts at INIT_RATIO and decays by RATIO_DECAY
each tick down to MIN_RATIO, admitting more while the bet keeps winning. A retraction (a lost bet)
puts it back to 1, where admission waits until every running request could finish; an empty batch
puts it back to INIT_RATIO. On a PD decode instance a transfer takes its destination pages only
under the same rule (`admits`), behind every waiting request, so transfers neither starve running
decodes nor overtake retracted requests; once adopted it is a running decode like any other, and
retracted it recomputes its prompt here.

Retraction. A decode grows its page table when it crosses a page boundary. When the decodes of a
tick need more pages than are free, decodes are retracted, youngest arrival first, until the rest
fit: their pages and slot are freed and they go back to the waiting queue at their arrival place,
which is ahead of every request that has never run, keeping their generated tokens. Re-admitted,
a request recomputes prompt + generated tokens as a chunked prefill whose last chunk samples its
next new token, so it continues as it would have (sampling noise is a function of (seed,
position): sampling.py). Only decodes are retracted, and a decode has sampled a token since it was
last admitted, so every retraction follows progress (no livelock); retracting every decode would
remove every need for a page, so retraction always succeeds. Memory pressure never fails a
request: every request fits the pool alone (check_admissible), and the queue's head is the oldest
waiting request, admitted at the latest when the running requests are done.

Prefix cache (docs/PREFIX_CACHE.md). With a RadixCache, a request's full pages join the cache as it
computes them: a chunk that ends at a page boundary has its slot copied into a boundary snapshot
after the forward (`ForwardBatch.snapshots`), a boundary at least a window inside a chunk is written
into one during it (`ForwardBatch.captures`), and at the next scheduler step each page and snapshot
become a node that the request itself holds. A prefill chunk of a request that is still caching runs
from a page boundary to the prompt's end or to the last boundary the token budget reaches (without
the model's window: to the next page boundary), so that every page gets its snapshot. Admission
matches the longest cached prefix of whole pages, leaving at least the last token to compute (its
logits are sampled), shares those pages and restores its slot from the last one's snapshot before
the forward (`ForwardBatch.restores`); its first chunk starts at that page boundary. A request that
asked for prompt logprobs matches only pages before the first position whose logits it needs (a
cached page has no logits), and its chunks name the positions whose logits come back
(`prompt_logits_from`). No chunk writes a row of a position before its start_pos, and every
compressed row lives in the page of its window's first token, so a shared page is never written.
Unreferenced cached pages count as free for admission and retraction, and are evicted (LRU) when
pages are taken.

Host tier (HiCache). A hit may include pages cached on the host only (matched under the same
limits, prompt logprobs included): admission takes device pages and snapshot units for them (they
count as needed pages) and records their loads, and the tick starts the copies once the plan that
hands those units out has been applied. The request waits in `loading`, holding its slot, pages and
references, while later requests are admitted past it. Each schedule polls the copies (after a tick
that ran nothing, the tick loop waits for the next copy to land: Engine._supervise); a loading request
whose path is all on the device starts then (restore, first chunk), and one whose load failed
(checksum) fails alone (`take_failed`). No chunk ever reads a page whose load has not completed.

On rank 0, deciding a plan and applying its allocations are one step: the allocator is rank 0's
record of ownership, and the plan names every (page, generation) it hands out, which is all any
other party (the runner's pools, follower ranks) needs to apply it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import msgspec

from dsv4.cache.radix import CACHE_OWNER, CacheNode, RadixCache
from dsv4.engine.request import AdmissionError, Request, RequestState
from dsv4.memory.allocator import Handle, PageSlotAllocator
from dsv4.protocol import BoundaryCapture, ForwardBatch, ForwardChunk, SamplingParams, SlotCopy, TickPlan

INIT_RATIO = 0.7
MIN_RATIO = 0.1
RATIO_DECAY = (INIT_RATIO - MIN_RATIO) / 600  # per tick
RESERVE_CLIP_TOKENS = 4096


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, allocator: PageSlotAllocator, *, page_size: int, token_budget: int, max_context: int,
                 prefix_cache: RadixCache | None = None, window: int | None = None):
        """`window`: the model's sliding window, when page boundaries inside a chunk can be captured
        during its forward (`BoundaryCapture`: at least a window past the chunk's start). Without it a
        caching request's chunks end at page boundaries, where its slot is copied after the forward."""
        if token_budget < allocator.slots.capacity:
            raise ValueError(f"token budget {token_budget} is smaller than the {allocator.slots.capacity} slots")
        self.allocator = allocator
        self.page_size = page_size
        self.token_budget = token_budget
        self.max_context = max_context
        self.window = window
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order, oldest first
        self.loading: list[Request] = []  # admitted, waiting for host-tier loads of cached pages
        self._failed: list[Request] = []  # ended by a failed load since the last take_failed
        self._by_rid: dict[str, Request] = {}
        self._seq = 0
        self._arrivals = 0
        self.new_token_ratio = INIT_RATIO
        # Released since the last plan; the next plan reports them so the plan log is a complete
        # record of ownership changes.
        self._finished_since_plan: list[str] = []
        self._aborted_since_plan: list[str] = []
        self._retracted_since_plan: list[str] = []
        self._adopted_since_plan: list[str] = []
        self.cache = prefix_cache
        # Boundary snapshots the last plan's forward took, (request, index of the page, snapshot unit):
        # they join the cache at the next scheduler step, once that forward is known to be done.
        self._snapshotted: list[tuple[Request, int, Handle]] = []

    # -- queries ------------------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        return self._seq

    def get(self, rid: str) -> Request | None:
        return self._by_rid.get(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading or self._finished_since_plan
                    or self._aborted_since_plan)

    def requests(self) -> list[Request]:
        return [*self.running, *self.loading, *self.waiting]

    def take_failed(self) -> list[Request]:
        """Requests ended (released, finish_reason "error") because a host-tier load of a page they
        share failed, since the last call: the tick delivers their last output."""
        failed, self._failed = self._failed, []
        return failed

    def capacity(self) -> dict:
        """The allocator's counts, where unreferenced cached pages count as free (they are, on demand)."""
        snapshot = self.allocator.snapshot()
        if self.cache is not None:
            snapshot.update(self.cache.snapshot(), free_pages=self._available_pages())
        return snapshot

    # -- inputs ---------------------------------------------------------------------------------------
    def check_admissible(self, prompt_len: int, sampling: SamplingParams) -> None:
        if prompt_len <= 0:
            raise AdmissionError("the prompt is empty")
        max_new_tokens = sampling.max_new_tokens
        if max_new_tokens <= 0:
            raise AdmissionError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if sampling.temperature < 0 or not 0 < sampling.top_p <= 1 or sampling.top_k == 0 or sampling.top_k < -1:
            raise AdmissionError(
                f"invalid sampling: temperature {sampling.temperature} (>= 0), top_p {sampling.top_p} (in (0, 1]), "
                f"top_k {sampling.top_k} (-1 or >= 1)"
            )
        total = prompt_len + max_new_tokens
        pool_tokens = self.allocator.pages.capacity * self.page_size
        if total > self.max_context:
            limit = " (the KV pool, --max-total-tokens)" if self.max_context == pool_tokens else ""
            raise AdmissionError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"context limit of {self.max_context} tokens{limit}"
            )
        # Decoding writes the row of every token but the last sampled one.
        need = pages_for(total - 1, self.page_size)
        if need > self.allocator.pages.capacity:
            raise AdmissionError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) needs up to {need} KV pages of "
                f"{self.page_size} tokens; the pool has {self.allocator.pages.capacity} ({pool_tokens} tokens, "
                f"--max-total-tokens)"
            )

    def add(self, req: Request) -> None:
        if req.rid in self._by_rid:
            raise AdmissionError(f"request id {req.rid!r} is already in use")
        self.check_admissible(len(req.prompt_ids), req.sampling)
        self._number(req)
        self.waiting.append(req)
        self._by_rid[req.rid] = req

    def adopt(self, req: Request) -> None:
        """PD decode: a request whose prompt state arrived by transfer, already holding its pages
        and slot (allocated under its rid), joins the running batch with its prompt computed."""
        if req.rid in self._by_rid:
            raise AdmissionError(f"request id {req.rid!r} is already in use")
        req.state = RequestState.RUNNING
        req.num_computed = len(req.prompt_ids)
        req.last_event = "adopted after transfer"
        self._number(req)
        self.running.append(req)
        self._by_rid[req.rid] = req
        self._adopted_since_plan.append(req.rid)

    def abort(self, rid: str, error: str, finish_reason: str = "abort") -> Request | None:
        """Releases everything `rid` holds at once; None if it is not queued or running."""
        req = self._by_rid.get(rid)
        if req is None:
            return None
        self._commit_snapshots()
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
        elif req.state is RequestState.LOADING:
            self.loading.remove(req)
        self._release(req, finish_reason, error)
        self._aborted_since_plan.append(rid)
        return req

    def finish(self, req: Request, finish_reason: str) -> None:
        self._commit_snapshots()
        self._release(req, finish_reason, None)
        self._finished_since_plan.append(req.rid)

    # -- the decision of one tick -------------------------------------------------------------------
    def schedule(self) -> TickPlan:
        """Decides the next tick and records its allocations and retractions."""
        self._commit_snapshots()
        self._poll_loads()
        self._make_room_for_decodes()
        decodes = [r for r in self.running if not r.prefilling]
        for req in decodes:
            missing = pages_for(req.num_tokens, self.page_size) - len(req.pages)
            if missing > 0:
                req.pages += self.take_pages(req.rid, missing)
        scheduled = list(decodes)
        chunks = [self._chunk(r, r.num_tokens - 1, 1) for r in decodes]
        budget = self.token_budget - len(decodes)
        for req in [r for r in self.running if r.prefilling]:
            if budget == 0:
                break
            n = self._prefill_length(req, budget)
            scheduled.append(req)
            chunks.append(self._chunk(req, req.num_computed, n))
            budget -= n
        restores: list[SlotCopy] = []
        for req in [r for r in self.loading if all(node.on_device for node in r.cached)]:
            if budget == 0:
                break
            self.loading.remove(req)
            self._start(req, restores)
            n = self._prefill_length(req, budget)
            scheduled.append(req)
            chunks.append(self._chunk(req, req.num_computed, n))
            budget -= n
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            if req.state is RequestState.LOADING:
                self.loading.append(req)
                continue
            self._start(req, restores)
            n = self._prefill_length(req, budget)
            scheduled.append(req)
            chunks.append(self._chunk(req, req.num_computed, n))
            budget -= n
        captures: list[BoundaryCapture] = []
        snapshots: list[SlotCopy] = []
        for req, chunk in zip(scheduled, chunks, strict=True):
            self._snapshot(req, chunk.start_pos, captures, snapshots)
        if self.running:
            self.new_token_ratio = max(MIN_RATIO, self.new_token_ratio - RATIO_DECAY)
        else:
            self.new_token_ratio = INIT_RATIO
        self._seq += 1
        page_handouts, slot_handouts = self.allocator.drain_handouts()
        plan = TickPlan(
            seq=self._seq,
            page_handouts=page_handouts,
            slot_handouts=slot_handouts,
            batch=ForwardBatch(tick=self._seq, chunks=tuple(chunks), restores=tuple(restores),
                               captures=tuple(captures), snapshots=tuple(snapshots)),
            finished=tuple(self._finished_since_plan),
            aborted=tuple(self._aborted_since_plan),
            retracted=tuple(self._retracted_since_plan),
            adopted=tuple(self._adopted_since_plan),
        )
        self._finished_since_plan.clear()
        self._aborted_since_plan.clear()
        self._retracted_since_plan.clear()
        self._adopted_since_plan.clear()
        return plan

    def _make_room_for_decodes(self) -> None:
        while True:
            short = sum(
                1 for r in self.running if not r.prefilling and len(r.pages) < pages_for(r.num_tokens, self.page_size)
            )
            free = self._available_pages()
            if short <= free:
                return
            # Decodes only: each has sampled a token since it was (re)admitted.
            victim = max((r for r in self.running if not r.prefilling), key=lambda r: r.arrival_index)
            self._retract(victim, f"{short} running decodes needed a new KV page and {free} of "
                                  f"{self.allocator.pages.capacity} were free")

    def _retract(self, req: Request, reason: str) -> None:
        self._free_resources(req)
        self.running.remove(req)
        req.state = RequestState.WAITING
        req.num_computed = 0
        req.retractions += 1
        req.last_retraction = reason
        req.last_event = f"retracted after {len(req.output_ids)} tokens: {reason}"
        # Its place in arrival order, ahead of every request that never ran: FCFS admitted it before them.
        place = next((i for i, r in enumerate(self.waiting) if r.arrival_index > req.arrival_index), len(self.waiting))
        self.waiting.insert(place, req)
        self._retracted_since_plan.append(req.rid)
        self.new_token_ratio = 1.0

    def admits(self, new: Request, holding: Iterable[Request] = ()) -> bool:
        """Whether `new`, joining from outside the queue (PD decode: a transfer about to take its
        destination), may take its pages and a slot now under the admission rule: nobody waits
        ahead of it (retracted requests included) and the free pages cover its rows plus the
        reserve. `holding`: requests already holding pages outside the scheduler (other transfers),
        whose growth counts as a running request's does."""
        return not self.waiting and self._fits(new, holding)

    def _fits(self, req: Request, holding: Iterable[Request] = (), hit: list[CacheNode] = ()) -> bool:
        """A slot is free, and so are the pages `req` needs beyond the cached device pages it `hit`
        (a host-tier hit needs a device page to load into), plus the reserve; `hit`'s unreferenced
        device pages are no longer free once it shares them."""
        on_device = [node for node in hit if node.page is not None]
        need = pages_for(req.num_tokens, self.page_size) - len(on_device)
        available = self._available_pages() - sum(1 for node in on_device if node.refs == 0)
        return self.allocator.slots.num_free > 0 and available >= need + self._reserve(req, holding)

    def _admit(self, req: Request) -> bool:
        """Gives the queue's head its slot, pages and cached prefix; it is RUNNING, or LOADING until
        the host-tier loads of its cached pages complete. False: it does not fit yet."""
        hit = self._match(req)
        if not self._fits(req, hit=hit):
            return False
        to_load = [node for node in hit if node.page is None]
        if hit:
            self.cache.acquire(hit)  # first: so that taking pages cannot evict them
        (req.slot,) = self.allocator.slots.allocate(req.rid)
        for node, page in zip(to_load, self.take_pages(CACHE_OWNER, len(to_load)), strict=True):
            self.cache.load(node, page, self._take_snapshot_unit(CACHE_OWNER))
        req.pages = [node.page for node in hit] + self.take_pages(
            req.rid, pages_for(req.num_tokens, self.page_size) - len(hit))
        req.cached = hit
        req.num_computed = len(hit) * self.page_size
        if not req.output_ids:
            req.cached_tokens = req.num_computed
            req.cached_host_tokens = len(to_load) * self.page_size
        if all(node.on_device for node in hit):
            req.state = RequestState.RUNNING
        else:
            req.state = RequestState.LOADING
            req.last_event = f"loading {sum(1 for node in hit if not node.on_device)} cached pages from the host tier"
        return True

    def _start(self, req: Request, restores: list[SlotCopy]) -> None:
        """An admitted request whose cached pages are all on the device runs from its cached prefix."""
        if req.cached:
            snapshot = req.cached[-1].snapshot
            restores.append(SlotCopy(self.allocator.snapshot_unit(snapshot), snapshot.generation, req.slot.id,
                                     req.slot.generation))
        req.state = RequestState.RUNNING
        req.last_event = "readmitted" if req.retractions else "admitted"
        self.running.append(req)

    def _poll_loads(self) -> None:
        """Applies completed host-tier copies; a loading request that shares a node whose load failed
        fails alone (its other references are released as by any abort)."""
        if self.cache is None or self.cache.host is None:
            return
        self.cache.poll()
        for req in [r for r in self.loading if any(node.broken for node in r.cached)]:
            self.abort(req.rid, "a cached page loaded from the host tier failed its check; the page was dropped "
                                "from the cache", finish_reason="error")
            self._failed.append(req)

    def _reserve(self, new: Request, holding: Iterable[Request] = ()) -> int:
        """Pages kept free, when admitting `new`, for the growth of the running requests and its own."""
        growth = sum(self._growth_pages(r, len(r.pages)) for r in (*self.running, *self.loading, *holding))
        growth += self._growth_pages(new, pages_for(new.num_tokens, self.page_size))
        return math.ceil(self.new_token_ratio * growth)

    def _growth_pages(self, req: Request, held: int) -> int:
        more = min(req.sampling.max_new_tokens - len(req.output_ids), RESERVE_CLIP_TOKENS)
        # The rows of every token but the last sampled one.
        return max(0, pages_for(req.num_tokens - 1 + more, self.page_size) - held)

    def take_pages(self, owner: str, count: int) -> list[Handle]:
        """`count` pages for `owner`, evicting unreferenced cached pages if too few are free."""
        short = count - self.allocator.pages.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
        return self.allocator.pages.allocate(owner, count)

    def _available_pages(self) -> int:
        return self.allocator.pages.num_free + (self.cache.num_unreferenced if self.cache is not None else 0)

    # -- prefix cache -------------------------------------------------------------------------------
    def _match(self, req: Request) -> list[CacheNode]:
        if self.cache is None:
            return []
        # The last token is always computed: its logits give the next token. A cached page has no
        # logits: a request that wants prompt logprobs takes no page holding a position it needs.
        computed_from = req.num_tokens - 1
        if not req.output_ids and req.sampling.prompt_logits_from is not None:
            computed_from = min(computed_from, req.sampling.prompt_logits_from)
        return self.cache.match((*req.prompt_ids, *req.output_ids), computed_from // self.page_size)

    def _caching(self, req: Request) -> bool:
        """Every full page before `req`'s next chunk is a cached node it holds: its next page can join."""
        return self.cache is not None and len(req.cached) == req.num_computed // self.page_size

    def _prefill_length(self, req: Request, budget: int) -> int:
        n = min(req.num_tokens - req.num_computed, budget)
        if not self._caching(req):
            return n
        P, start = self.page_size, req.num_computed
        to_boundary = P - start % P
        if self.window is None or start % P or self.window > P:
            return min(n, to_boundary)  # end at the page boundary, where the slot is copied
        # From a page boundary: boundaries inside the chunk are captured during its forward, so the
        # chunk runs on; one that stops short of the prompt's end stops at a boundary if it can.
        if n < req.num_tokens - start and n >= P:
            n -= n % P
        return n

    def _snapshot(self, req: Request, start: int, captures: list[BoundaryCapture], copies: list[SlotCopy]) -> None:
        """Each page boundary `req`'s chunk [start, num_computed) reaches whose page it may cache (every
        page before it is a cached node it holds): one inside the chunk is captured during the forward,
        one at its end is the slot copied after it. Each takes a snapshot unit; the pages join the
        cache at the next step."""
        if self.cache is None:
            return
        P, end = self.page_size, req.num_computed
        page = len(req.cached)
        for boundary in range(start - start % P + P, end + 1, P):
            if page != boundary // P - 1:
                return
            inside = boundary < end
            if inside and (self.window is None or boundary - start < self.window):
                return  # its window reaches before the chunk: only a slot copy at a chunk's end has it
            if self.allocator.snapshots.num_free == 0 and not self.cache.evict(1):
                return  # every snapshot is shared: this page and the request's later ones stay its own
            unit = self._take_snapshot_unit(req.rid)
            self._snapshotted.append((req, page, unit))
            pool_unit = self.allocator.snapshot_unit(unit)
            if inside:
                captures.append(BoundaryCapture(req.slot.id, boundary, pool_unit, unit.generation))
            else:
                copies.append(SlotCopy(req.slot.id, req.slot.generation, pool_unit, unit.generation))
            page += 1

    def _take_snapshot_unit(self, owner: str) -> Handle:
        if self.allocator.snapshots.num_free == 0:
            self.cache.evict(1)
        return self.allocator.snapshots.allocate(owner)[0]

    def _commit_snapshots(self) -> None:
        """The last plan's forward is done: each page it completed joins the cache with its snapshot,
        held by its request (or, cached already by another request, stays the request's own, and so
        do the request's later pages)."""
        P = self.page_size
        for req, index, unit in self._snapshotted:
            node = None
            if index == len(req.cached):
                key = tuple(req.token_at(p) for p in range(index * P, (index + 1) * P))
                node = self.cache.insert(req.cached[-1] if req.cached else None, key, req.pages[index], unit)
            if node is None:
                self.allocator.snapshots.free(unit)
            else:
                req.cached.append(node)
        self._snapshotted.clear()

    def _chunk(self, req: Request, start: int, n: int) -> ForwardChunk:
        decode = not req.prefilling and req.num_computed > 0
        req.num_computed = start + n
        if decode:
            req.last_event = f"decode@{start}"
        else:
            req.last_event = f"{'recompute' if req.retractions else 'prefill'} {start}..{start + n}"
        chunk = ForwardChunk(
            rid=req.rid,
            slot=req.slot.id,
            slot_generation=req.slot.generation,
            start_pos=start,
            token_ids=tuple(req.token_at(p) for p in range(start, start + n)),
            page_ids=tuple(h.id for h in req.pages),
            page_generations=tuple(h.generation for h in req.pages),
            sample=req.num_computed == req.num_tokens,  # the last chunk of a prefill or recompute, or a decode
            # Prompt logprobs are delivered with the first token: a recompute after it needs none.
            prompt_logits_from=None if req.output_ids else req.sampling.prompt_logits_from,
        )
        if chunk.prompt_logits_from is not None and not chunk.prompt_logit_positions():
            chunk = msgspec.structs.replace(chunk, prompt_logits_from=None)
        return chunk

    def _free_resources(self, req: Request) -> None:
        if req.cached:
            self.cache.release(req.cached)
        for handle in req.pages[len(req.cached):]:
            self.allocator.pages.free(handle)
        if req.slot is not None:
            self.allocator.slots.free(req.slot)
        req.pages, req.slot, req.cached = [], None, []

    def _number(self, req: Request) -> None:
        req.arrival_index = self._arrivals
        self._arrivals += 1

    def _release(self, req: Request, finish_reason: str, error: str | None) -> None:
        self._free_resources(req)
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
        req.state = RequestState.FINISHED
        req.finish_reason, req.error = finish_reason, error
        req.last_event = f"finished: {finish_reason}"
        del self._by_rid[req.rid]
