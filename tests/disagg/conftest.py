"""PD fixtures over real UCX on 127.0.0.1, everything stopped after: `make_pair`, a prefill server
and a decode-side RemotePrefill on fakes; `make_pd`, a prefill/decode pair of real engines on the
tiny checkpoint (what else the tests share is in pd_helpers.py).

Each test runs on its own event loop (pytest-asyncio's default), and so do its fixtures: what a
test starts is stopped on the loop it was started on. ucxx keeps one progress task per event loop,
so every test's endpoints progress on that test's loop.
"""

from __future__ import annotations

import asyncio

import pytest_asyncio
from pd_fakes import FakeDecodeTarget, FakePrefillSource
from pd_helpers import FAST, PREFILL_CONTEXT, Pair, engine_of, wait_until

from dsv4.disagg.decode import RemotePrefill
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.prefill import PrefillServer
from dsv4.engine.pd import PdEngine


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


@pytest_asyncio.fixture
async def make_pd(tiny_ckpt):
    """`await make_pd(faults, prefill_args=, decode_args=)`: (prefill, decode) with ServerArgs overrides,
    built on the test's loop, stopped after."""
    started = []

    async def make(faults: str | None = None, *, prefill_args: dict | None = None, decode_args: dict | None = None):
        prefill_engine, prefill_args = engine_of(tiny_ckpt, **{
            "context_length": PREFILL_CONTEXT, "verify_indexer": "fail", "disaggregation_mode": "prefill",
            "disaggregation_bootstrap_port": 0, "fault_inject": faults, **(prefill_args or {})})
        prefill = PdEngine(prefill_engine, prefill_args)
        await prefill.start()
        started.append(prefill)
        decode_engine, decode_args = engine_of(tiny_ckpt, **{
            "disaggregation_mode": "decode", "prefill_addr": (f"127.0.0.1:{prefill.side.port}",),
            **(decode_args or {})})
        decode = PdEngine(decode_engine, decode_args)
        await decode.start()
        started.append(decode)
        await wait_until(lambda: decode.ready()[0], 20, "the decode side", explain=lambda: decode.ready()[1])
        return prefill, decode

    yield make
    for service in reversed(started):
        await asyncio.wait_for(service.stop(), 15)
