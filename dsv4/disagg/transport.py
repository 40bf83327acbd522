"""A small layer over ucxx: typed control frames, tagged payload buffers, fencing.

Control frames are msgpack-encoded `dsv4.protocol` structs sent with ucxx's multi-buffer tag
messages, which carry their own sizes: a frame of any size or content can be read, judged and
dropped. (Not active messages: ucxx can hand an active message to a receive left pending on a
closed endpoint, so a new connection loses frames.) Payload bytes go as raw buffers over tagged
messages; the tag is derived from (room, seq) and ucxx scopes tags to the endpoint pair, so bytes
of different rooms or connections can never match each other's receives. A receive is posted
only into a buffer its transfer owns.

Fencing a link aborts its endpoint: UCX cancels every receive still posted on it, so once a
fenced link's receive tasks have ended no byte can land in their buffers any more. An endpoint the
peer ended is aborted here too, the first time it is seen dead: UCX leaves the requests posted on a
dead endpoint pending until a local abort (tag receives belong to the worker, not the endpoint), so
without it a send or receive posted just before the peer went would never end. A control frame
that is not sent within `send_timeout` fences the link: a small frame a peer does not take is a
broken connection, and every wait has a bound (ARCHITECTURE.md invariant 5).
"""

from __future__ import annotations

import asyncio
import logging
import time
import zlib

import msgspec
import numpy as np
import ucxx
from ucxx.exceptions import UCXError

from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.metrics import DisaggMetrics
from dsv4.protocol import PD_PROTOCOL_VERSION, Capabilities, FrameHead, PayloadHeader, PdFrame

log = logging.getLogger(__name__)

SEQ_BITS = 20  # payloads per room; a room moves ceil(prompt / page_size) pages + 1 slot
MAX_ROOM = 1 << (64 - SEQ_BITS)

_encoder = msgspec.msgpack.Encoder()
_head_decoder = msgspec.msgpack.Decoder(FrameHead)
_frame_decoder = msgspec.msgpack.Decoder(PdFrame)


class FrameEncodeError(ValueError):
    """A frame that cannot be put on the wire (a value msgpack cannot carry, such as an integer beyond
    64 bits): the failure of the one request the frame belongs to."""


def valid_tag(room: int, seq: int) -> bool:
    return 0 <= room < MAX_ROOM and 0 <= seq < 1 << SEQ_BITS


def payload_tag(room: int, seq: int) -> int:
    if not valid_tag(room, seq):
        raise ValueError(f"room {room} / seq {seq} out of tag range")
    return (room << SEQ_BITS) | seq


def frame_kind(frame) -> str:
    """The frame's wire tag ("payload", "commit", ...), as fault specs and metrics name it."""
    return type(frame).__struct_config__.tag


def seal(body: bytes) -> bytes:
    """A frame on the wire: CRC-32 of the body (4 bytes, little-endian), then the body. A flipped
    bit anywhere (a prompt token, a first token) must make the frame unreadable, never different."""
    return zlib.crc32(body).to_bytes(4, "little") + body


def encode_frame(frame) -> bytes:
    try:
        return seal(_encoder.encode(frame))
    except (msgspec.EncodeError, OverflowError, TypeError, ValueError) as e:
        raise FrameEncodeError(f"{frame_kind(frame)} frame cannot be encoded: {type(e).__name__}: {e}") from None


def decode_frame(data, metrics: DisaggMetrics | None = None):
    """The frame in `data`, or None after counting why it was dropped."""
    data = memoryview(data).cast("B")
    body = data[4:]
    reason = None
    if len(data) < 4:
        reason = "garbage"
    elif zlib.crc32(body) != int.from_bytes(data[:4], "little"):
        reason = "corrupt"
    else:
        try:
            head = _head_decoder.decode(body)
        except (msgspec.DecodeError, msgspec.ValidationError):
            reason = "garbage"
        else:
            if head.version != PD_PROTOCOL_VERSION:
                reason = "version"
            else:
                try:
                    return _frame_decoder.decode(body)
                except (msgspec.DecodeError, msgspec.ValidationError):
                    reason = "malformed"
    if metrics is not None:
        metrics.dropped_frames.labels(reason).inc()
    log.debug("dropped a control frame: %s", reason)
    return None


