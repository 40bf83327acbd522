"""The prefill side: computes prompts for decode instances and pushes their state.

Per room: queued → computing → sending → committed | failed, each state with a deadline. A room
is *quiescent* once its task has ended: nothing of it is being sent and nothing will be. Only then
is the decode side told it may reuse its buffers (DrainAck), or told of a prefill-side failure
(Abort, which implies drained). Drain and Abort of a room this side does not know are answered at
once: an unknown room has nothing in flight. A room whose sending overruns its deadline may have
a send the decode side never matched, so its link is fenced instead.

A room's failure is its own (ARCHITECTURE.md invariant 5): a prompt the engine refuses, a verify
failure, a deadline or an unexpected exception while serving one room ends that room with an
Abort naming the reason and its HTTP status; the instance stays ready. Only the infrastructure
(the listener, the heartbeat, the reaper, the engine's tick) makes it not ready.
"""

from __future__ import annotations

import asyncio
import enum
import itertools
import logging
import time
import uuid
import zlib
from dataclasses import dataclass, field

from dsv4.disagg.contracts import DEFAULT_TIMEOUTS, PdTimeouts, PrefillSource, RequestFailed
from dsv4.disagg.faults import InjectedFault, TransferFaults
from dsv4.disagg.metrics import DisaggMetrics
from dsv4.disagg.supervisor import Supervisor
from dsv4.disagg.transport import Link, capability_mismatch, frame_kind, listen, prompt_checksum
from dsv4.protocol import (
    Abort,
    AbortAck,
    Commit,
    Drain,
    DrainAck,
    Heartbeat,
    Hello,
    HelloAck,
    PayloadHeader,
    PrefillRequest,
)

log = logging.getLogger(__name__)


class PrefillState(enum.Enum):
    QUEUED = "queued"
    COMPUTING = "computing"
    SENDING = "sending"
    COMMITTED = "committed"
    FAILED = "failed"


_TERMINAL = (PrefillState.COMMITTED, PrefillState.FAILED)


@dataclass(eq=False)
class PrefillRoom:
    link: Link
    request: PrefillRequest
    received_at: float
    deadline: float  # the decode side's own bound for the whole room
    state: PrefillState = PrefillState.QUEUED
    state_since: float = 0.0
    failure: str | None = None
    status: int = 500  # the failure's HTTP status, sent in the Abort
    failed_by_peer: bool = False  # the decode side aborted: answer with DrainAck, not Abort
    drain_requested: bool = False
    task: asyncio.Task | None = None

    def enter(self, state: PrefillState) -> None:
        self.state, self.state_since = state, time.monotonic()

    def fail(self, reason: str, status: int = 500) -> bool:
        """Sticky: the first failure wins and a later success cannot replace it."""
        if self.failure is not None or self.state is PrefillState.COMMITTED:
            return False
        self.failure, self.status = reason, status
        self.enter(PrefillState.FAILED)
        return True


@dataclass(eq=False)
class DecodePeer:
    link: Link
    rooms: dict[int, PrefillRoom] = field(default_factory=dict)


