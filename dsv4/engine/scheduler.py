"""Continuous batching with chunked prefill (torch-free, pure: no clock, no I/O).

Each tick has a token budget (`--chunked-prefill-size`). Running decodes take one token each and
always run; what is left goes to prefill chunks, first to requests already prefilling, then to
new admissions in strict arrival order (FCFS: the head of the queue is never overtaken, so a
large prompt cannot starve). A request is admitted when a slot and the pages for its whole prompt
are free; a decode grows its page table when it crosses a page boundary. There is no preemption:
when decodes need pages and none are free, the youngest running requests are aborted with an
error until the older ones fit, so the engine never wedges.

On rank 0, deciding a plan and applying its allocations are one step: the allocator is rank 0's
record of ownership, and the plan names every (page, generation) it hands out, which is all any
other party (the runner's pools, follower ranks) needs to apply it.
"""

from __future__ import annotations

from collections import deque

from dsv4.engine.request import AdmissionError, Request, RequestState
from dsv4.memory.allocator import PageSlotAllocator
from dsv4.protocol import ForwardBatch, ForwardChunk, SamplingParams, TickPlan


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
        # Released since the last plan; the next plan reports them so the plan log is a complete
        # record of ownership changes.
        self._finished_since_plan: list[str] = []
        self._aborted_since_plan: list[str] = []

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
        if total > self.max_context:
            raise AdmissionError(
                f"prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
                f"context limit of {self.max_context} tokens"
            )
        # Decoding writes the row of every token but the last sampled one.
        need = pages_for(total - 1, self.page_size)
        if need > self.allocator.pages.capacity:
            raise AdmissionError(
                f"the request needs up to {need} KV pages of {self.page_size} tokens; the pool has "
                f"{self.allocator.pages.capacity} (--max-total-tokens)"
            )

    def add(self, req: Request) -> None:
        if req.rid in self._by_rid:
            raise AdmissionError(f"request id {req.rid!r} is already in use")
        self.check_admissible(len(req.prompt_ids), req.sampling)
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
    def schedule(self) -> tuple[TickPlan, list[Request]]:
        """Decides the next tick and records its allocations; returns the plan and the requests it
        aborted for lack of pages (already released, with their error set)."""
        victims = self._make_room_for_decodes()
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
            n = min(len(req.prompt_ids) - req.num_computed, budget)
            chunks.append(self._chunk(req, req.num_computed, n))
            budget -= n
        while budget > 0 and self.waiting and self._admit(self.waiting[0]):
            req = self.waiting.popleft()
            n = min(len(req.prompt_ids), budget)
            chunks.append(self._chunk(req, 0, n))
            budget -= n
        self._seq += 1
        plan = TickPlan(
            seq=self._seq,
            batch=ForwardBatch(tick=self._seq, chunks=tuple(chunks)),
            finished=tuple(self._finished_since_plan),
            aborted=tuple(self._aborted_since_plan),
        )
        self._finished_since_plan.clear()
        self._aborted_since_plan.clear()
        return plan, victims

    def _make_room_for_decodes(self) -> list[Request]:
        victims = []
        while True:
            short = sum(
                1 for r in self.running if not r.prefilling and len(r.pages) < pages_for(r.num_tokens, self.page_size)
            )
            if short <= self.allocator.pages.num_free:
                return victims
            youngest = self.running[-1]
            self.abort(
                youngest.rid,
                f"out of KV cache pages: {short} running decodes need a new page and {self.allocator.pages.num_free} "
                f"of {self.allocator.pages.capacity} are free; aborted the youngest running request",
                finish_reason="error",
            )
            victims.append(youngest)

    def _admit(self, req: Request) -> bool:
        need = pages_for(len(req.prompt_ids), self.page_size)
        if self.allocator.slots.num_free == 0 or self.allocator.pages.num_free < need:
            return False
        (req.slot,) = self.allocator.slots.allocate(req.rid)
        req.pages = self.allocator.pages.allocate(req.rid, need)
        req.state = RequestState.RUNNING
        req.last_event = "admitted"
        self.running.append(req)
        return True

    def _chunk(self, req: Request, start: int, n: int) -> ForwardChunk:
        req.num_computed = start + n
        req.last_event = f"decode@{start}" if start >= len(req.prompt_ids) else f"prefill {start}..{start + n}"
        return ForwardChunk(
            rid=req.rid,
            slot=req.slot.id,
            slot_generation=req.slot.generation,
            start_pos=start,
            token_ids=tuple(req.token_at(p) for p in range(start, start + n)),
            page_ids=tuple(h.id for h in req.pages),
            page_generations=tuple(h.generation for h in req.pages),
            sample=req.num_computed >= len(req.prompt_ids),  # a prompt's last chunk, or a decode
        )

    def _release(self, req: Request, finish_reason: str, error: str | None) -> None:
        for handle in req.pages:
            self.allocator.pages.free(handle)
        if req.slot is not None:
            self.allocator.slots.free(req.slot)
        if req.state is RequestState.RUNNING:
            self.running.remove(req)
        req.pages, req.slot = [], None
        req.state = RequestState.FINISHED
        req.finish_reason, req.error = finish_reason, error
        req.last_event = f"finished: {finish_reason}"
        del self._by_rid[req.rid]
