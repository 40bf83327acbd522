"""A decode instance's connection to one prefill instance: connect, handshake, read, reconnect.

The connection is kept by one supervised task for the life of the instance. A prefill instance
that restarts is reconnected (a new instance id); rooms in flight on the lost link fail with an
error naming the peer, and new ones go to the new link. The peer's limits (`PrefillLimits`, from
its HelloAck) are kept across reconnects until a new handshake replaces them, so decode can refuse
a prompt no peer can take even while a peer is away. `on_change` runs whenever the peer may have
become usable or unusable (connected, its heartbeat's readiness flipped, link lost).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time

from ucxx.exceptions import UCXError

from dsv4.disagg.contracts import PdTimeouts
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.metrics import DisaggMetrics
from dsv4.disagg.supervisor import Supervisor
from dsv4.disagg.transport import Link, capability_mismatch, connect, frame_kind
from dsv4.protocol import Capabilities, Heartbeat, Hello, HelloAck, PrefillLimits

log = logging.getLogger(__name__)


class PrefillPeer:
    def __init__(self, addr: str, instance_id: str, capabilities: Capabilities, timeouts: PdTimeouts,
                 metrics: DisaggMetrics, faults: TransferFaults, *, on_frame, on_lost, on_change,
                 supervisor: Supervisor):
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--prefill-addr {addr!r}: expected HOST:PORT")
        self.addr = addr
        self._host, self._port = host, int(port)
        self._instance_id = instance_id
        self._capabilities = capabilities
        self._timeouts = timeouts
        self._metrics = metrics
        self._faults = faults
        self._on_frame = on_frame  # (link, frame) for frames that name a room
        self._on_lost = on_lost  # (peer, link) after a link ended
        self._on_change = on_change  # () when `usable` may have changed
        self._supervisor = supervisor
        self.link: Link | None = None
        self.status = "connecting"
        self.rooms: set[int] = set()
        self.load = 0
        self.peer_ready = False
        self.peer_reasons: tuple[str, ...] = ()
        self.limits: PrefillLimits | None = None  # None until a handshake told us
        self._was_usable = False
        self._closing = False

    @property
    def usable(self) -> bool:
        link = self.link
        return (
            link is not None
            and not link.closed
            and self.peer_ready
            and time.monotonic() - link.last_heard < self._timeouts.peer_silence
        )

    def start(self) -> None:
        self._supervisor.spawn(f"peer-{self.addr}", self._maintain())

    def close(self, reason: str) -> None:
        self._closing = True
        if self.link is not None:
            self.link.close(reason)

    async def _maintain(self) -> None:
        while not self._closing:
            link = await self._connect()
            if link is not None:
                await self._serve(link)
            refused = self.status.startswith("refused")  # retried, but without flooding the peer's log
            await asyncio.sleep(self._timeouts.reconnect * (20 if refused else 1))

    async def _connect(self) -> Link | None:
        try:
            link = await connect(self._host, self._port, metrics=self._metrics, faults=self._faults,
                                 timeout=self._timeouts.handshake, send_timeout=self._timeouts.send)
        except (UCXError, OSError, TimeoutError) as e:
            self.status = f"unreachable: {type(e).__name__}: {e}"
            return None
        hello = Hello(instance_id=self._instance_id, role="decode", capabilities=self._capabilities)
        ack = await link.receive_first(HelloAck, self._timeouts.handshake) if await link.send(hello) else None
        if ack is None:
            self.status = f"unreachable: no handshake answer ({link.close_reason or 'timeout'})"
            link.fence("no handshake answer")
            return None
        mismatch = None if ack.capabilities is None else capability_mismatch(
            self._capabilities, ack.capabilities, me="decode", them="prefill")
        if not ack.accepted or mismatch:
            self.status = f"refused: {ack.error or mismatch}"
            log.error("prefill peer %s refused the connection: %s", self.addr, ack.error or mismatch)
            link.fence("capability mismatch")
            return None
        link.peer_instance = ack.instance_id
        self.limits = ack.limits
        return link

    async def _serve(self, link: Link) -> None:
        self.link, self.peer_ready, self.load = link, True, 0
        self.status = f"connected to prefill instance {link.peer_instance}"
        log.info("prefill peer %s: %s", self.addr, self.status)
        beat = self._supervisor.spawn(f"heartbeat-{self.addr}", self._heartbeat(link), kind="connection")
        self._changed()
        try:
            while (frame := await link.receive()) is not None:
                if isinstance(frame, Heartbeat):
                    if frame.ready != self.peer_ready:
                        log.warning("prefill peer %s: %s", self.addr, "ready again" if frame.ready else
                                    f"not ready: {'; '.join(frame.reasons) or 'no reason given'}")
                    self.peer_ready, self.load, self.peer_reasons = frame.ready, frame.load, frame.reasons
                    self._changed()
                elif hasattr(frame, "room"):
                    try:
                        self._on_frame(link, frame)
                    except Exception:  # one frame's problem (and its room's), not the link's
                        log.exception("prefill peer %s: %s frame could not be handled", self.addr, frame_kind(frame))
                        self._metrics.dropped_frames.labels("unhandled").inc()
                else:
                    self._metrics.dropped_frames.labels("unexpected_kind").inc()
        finally:
            beat.cancel()
            self.peer_ready = False
            self._was_usable = False
            self.status = f"disconnected from prefill instance {link.peer_instance}: {link.close_reason}"
            log.warning("prefill peer %s: %s", self.addr, self.status)
            self._on_lost(self, link)

    def _changed(self) -> None:
        usable = self.usable
        if usable != self._was_usable:
            self._was_usable = usable
            self._on_change()

    async def _heartbeat(self, link: Link) -> None:
        for seq in itertools.count():
            silence = time.monotonic() - link.last_heard
            if silence > self._timeouts.peer_silence:
                link.fence(f"prefill peer {self.addr} silent for {silence:.1f}s")
                return
            if not await link.send(Heartbeat(seq=seq, load=len(self.rooms))):
                return
            await asyncio.sleep(self._timeouts.heartbeat)

    def explain(self) -> str:
        if self.link is not None and not self.link.closed and not self.peer_ready:
            return f"{self.status}, not ready: {'; '.join(self.peer_reasons) or 'no reason given'}"
        return self.status

    def describe(self) -> dict:
        return {
            "addr": self.addr,
            "status": self.status,
            "usable": self.usable,
            "peer_ready": self.peer_ready,
            "peer_reasons": list(self.peer_reasons),
            "load": self.load,
            "limits": None if self.limits is None else {"context_length": self.limits.context_length,
                                                        "pool_tokens": self.limits.pool_tokens},
            "rooms_in_flight": len(self.rooms),
        }