class PrefillServer:
    def __init__(self, source: PrefillSource, *, port: int = 0, timeouts: PdTimeouts = DEFAULT_TIMEOUTS,
                 faults: TransferFaults | None = None, max_concurrent: int = 8):
        self.source = source
        self.instance_id = uuid.uuid4().hex[:12]
        self.timeouts = timeouts
        self.faults = faults or TransferFaults()
        self.metrics = DisaggMetrics()
        self.supervisor = Supervisor(
            "prefill", on_death=lambda name: self.metrics.task_deaths.labels(name).inc(),
            on_request_error=lambda name: self.metrics.request_task_errors.labels(name.split("-")[0]).inc())
        self._requested_port = port
        self._listener = None
        self._peers: dict[int, DecodePeer] = {}
        self._link_ids = itertools.count(1)
        self._compute_permits = asyncio.Semaphore(max_concurrent)

    @property
    def port(self) -> int:
        return self._listener.port

    async def start(self) -> None:
        self._listener = listen(self._on_link, port=self._requested_port, metrics=self.metrics, faults=self.faults,
                                send_timeout=self.timeouts.send)
        self.supervisor.spawn("reaper", self._reap_forever())
        self.supervisor.spawn("heartbeat", self._heartbeat_forever())

    async def stop(self) -> None:
        if self._listener is not None:
            self._listener.close()
        for peer in list(self._peers.values()):
            peer.link.close("prefill instance stopping")
        await self.supervisor.stop()

    # -- connections ------------------------------------------------------------------------------
    async def _on_link(self, link: Link) -> None:
        if not await self._handshake(link):
            return
        link_id = next(self._link_ids)
        peer = self._peers[link_id] = DecodePeer(link)
        self.supervisor.spawn(f"reader-{link_id}", self._read(link_id, peer), kind="connection")

    async def _handshake(self, link: Link) -> bool:
        mine = self.source.capabilities
        hello = await link.receive_first(Hello, self.timeouts.handshake)
        if hello is None:
            self.metrics.dropped_frames.labels("no_hello").inc()
            link.fence("no hello within the handshake timeout")
            return False
        link.peer = f"decode {hello.instance_id}"
        mismatch = capability_mismatch(mine, hello.capabilities, me="prefill", them="decode")
        if mismatch:
            log.error("refusing %s: capabilities differ: %s", link.peer, mismatch)
            await link.send(HelloAck(instance_id=self.instance_id, accepted=False,
                                     error=f"prefill {self.instance_id} refuses: {mismatch}", capabilities=mine))
            await asyncio.sleep(0.2)  # let the refusal reach the peer before the endpoint goes
            link.fence(f"capability mismatch: {mismatch}")
            return False
        link.peer_instance = hello.instance_id
        return await link.send(HelloAck(instance_id=self.instance_id, accepted=True, capabilities=mine,
                                        limits=self.source.limits))

    async def _read(self, link_id: int, peer: DecodePeer) -> None:
        try:
            while (frame := await peer.link.receive()) is not None:
                try:
                    self._dispatch(peer, frame)
                except Exception:  # a frame this side cannot handle is that frame's problem, not the link's
                    log.exception("prefill: frame %s from %s could not be handled", frame_kind(frame), peer.link.peer)
                    self.metrics.dropped_frames.labels("unhandled").inc()
        finally:
            self._peers.pop(link_id, None)
            for room in list(peer.rooms.values()):
                self._fail(room, f"decode peer gone: {peer.link.close_reason}", by_peer=True)
                if room.task is not None:
                    room.task.cancel()

    def _dispatch(self, peer: DecodePeer, frame) -> None:
        if isinstance(frame, PrefillRequest):
            self._accept(peer, frame)
        elif isinstance(frame, Abort):
            self.metrics.aborts.labels("decode").inc()
            room = peer.rooms.get(frame.room)
            self._spawn_send(peer.link, AbortAck(room=frame.room))
            if room is None:
                self._spawn_send(peer.link, DrainAck(room=frame.room))
                return
            room.drain_requested = True
            # A send already posted must complete (the decode side still matches it), so only a
            # room that has not started sending is cancelled; a sending one stops at its next payload.
            cancellable = room.state in (PrefillState.QUEUED, PrefillState.COMPUTING)
            if self._fail(room, f"aborted by decode: {frame.reason}", by_peer=True) and cancellable:
                room.task.cancel()
        elif isinstance(frame, Drain):
            room = peer.rooms.get(frame.room)
            if room is None:
                self._spawn_send(peer.link, DrainAck(room=frame.room))
            else:
                room.drain_requested = True
        elif isinstance(frame, Heartbeat):
            pass  # receiving anything refreshes link.last_heard
        else:
            self.metrics.dropped_frames.labels("unexpected_kind").inc()

    def _spawn_send(self, link: Link, frame) -> None:
        self.supervisor.spawn(f"send-{frame_kind(frame)}", link.send(frame), kind="request")

    # -- one room ---------------------------------------------------------------------------------
    def _accept(self, peer: DecodePeer, req: PrefillRequest) -> None:
        if req.room in peer.rooms:
            self.metrics.dropped_frames.labels("duplicate").inc()
            return
        page_size = self.source.capabilities.page_size
        now = time.monotonic()
        room = PrefillRoom(peer.link, req, received_at=now, deadline=now + req.timeout_s, state_since=now)
        expected_pages = -(-len(req.prompt_ids) // page_size)
        if not req.prompt_ids or len(req.pages) != expected_pages:
            room.fail(f"bad prefill request: {len(req.pages)} destination pages for {len(req.prompt_ids)} "
                      f"prompt tokens at page size {page_size} (expected {expected_pages})")
            self.metrics.transfers.labels("rejected").inc()
            self._spawn_send(peer.link, Abort(room=req.room, reason=room.failure))
            return
        peer.rooms[req.room] = room
        room.task = self.supervisor.spawn(f"room-{req.room}", self._serve(peer, room), kind="request")
        # Not a `finally` in _serve: a task cancelled before its first step never runs its body.
        room.task.add_done_callback(
            lambda _: self.supervisor.spawn(f"quiesce-{req.room}", self._quiesce(peer, room), kind="request"))

    async def _serve(self, peer: DecodePeer, room: PrefillRoom) -> None:
        req = room.request
        try:
            if self.faults.take_kill():
                raise InjectedFault(f"kill:transfer_task while serving room {req.room}")
            async with self._compute_permits:
                if room.failure:
                    return
                room.enter(PrefillState.COMPUTING)
                if self.faults.stall_prefill_s:
                    await asyncio.sleep(self.faults.stall_prefill_s)
                state = await self.source.compute(f"pd-{peer.link.peer_instance}-{req.room}", req.prompt_ids,
                                                  req.sampling)
            if room.failure:
                return
            room.enter(PrefillState.SENDING)
            bodies = [("page", i, dest.generation, body) for i, (dest, body) in enumerate(zip(req.pages, state.pages))]
            bodies.append(("slot", 0, req.slot.generation, state.slot))
            for seq, (target, index, generation, body) in enumerate(bodies):
                if room.failure:
                    return
                header = PayloadHeader(room=req.room, seq=seq, target=target, index=index, generation=generation,
                                       nbytes=body.nbytes, checksum=zlib.crc32(body))
                if not await room.link.send_payload(header, body):
                    self._fail(room, f"link to {room.link.peer} closed while sending")
                    return
            if room.failure:
                return
            commit = Commit(
                room=req.room,
                page_generations=tuple(p.generation for p in req.pages),
                slot_generation=req.slot.generation,
                first_token=state.first_token,
                num_payloads=len(bodies),
                prompt_checksum=prompt_checksum(req.prompt_ids),
                page_checksums=tuple(state.page_checksums) if req.verify else None,
                slot_checksum=state.slot_checksum if req.verify else None,
                first_logprob=state.first_logprob,
                prompt_logprobs=state.prompt_logprobs,
            )
            if await room.link.send(commit) and room.failure is None:
                room.enter(PrefillState.COMMITTED)
                self.metrics.transfers.labels("committed").inc()
                self.metrics.latency.observe(time.monotonic() - room.received_at)
        except asyncio.CancelledError:
            self._fail(room, room.failure or "cancelled")
        except RequestFailed as e:
            self._fail(room, str(e), status=e.status)
        except Exception as e:  # a bug or an injected kill: this room's failure, logged with its traceback
            log.exception("prefill: room %d failed unexpectedly", req.room)
            self.metrics.request_task_errors.labels("room").inc()
            self._fail(room, f"prefill failed: {type(e).__name__}: {e}")

    async def _quiesce(self, peer: DecodePeer, room: PrefillRoom) -> None:
        """The room's task has ended: nothing of it is or will be sent. Tell the decode side."""
        peer.rooms.pop(room.request.room, None)
        self._fail(room, "cancelled before it started")  # a no-op unless the task never ran
        if room.state is PrefillState.COMMITTED:
            return
        self.metrics.transfers.labels("failed").inc()
        if room.failed_by_peer or room.drain_requested:
            if await room.link.send(DrainAck(room=room.request.room)):
                self.metrics.drains.inc()
        else:
            self.metrics.aborts.labels("prefill").inc()
            await room.link.send(Abort(room=room.request.room, reason=f"prefill {self.instance_id}: {room.failure}",
                                       status=room.status))

    def _fail(self, room: PrefillRoom, reason: str, *, status: int = 500, by_peer: bool = False) -> bool:
        if not room.fail(reason, status):
            return False
        room.failed_by_peer = room.failed_by_peer or by_peer
        return True

    # -- deadlines and liveness -------------------------------------------------------------------
    def _state_deadline(self, room: PrefillRoom) -> float:
        bound = self.timeouts.transfer if room.state is PrefillState.SENDING else float("inf")
        return min(room.deadline, room.state_since + bound)

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(min(0.1, self.timeouts.heartbeat))
            now = time.monotonic()
            for peer in list(self._peers.values()):
                if now - peer.link.last_heard > self.timeouts.peer_silence:
                    peer.link.fence(f"silent for {now - peer.link.last_heard:.1f}s")
                for room in list(peer.rooms.values()):
                    if room.state in _TERMINAL or now <= self._state_deadline(room):
                        continue
                    state = room.state
                    self._fail(room, f"deadline exceeded in state {state.value}")
                    if state is PrefillState.SENDING:
                        # A send the decode side never matched may still be posted: fence.
                        peer.link.fence(f"room {room.request.room} overran its sending deadline")
                    if room.task is not None:
                        room.task.cancel()

    async def _heartbeat_forever(self) -> None:
        for seq in itertools.count():
            ready, reasons = self.ready()
            for peer in list(self._peers.values()):
                if not peer.link.closed:
                    await peer.link.send(Heartbeat(seq=seq, ready=ready, load=self.load(), reasons=tuple(reasons)))
            await asyncio.sleep(self.timeouts.heartbeat)

    # -- views ------------------------------------------------------------------------------------
    def load(self) -> int:
        return sum(len(p.rooms) for p in self._peers.values())

    def ready(self) -> tuple[bool, list[str]]:
        ok, reasons = self.supervisor.ready()
        source_ok, source_reasons = self.source.ready()
        return ok and source_ok, reasons + source_reasons

    def debug(self) -> dict:
        now = time.monotonic()
        return {
            "role": "prefill",
            "instance_id": self.instance_id,
            "transfers": [
                {
                    "room": room.request.room,
                    "rid": room.request.rid,
                    "decode": peer.link.peer,
                    "state": room.state.value,
                    "age_s": round(now - room.received_at, 3),
                    "in_state_s": round(now - room.state_since, 3),
                    "failure": room.failure,
                }
                for peer in self._peers.values()
                for room in peer.rooms.values()
            ],
            "decode_peers": [peer.link.peer for peer in self._peers.values()],
            "task_deaths": dict(self.supervisor.deaths),
        }
