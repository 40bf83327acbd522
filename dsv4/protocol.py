"""Every typed message that crosses a process, rank or role boundary (msgspec; never pickle).

The engine's one contract with the model runner is `ForwardBatch`, derived from the `TickPlan`
that rank 0 decides each tick (ARCHITECTURE.md invariant 1).
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


class ForwardChunk(msgspec.Struct, frozen=True, kw_only=True):
    """One request's share of a forward pass: a prefill chunk or a single decode token.

    `token_ids` occupy positions start_pos .. start_pos+len-1. `page_ids` is the request's whole
    page table (covering at least start_pos+len tokens); `page_generations` names the generation
    each page was allocated under, so stale references are detectable. `slot` names the
    request's per-request state (window rings, compressor partial state); start_pos == 0 means
    the slot starts empty. `sample` is true when the last position's logits are needed.
    """

    rid: str
    slot: int
    slot_generation: int
    start_pos: int
    token_ids: tuple[int, ...]
    page_ids: tuple[int, ...]
    page_generations: tuple[int, ...]
    sample: bool


class ForwardBatch(msgspec.Struct, frozen=True, kw_only=True):
    tick: int
    chunks: tuple[ForwardChunk, ...]


class TickPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's immutable decision for one tick; every rank applies it exactly once, in order."""

    seq: int
    batch: ForwardBatch
    finished: tuple[str, ...] = ()  # requests whose pages and slots are released after this tick
    aborted: tuple[str, ...] = ()


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What the HTTP layer hands the engine: a tokenised prompt and how to continue it."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    deadline: float | None = None  # time.monotonic() seconds; the request fails when it passes


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One increment of a request's output, delivered through the request's own queue.

    `text` is the detokenised delta for `token_ids` (complete UTF-8 only; stop strings trimmed).
    The last output of a request has `finished=True` and a `finish_reason` in
    {"stop", "length", "abort", "error"}; `error` explains "error" and "abort".
    """

    rid: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
