"""One decode-side transfer: its states, its record and the events its task reads from its inbox.

The state machine that drives it is `dsv4/disagg/decode.py`; only that transfer's task changes it.
"""

from __future__ import annotations

import asyncio
import enum
import time
from dataclasses import dataclass, field

import numpy as np

from dsv4.disagg.peers import PrefillPeer
from dsv4.disagg.transport import Link
from dsv4.memory.allocator import Handle
from dsv4.protocol import Commit, GenerationRequest, PayloadHeader


class DecodeState(enum.Enum):
    BOOTSTRAPPING = "bootstrapping"
    WAITING_FOR_PREFILL = "waiting_for_prefill"
    TRANSFERRING = "transferring"
    COMMITTING = "committing"
    INSTALLING = "installing"
    DONE = "done"
    FAILED = "failed"


class TransferFailed(Exception):
    def __init__(self, reason: str, status: int = 500):
        super().__init__(reason)
        self.status = status  # the HTTP status the client gets (RequestOutput.error_status)


@dataclass(frozen=True)
class Received:
    seq: int
    error: str | None  # None: the body is in its staging buffer


@dataclass(frozen=True)
class ClientAbort:
    reason: str


@dataclass(eq=False)
class DecodeTransfer:
    req: GenerationRequest
    room: int
    created_at: float
    state: DecodeState = DecodeState.BOOTSTRAPPING
    state_since: float = 0.0
    peer: PrefillPeer | None = None
    link: Link | None = None  # the peer's link this room was sent on (a reconnect makes a new one)
    pages: list[Handle] = field(default_factory=list)
    slot: Handle | None = None
    headers: dict[int, PayloadHeader] = field(default_factory=dict)  # seq -> header
    staging: dict[int, np.ndarray] = field(default_factory=dict)  # seq -> buffer this transfer owns
    receiving: set[asyncio.Task] = field(default_factory=set)
    received: set[int] = field(default_factory=set)
    failure: str | None = None
    status: int = 500  # the failure's HTTP status
    drained: bool = False  # the peer proved it sends nothing more for this room
    lease: str = "none"  # none | held | released | fenced
    commit: Commit | None = None
    installing: asyncio.Future | None = None  # the copy into the pools, once started
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)
    outcome: asyncio.Future | None = None

    def enter(self, state: DecodeState) -> None:
        self.state, self.state_since = state, time.monotonic()


# INSTALLING has no timer of its own: the copy waits behind this engine's own ticks, not on the peer.
# The engine bounds it (each tick has its forward deadline; a tick that fails, or a loop that ends,
# fails the installs it holds), its stall check reports it, and the request's deadline still applies.
STATE_TIMEOUT = {
    DecodeState.BOOTSTRAPPING: "bootstrap",
    DecodeState.WAITING_FOR_PREFILL: "wait_for_prefill",
    DecodeState.TRANSFERRING: "transfer",
    DecodeState.COMMITTING: "commit",
}
