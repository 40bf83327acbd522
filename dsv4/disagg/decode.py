"""The decode side: owns the request, allocates its destination, asks a prefill peer to fill it.

Per transfer: bootstrapping → waiting_for_prefill → transferring → committing → done | failed,
each state with a deadline. One task per transfer reads that transfer's frames from its own inbox,
so every decision about a transfer is made in one place, in order.

Payload bytes land only in staging buffers the transfer owns; they are copied into the pools only
after a Commit that names the right generations, follows every payload and (in verify mode)
carries checksums equal to what landed in the pools. A failed transfer keeps its pages, slot and
staging until it has proof that nothing more can land: a Commit, a DrainAck or the peer's own
Abort, plus the end of its posted receives; without proof within the lease, the peer is fenced.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import numpy as np
from ucxx.exceptions import UCXError

from dsv4.disagg.contracts import DEFAULT_TIMEOUTS, DecodeTarget, PdTimeouts
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.metrics import DisaggMetrics
from dsv4.disagg.peers import PrefillPeer
from dsv4.disagg.staging import StagingPool
from dsv4.disagg.supervisor import Supervisor
from dsv4.disagg.transport import Link, frame_kind, prompt_checksum
from dsv4.memory.allocator import Handle
from dsv4.protocol import (
    Abort,
    AbortAck,
    Commit,
    Destination,
    Drain,
    DrainAck,
    GenerationRequest,
    PayloadHeader,
    PrefillRequest,
    RequestOutput,
)

log = logging.getLogger(__name__)


class DecodeState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_PREFILL = "waiting_for_prefill"
    TRANSFERRING = "transferring"
    COMMITTING = "committing"
    DONE = "done"
    FAILED = "failed"


MAX_DISCARDING = 64


class TransferFailed(Exception):
    pass


@dataclass(frozen=True)
class _Received:
    seq: int
    error: str | None  # None: the body is in its staging buffer


@dataclass(frozen=True)
class _ClientAbort:
    reason: str


@dataclass(eq=False)
class DecodeTransfer:
    req: GenerationRequest
    room: int
    created_at: float
    state: DecodeState = DecodeState.BOOTSTRAPPING
    state_since: float = 0.0
    peer: PrefillPeer | None = None
    link: Link | None = None  # the peer's link this room was sent on (a reconnect makes a new one)
    pages: list[Handle] = field(default_factory=list)
    slot: Handle | None = None
    headers: dict[int, PayloadHeader] = field(default_factory=dict)  # seq -> header
    staging: dict[int, np.ndarray] = field(default_factory=dict)  # seq -> buffer this transfer owns
    receiving: set[asyncio.Task] = field(default_factory=set)
    received: set[int] = field(default_factory=set)
    failure: str | None = None
    drained: bool = False  # the peer proved it sends nothing more for this room
    lease: str = "none"  # none | held | released | fenced
    commit: Commit | None = None
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    outcome: asyncio.Future | None = None

    def enter(self, state: DecodeState) -> None:
        self.state, self.state_since = state, time.monotonic()


_STATE_TIMEOUT = {
    DecodeState.BOOTSTRAPPING: "bootstrap",
    DecodeState.WAITING_FOR_PREFILL: "wait_for_prefill",
    DecodeState.TRANSFERRING: "transfer",
    DecodeState.COMMITTING: "commit",
}


class RemotePrefill:
    """Serves a decode instance's requests by transfer from its prefill peers, then hands them to the
    decode batch (`DecodeTarget.admit`)."""

    def __init__(self, target: DecodeTarget, prefill_addrs: list[str], *, timeouts: PdTimeouts = DEFAULT_TIMEOUTS,
                 verify: bool = False, faults: TransferFaults | None = None, max_queue_wait: float = 60.0):
        if not prefill_addrs:
            raise ValueError("decode mode needs at least one --prefill-addr")
        self.target = target
        self.instance_id = uuid.uuid4().hex[:12]
        self.timeouts = timeouts
        self.verify = verify
        self.faults = faults or TransferFaults()
        self.metrics = DisaggMetrics()
        self.supervisor = Supervisor("decode", on_death=lambda name: self.metrics.task_deaths.labels(name).inc())
        self.staging = StagingPool()
        self.peers = [
            PrefillPeer(addr, self.instance_id, target.capabilities, self.timeouts, self.metrics, self.faults,
                        on_frame=self._route, on_lost=self._peer_lost, supervisor=self.supervisor)
            for addr in prefill_addrs
        ]
        self.transfers: dict[str, DecodeTransfer] = {}  # rid -> transfer, until its resources are released
        self._by_room: dict[int, DecodeTransfer] = {}
        self._rooms = itertools.count(1)
        self._peer_ready = asyncio.Event()
        self._max_queue_wait = max_queue_wait
        self._allocation_queue: deque[DecodeTransfer] = deque()  # FCFS: only the head allocates
        self._discarding = 0  # receives posted for payloads of unknown rooms

    async def start(self) -> None:
        for peer in self.peers:
            peer.start()

    async def stop(self) -> None:
        for peer in self.peers:
            peer.close("decode instance stopping")
        await self.supervisor.stop()

    # -- the engine's entry points ------------------------------------------------------------------
    def submit(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if req.rid in self.transfers:
            raise ValueError(f"request id {req.rid!r} is already in use")
        now = time.monotonic()
        t = DecodeTransfer(req, next(self._rooms), created_at=now, state_since=now,
                           outcome=asyncio.get_running_loop().create_future())
        self.transfers[req.rid] = t
        self._by_room[t.room] = t
        self.supervisor.spawn(f"transfer-{t.room}", self._run(t), critical=False)
        return self._outputs(t)

    def abort(self, rid: str, reason: str = "client disconnected") -> bool:
        """True when `rid` was still with disagg (the engine handles it otherwise)."""
        t = self.transfers.get(rid)
        if t is None or t.state is DecodeState.DONE:
            return False
        t.inbox.put_nowait(_ClientAbort(reason))
        return True

    async def _outputs(self, t: DecodeTransfer) -> AsyncIterator[RequestOutput]:
        try:
            admitted = await t.outcome
        except asyncio.CancelledError:
            self.abort(t.req.rid, "client went away")
            raise
        if isinstance(admitted, str):
            reason = "abort" if admitted.startswith("aborted") else "error"
            yield RequestOutput(rid=t.req.rid, finished=True, finish_reason=reason, error=admitted,
                                prompt_tokens=len(t.req.input_ids))
            return
        async for out in admitted:
            yield out

    # -- one transfer -------------------------------------------------------------------------------
    async def _run(self, t: DecodeTransfer) -> None:
        try:
            await self._bootstrap(t)
            await self._receive_until_commit(t)
            await self._commit(t)
        except TransferFailed as e:
            self._fail(t, str(e))
        except asyncio.CancelledError:
            self._fail(t, "decode instance stopping")
        except BaseException as e:
            self._fail(t, f"transfer task failed: {type(e).__name__}: {e}")
            raise
        finally:
            if t.state is not DecodeState.DONE:
                await self._end_lease(t)

    def _deadline(self, t: DecodeTransfer) -> float:
        bound = t.state_since + getattr(self.timeouts, _STATE_TIMEOUT[t.state])
        return bound if t.req.deadline is None else min(bound, t.req.deadline)

    async def _next(self, t: DecodeTransfer):
        """The transfer's next event, or TransferFailed when its state's deadline passes first."""
        remaining = self._deadline(t) - time.monotonic()
        try:
            event = await asyncio.wait_for(t.inbox.get(), max(remaining, 0.0))
        except TimeoutError:
            raise TransferFailed(self._deadline_message(t)) from None
        if isinstance(event, _ClientAbort):
            self.metrics.aborts.labels("client").inc()
            raise TransferFailed(f"aborted: {event.reason}")
        if isinstance(event, Abort):
            self.metrics.aborts.labels("prefill").inc()
            t.drained = True  # the prefill side aborts only once its room is quiescent
            self._send(t, AbortAck(room=t.room))
            raise TransferFailed(f"prefill peer {t.peer.addr} failed the transfer: {event.reason}")
        return event

    def _deadline_message(self, t: DecodeTransfer) -> str:
        which = "request" if t.req.deadline is not None and time.monotonic() >= t.req.deadline else "transfer"
        peer = f" (prefill peer {t.peer.addr})" if t.peer else ""
        return f"{which} deadline exceeded in state {t.state.value}{peer}"

    async def _bootstrap(self, t: DecodeTransfer) -> None:
        num_pages = -(-len(t.req.input_ids) // self.target.capabilities.page_size)
        while t.peer is None:
            t.peer = self._pick_peer()
            if t.peer is None:
                await self._wait_or_fail(t, self._peer_ready.wait(), self._no_peer_message())
        self._allocation_queue.append(t)
        try:
            while not t.pages:
                held = await self.target.allocate(t.req.rid, num_pages) if self._allocation_queue[0] is t else None
                if held is None:
                    await self._wait_or_fail(t, asyncio.sleep(0.02), "no free pages or slot for the transfer")
                else:
                    t.pages, t.slot = held
                    t.lease = "held"
        finally:
            self._allocation_queue.remove(t)
        if not t.peer.usable:
            raise TransferFailed(f"prefill peer {t.peer.addr} went away: {t.peer.status}")
        t.link = t.peer.link
        t.peer.rooms.add(t.room)
        remaining = (self._deadline(t) if t.req.deadline is None else t.req.deadline) - time.monotonic()
        request = PrefillRequest(
            room=t.room,
            rid=t.req.rid,
            prompt_ids=t.req.input_ids,
            sampling=t.req.sampling,
            pages=tuple(Destination(h.id, h.generation) for h in t.pages),
            slot=Destination(t.slot.id, t.slot.generation),
            timeout_s=min(self.timeouts.wait_for_prefill + self.timeouts.transfer, max(remaining, 0.0)),
            verify=self.verify,
        )
        t.enter(DecodeState.WAITING_FOR_PREFILL)
        if not await t.link.send(request):
            raise TransferFailed(f"prefill peer {t.peer.addr} went away: {t.peer.status}")

    async def _wait_or_fail(self, t: DecodeTransfer, waiting, why: str) -> None:
        """Waits for `waiting` or an inbox event, within the state's deadline."""
        waiter = asyncio.ensure_future(waiting)
        getter = asyncio.ensure_future(t.inbox.get())
        try:
            done, _ = await asyncio.wait({waiter, getter}, timeout=max(self._deadline(t) - time.monotonic(), 0.0),
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            waiter.cancel()
            getter.cancel()
        if getter in done and not getter.cancelled():
            event = getter.result()
            if isinstance(event, _ClientAbort):
                self.metrics.aborts.labels("client").inc()
                raise TransferFailed(f"aborted: {event.reason}")
            self.metrics.dropped_frames.labels("unexpected_kind").inc()  # nothing was sent yet
        elif not done:
            raise TransferFailed(f"{why}; gave up after {time.monotonic() - t.state_since:.1f}s in {t.state.value}")

    async def _receive_until_commit(self, t: DecodeTransfer) -> None:
        while True:
            event = await self._next(t)
            if isinstance(event, PayloadHeader):
                self._on_header(t, event)
            elif isinstance(event, _Received):
                if event.error is not None:
                    raise TransferFailed(event.error)
                t.received.add(event.seq)
            elif isinstance(event, Commit):
                t.drained = True  # the prefill side commits only after every payload was sent
                self._check_commit(t, event)
                t.enter(DecodeState.COMMITTING)
                t.commit = event
                return
            else:
                self.metrics.dropped_frames.labels("unexpected_kind").inc()

    def _on_header(self, t: DecodeTransfer, h: PayloadHeader) -> None:
        unit_bytes, expected_generation = self._destination(t, h)
        if h.seq in t.headers:
            self.metrics.dropped_frames.labels("duplicate").inc()
            self._receive(t, h, None)  # consume the duplicate body so the sender's send completes
            return
        if h.nbytes != unit_bytes or expected_generation is None:
            self.metrics.dropped_frames.labels("malformed").inc()
            raise TransferFailed(f"payload {h.seq} does not fit its destination ({h.target} {h.index}, "
                                 f"{h.nbytes} bytes, expected {unit_bytes})")
        if h.generation != expected_generation:
            self.metrics.dropped_frames.labels("stale_generation").inc()
            raise TransferFailed(f"payload {h.seq} names {h.target} {h.index} generation {h.generation}, "
                                 f"the destination is generation {expected_generation}")
        if t.state is DecodeState.WAITING_FOR_PREFILL:
            t.enter(DecodeState.TRANSFERRING)
        t.headers[h.seq] = h
        self._receive(t, h, self.staging.acquire(h.nbytes))

    def _destination(self, t: DecodeTransfer, h: PayloadHeader) -> tuple[int, int | None]:
        caps = self.target.capabilities
        if h.target == "page" and 0 <= h.index < len(t.pages) and h.seq == h.index:
            return caps.page_bytes, t.pages[h.index].generation
        if h.target == "slot" and h.index == 0 and h.seq == len(t.pages):
            return caps.slot_bytes, t.slot.generation
        return -1, None

    def _receive(self, t: DecodeTransfer, h: PayloadHeader, buf: np.ndarray | None) -> None:
        """Posts the receive of `h`'s body into `buf` (owned by `t`), or into a throwaway buffer."""
        if buf is not None:
            t.staging[h.seq] = buf
        target = buf if buf is not None else np.empty(h.nbytes, dtype=np.uint8)
        link = t.link

        async def receive() -> None:
            try:
                await link.recv_payload(t.room, h.seq, target)
            except UCXError as e:
                error = f"payload {h.seq} not received from prefill peer {t.peer.addr}: {type(e).__name__}: {e}"
            else:
                self.metrics.bytes.inc(h.nbytes)
                error = None if zlib.crc32(target) == h.checksum else (
                    f"payload {h.seq} ({h.target} {h.index}) failed its checksum")
            if buf is not None:
                t.inbox.put_nowait(_Received(h.seq, error))

        task = self.supervisor.spawn(f"receive-{t.room}-{h.seq}", receive(), critical=False)
        t.receiving.add(task)
        task.add_done_callback(t.receiving.discard)

    def _check_commit(self, t: DecodeTransfer, c: Commit) -> None:
        if c.num_payloads != len(t.pages) + 1 or len(t.headers) != c.num_payloads:
            raise TransferFailed(f"commit before payload: {len(t.headers)} of {c.num_payloads} payloads "
                                 f"announced (expected {len(t.pages) + 1})")
        if c.prompt_checksum != prompt_checksum(t.req.input_ids):
            raise TransferFailed("commit is for a different prompt than the one requested")
        if c.page_generations != tuple(h.generation for h in t.pages) or c.slot_generation != t.slot.generation:
            self.metrics.dropped_frames.labels("stale_generation").inc()
            raise TransferFailed("commit names stale generations")
        if self.verify and (c.page_checksums is None or c.slot_checksum is None
                            or len(c.page_checksums) != len(t.pages)):
            raise TransferFailed("verify mode: the commit carries no per-page checksums")

    async def _commit(self, t: DecodeTransfer) -> None:
        while len(t.received) < len(t.headers):
            event = await self._next(t)
            if isinstance(event, _Received):
                if event.error is not None:
                    raise TransferFailed(event.error)
                t.received.add(event.seq)
            elif isinstance(event, PayloadHeader):
                self._on_header(t, event)  # only duplicates can still come
            else:
                self.metrics.dropped_frames.labels("unexpected_kind").inc()
        pages = [t.staging[i] for i in range(len(t.pages))]
        page_sums, slot_sum = await self.target.install(t.pages, t.slot, pages, t.staging[len(t.pages)])
        c = t.commit
        if self.verify:
            bad = [i for i, (got, want) in enumerate(zip(page_sums, c.page_checksums)) if got != want]
            if bad or slot_sum != c.slot_checksum:
                raise TransferFailed(f"verify mode: checksum mismatch on pages {bad}"
                                     + ("" if slot_sum == c.slot_checksum else " and the slot"))
        while not t.inbox.empty():  # an abort that raced the commit still wins
            event = await self._next(t)
            if isinstance(event, PayloadHeader):
                self._on_header(t, event)
        self._release_staging(t)
        outputs = self.target.admit(t.req, t.pages, t.slot, c.first_token)
        t.lease = "released"  # to the engine, which owns the pages and slot from now on
        t.enter(DecodeState.DONE)
        self.metrics.transfers.labels("done").inc()
        self.metrics.latency.observe(time.monotonic() - t.created_at)
        t.peer.rooms.discard(t.room)
        self._forget(t)
        t.outcome.set_result(outputs)

    # -- failure and the end of a lease --------------------------------------------------------------
    def _fail(self, t: DecodeTransfer, reason: str) -> None:
        if t.failure is not None or t.state is DecodeState.DONE:
            return  # sticky: the first failure stands, and a done transfer is the engine's
        t.failure = reason
        t.enter(DecodeState.FAILED)
        log.info("transfer %s (room %d) failed: %s", t.req.rid, t.room, reason)
        if not t.outcome.done():
            t.outcome.set_result(reason)

    async def _end_lease(self, t: DecodeTransfer) -> None:
        """Releases what a failed transfer holds once nothing can land in it any more."""
        self.metrics.transfers.labels("aborted" if t.failure.startswith("aborted") else "failed").inc()
        link = t.link
        if link is not None and not t.drained and not link.closed:
            self._send(t, Abort(room=t.room, reason=t.failure))
            lease_end = time.monotonic() + self.timeouts.lease
            while not t.drained and not link.closed and time.monotonic() < lease_end:
                self._send(t, Drain(room=t.room))
                await self._await_drain(t, min(self.timeouts.drain_retry, lease_end - time.monotonic()))
            if not t.drained and not link.closed:
                link.fence(f"room {t.room} not drained within its {self.timeouts.lease}s lease")
                t.lease = "fenced"
        if t.receiving:
            await asyncio.wait(set(t.receiving), timeout=self.timeouts.lease)
            if t.receiving and not link.closed:
                link.fence(f"room {t.room}: receives still posted after drain")
                t.lease = "fenced"
            if t.receiving:
                await asyncio.wait(set(t.receiving), timeout=self.timeouts.lease)
        if t.receiving:
            # Not even a fenced endpoint ended them: keep the buffers rather than risk reuse.
            log.error("room %d: %d receives never ended; its staging and pages are quarantined",
                      t.room, len(t.receiving))
            t.lease = "quarantined"
            return
        if t.peer is not None:
            t.peer.rooms.discard(t.room)
        self._release_staging(t)
        if t.pages:
            await self.target.release(t.pages, t.slot)
        if t.lease != "fenced":
            t.lease = "released"
        self._forget(t)

    async def _await_drain(self, t: DecodeTransfer, timeout: float) -> None:
        end = time.monotonic() + max(timeout, 0.0)
        while not t.drained and (remaining := end - time.monotonic()) > 0:
            try:
                event = await asyncio.wait_for(t.inbox.get(), remaining)
            except TimeoutError:
                return
            if isinstance(event, DrainAck | Commit | Abort):
                t.drained = True
                if isinstance(event, DrainAck):
                    self.metrics.drains.inc()
                elif isinstance(event, Commit):
                    self.metrics.dropped_frames.labels("late_commit").inc()
            elif isinstance(event, PayloadHeader):
                # A payload already on its way: match it so the sender's send completes and its room
                # drains; into a buffer this transfer owns, so nothing lands anywhere else.
                self.metrics.dropped_frames.labels("after_failure").inc()
                if event.nbytes != self._destination(t, event)[0]:
                    continue
                if event.seq in t.headers:
                    self._receive(t, event, None)
                else:
                    t.headers[event.seq] = event
                    self._receive(t, event, self.staging.acquire(event.nbytes))

    def _release_staging(self, t: DecodeTransfer) -> None:
        for buf in t.staging.values():
            self.staging.release(buf)
        t.staging.clear()

    def _forget(self, t: DecodeTransfer) -> None:
        self.transfers.pop(t.req.rid, None)
        self._by_room.pop(t.room, None)

    def _send(self, t: DecodeTransfer, frame) -> None:
        self.supervisor.spawn(f"send-{frame_kind(frame)}", t.link.send(frame), critical=False)

    # -- frames from peers --------------------------------------------------------------------------
    def _route(self, link: Link, frame) -> None:
        t = self._by_room.get(frame.room)
        if t is None or t.link is not link:
            self.metrics.dropped_frames.labels("unknown_room").inc()
            if isinstance(frame, PayloadHeader):
                self._discard_payload(link, frame)
            return
        t.inbox.put_nowait(frame)

    def _discard_payload(self, link: Link, h: PayloadHeader) -> None:
        """Matches the body of a payload no transfer expects, so its sender's send completes instead of
        stalling its room; the body lands in a throwaway buffer. A body that never comes keeps its
        receive posted until the link closes, so at most MAX_DISCARDING are allowed at once."""
        caps = self.target.capabilities
        if h.nbytes not in (caps.page_bytes, caps.slot_bytes):
            return  # not a body a peer could have sent us
        if self._discarding >= MAX_DISCARDING:
            link.fence(f"more than {MAX_DISCARDING} payloads for unknown rooms in flight")
            return
        self._discarding += 1

        async def discard() -> None:
            try:
                await link.recv_payload(h.room, h.seq, np.empty(h.nbytes, dtype=np.uint8))
            except UCXError:
                pass  # the link closed: the receive was cancelled
            finally:
                self._discarding -= 1

        self.supervisor.spawn(f"discard-{h.room}-{h.seq}", discard(), critical=False)

    def _peer_lost(self, peer: PrefillPeer, link: Link) -> None:
        # The endpoint is closed, so UCX has cancelled every receive posted on it: nothing can land.
        for t in list(self._by_room.values()):
            if t.link is link:
                t.inbox.put_nowait(Abort(room=t.room, reason=f"link lost: {link.close_reason}"))
        self._update_peer_ready()

    def _pick_peer(self) -> PrefillPeer | None:
        usable = [p for p in self.peers if p.usable]
        self._update_peer_ready()
        return min(usable, key=lambda p: len(p.rooms) + p.load, default=None)

    def _update_peer_ready(self) -> None:
        if any(p.usable for p in self.peers):
            self._peer_ready.set()
        else:
            self._peer_ready.clear()

    def _no_peer_message(self) -> str:
        return "no prefill peer reachable: " + "; ".join(f"{p.addr} ({p.explain()})" for p in self.peers)

    # -- views --------------------------------------------------------------------------------------
    def ready(self) -> tuple[bool, list[str]]:
        ok, reasons = self.supervisor.ready()
        if not any(p.usable for p in self.peers):
            ok = False
            reasons.append(self._no_peer_message())
        if self._allocation_queue:
            waited = time.monotonic() - self._allocation_queue[0].created_at
            if waited > self._max_queue_wait:
                ok = False
                reasons.append(f"the oldest request waiting for a transfer destination has waited {waited:.1f} s "
                               f"(--max-queue-wait {self._max_queue_wait:g} s)")
        return ok, reasons

    def debug(self) -> dict:
        now = time.monotonic()
        return {
            "role": "decode",
            "instance_id": self.instance_id,
            "transfers": [
                {
                    "rid": t.req.rid,
                    "room": t.room,
                    "prefill": t.peer.addr if t.peer else None,
                    "state": t.state.value,
                    "age_s": round(now - t.created_at, 3),
                    "in_state_s": round(now - t.state_since, 3),
                    "lease": t.lease,
                    "failure": t.failure,
                }
                for t in self.transfers.values()
            ],
            "prefill_peers": [p.describe() for p in self.peers],
            "staging_buffers_in_use": self.staging.in_use,
            "staging_bytes_in_use": self.staging.bytes_in_use,
            "task_deaths": dict(self.supervisor.deaths),
        }
