"""Frames, bad frames, handshakes, fault specs and supervision."""

from __future__ import annotations

import asyncio

import msgspec
import numpy as np
import pytest
from pd_fakes import FakeDecodeTarget, FakePrefillSource, capabilities
from pd_helpers import wait_until

from dsv4.config import FRAME_KINDS, ConfigError, ServerArgs
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.metrics import DisaggMetrics
from dsv4.disagg.supervisor import Supervisor
from dsv4.disagg.transport import Link, decode_frame, encode_frame, frame_kind, payload_tag, seal
from dsv4.protocol import (
    Abort,
    AbortAck,
    Commit,
    Destination,
    Drain,
    DrainAck,
    GenerationRequest,
    Heartbeat,
    Hello,
    HelloAck,
    PayloadHeader,
    PrefillLimits,
    PrefillRequest,
    SamplingParams,
)

FRAMES = [
    Hello(instance_id="d1", role="decode", capabilities=capabilities()),
    HelloAck(instance_id="p1", accepted=True, capabilities=capabilities(),
             limits=PrefillLimits(context_length=4096, pool_tokens=8192)),
    PrefillRequest(room=7, rid="r", prompt_ids=(1, 2, 3), sampling=SamplingParams(temperature=0.0),
                   pages=(Destination(3, 9),), slot=Destination(1, 2), timeout_s=4.5, verify=True),
    PayloadHeader(room=7, seq=0, target="page", index=0, generation=9, nbytes=10, checksum=123),
    Commit(room=7, page_generations=(9,), slot_generation=2, first_token=5, num_payloads=2, prompt_checksum=3,
           page_checksums=(1,), slot_checksum=2),
    Abort(room=7, reason="why", status=400),
    AbortAck(room=7),
    Drain(room=7),
    DrainAck(room=7),
    Heartbeat(seq=3, ready=False, load=2, reasons=("x",)),
]


@pytest.mark.parametrize("frame", FRAMES, ids=lambda f: type(f).__name__)
def test_every_frame_round_trips(frame):
    assert decode_frame(encode_frame(frame)) == frame


def test_fault_specs_name_exactly_the_wire_frame_kinds():
    assert set(FRAME_KINDS) == {frame_kind(f) for f in FRAMES}


def test_bad_frames_are_counted_and_dropped():
    metrics = DisaggMetrics()
    wrong_version = seal(msgspec.msgpack.encode({"kind": "abort", "version": 99, "room": 1, "reason": "x"}))
    unknown_kind = seal(msgspec.msgpack.encode({"kind": "teleport", "version": 1}))
    missing_field = seal(msgspec.msgpack.encode({"kind": "abort", "version": 1}))
    flipped = bytearray(encode_frame(Commit(room=1, page_generations=(), slot_generation=0, first_token=7,
                                            num_payloads=1, prompt_checksum=0)))
    flipped[-1] ^= 0x01  # still valid msgpack, with another number in it: caught by the frame CRC
    for data in (b"\xc1garbage", b"", seal(b"\xc1"), wrong_version, unknown_kind, missing_field, bytes(flipped)):
        assert decode_frame(data, metrics) is None
    assert metrics.sample("dsv4_pd_dropped_frames", reason="version") == 1
    assert metrics.sample("dsv4_pd_dropped_frames", reason="malformed") == 2
    assert metrics.sample("dsv4_pd_dropped_frames", reason="garbage") == 2
    assert metrics.sample("dsv4_pd_dropped_frames", reason="corrupt") == 2


def test_payload_tags_never_collide_across_rooms():
    tags = {payload_tag(room, seq) for room in range(1, 50) for seq in range(40)}
    assert len(tags) == 49 * 40
    with pytest.raises(ValueError):
        payload_tag(1, 1 << 20)


def test_fault_spec_parses_the_documented_forms():
    faults = TransferFaults.parse(
        "drop:payload:0.05,delay:commit:0.05:200ms,duplicate:*:0.05,corrupt:payload:0.05,stall:prefill:2s,"
        "kill:transfer_task,stall_tick=1@3"
    )
    assert [(f.action, f.kind) for f in faults.frame_faults] == [
        ("drop", "payload"), ("delay", "commit"), ("duplicate", "*"), ("corrupt", "payload")
    ]
    assert faults.frame_faults[1].delay_seconds == 0.2 and faults.stall_prefill_s == 2.0
    assert faults.take_kill() and not faults.take_kill()
    assert not TransferFaults.parse(None).frame_faults
    for bad in ("drop:teleport:0.1", "drop:payload:2", "delay:commit:0.1", "stall:prefill:soon", "explode:x"):
        with pytest.raises(ConfigError, match="fault-inject"):
            ServerArgs(fault_inject=bad)


def test_disaggregation_arguments_are_checked():
    args = ServerArgs(disaggregation_mode="decode", prefill_addr=["127.0.0.1:8998", "10.0.0.2:9000"])
    assert args.prefill_addr == ("127.0.0.1:8998", "10.0.0.2:9000")
    for bad, message in (
        ({"disaggregation_mode": "decode"}, "needs at least one --prefill-addr"),
        ({"prefill_addr": ("127.0.0.1:8998",)}, "only meaningful"),
        ({"disaggregation_mode": "decode", "prefill_addr": ("nohost",)}, "HOST:PORT"),
        ({"disaggregation_mode": "sideways"}, "expected one of"),
    ):
        with pytest.raises(ConfigError, match=message):
            ServerArgs(**bad)


