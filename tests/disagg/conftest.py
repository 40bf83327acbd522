"""PD fixtures over real UCX on 127.0.0.1, everything stopped after: `make_pair`, a prefill server
and a decode-side RemotePrefill on fakes; `make_pd`, a prefill/decode pair of real engines on the
tiny checkpoint (`engine_of` builds one engine; `held` says what one side still holds).

Each test runs on its own event loop (pytest-asyncio's default), and so do its fixtures: what a
test starts is stopped on the loop it was started on. ucxx keeps one progress task per event loop,
so every test's endpoints progress on that test's loop.
"""

from __future__ import annotations

import asyncio
import time

import pytest_asyncio
from pd_fakes import FakeDecodeTarget, FakePrefillSource

from dsv4.config import ServerArgs
from dsv4.disagg.contracts import PdTimeouts
from dsv4.disagg.decode import RemotePrefill
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.prefill import PrefillServer
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.engine.pd import PdEngine

FAST = PdTimeouts(handshake=3.0, bootstrap=3.0, wait_for_prefill=5.0, transfer=3.0, commit=2.0, lease=1.0,
                  drain_retry=0.1, heartbeat=0.1, peer_silence=2.0, reconnect=0.1)
PREFILL_CONTEXT = 256  # make_pd: smaller than the decode side's
CHUNK = 128  # engine_of's --chunked-prefill-size


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


def engine_of(checkpoint, **overrides) -> Engine:
    args = ServerArgs(**{"model": str(checkpoint), "max_running_requests": 8, "max_total_tokens": 128 * 32,
                         "chunked_prefill_size": CHUNK, "dtype": "float32", **overrides})
    model = load_model(args)
    return Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name), args


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


def held(pd: PdEngine) -> dict:
    """What one side still holds: requests, transfers, pages and slots not free."""
    debug = pd.debug_requests()
    return {"requests": len(debug["requests"]), "transfers": len(debug["disaggregation"]["transfers"]),
            "pages": debug["total_pages"] - debug["free_pages"], "slots": debug["total_slots"] - debug["free_slots"]}
