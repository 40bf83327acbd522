"""What the PD tests share besides fixtures: fast timeouts, polling, engines on the tiny checkpoint.

(A module of its own, not conftest.py: test modules import it by name, and every test folder has a
conftest.py, so `from conftest import ...` found another folder's when pytest ran several folders.)
"""

from __future__ import annotations

import asyncio
import time

from dsv4.config import ServerArgs
from dsv4.disagg.contracts import PdTimeouts
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


def engine_of(checkpoint, **overrides) -> Engine:
    args = ServerArgs(**{"model": str(checkpoint), "max_running_requests": 8, "max_total_tokens": 128 * 32,
                         "chunked_prefill_size": CHUNK, "dtype": "float32", **overrides})
    model = load_model(args)
    return Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name), args


def held(pd: PdEngine) -> dict:
    """What one side still holds: requests, transfers, pages and slots not free."""
    debug = pd.debug_requests()
    return {"requests": len(debug["requests"]), "transfers": len(debug["disaggregation"]["transfers"]),
            "pages": debug["total_pages"] - debug["free_pages"], "slots": debug["total_slots"] - debug["free_slots"]}
