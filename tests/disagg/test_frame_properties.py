"""Property tests (hypothesis): whatever bytes or frames arrive, they are counted and dropped or
handled, never a crash, never a stuck transfer, never a leak, never the instance's failure."""

from __future__ import annotations

import asyncio
import time
import zlib

import msgspec
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pd_fakes import PAGE_BYTES, PAGE_SIZE, SLOT_BYTES, FakeDecodeTarget
from test_transport import FRAMES

from dsv4.disagg.contracts import PdTimeouts
from dsv4.disagg.decode import RemotePrefill
from dsv4.disagg.metrics import DisaggMetrics
from dsv4.disagg.transfer import DecodeState
from dsv4.disagg.transport import decode_frame, encode_frame, seal
from dsv4.protocol import (
    Abort,
    AbortAck,
    Commit,
    Drain,
    DrainAck,
    GenerationRequest,
    PayloadHeader,
    PdFrame,
    PrefillRequest,
    SamplingParams,
)

FRAME_TYPES = tuple(PdFrame.__args__)


def dropped(metrics: DisaggMetrics) -> float:
    return sum(s.value for m in metrics.registry.collect() if m.name == "dsv4_pd_dropped_frames"
               for s in m.samples if s.name.endswith("_total"))


def check_decoded(data: bytes) -> None:
    metrics = DisaggMetrics()
    frame = decode_frame(data, metrics)
    assert frame is None or isinstance(frame, FRAME_TYPES)
    assert dropped(metrics) == (1 if frame is None else 0)  # a dropped frame is counted, once


@given(st.binary(max_size=600))
def test_random_bytes_are_counted_and_dropped(data):
    check_decoded(data)


@st.composite
def mutated(draw, sealed_again: bool):
    """A valid frame with bytes flipped, inserted, deleted or cut off; `sealed_again` re-seals the
    mutated body so it passes the CRC and reaches the msgpack and schema checks."""
    body = bytearray(encode_frame(draw(st.sampled_from(FRAMES)))[4:] if sealed_again
                     else encode_frame(draw(st.sampled_from(FRAMES))))
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(("flip", "insert", "delete", "truncate")))
        at = draw(st.integers(0, max(len(body) - 1, 0)))
        if op == "flip" and body:
            body[at] ^= draw(st.integers(1, 255))
        elif op == "insert":
            body[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and body:
            del body[at]
        elif op == "truncate":
            del body[at:]
    return seal(bytes(body)) if sealed_again else bytes(body)


@given(mutated(sealed_again=False))
def test_mutated_frames_are_counted_and_dropped(data):
    check_decoded(data)
    assert decode_frame(data) is None or zlib.crc32(data[4:]) == int.from_bytes(data[:4], "little")


@given(mutated(sealed_again=True))
def test_mutated_frames_that_pass_the_crc_are_read_or_dropped(data):
    check_decoded(data)


# -- frames into a live decode transfer (no UCX: a fake link, one event loop per example) ----------
TINY = PdTimeouts(handshake=1.0, bootstrap=1.0, wait_for_prefill=0.3, transfer=0.3, commit=0.3, lease=0.2,
                  drain_retry=0.05, heartbeat=0.1, peer_silence=5.0, reconnect=0.1)
PROMPT = tuple(range(2 * PAGE_SIZE - 5))  # two pages and the slot


class FakeLink:
    """What a transfer uses of a Link: sends are recorded, a payload's body arrives at once."""

    def __init__(self):
        self.sent: list = []
        self.closed = False
        self.close_reason = None
        self.last_heard = time.monotonic()
        self.peer = "fake prefill"

    async def send(self, frame) -> bool:
        encode_frame(frame)  # what would go on the wire must encode
        self.sent.append(frame)
        return not self.closed

    async def recv_payload(self, room: int, seq: int, out: np.ndarray) -> None:
        out[:] = seq

    def fence(self, reason: str) -> None:
        self.closed, self.close_reason = True, f"fenced: {reason}"


def room_frames(room: int):
    ints = st.integers(-2, 3) | st.integers(-(1 << 63), (1 << 64) - 1)
    rooms = st.just(room) | ints
    return st.one_of(
        st.builds(PayloadHeader, room=rooms, seq=st.integers(-1, 4), target=st.sampled_from(("page", "slot", "x")),
                  index=st.integers(-1, 3), generation=st.integers(0, 3) | ints,
                  nbytes=st.sampled_from((PAGE_BYTES, SLOT_BYTES, 0, 1)) | ints, checksum=ints),
        st.builds(Commit, room=rooms, page_generations=st.lists(st.integers(0, 3), max_size=3).map(tuple),
                  slot_generation=st.integers(0, 3), first_token=ints, num_payloads=st.integers(-1, 4),
                  prompt_checksum=st.just(zlib.crc32(np.asarray(PROMPT, dtype="<i8").tobytes())) | ints,
                  page_checksums=st.none() | st.lists(ints, max_size=3).map(tuple), slot_checksum=st.none() | ints),
        st.builds(Abort, room=rooms, reason=st.text(max_size=20), status=st.integers(100, 599) | ints),
        st.builds(AbortAck, room=rooms),
        st.builds(Drain, room=rooms),
        st.builds(DrainAck, room=rooms),
    )


async def _drive(frames_for_room) -> None:
    target = FakeDecodeTarget(num_pages=4, num_slots=2)
    decode = RemotePrefill(target, ["127.0.0.1:1"], timeouts=TINY)
    peer, link = decode.peers[0], FakeLink()
    peer.link, peer.peer_ready = link, True
    req = GenerationRequest(rid="r", input_ids=PROMPT, sampling=SamplingParams(temperature=0.0))
    outputs = decode.submit(req)
    collect = asyncio.ensure_future(_all(outputs))
    while not any(isinstance(f, PrefillRequest) for f in link.sent):
        await asyncio.sleep(0.001)
    t = decode.transfers["r"]
    for frame in frames_for_room(t.room):
        decode._route(link, frame)
        await asyncio.sleep(0)
    async with asyncio.timeout(5.0):  # every state has a deadline: the request ends, whatever came
        outs = await collect
        while decode.transfers:  # and its lease ends: drained, or the fake peer fenced
            await asyncio.sleep(0.01)
    assert outs[-1].finished
    if outs[-1].finish_reason == "length":
        assert t.state is DecodeState.DONE
    assert target.leaked() == {}
    assert decode.staging.in_use == 0
    assert not decode.supervisor.deaths
    assert decode.metrics.sample("dsv4_pd_request_task_errors", task="transfer") == 0
    await decode.supervisor.stop()


async def _all(outputs):
    return [o async for o in outputs]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_any_frames_for_a_room_end_its_transfer_within_its_deadlines_and_leak_nothing(data):
    def frames_for_room(room):
        return data.draw(st.lists(room_frames(room), max_size=8))

    asyncio.run(_drive(frames_for_room))


def test_a_sealed_frame_with_an_unknown_field_is_still_read():
    """Adding a field with a default (Abort.status, HelloAck.limits) needs no version bump."""
    old = seal(msgspec.msgpack.encode({"kind": "abort", "version": 1, "room": 3, "reason": "x", "future": 1}))
    assert decode_frame(old) == Abort(room=3, reason="x")