async def test_supervisor_records_a_death_with_its_reason():
    sup = Supervisor("decode")

    async def dies():
        raise RuntimeError("unexpected ABORT frame")

    async def forever():
        await asyncio.Event().wait()

    sup.spawn("reader", dies())
    sup.spawn("heartbeat", forever())
    await wait_until(lambda: sup.deaths, 2.0, "the death to be recorded")
    ready, reasons = sup.ready()
    assert not ready and "reader" in reasons[0] and "unexpected ABORT frame" in reasons[0]
    await sup.stop()


class StuckEndpoint:
    """A ucxx endpoint whose sends never complete until it is aborted (a peer gone mid-send)."""

    def __init__(self, alive: bool = True):
        self.alive = alive
        self.aborts = 0
        self._aborted = asyncio.Event()

    @property
    def closed(self) -> bool:
        return not self.alive

    def abort(self) -> None:
        self.aborts += 1
        self.alive = False
        self._aborted.set()

    async def send_multi(self, buffers) -> None:
        await self._aborted.wait()
        raise AssertionError("a send completed after its endpoint was aborted")


async def test_a_control_frame_that_cannot_be_sent_fences_its_link_within_the_send_timeout():
    endpoint = StuckEndpoint()
    link = Link(endpoint, peer="p", metrics=DisaggMetrics(), faults=TransferFaults(), send_timeout=0.2)
    async with asyncio.timeout(2.0):
        assert await link.send(Drain(room=1)) is False
    assert link.closed and "not sent within 0.2 s" in link.close_reason
    assert endpoint.aborts == 1


def test_an_endpoint_the_peer_ended_is_aborted_here_when_first_seen():
    """Requests posted on a dead ucxx endpoint stay pending until a local abort cancels them."""
    endpoint = StuckEndpoint(alive=False)
    link = Link(endpoint, peer="p", metrics=DisaggMetrics(), faults=TransferFaults())
    assert link.closed and link.closed
    assert endpoint.aborts == 1 and link.close_reason == "the connection ended"


async def test_bad_frames_on_live_links_are_counted_and_nothing_stalls(make_pair):
    pair = await make_pair()
    decode_link = next(iter(pair.prefill._peers.values())).link  # prefill's end of the link
    prefill_link = pair.decode.peers[0].link
    garbage = b"\x00\xff garbage \x13"
    wrong_version = seal(msgspec.msgpack.encode({"kind": "commit", "version": 2, "room": 1}))
    for link in (decode_link, prefill_link):
        assert await link.send_raw(garbage)
        assert await link.send_raw(wrong_version)
    assert await decode_link.send(Commit(room=424242, page_generations=(), slot_generation=0, first_token=0,
                                         num_payloads=1, prompt_checksum=0))
    assert await prefill_link.send(Drain(room=31337))  # an unknown room is trivially drained: answered
    for side in (pair.prefill.metrics, pair.decode.metrics):
        await wait_until(lambda m=side: m.sample("dsv4_pd_dropped_frames", reason="version") == 1, 5, "the count")
        assert side.sample("dsv4_pd_dropped_frames", reason="corrupt") == 1
    await wait_until(lambda: pair.decode.metrics.sample("dsv4_pd_dropped_frames", reason="unknown_room") >= 2, 5,
                     "unknown rooms to be counted (the commit and the drain ack)")
    # Both sides still serve.
    req = GenerationRequest(rid="after", input_ids=tuple(range(300)), sampling=SamplingParams(temperature=0.0))
    outs = [o async for o in pair.decode.submit(req)]
    assert outs[-1].finish_reason == "length", outs[-1].error
    assert pair.decode.ready()[0] and pair.prefill.ready()[0]


async def test_a_payload_for_an_unknown_room_is_consumed_so_its_sender_never_stalls(make_pair):
    pair = await make_pair()
    decode_link = next(iter(pair.prefill._peers.values())).link
    body = np.zeros(pair.target.capabilities.page_bytes, dtype=np.uint8)  # rendezvous-sized
    header = PayloadHeader(room=987654, seq=0, target="page", index=0, generation=1, nbytes=body.nbytes,
                           checksum=0)
    assert await asyncio.wait_for(decode_link.send_payload(header, body), 5)
    assert pair.decode.metrics.sample("dsv4_pd_dropped_frames", reason="unknown_room") == 1
    await wait_until(lambda: pair.decode._discarding == 0, 5, "the discard receive to end")


async def test_capability_mismatch_refuses_the_connection_on_both_sides(make_pair):
    pair = await make_pair(target=FakeDecodeTarget(page_size=256), ready=False)
    await wait_until(lambda: pair.decode.peers[0].status.startswith("refused"), 10, "the refusal")
    ready, reasons = pair.decode.ready()
    assert not ready
    assert "page_size: prefill 128, decode 256" in reasons[0] and "refuses" in reasons[0]
    assert not pair.prefill._peers  # the prefill side kept no link either


async def test_prefill_source_capabilities_are_what_a_decode_compares(make_pair):
    pair = await make_pair(source=FakePrefillSource(index_key_dtype="bf16"), ready=False)
    await wait_until(lambda: pair.decode.peers[0].status.startswith("refused"), 10, "the refusal")
    assert "index_key_dtype" in pair.decode.ready()[1][0]
