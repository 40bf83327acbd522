"""What each side of a transfer needs from its engine, and the timeouts bounding every state.

The engine side implements these (dsv4/engine/pd.py adapts the real Engine; tests use a fake);
the state machines in prefill.py and decode.py know nothing else about the engine.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from dsv4.memory.allocator import Handle
from dsv4.protocol import Capabilities, GenerationRequest, PrefillLimits, RequestOutput, SamplingParams, TokenLogprob


@dataclass(frozen=True)
class PdTimeouts:
    """Seconds each non-terminal state may last (ARCHITECTURE.md invariant 5)."""

    handshake: float = 5.0
    # decode: wait for a peer and for destination pages and a slot (the decode side's admission
    # queue; the request's own deadline usually ends it first)
    bootstrap: float = 600.0
    # decode: prefill request sent, no payload yet: the prefill's queue and compute. Load or memory
    # pressure there waits, as in a colocated queue (the request's deadline usually ends it first); a
    # peer that dies is fenced by its silence, a prefill engine that stops fails its rooms itself.
    wait_for_prefill: float = 600.0
    transfer: float = 10.0  # decode: first payload header .. commit; prefill: sending
    commit: float = 5.0  # decode: commit received .. every payload received (then the engine's install)
    send: float = 5.0  # one control frame; a link that cannot send a small frame this long is fenced
    lease: float = 5.0  # a failed transfer's wait for a drain acknowledgement before fencing the peer
    drain_retry: float = 0.5
    heartbeat: float = 0.5
    peer_silence: float = 5.0  # a peer heard from less recently than this is fenced
    reconnect: float = 0.5


DEFAULT_TIMEOUTS = PdTimeouts()


@dataclass(frozen=True)
class ExportedState:
    """A prompt's whole state as the prefill engine left it, copied out of its pools."""

    first_token: int
    pages: list[np.ndarray]  # uint8 [page_bytes] each, in page-table order
    slot: np.ndarray  # uint8 [slot_bytes]
    page_checksums: list[int]
    slot_checksum: int
    # When the request asked for them: the first token's logprob and the prompt's logprobs.
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class RequestFailed(Exception):
    """A failure that belongs to one request: it ends that request only, never the instance.
    `status` is the HTTP status it maps to for the client (4xx when the request's input is the cause)."""

    def __init__(self, reason: str, status: int = 500):
        super().__init__(reason)
        self.status = status


class PrefillSource(Protocol):
    capabilities: Capabilities
    limits: PrefillLimits

    async def compute(self, rid: str, prompt_ids: tuple[int, ...], sampling: SamplingParams) -> ExportedState:
        """Computes the prompt and samples its first token; cancelling it aborts the computation.
        Raises RequestFailed when this prompt cannot be served (refused, or failed in the engine)."""

    def ready(self) -> tuple[bool, list[str]]: ...


class DecodeTarget(Protocol):
    capabilities: Capabilities

    async def allocate(self, req: GenerationRequest, num_pages: int) -> tuple[list[Handle], Handle] | None:
        """Destination pages and a slot owned by `req.rid`, or None when the engine would not admit
        the request now (pressure: the caller waits and asks again)."""

    async def release(self, rid: str, pages: list[Handle], slot: Handle) -> None:
        """Gives back what `allocate` handed out for `rid` (a transfer that failed)."""

    async def install(self, rid: str, pages: list[Handle], slot: Handle, page_data: list[np.ndarray],
                      slot_data: np.ndarray) -> tuple[list[int], int]:
        """Copies `rid`'s received state into the pools (of every rank); returns the checksums of what
        landed there. Raises RequestFailed when it did not land (the transfer fails, not the instance)."""

    def admit(self, req: GenerationRequest, pages: list[Handle], slot: Handle, first_token: int,
              first_logprob: TokenLogprob | None = None,
              prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None) -> AsyncIterator[RequestOutput]:
        """Hands the request (and the handles) to the decode batch, with the first token the prefill
        side sampled and, when the request asked, its logprobs."""
