"""Per-request state, owned by the tick loop (torch-free)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

from dsv4.cache.radix import CacheNode
from dsv4.memory.allocator import Handle
from dsv4.protocol import SamplingParams, TokenLogprob


class AdmissionError(ValueError):
    """A request that can never be served as asked; the message says why."""


class RequestState(enum.Enum):
    WAITING = "waiting"  # queued (new, or retracted with its generated tokens); holds nothing
    RUNNING = "running"  # holds a slot and the pages for every token it has fed
    LOADING = "loading"  # admitted, holds its slot and pages; waits for host-tier loads of its cached pages
    FINISHED = "finished"  # holds nothing; its last output has been (or is being) delivered


@dataclass(eq=False)
class Request:
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    arrival: float  # engine clock
    deadline: float  # engine clock
    state: RequestState = RequestState.WAITING
    output_ids: list[int] = field(default_factory=list)
    pages: list[Handle] = field(default_factory=list)
    slot: Handle | None = None
    # Prefix cache: the cached pages this request shares, a root-first chain that is always the start
    # of `pages` (one reference to each); the rest of `pages` is its own.
    cached: list[CacheNode] = field(default_factory=list)
    cached_tokens: int = 0  # prompt tokens that came from the cache when it was first admitted (both tiers)
    cached_host_tokens: int = 0  # of those, loaded from the host tier
    num_computed: int = 0  # tokens whose rows are in the pools
    arrival_index: int = -1  # place in arrival order, given by the scheduler
    retractions: int = 0  # times preempted for pages (its rows dropped, to be recomputed)
    last_retraction: str | None = None  # why, the last time
    retracted_at: float | None = None  # engine clock: when it last went back to the queue
    first_token_at: float | None = None
    last_token_at: float | None = None
    finish_reason: str | None = None
    error: str | None = None
    error_status: int = 500  # the HTTP status of `error`: 400 when the request's own input is the cause
    last_event: str = "queued"
    # PD prefill (dsv4/engine/pd.py): called at the tick boundary right after the first token was
    # sampled, before the request's pages and slot are released, to copy its state out.
    export_state: Callable[[Request], None] | None = None
    # Logprobs (when asked): the prompt's, gathered chunk by chunk until the first token delivers
    # them (from position max(prompt_logprobs_start, 1) on), and the last sampled token's.
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)
    last_logprob: TokenLogprob | None = None
    # --verify-indexer: this request's failed indexer selections, and where the last one was.
    indexer_mismatches: int = 0
    last_indexer_mismatch: str | None = None  # "layer L position P"

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prefilling(self) -> bool:
        """Rows are missing before the last token: a prompt, or after a retraction the prompt and
        generated tokens, still being computed. A decode feeds only its last token."""
        return self.num_computed < self.num_tokens - 1

    def delivered_prompt_logprobs(self) -> tuple[TokenLogprob | None, ...] | None:
        """What the first output carries: one per prompt position from prompt_logprobs_start on,
        None for position 0 (no token precedes it)."""
        if self.sampling.prompt_logprobs is None:
            return None
        head = (None,) if self.sampling.prompt_logprobs_start == 0 else ()
        return (*head, *self.prompt_logprobs)

    @property
    def waiting_since(self) -> float:
        return self.arrival if self.retracted_at is None else self.retracted_at

    def token_at(self, position: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[position] if position < n else self.output_ids[position - n]

    def describe(self, now: float) -> dict:
        return {
            "rid": self.rid,
            "state": self.state.value,
            "prompt_tokens": len(self.prompt_ids),
            "generated_tokens": len(self.output_ids),
            "computed_tokens": self.num_computed,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_by_tier": {"device": self.cached_tokens - self.cached_host_tokens,
                                      "host": self.cached_host_tokens},
            "shared_pages": len(self.cached),
            "pending_loads": sum(1 for node in self.cached if not node.on_device),
            "age_s": round(now - self.arrival, 3),
            "deadline_in_s": round(self.deadline - now, 3),
            "last_event": self.last_event,
            "retractions": self.retractions,
            "last_retraction": self.last_retraction,
            "indexer_mismatches": self.indexer_mismatches,
            "last_indexer_mismatch": self.last_indexer_mismatch,
        }
