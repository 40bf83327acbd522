"""A prefill server and a decode-side RemotePrefill over real UCX on 127.0.0.1, both stopped after.

Each test runs on its own event loop (pytest-asyncio's default), and so does its `make_pair`
fixture: what a test starts is stopped on the loop it was started on. ucxx keeps one progress task
per event loop, so every test's endpoints progress on that test's loop.
"""

from __future__ import annotations

import asyncio
import time

import pytest_asyncio
from pd_fakes import FakeDecodeTarget, FakePrefillSource

from dsv4.disagg.contracts import PdTimeouts
from dsv4.disagg.decode import RemotePrefill
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.prefill import PrefillServer

FAST = PdTimeouts(handshake=3.0, bootstrap=3.0, wait_for_prefill=5.0, transfer=3.0, commit=2.0, lease=1.0,
                  drain_retry=0.1, heartbeat=0.1, peer_silence=2.0, reconnect=0.1)


async def wait_until(predicate, timeout: float = 10.0, what: str = "condition", explain=None) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > end:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f": {explain()}" if explain else ""))
        await asyncio.sleep(0.02)


class Pair:
    def __init__(self, source, prefill, target, decode):
        self.source, self.prefill, self.target, self.decode = source, prefill, target, decode

    async def settle(self, timeout: float = 10.0) -> None:
        """Until every transfer on both sides has released what it holds."""
        await wait_until(lambda: not self.decode.transfers and not self.prefill.load(), timeout, "transfers to end")


@pytest_asyncio.fixture
async def make_pair():
    started = []

    async def make(*, prefill_faults: str | None = None, decode_faults: str | None = None, timeouts=FAST,
                   prefill_timeouts=None, verify: bool = False, source=None, target=None, prefill_port: int = 0,
                   ready: bool = True):
        source = source or FakePrefillSource()
        prefill = PrefillServer(source, port=prefill_port, timeouts=prefill_timeouts or timeouts,
                                faults=TransferFaults.parse(prefill_faults, seed=1))
        await prefill.start()
        started.append(prefill)
        target = target or FakeDecodeTarget()
        decode = RemotePrefill(target, [f"127.0.0.1:{prefill.port}"], timeouts=timeouts, verify=verify,
                               faults=TransferFaults.parse(decode_faults, seed=2))
        await decode.start()
        started.append(decode)
        if ready:
            await wait_until(lambda: decode.ready()[0], 10.0, "the decode side to be ready",
                             explain=lambda: decode.ready()[1])
        return Pair(source, prefill, target, decode)

    yield make
    for service in reversed(started):
        await asyncio.wait_for(service.stop(), 10.0)
