"""The decode side: owns the request, allocates its destination, asks a prefill peer to fill it.

Per transfer: bootstrapping → waiting_for_prefill → transferring → committing → installing →
done | failed, each state with a deadline (installing's is the engine's own: see STATE_TIMEOUT).
One task per transfer reads that transfer's frames from its own inbox, so every decision about a
transfer is made in one place, in order.

Payload bytes land only in staging buffers the transfer owns; they are copied into the pools only
after a Commit that names the right generations, follows every payload and (in verify mode)
carries checksums equal to what landed in the pools. A failed transfer keeps its pages, slot and
staging until it has proof that nothing more can land: a Commit, a DrainAck or the peer's own
Abort, plus the end of its posted receives; without proof within the lease, the peer is fenced.
Receives land only in staging, never in the pools, so once the peer is fenced the pages and slot go
back even if a receive never ends; that receive's staging buffer is abandoned, never reused. Pages
are never released while an install copy into them may still run (shutdown included).

A transfer's failure is its request's (ARCHITECTURE.md invariant 5): a prefill's Abort, a deadline,
a bad frame for its room, a frame that cannot be encoded or an unexpected exception ends that
request with its reason and HTTP status (4xx when the request's input is the cause); only the
links and this side's service tasks make the instance not ready.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
import uuid
import zlib
from collections import deque
from collections.abc import AsyncIterator

import numpy as np
from ucxx.exceptions import UCXError

from dsv4.disagg.contracts import DEFAULT_TIMEOUTS, DecodeTarget, PdTimeouts, RequestFailed
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.metrics import DisaggMetrics
from dsv4.disagg.peers import PrefillPeer
from dsv4.disagg.routing import PeerRouter
from dsv4.disagg.staging import StagingPool
from dsv4.disagg.supervisor import Supervisor
from dsv4.disagg.transfer import STATE_TIMEOUT, ClientAbort, DecodeState, DecodeTransfer, Received, TransferFailed
from dsv4.disagg.transport import FrameEncodeError, Link, frame_kind, prompt_checksum, valid_tag
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

MAX_DISCARDING = 64


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
        self.supervisor = Supervisor(
            "decode", on_death=lambda name: self.metrics.task_deaths.labels(name).inc(),
            on_request_error=lambda name: self.metrics.request_task_errors.labels(name.split("-")[0]).inc())
        self.staging = StagingPool()
        self.peers = [
            PrefillPeer(addr, self.instance_id, target.capabilities, self.timeouts, self.metrics, self.faults,
                        on_frame=self._route, on_lost=self._peer_lost, on_change=self._peers_changed,
                        supervisor=self.supervisor)
            for addr in prefill_addrs
        ]
        self.router = PeerRouter(self.peers, target.capabilities.page_size)
        self.transfers: dict[str, DecodeTransfer] = {}  # rid -> transfer, until its resources are released
        self._by_room: dict[int, DecodeTransfer] = {}
        self._rooms = itertools.count(1)
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
    def refusal(self, req: GenerationRequest) -> str | None:
        """Why no prefill peer can ever take `req`'s prompt (the engine refuses it with 400), or None."""
        return self.router.refusal(len(req.input_ids))

    def submit(self, req: GenerationRequest) -> AsyncIterator[RequestOutput]:
        if req.rid in self.transfers:
            raise ValueError(f"request id {req.rid!r} is already in use")
        now = time.monotonic()
        t = DecodeTransfer(req, next(self._rooms), created_at=now, state_since=now,
                           outcome=asyncio.get_running_loop().create_future())
        self.transfers[req.rid] = t
        self._by_room[t.room] = t
        task = self.supervisor.spawn(f"transfer-{t.room}", self._run(t), kind="request")
        # A task cancelled before its first step (shutdown) never runs its body: its request still ends.
        task.add_done_callback(lambda _: self._fail(t, "decode instance stopping", 503))
        return self._outputs(t)

    def abort(self, rid: str, reason: str = "client disconnected") -> bool:
        """True when `rid` was still with disagg (the engine handles it otherwise)."""
        t = self.transfers.get(rid)
        if t is None or t.state is DecodeState.DONE:
            return False
        t.inbox.put_nowait(ClientAbort(reason))
        return True

    async def _outputs(self, t: DecodeTransfer) -> AsyncIterator[RequestOutput]:
        try:
            admitted = await t.outcome
        except asyncio.CancelledError:
            self.abort(t.req.rid, "client went away")
            raise
        if admitted is None:
            reason = "abort" if t.failure.startswith("aborted") else "error"
            yield RequestOutput(rid=t.req.rid, finished=True, finish_reason=reason, error=t.failure,
                                error_status=t.status, prompt_tokens=len(t.req.input_ids))
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
            self._fail(t, str(e), e.status)
        except asyncio.CancelledError:
            self._fail(t, "decode instance stopping", 503)
        except Exception as e:  # a bug: this request's failure, logged with its traceback
            log.exception("transfer %s (room %d) failed unexpectedly", t.req.rid, t.room)
            self.metrics.request_task_errors.labels("transfer").inc()
            self._fail(t, f"transfer task failed: {type(e).__name__}: {e}")
        finally:
            if t.state is not DecodeState.DONE:
                await self._end_lease(t)

    def _deadline(self, t: DecodeTransfer) -> float:
        timeout = STATE_TIMEOUT.get(t.state)
        bound = float("inf") if timeout is None else t.state_since + getattr(self.timeouts, timeout)
        return bound if t.req.deadline is None else min(bound, t.req.deadline)

    async def _next(self, t: DecodeTransfer):
        """The transfer's next event, or TransferFailed when its state's deadline passes first."""
        remaining = self._deadline(t) - time.monotonic()
        try:
            event = await asyncio.wait_for(t.inbox.get(), max(remaining, 0.0))
        except TimeoutError:
            raise TransferFailed(self._deadline_message(t)) from None
        if isinstance(event, ClientAbort):
            self.metrics.aborts.labels("client").inc()
            raise TransferFailed(f"aborted: {event.reason}")
        if isinstance(event, Abort):
            self.metrics.aborts.labels("prefill").inc()
            t.drained = True  # the prefill side aborts only once its room is quiescent
            self._send(t, AbortAck(room=t.room))
            raise TransferFailed(f"prefill peer {t.peer.addr} failed the transfer: {event.reason}", event.status)
        return event

    def _deadline_message(self, t: DecodeTransfer) -> str:
        which = "request" if t.req.deadline is not None and time.monotonic() >= t.req.deadline else "transfer"
        peer = f" (prefill peer {t.peer.addr})" if t.peer else ""
        return f"{which} deadline exceeded in state {t.state.value}{peer}"

    async def _bootstrap(self, t: DecodeTransfer) -> None:
        prompt_tokens = len(t.req.input_ids)
        num_pages = -(-prompt_tokens // self.target.capabilities.page_size)
        await self._pick_peer(t, prompt_tokens)  # first: a prompt no peer takes is refused holding no pages
        self._allocation_queue.append(t)
        try:
            while not t.pages:
                held = await self.target.allocate(t.req, num_pages) if self._allocation_queue[0] is t else None
                if held is None:
                    await self._wait_or_fail(t, asyncio.sleep(0.02), "no free pages or slot for the transfer")
                else:
                    t.pages, t.slot = held
                    t.lease = "held"
        finally:
            self._allocation_queue.remove(t)
        if not t.peer.usable:
            # The peer went away or turned not ready (e.g. a slow tick) while this transfer waited for
            # its destination. Nothing was sent to it yet: wait for a usable peer, as at the start.
            t.peer = None
            await self._pick_peer(t, prompt_tokens)
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
        try:
            sent = await t.link.send(request)
        except FrameEncodeError as e:  # a value of the request msgpack cannot carry (e.g. a seed past 64 bits)
            t.drained = True  # nothing was sent: the peer has nothing of this room
            raise TransferFailed(f"the request cannot be sent to a prefill instance: {e}", 400) from None
        if not sent:
            raise TransferFailed(f"prefill peer {t.peer.addr} went away: {t.link.close_reason}")

    async def _pick_peer(self, t: DecodeTransfer, prompt_tokens: int) -> None:
        while t.peer is None:
            if (refusal := self.router.refusal(prompt_tokens)) is not None:
                raise TransferFailed(refusal, 400)
            t.peer = self.router.pick(prompt_tokens)
            if t.peer is None:
                await self._wait_or_fail(t, self.router.wait_for_change(),
                                         "no usable prefill peer can take the prompt; " + self.router.no_peer_message())

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
            if isinstance(event, ClientAbort):
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
            elif isinstance(event, Received):
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
                t.inbox.put_nowait(Received(h.seq, error))

        task = self.supervisor.spawn(f"receive-{t.room}-{h.seq}", receive(), kind="request")
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
            if isinstance(event, Received):
                if event.error is not None:
                    raise TransferFailed(event.error)
                t.received.add(event.seq)
            elif isinstance(event, PayloadHeader):
                self._on_header(t, event)  # only duplicates can still come
            else:
                self.metrics.dropped_frames.labels("unexpected_kind").inc()
        pages = [t.staging[i] for i in range(len(t.pages))]
        t.enter(DecodeState.INSTALLING)
        # Shielded: a cancelled transfer must not release its pages while the copy into them still runs.
        t.installing = asyncio.ensure_future(self.target.install(t.req.rid, t.pages, t.slot, pages,
                                                                 t.staging[len(t.pages)]))
        deadline = self._deadline(t)
        wait = None if deadline == float("inf") else max(deadline - time.monotonic(), 0.0)
        try:
            page_sums, slot_sum = await asyncio.wait_for(asyncio.shield(t.installing), wait)
        except TimeoutError:
            raise TransferFailed(self._deadline_message(t)) from None
        except RequestFailed as e:
            raise TransferFailed(str(e), e.status) from None
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
        outputs = self.target.admit(t.req, t.pages, t.slot, c.first_token, c.first_logprob, c.prompt_logprobs)
        t.lease = "released"  # to the engine, which owns the pages and slot from now on
        t.enter(DecodeState.DONE)
        self.metrics.transfers.labels("done").inc()
        self.metrics.latency.observe(time.monotonic() - t.created_at)
        t.peer.rooms.discard(t.room)
        self._forget(t)
        t.outcome.set_result(outputs)

    # -- failure and the end of a lease --------------------------------------------------------------
    def _fail(self, t: DecodeTransfer, reason: str, status: int = 500) -> None:
        if t.failure is not None or t.state is DecodeState.DONE:
            return  # sticky: the first failure stands, and a done transfer is the engine's
        t.failure, t.status = reason, status
        t.enter(DecodeState.FAILED)
        log.info("transfer %s (room %d) failed: %s", t.req.rid, t.room, reason)
        if not t.outcome.done():
            t.outcome.set_result(None)  # the failure is in t.failure and t.status

    async def _end_lease(self, t: DecodeTransfer) -> None:
        """Releases what a failed transfer holds once nothing can land in it any more."""
        self.metrics.transfers.labels("aborted" if t.failure.startswith("aborted") else "failed").inc()
        if t.installing is not None:
            # Bounded by the engine's forward deadline; a stopping engine cancels a copy not yet begun.
            await asyncio.wait({t.installing})
        link = t.link
        if link is not None and not t.drained and not link.closed:
            self._send(t, Abort(room=t.room, reason=t.failure, status=t.status))
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
        if t.peer is not None:
            t.peer.rooms.discard(t.room)
        if t.receiving:
            # The endpoint is fenced, yet UCX has not ended these receives. They can only ever land in
            # staging: those buffers are abandoned (never reused); the pages and slot go back.
            log.error("room %d: %d receives did not end after the fence; abandoning its staging buffers",
                      t.room, len(t.receiving))
            for buf in t.staging.values():
                self.staging.abandon(buf)
            t.staging.clear()
        self._release_staging(t)
        if t.pages:
            await self.target.release(t.req.rid, t.pages, t.slot)
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
        self.supervisor.spawn(f"send-{frame_kind(frame)}", t.link.send(frame), kind="request")

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
        if h.nbytes not in (caps.page_bytes, caps.slot_bytes) or not valid_tag(h.room, h.seq):
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

        self.supervisor.spawn(f"discard-{h.room}-{h.seq}", discard(), kind="request")

    def _peer_lost(self, peer: PrefillPeer, link: Link) -> None:
        # The endpoint is closed, so UCX has cancelled every receive posted on it: nothing can land.
        for t in list(self._by_room.values()):
            if t.link is link:
                t.inbox.put_nowait(Abort(room=t.room, reason=f"link lost: {link.close_reason}"))
        self._peers_changed()

    def _peers_changed(self) -> None:
        self.router.changed()  # requests waiting for a peer look again

    # -- views --------------------------------------------------------------------------------------
    def ready(self) -> tuple[bool, list[str]]:
        """Transfers are pending work: one waiting too long, or stuck past its state's deadline (receives
        that do not end, a lease that does not end), makes this not ready. A copy into the pools is the
        engine's pending work: its stall check reports one that does not return."""
        ok, reasons = self.supervisor.ready()
        if not self.router.any_usable():
            reasons.append(self.router.no_peer_message())
        now = time.monotonic()
        waiting = [t.created_at for t in self.transfers.values() if t.state is DecodeState.BOOTSTRAPPING]
        if waiting and now - min(waiting) > self._max_queue_wait:
            reasons.append(f"the oldest request waiting for a prefill peer or a transfer destination has waited "
                           f"{now - min(waiting):.1f} s (--max-queue-wait {self._max_queue_wait:g} s)")
        stuck = [t for t in self.transfers.values() if now - self._release_bound(t) > 0]
        if stuck:
            t = min(stuck, key=lambda t: t.state_since)
            reasons.append(f"transfer of {t.req.rid} (room {t.room}) stuck in state {t.state.value} for "
                           f"{now - t.state_since:.1f} s (lease {t.lease})")
        return ok and not reasons, reasons

    def _release_bound(self, t: DecodeTransfer) -> float:
        """When `t` should have moved on at the latest: its state's deadline, or for a failed one the
        longest a lease may take (drain, fence, receives ending), each with a lease of slack."""
        if t.state is DecodeState.INSTALLING:
            return float("inf")  # the engine's work from here: its stall check and forward deadline bound it
        if t.state in STATE_TIMEOUT:
            if t.state is DecodeState.BOOTSTRAPPING:
                return float("inf")  # bounded by its deadline and reported by --max-queue-wait above
            return self._deadline(t) + self.timeouts.lease
        return t.state_since + 4 * self.timeouts.lease

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
            "staging_buffers_abandoned": self.staging.abandoned,
            "task_deaths": dict(self.supervisor.deaths),
        }
