"""The server's own lifecycle: serving, then draining on SIGTERM/SIGINT or when the engine dies.

Draining stops accepting connections and refuses new requests on open ones (503); requests in
flight may finish within --shutdown-timeout, then the engine is stopped, which ends the rest with
an error each client sees (an SSE error event and [DONE] when streaming, a 503 JSON otherwise).
A dead engine (tick loop gone) ends every open request with the reason and the process exits
non-zero, so that a supervisor restarts it: liveness is never green over a dead engine.
"""

from __future__ import annotations

import asyncio
import logging
import signal

log = logging.getLogger(__name__)

# After the engine has ended every request, handlers need a moment to send their last bytes.
FLUSH_SECONDS = 1.0
# Kept back from --shutdown-timeout for stopping the engine and flushing, so the process exits
# within the timeout plus a small margin.
WRAP_UP_SECONDS = 1.0


class Lifecycle:
    """Requests in flight (generation and API routes; probes excluded) and whether the server drains."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        try:
            async with asyncio.timeout(max(timeout, 0.0)):
                await self._idle.wait()
        except TimeoutError:
            return False
        return True


async def until_signalled_or_dead(engine) -> bool:
    """True on SIGINT or SIGTERM; False when the engine died first."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    signalled = asyncio.ensure_future(stop.wait())
    dead = asyncio.ensure_future(engine.until_dead())
    try:
        await asyncio.wait({signalled, dead}, return_when=asyncio.FIRST_COMPLETED)
        return stop.is_set()
    finally:
        signalled.cancel()
        dead.cancel()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)


async def drain(lifecycle: Lifecycle, engine, shutdown_timeout: float) -> None:
    """Lets requests in flight finish within `shutdown_timeout`, then ends the rest."""
    lifecycle.draining = True
    log.info("shutting down: %d requests in flight may finish within %.1f s", lifecycle.in_flight, shutdown_timeout)
    if not await lifecycle.wait_idle(shutdown_timeout - WRAP_UP_SECONDS):
        log.warning("shutting down: ending %d requests that did not finish in time", lifecycle.in_flight)
    await engine.stop("the server is shutting down")
    await lifecycle.wait_idle(FLUSH_SECONDS)