def prompt_checksum(prompt_ids) -> int:
    return zlib.crc32(np.asarray(prompt_ids, dtype="<i8").tobytes())


def capability_mismatch(mine: Capabilities, theirs: Capabilities, *, me: str, them: str) -> str | None:
    """None when two sides can exchange state, else which fields differ (both sides' values named)."""
    diffs = [
        f"{name}: {me} {getattr(mine, name)!r}, {them} {getattr(theirs, name)!r}"
        for name in Capabilities.__struct_fields__
        if getattr(mine, name) != getattr(theirs, name)
    ]
    return "; ".join(diffs) or None


class Link:
    """One UCX endpoint to a peer."""

    def __init__(self, endpoint, *, peer: str, metrics: DisaggMetrics, faults: TransferFaults,
                 send_timeout: float = 5.0):
        self._ep = endpoint
        self.peer = peer  # "host:port" of the prefill side, or the decode instance id
        self.peer_instance: str | None = None
        self._metrics = metrics
        self._faults = faults
        self._send_timeout = send_timeout
        self.close_reason: str | None = None
        self.last_heard = time.monotonic()

    @property
    def closed(self) -> bool:
        if self.close_reason is None and self._ep.closed:
            self._closed_by("the connection ended")  # the peer's doing: cancel what is posted here
        return self.close_reason is not None

    # -- control frames ---------------------------------------------------------------------------
    async def send(self, frame) -> bool:
        """False when the link is closed (the frame is then lost, as it would be on the wire); raises
        FrameEncodeError for a frame that cannot be encoded."""
        data = encode_frame(frame)
        decision = self._faults.on_send(frame_kind(frame)) if self._faults.frame_faults else None
        if decision is not None:
            if decision.delay_s:
                await asyncio.sleep(decision.delay_s)
            if decision.drop:
                return not self.closed
            if decision.corrupt:
                data = _flip_a_byte(data, self._faults.rng)
        for _ in range(2 if decision is not None and decision.duplicate else 1):
            if not await self._send_frame_bytes(data):
                return False
        return True

    async def send_raw(self, data: bytes) -> bool:
        """Sends bytes as a control frame as they are (tests of malformed frames)."""
        return await self._send_frame_bytes(data)

    async def _send_frame_bytes(self, data: bytes) -> bool:
        if self.closed:
            return False
        try:
            async with asyncio.timeout(self._send_timeout):
                await self._ep.send_multi([np.frombuffer(data, dtype=np.uint8)])
            return True
        except UCXError as e:
            self._closed_by(f"send failed: {type(e).__name__}: {e}")
            return False
        except TimeoutError:
            # Fencing aborts the endpoint, which cancels the send while `data` is still referenced here.
            self.fence(f"a control frame was not sent within {self._send_timeout:g} s")
            return False

    async def receive(self):
        """The next well-formed frame of the current protocol version; None once the link closed."""
        while not self.closed:
            try:
                buffers = await self._ep.recv_multi()
            except UCXError as e:
                self._closed_by(f"peer gone: {type(e).__name__}: {e}")
                return None
            self.last_heard = time.monotonic()
            frame = decode_frame(buffers[0] if len(buffers) == 1 else b"", self._metrics)
            if frame is not None:
                return frame
        return None

    async def receive_first(self, kind: type, timeout: float):
        """The first frame of type `kind` within `timeout`, or None. Anything before it is counted and
        dropped: UCX may hand a new endpoint active messages still queued for a closed predecessor."""
        try:
            async with asyncio.timeout(timeout):
                while (frame := await self.receive()) is not None:
                    if isinstance(frame, kind):
                        return frame
                    self._metrics.dropped_frames.labels("before_handshake").inc()
        except TimeoutError:
            pass
        return None

    # -- payload buffers --------------------------------------------------------------------------
    async def send_payload(self, header: PayloadHeader, body: np.ndarray) -> bool:
        """The header frame, then `body` on the room's tag. Faults treat the two as one frame."""
        decision = self._faults.on_send("payload") if self._faults.frame_faults else None
        copies = 1
        if decision is not None:
            if decision.delay_s:
                await asyncio.sleep(decision.delay_s)
            if decision.drop:
                return not self.closed
            if decision.corrupt:
                body = body.copy()
                body[self._faults.rng.randrange(body.size)] ^= 0xFF
            copies = 2 if decision.duplicate else 1
        tag = payload_tag(header.room, header.seq)
        for _ in range(copies):
            if not await self._send_frame_bytes(encode_frame(header)):
                return False
            try:
                await self._ep.send(body, tag=tag)
            except UCXError as e:
                self._closed_by(f"payload send failed: {type(e).__name__}: {e}")
                return False
            self._metrics.bytes.inc(body.nbytes)
        return True

    async def recv_payload(self, room: int, seq: int, out: np.ndarray) -> None:
        """Receives into `out` (owned by the caller until this returns or raises)."""
        await self._ep.recv(out, tag=payload_tag(room, seq))

    # -- closing ----------------------------------------------------------------------------------
    def _closed_by(self, reason: str) -> None:
        if self.close_reason is None:
            self.close_reason = reason
            log.info("link to %s closed: %s", self.peer, reason)
            self._ep.abort()  # also when the peer ended it: only a local abort cancels what is posted

    def close(self, reason: str) -> None:
        """Closes the link on purpose (shutdown): not a fence, nothing is owed."""
        self._closed_by(reason)

    def fence(self, reason: str) -> None:
        """Aborts the endpoint: every receive still posted on it is cancelled, nothing lands later."""
        if self.close_reason is None:
            self._metrics.fenced.inc()
        self._closed_by(f"fenced: {reason}")


