"""The load generator's HTTP reader (scripts/bench/client.py StreamedResponse) on bytes cut at every
place: the status and headers, the chunked body's SSE events each stamped with the arrival of its
last piece, a failed response's body, and a connection lost mid-stream."""

from __future__ import annotations

import asyncio
import itertools
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench.client import StreamedResponse

EVENTS = [b'{"output_ids":[5],"text":"a"}', b'{"output_ids":[6,7],"text":"b\\n\\nc"}', b"[DONE]"]


def chunked(body: bytes, sizes: list[int]) -> bytes:
    out, at = b"", 0
    for size in sizes:
        out += b"%x\r\n%s\r\n" % (size, body[at:at + size])
        at += size
    return out + b"0\r\n\r\n"


def sse(events: list[bytes]) -> bytes:
    return b"".join(b"data: " + e + b"\n\n" for e in events)


HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


def response(events: list[bytes], sizes: list[int]) -> bytes:
    return HEAD + chunked(sse(events), sizes)


def wire_offsets(sizes: list[int]) -> list[int]:
    """Where each byte of the body lies in `response(..., sizes)`."""
    offsets, at = [], len(HEAD)
    for size in sizes:
        at += len(b"%x\r\n" % size)
        offsets += range(at, at + size)
        at += size + 2
    return offsets


async def read(data: bytes, pieces: list[int], lose: bool = False) -> tuple[StreamedResponse, list]:
    """Feeds `data` cut at `pieces` (offsets), piece i arriving at time i (the protocol's clock)."""
    got = []
    protocol = StreamedResponse(lambda at, event: got.append((at, event)))
    bounds = [0, *pieces, len(data)]
    clock = [0.0]
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("bench.client.time.perf_counter", lambda: clock[0])
        for i, (a, b) in enumerate(itertools.pairwise(bounds)):
            clock[0] = float(i)
            protocol.data_received(data[a:b])
    if lose:
        protocol.connection_lost(None)
    return protocol, got


async def test_every_cut_of_a_chunked_stream_gives_the_same_events():
    body = sse(EVENTS)
    sizes = [7, len(body) - 7 - 3, 3]  # chunks that cut events and lines apart
    data, offsets = response(EVENTS, sizes), wire_offsets(sizes)
    # (each event's last byte, on the wire: an event is stamped with the piece that completed it)
    ends = [offsets[len(sse(EVENTS[:i + 1])) - 1] for i in range(len(EVENTS))]
    for cut in range(1, len(data)):
        protocol, got = await read(data, [cut])
        assert protocol.status == 200 and protocol.done.done()
        assert [e for _, e in got] == EVENTS, cut
        assert [at for at, _ in got] == [0.0 if end < cut else 1.0 for end in ends], cut


async def test_many_small_pieces():
    data = response(EVENTS, [len(sse(EVENTS))])
    protocol, got = await read(data, list(range(1, len(data), 3)))
    assert [e for _, e in got] == EVENTS and protocol.done.done()


async def test_a_failed_response_keeps_its_body_and_a_lost_connection_fails():
    body = b'{"error": {"message": "too long"}}'
    data = b"HTTP/1.1 400 Bad Request\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)
    protocol, got = await read(data, [20, 60])
    assert protocol.status == 400 and bytes(protocol.body) == body and not got and protocol.done.done()

    protocol, got = await read(response(EVENTS, [len(sse(EVENTS))])[:-20], [], lose=True)
    assert isinstance(protocol.done.exception(), ConnectionError) and [e for _, e in got] == EVENTS[:2]


async def test_a_malformed_response_fails_its_wait():
    protocol, _ = await read(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", [])
    assert isinstance(protocol.done.exception(), ValueError)


async def test_a_body_to_the_close_ends_at_the_close():
    protocol, _ = await read(b"HTTP/1.1 503 Service Unavailable\r\n\r\nbusy", [], lose=True)
    assert protocol.status == 503 and bytes(protocol.body) == b"busy" and protocol.done.result() is None
    await asyncio.sleep(0)
