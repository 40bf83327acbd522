"""The Engine: what the HTTP server talks to (docs/ENGINE_CONTRACTS.md).

It owns the tokenizer, the runner, the scheduler and the supervised tick loop, and reports
readiness as forward progress (ARCHITECTURE.md invariant 6). Every method runs on the event loop
thread; only forwards run elsewhere.

With --tp-size N it is rank 0's engine: it owns the group and this node's other rank processes,
watches them (a rank that exits kills the tick loop with that rank named) and stops them with itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import zlib
from collections.abc import AsyncIterator, Callable

import numpy as np

from dsv4.cache.hicache import HostTier, host_units
from dsv4.cache.metrics import PrefixCacheCollector
from dsv4.cache.radix import RadixCache
from dsv4.config import CSA, ModelConfig, ServerArgs
from dsv4.dist.collectives import TpGroup
from dsv4.dist.ranks import RankProcesses
from dsv4.engine.grammar import Constraints
from dsv4.engine.install import InstallFailed, PendingInstall
from dsv4.engine.metrics import EngineMetrics
from dsv4.engine.request import AdmissionError, Request
from dsv4.engine.scheduler import Scheduler
from dsv4.engine.tick import Adopted, Ticker
from dsv4.memory.allocator import Handle, PageSlotAllocator
from dsv4.protocol import GenerationRequest, RequestOutput, StateInstall
from dsv4.tokenizer import IncrementalDetokenizer

__all__ = ["AdmissionError", "Engine"]

log = logging.getLogger(__name__)

IDLE_WAKE_S = 1.0  # an idle loop re-checks this often; it does not spin
# After a tick that could run nothing while work is pending (requests waiting for host-tier loads, or for room),
# the loop ticks again on the next event (an arrival, an abort, a landed copy) or after this long, for a change
# no event announces. Ticking again at once spun the loop: /health went unanswered while loads ran, and the copy
# thread waited for the GIL at each step (`small`'s host-tier hit of 3968 tokens: 530 ms to the first token
# against 180 with this wait).
BLOCKED_WAKE_S = 0.05
# A forward that has not returned after this many stall bounds is declared stuck: the tick loop
# dies with a named error instead of leaving requests hanging.
FORWARD_DEADLINE_STALLS = 12
STOP_TIMEOUT_S = 5.0
RANK_POLL_S = 0.2  # how often rank 0 checks that the other rank processes still run


class Engine:
    def __init__(
        self,
        args: ServerArgs,
        model_config: ModelConfig,
        tokenizer,
        runner,
        *,
        model_name: str = "dsv4",
        clock: Callable[[], float] = time.monotonic,
        group: TpGroup | None = None,
        ranks: RankProcesses | None = None,
    ) -> None:
        self.args = args
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner = runner
        self.model_name = args.served_model_name or model_name
        self.max_context = min(
            args.context_length or model_config.max_position_embeddings, runner.num_pages * args.page_size
        )
        self.metrics = EngineMetrics()
        # The runner has a boundary snapshot unit per page unless --disable-radix-cache.
        self.allocator = PageSlotAllocator(runner.num_pages, runner.num_slots, runner.num_snapshots)
        prefix_cache = None
        self.host_tier = None
        if runner.num_snapshots and args.enable_hierarchical_cache:
            pools = runner.pools
            self.host_tier = HostTier(
                pools, host_units(pools.page_bytes + pools.slot_bytes, runner.num_pages, args.hicache_ratio,
                                  args.hicache_size),
                snapshot_unit=self.allocator.snapshot_unit, write_policy=args.hicache_write_policy,
                verify=args.verify_transfers, delays=args.faults.copy_delays, on_copy=self._copy_landed)
        if runner.num_snapshots:
            prefix_cache = RadixCache(args.page_size, self.allocator.pages, self.allocator.snapshots,
                                      host=self.host_tier)
            self.metrics.registry.register(PrefixCacheCollector(prefix_cache))
        self.scheduler = Scheduler(
            self.allocator,
            page_size=args.page_size,
            token_budget=args.chunked_prefill_size,
            max_context=self.max_context,
            prefix_cache=prefix_cache,
            window=model_config.sliding_window,
        )
        self._clock = clock
        self._forward_deadline = FORWARD_DEADLINE_STALLS * args.tick_stall_timeout
        eos_ids = frozenset({model_config.eos_token_id, tokenizer.eos_id})
        self._ticker = Ticker(
            self.scheduler,
            runner,
            new_detokenizer=lambda: IncrementalDetokenizer(tokenizer),
            eos_ids=eos_ids,
            metrics=self.metrics,
            deliver=self._deliver,
            forward_deadline=self._forward_deadline,
            faults=args.faults,
            clock=clock,
            verify_indexer=args.verify_indexer,
            group=group,
            constraints=Constraints(tokenizer, model_config.vocab_size, eos_ids),
        )
        self._group, self._ranks = group, ranks
        if group is not None:
            group.observe = lambda op, seconds: self.metrics.collective_seconds.labels(op=op).observe(seconds)
        if args.verify_indexer != "off":
            self.metrics.track_indexer_layers(i for i in range(model_config.num_layers)
                                              if model_config.layer_kind(i) == CSA)
        self._queues: dict[str, asyncio.Queue[RequestOutput]] = {}  # live requests, until their last output
        self._loop: asyncio.AbstractEventLoop | None = None  # the tick loop's, once started
        self._task: asyncio.Task | None = None
        self._watch: asyncio.Task | None = None
        self._dead: str | None = None
        self._died = asyncio.Event()
        self._progress_at = clock()
        self._ticks_done = 0
        self._rank_ticks: list[int] = []  # consensus of tick _ticks_done; the ticker's own changes mid-tick, on the forward thread
        self.metrics.watch_capacity(self.scheduler.capacity, lambda: len(self.scheduler.running),
                                    lambda: len(self.scheduler.waiting))

    @classmethod
    def from_args(cls, args: ServerArgs) -> Engine:
        from dsv4.engine.launch import load_model, start_node

        if args.tp_size == 1:
            model = load_model(args)
            return cls(args, model.config, model.tokenizer, model.runner, model_name=model.name)
        group, ranks = start_node(args)
        try:
            model = load_model(args, group)
        except BaseException:
            ranks.stop()
            raise
        return cls(args, model.config, model.tokenizer, model.runner, model_name=model.name, group=group, ranks=ranks)

    # -- lifecycle -----------------------------------------------------------------------------------
    async def start(self) -> None:
        if self._task is None:
            self._loop = asyncio.get_running_loop()
            self._progress_at = self._clock()
            self._task = asyncio.create_task(self._supervise(), name="dsv4-tick-loop")
            if self._ranks is not None:
                self._watch = asyncio.create_task(self._watch_ranks(), name="dsv4-rank-watch")

    async def stop(self, reason: str = "engine stopped") -> None:
        """Stops the tick loop; every request still live ends with `reason`."""
        for task in (self._task, self._watch):
            if task is not None and not task.done():
                task.cancel()
                await asyncio.wait({task}, timeout=STOP_TIMEOUT_S)
        self._ticker.close()
        if self.host_tier is not None:
            self.host_tier.close()
        if self._ranks is not None:
            await asyncio.to_thread(self._ranks.stop)
            # With the other ranks gone, a collective still in flight fails at once; then the group can go.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.to_thread(self._ticker.close, wait=True), self.args.dist_timeout)
            self._group.close()
        if self._dead is None:
            self._dead = reason
            self._ticker.fail_all(self._dead)

    def alive(self) -> tuple[bool, str | None]:
        """Liveness: False (with the reason) once the tick loop has died and nothing can be served."""
        return not self._died.is_set(), self._dead if self._died.is_set() else None

    async def until_dead(self) -> str:
        """Returns the reason once the tick loop has died (not when it was stopped)."""
        await self._died.wait()
        return self._dead

    async def _supervise(self) -> None:
        try:
            while True:
                if not self._has_work():
                    await self._ticker.inbox.wait(IDLE_WAKE_S)
                    if self._group is None:
                        continue  # a group ticks anyway: its followers wait for a plan within the deadline
                plan = await self._ticker.step()
                self._ticks_done = plan.seq
                self._rank_ticks = list(self._ticker.rank_ticks)
                self._progress_at = self._clock()
                if self._group is None and not plan.batch.chunks and self._has_work():
                    await self._ticker.inbox.wait(BLOCKED_WAKE_S)
        except asyncio.CancelledError:
            raise
        except Exception as e:
            log.exception("tick loop died")
            self._die(f"tick loop died at tick {self._ticks_done + 1}: {type(e).__name__}: {e}")

    def _copy_landed(self) -> None:
        """The copy thread set a host-tier copy's fence: a tick loop waiting for one ticks again."""
        if self._loop is not None:
            with contextlib.suppress(RuntimeError):  # (the loop is closed: nobody waits)
                self._loop.call_soon_threadsafe(self._ticker.inbox.wake)

    async def _watch_ranks(self) -> None:
        while (dead := self._ranks.dead()) is None:
            await asyncio.sleep(RANK_POLL_S)
        self._die(f"{dead} (rank 0 at tick {self._ticks_done + 1})")
        if self._task is not None:
            self._task.cancel()

    def _die(self, reason: str) -> None:
        """The engine can serve no more: every live request ends with `reason`, and so does liveness."""
        if self._died.is_set():
            return
        self._dead = reason
        log.critical("%s", reason)
        self._ticker.fail_all(reason)
        self._died.set()

    # -- requests --------------------------------------------------------------------------------------
    def submit(self, req: GenerationRequest, *, export_state: Callable[[Request], None] | None = None
               ) -> AsyncIterator[RequestOutput]:
        """Queues `req`; raises AdmissionError now if it can never be served. `export_state` (PD
        prefill) sees the request at the tick boundary after its first token, before release."""
        self.check_request(req)
        now = self._clock()
        deadline = req.deadline if req.deadline is not None else now + self.args.request_timeout
        request = Request(rid=req.rid, prompt_ids=tuple(req.input_ids), sampling=req.sampling,
                          arrival=now, deadline=deadline, export_state=export_state)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req.rid] = queue
        if self._dead is not None:
            queue.put_nowait(RequestOutput(rid=req.rid, finished=True, finish_reason="error", error=self._dead,
                                           prompt_tokens=len(req.input_ids), error_status=503))
        else:
            if not self._has_work():
                self._progress_at = now  # the stall clock starts when work arrives, not at the last tick
            self._ticker.inbox.put_request(request)
        return self._outputs(request, queue)

    # -- PD decode (dsv4/engine/pd.py; docs/PD_ENGINE_HOOKS.md) ----------------------------------------
    def submit_transferred(self, req: GenerationRequest, *, pages: list[Handle], slot: Handle,
                           first: Adopted) -> AsyncIterator[RequestOutput]:
        """A request whose prompt state was transferred into `pages`/`slot` (held under its rid; the
        engine owns them from now on) joins the decode batch at the next tick boundary, with the
        first token (and its logprobs) sampled on the prefill side."""
        now = self._clock()
        deadline = req.deadline if req.deadline is not None else now + self.args.request_timeout
        request = Request(rid=req.rid, prompt_ids=tuple(req.input_ids), sampling=req.sampling, arrival=now,
                          deadline=deadline, pages=list(pages), slot=slot)
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()
        self._queues[req.rid] = queue
        if self._dead is not None:
            for handle in pages:
                self.allocator.pages.free(handle)
            self.allocator.slots.free(slot)
            queue.put_nowait(RequestOutput(rid=req.rid, finished=True, finish_reason="error", error=self._dead,
                                           prompt_tokens=len(req.input_ids), error_status=503))
        else:
            if not self._has_work():
                self._progress_at = now
            self._ticker.inbox.put_adopted(request, first)
        return self._outputs(request, queue)

    async def install(self, rid: str, pages: list[Handle], slot: Handle, page_data: list[np.ndarray],
                      slot_data: np.ndarray) -> tuple[list[int], int]:
        """Writes a transfer's received state into `pages` and `slot` on every rank: the next plan carries
        the install, applied before its forward (never during one). Returns the CRC-32s of what landed
        once the tick's consensus vector shows it landed on every rank; raises InstallFailed otherwise."""
        pools = self.runner.pools
        if any(p.nbytes != pools.page_bytes for p in page_data) or slot_data.nbytes != pools.slot_bytes:
            raise ValueError(f"{rid}: a page or the slot has the wrong size for this engine's pools")

        def pack() -> tuple[np.ndarray, StateInstall]:  # off the event loop: large states take a while
            return np.concatenate([*page_data, slot_data]), StateInstall(
                rid, tuple(h.id for h in pages), tuple(h.generation for h in pages), slot.id, slot.generation,
                tuple(zlib.crc32(p) for p in page_data), zlib.crc32(slot_data))

        data, install = await asyncio.to_thread(pack)
        if self._dead is not None:
            raise InstallFailed(self._dead)
        if not self._has_work():
            self._progress_at = self._clock()
        done: asyncio.Future[tuple[list[int], int]] = asyncio.get_running_loop().create_future()
        self._ticker.inbox.put_install(PendingInstall(install, data, done))
        return await done

    def check_request(self, req: GenerationRequest) -> None:
        """Raises AdmissionError if `req` can never be served (also used before a PD transfer)."""
        if req.rid in self._queues:
            raise AdmissionError(f"request id {req.rid!r} is already in use")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in req.input_ids):
            raise AdmissionError(f"prompt token ids must lie in 0..{vocab - 1}")
        if any(not s for s in req.sampling.stop):
            raise AdmissionError("stop strings must not be empty")
        self.scheduler.check_admissible(len(req.input_ids), req.sampling)

    async def _outputs(self, req: Request, queue: asyncio.Queue[RequestOutput]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while not finished:
                # The engine answers by the deadline, or its forward deadline kills the loop and
                # fail_all answers; this timeout is the last resort if both fail.
                timeout = max(0.0, req.deadline - self._clock()) + self._forward_deadline
                try:
                    async with asyncio.timeout(timeout):
                        output = await queue.get()
                except TimeoutError:
                    error = f"the engine gave no answer for {timeout:.0f} s, past the request's deadline"
                    self.abort(req.rid, error)
                    output = RequestOutput(rid=req.rid, finished=True, finish_reason="error", error=error,
                                           prompt_tokens=len(req.prompt_ids))
                finished = output.finished
                yield output
        finally:
            if not finished:
                self.abort(req.rid, "client stopped reading")

    def abort(self, rid: str, reason: str = "client disconnected") -> None:
        if rid in self._queues and self._dead is None:
            self._ticker.inbox.put_abort(rid, reason)

    def _deliver(self, output: RequestOutput) -> None:
        queue = self._queues.get(output.rid)
        if queue is None:
            return
        queue.put_nowait(output)
        if output.finished:
            del self._queues[output.rid]

    # -- health and introspection -----------------------------------------------------------------------
    def _has_work(self) -> bool:
        return bool(self._ticker.inbox) or self.scheduler.has_work()

    def ready(self) -> tuple[bool, list[str]]:
        if self._dead is not None:
            return False, [self._dead]
        if self._task is None:
            return False, ["engine not started"]
        reasons = []
        now = self._clock()
        stalled = now - self._progress_at
        if self._has_work() and stalled > self.args.tick_stall_timeout:
            reasons.append(
                f"tick {self._ticks_done + 1} has not completed in {stalled:.1f} s with work pending "
                f"(--tick-stall-timeout {self.args.tick_stall_timeout:g} s)"
            )
        # A retracted request's wait counts from its retraction: its time running is not queueing.
        arrivals = [r.waiting_since for r in self.scheduler.waiting] + [r.arrival for r in self._ticker.inbox.requests]
        if arrivals and now - min(arrivals) > self.args.max_queue_wait:
            reasons.append(
                f"the oldest waiting request has waited {now - min(arrivals):.1f} s "
                f"(--max-queue-wait {self.args.max_queue_wait:g} s)"
            )
        return not reasons, reasons

    def debug_requests(self) -> dict:
        now = self._clock()
        pages = self.allocator.pages.holders()
        slots = self.allocator.slots.holders()
        requests = []
        for req in [*self.scheduler.requests(), *self._ticker.inbox.requests]:
            entry = req.describe(now)
            entry["pages"] = pages.get(req.rid, [])
            entry["slot"] = slots.get(req.rid, [None])[0]
            requests.append(entry)
        debug = {"requests": requests, **self.scheduler.capacity(), "tick": self._ticks_done, "ready": self.ready()[0],
                 "tp_size": self.args.tp_size}
        if self._group is not None:
            slowest = self._group.slowest
            debug["rank_ticks"] = self._rank_ticks
            debug["slowest_collective"] = None if slowest is None else dict(zip(("op", "seconds", "tick"), slowest))
        return debug