def _flip_a_byte(data: bytes, rng) -> bytes:
    buf = bytearray(data)
    buf[rng.randrange(len(buf))] ^= 0xFF
    return bytes(buf)


_ucx_initialised = False


def _ensure_ucx() -> None:
    """Initialises UCX once per process, with the listening port reusable at once: a prefill
    instance restarted on its port must not wait out TIME_WAIT of its predecessor's connections."""
    global _ucx_initialised
    if not _ucx_initialised:
        try:
            ucxx.init(options={"TCP_CM_REUSEADDR": "y"})
        except RuntimeError:  # something else in this process initialised UCX first
            log.warning("UCX was initialised elsewhere; a restarted listener may wait for TIME_WAIT")
        _ucx_initialised = True


async def connect(host: str, port: int, *, metrics: DisaggMetrics, faults: TransferFaults,
                  timeout: float = 5.0, send_timeout: float = 5.0) -> Link:
    _ensure_ucx()
    endpoint = await asyncio.wait_for(ucxx.create_endpoint(host, port, connect_timeout=timeout), timeout)
    return Link(endpoint, peer=f"{host}:{port}", metrics=metrics, faults=faults, send_timeout=send_timeout)


def listen(on_link, *, port: int, metrics: DisaggMetrics, faults: TransferFaults, send_timeout: float = 5.0):
    """A ucxx listener; `on_link(link)` runs (as ucxx's handler coroutine) for each connection."""

    async def handler(endpoint) -> None:
        await on_link(Link(endpoint, peer=f"decode@{endpoint.uid}", metrics=metrics, faults=faults,
                           send_timeout=send_timeout))

    _ensure_ucx()
    return ucxx.create_listener(handler, port=port or None)
