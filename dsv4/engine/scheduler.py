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

On rank 0, deciding a plan and applying its allocations are one step: the allocator is rank 0's
record of ownership, and the plan names every (page, generation) it hands out, which is all any
other party (the runner's pools, follower ranks) needs to apply it.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

from dsv4.engine.request import AdmissionError, Request, RequestState
from dsv4.memory.allocator import PageSlotAllocator
from dsv4.protocol import ForwardBatch, ForwardChunk, SamplingParams, TickPlan

INIT_RATIO = 0.7
MIN_RATIO = 0.1
RATIO_DECAY = (INIT_RATIO - MIN_RATIO) / 600  # per tick
RESERVE_CLIP_TOKENS = 4096


def pages_for(num_tokens: int, page_size: int) -> int:
    return -(-num_tokens // page_size)


class Scheduler:
    def __init__(self, allocator: PageSlotAllocator, *, page_size: int, token_budget: int, max_context: int):
        if token_budget < allocator.slots.capacity:
            raise ValueError(f"token budget {token_budget} is smaller than the {allocator.slots.capacity} slots")
        self.allocator = allocator
        self.page_size = page_size
        self.token_budget = token_budget
        self.max_context = max_context
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order, oldest first
        self._by_rid: dict[str, Request] = {}
        self._seq = 0
        self._arrivals = 0
        self.new_token_ratio = INIT_RATIO
        # Released since the last plan; the next plan reports them so the plan log is a complete
        # record of ownership changes.
        self._finished_since_plan: list[str] = []
        self._aborted_since_plan: list[str] = []
        self._retracted_since_plan: list[str] = []

    # -- queries ------------------------------------------------------------------------------------
    @property
    def seq(self) -> int:
        return self._seq

    def get(self, rid: str) -> Request | None:
        return self._by_rid.get(rid)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._finished_since_plan or self._aborted_since_plan)

    def requests(self) -> list[Request]:
        return [*self.running, *self.waiting]

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

    def abort(self, rid: str, error: str, finish_reason: str = "abort") -> Request | None:
        """Releases everything `rid` holds at once; None if it is not queued or running."""
        req = self._by_rid.get(rid)
        if req is None:
            return None
        if req.state is RequestState.WAITING:
            self.waiting.remove(req)
        self._release(req, finish_reason, error)
        self._aborted_since_plan.append(rid)
        return req

    def finish(self, req: Request, finish_reason: str) -> None:
        self._release(req, finish_reason, None)
        self._finished_since_plan.append(req.rid)

    # -- the decision of one tick -------------------------------------------------------------------
    def schedule(self) -> TickPlan:
        """Decides the next tick and records its allocations and retractions."""
        self._make_room_for_decodes()
        decodes = [r for r in self.running if not r.prefilling]
        for req in decodes:
            missing = pages_for(req.num_tokens, self.page_size) - len(req.pages)
            if missing > 0:
                req.pages += self.allocator.pages.allocate(req.rid, missing)
        chunks = [self._chunk(r, r.num_tokens - 1, 1) for r in decodes]
        budget = self.token_budget - len(decodes)
        for req in [r for r in self.running if r.prefilling]:
            if budget == 0:
                break
            n = min(req.num_tokens - req.num_computed, budget)
            chunks.append(self._chunk(req, req.num_computed, n))
            budget -= n
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            n = min(req.num_tokens, budget)
            chunks.append(self._chunk(req, 0, n))
            budget -= n
        if self.running:
            self.new_token_ratio = max(MIN_RATIO, self.new_token_ratio - RATIO_DECAY)
        else:
            self.new_token_ratio = INIT_RATIO
        self._seq += 1
        plan = TickPlan(
            seq=self._seq,
            batch=ForwardBatch(tick=self._seq, chunks=tuple(chunks)),
            finished=tuple(self._finished_since_plan),
            aborted=tuple(self._aborted_since_plan),
            retracted=tuple(self._retracted_since_plan),
        )
        self._finished_since_plan.clear()
        self._aborted_since_plan.clear()
        self._retracted_since_plan.clear()
        return plan

    def _make_room_for_decodes(self) -> None:
        while True:
            short = sum(
                1 for r in self.running if not r.prefilling and len(r.pages) < pages_for(r.num_tokens, self.page_size)
            )
            free = self.allocator.pages.num_free
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

    def _fits(self, req: Request, holding: Iterable[Request] = ()) -> bool:
        need = pages_for(req.num_tokens, self.page_size)
        return self.allocator.slots.num_free > 0 and self.allocator.pages.num_free >= need + self._reserve(req, holding)

    def _admit(self, req: Request) -> bool:
        if not self._fits(req):
            return False
        need = pages_for(req.num_tokens, self.page_size)
        (req.slot,) = self.allocator.slots.allocate(req.rid)
        req.pages = self.allocator.pages.allocate(req.rid, need)
        req.state = RequestState.RUNNING
        req.last_event = "readmitted" if req.retractions else "admitted"
        self.running.append(req)
        return True

    def _reserve(self, new: Request, holding: Iterable[Request] = ()) -> int:
        """Pages kept free, when admitting `new`, for the growth of the running requests and its own."""
        growth = sum(self._growth_pages(r, len(r.pages)) for r in (*self.running, *holding))
        growth += self._growth_pages(new, pages_for(new.num_tokens, self.page_size))
        return math.ceil(self.new_token_ratio * growth)

    def _growth_pages(self, req: Request, held: int) -> int:
        more = min(req.sampling.max_new_tokens - len(req.output_ids), RESERVE_CLIP_TOKENS)
        # The rows of every token but the last sampled one.
        return max(0, pages_for(req.num_tokens - 1 + more, self.page_size) - held)

    def _chunk(self, req: Request, start: int, n: int) -> ForwardChunk:
        decode = not req.prefilling and req.num_computed > 0
        req.num_computed = start + n
        if decode:
            req.last_event = f"decode@{start}"
        else:
            req.last_event = f"{'recompute' if req.retractions else 'prefill'} {start}..{start + n}"
        return ForwardChunk(
            rid=req.rid,
            slot=req.slot.id,
            slot_generation=req.slot.generation,
            start_pos=start,
            token_ids=tuple(req.token_at(p) for p in range(start, start + n)),
            page_ids=tuple(h.id for h in req.pages),
            page_generations=tuple(h.generation for h in req.pages),
            sample=req.num_computed == req.num_tokens,  # the last chunk of a prefill or recompute, or a decode
        )

    def _free_resources(self, req: Request) -> None:
        for handle in req.pages:
            self.allocator.pages.free(handle)
        if req.slot is not None:
            self.allocator.slots.free(req.slot)
        req.pages, req.slot = [], None

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
