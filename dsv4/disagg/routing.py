"""Which prefill peer a decode instance sends a prompt to, and when to stop waiting for one.

A peer is a candidate when it is usable (connected, ready, heard from) and its limits admit the
prompt. A prompt that every peer's known limits refuse is refused at once (400), before any
transfer; a peer whose limits are not known yet (never connected) keeps the request waiting.
Waiters wake on an event pulsed whenever a peer may have become usable, never by polling.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine

from dsv4.disagg.peers import PrefillPeer


class PeerRouter:
    def __init__(self, peers: list[PrefillPeer], page_size: int):
        self.peers = peers
        self._page_size = page_size
        self._change = asyncio.Event()

    def changed(self) -> None:
        """A peer may have become usable or unusable: wake every waiter."""
        self._change.set()
        self._change = asyncio.Event()

    def wait_for_change(self) -> Coroutine:
        """Awaitable until the next `changed()`; bound to the current event now, so a change between
        this call and the first await is not missed."""
        return self._change.wait()

    def refusal(self, prompt_tokens: int) -> str | None:
        """Why no peer can ever take a prompt of `prompt_tokens`, or None while one might."""
        reasons = []
        for peer in self.peers:
            why = None if peer.limits is None else peer.limits.refusal(prompt_tokens, self._page_size)
            if why is None:
                return None
            reasons.append(f"{peer.addr}: {why}")
        return "no prefill instance can take this prompt: " + "; ".join(reasons)

    def pick(self, prompt_tokens: int) -> PrefillPeer | None:
        """The least loaded usable peer that can take the prompt, or None for now."""
        fits = [p for p in self.peers if p.usable
                and (p.limits is None or p.limits.refusal(prompt_tokens, self._page_size) is None)]
        return min(fits, key=lambda p: len(p.rooms) + p.load, default=None)

    def any_usable(self) -> bool:
        return any(p.usable for p in self.peers)

    def no_peer_message(self) -> str:
        return "no prefill peer reachable: " + "; ".join(f"{p.addr} ({p.explain()})" for p in self.peers)
