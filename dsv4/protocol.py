"""Every typed message that crosses a process, rank or role boundary (msgspec; never pickle).

The engine's one contract with the model runner is `ForwardBatch`, derived from the `TickPlan`
that rank 0 decides each tick (ARCHITECTURE.md invariant 1).
"""

from __future__ import annotations

import msgspec

PROTOCOL_VERSION = 1
GREEDY_TEMPERATURE = 1e-5


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1: no top-k cut
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Generated ids whose text is not output, though they count as tokens: the chat layer hides the
    # think markers that cannot legitimately appear where they were generated (stray markers).
    hidden_token_ids: tuple[int, ...] = ()
    # Logits processors, applied before temperature and greedy alike (OpenAI and vLLM semantics):
    # presence and frequency penalties over the generated tokens, the repetition penalty over the
    # prompt and generated tokens, additive biases; min_p cuts after temperature.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    min_p: float = 0.0
    # Grammar-constrained decoding: llguidance's serialised grammar of the whole completion (compiled
    # and validated by the server; dsv4/engine/grammar.py), or None.
    grammar: str | None = None
    # Logprobs, taken from the raw logits (before every processor and temperature, vLLM's default):
    # `logprobs` alternatives per generated token (None: no logprobs, 0: the token's own only);
    # `prompt_logprobs` per prompt token from position `prompt_logprobs_start` on (None: none).
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    prompt_logprobs_start: int = 0

    @property
    def greedy(self) -> bool:
        # Below vLLM's sampling epsilon a temperature only turns logits into infinities.
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def prompt_logits_from(self) -> int | None:
        """The first prompt position whose logits a request needs beside its last one (the logits at
        position p give the logprob of the token at p + 1), or None."""
        return None if self.prompt_logprobs is None else max(self.prompt_logprobs_start - 1, 0)

    @property
    def needs_history(self) -> bool:
        """The penalties read the tokens a request has seen."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


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
    prompt_logits_from: int | None = None

    def prompt_logit_positions(self) -> range:
        """The positions whose logits are returned besides the sampled last one, in order."""
        if self.prompt_logits_from is None:
            return range(0)
        end = self.start_pos + len(self.token_ids) - (1 if self.sample else 0)
        return range(max(self.start_pos, self.prompt_logits_from), end)


class SlotCopy(msgspec.Struct, frozen=True, array_like=True):
    """Copies one slot-sized unit of the state pools onto another (prefix cache: a slot's boundary
    snapshot, or a snapshot restored into a slot), each named with its generation."""

    src: int
    src_generation: int
    dst: int
    dst_generation: int


class BoundaryCapture(msgspec.Struct, frozen=True, array_like=True):
    """Prefix cache: the state the chunk in `slot` has at the page boundary `position` inside it,
    written into a snapshot unit during the forward. The boundary is at least a window past the
    chunk's start, so every row that state holds comes from the chunk's own tokens."""

    slot: int
    position: int
    unit: int
    unit_generation: int


class ForwardBatch(msgspec.Struct, frozen=True, kw_only=True):
    tick: int
    chunks: tuple[ForwardChunk, ...]
    # Prefix cache (docs/PREFIX_CACHE.md): `restores` run before the forward (a hit's slot from its
    # snapshot), `captures` during it (page boundaries inside chunks), `snapshots` after it (the
    # slots of chunks that ended at a page boundary).
    restores: tuple[SlotCopy, ...] = ()
    captures: tuple[BoundaryCapture, ...] = ()
    snapshots: tuple[SlotCopy, ...] = ()


class StateInstall(msgspec.Struct, frozen=True, array_like=True):
    """PD decode: one transfer's received state, written into the pools of every rank before the
    tick's forward. The bytes travel beside the plan, in one broadcast per tick (`install.bytes`):
    each install's pages in order, then its slot. The checksums are CRC-32s of those bytes, which
    every rank checks against what landed in its pools."""

    rid: str
    page_ids: tuple[int, ...]
    page_generations: tuple[int, ...]
    slot: int
    slot_generation: int
    page_checksums: tuple[int, ...]
    slot_checksum: int


class TickPlan(msgspec.Struct, frozen=True, kw_only=True):
    """Rank 0's immutable decision for one tick; every rank applies it exactly once, in order."""

    seq: int
    batch: ForwardBatch
    # (id, generation) of every page and slot unit allocated since the previous plan: every rank's
    # pools learn each tenancy before this plan's installs and forward, and from then on accept that
    # generation only (ARCHITECTURE.md invariant 2).
    page_handouts: tuple[tuple[int, int], ...] = ()
    slot_handouts: tuple[tuple[int, int], ...] = ()
    # PD decode: states installed before this tick's forward; a request is adopted (`adopted`, in a
    # later plan) only once the tick's consensus vector showed its install landed on every rank.
    installs: tuple[StateInstall, ...] = ()
    adopted: tuple[str, ...] = ()
    # Releases since the previous plan, so that the sequence of plans records every change of
    # ownership: `finished` requests ended by sampling in the previous tick; `aborted` ones
    # (aborts, deadlines, errors) were released at this tick's boundary, before its forward, and so
    # were `retracted` ones (preempted for pages: queued again, to recompute their rows later).
    finished: tuple[str, ...] = ()
    aborted: tuple[str, ...] = ()
    retracted: tuple[str, ...] = ()


class GenerationRequest(msgspec.Struct, frozen=True, kw_only=True):
    """What the HTTP layer hands the engine: a tokenised prompt and how to continue it."""

    rid: str
    input_ids: tuple[int, ...]
    sampling: SamplingParams
    deadline: float | None = None  # time.monotonic() seconds; the request fails when it passes


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """A token's log-probability under the raw logits (fp32 log_softmax over the whole vocabulary),
    and the `top` most likely tokens there as (token id, logprob), most likely first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


class RequestOutput(msgspec.Struct, frozen=True, kw_only=True):
    """One increment of a request's output, delivered through the request's own queue.

    `text` is the detokenised delta for `token_ids` (complete UTF-8 only; stop strings trimmed).
    The last output of a request has `finished=True` and a `finish_reason` in
    {"stop", "length", "abort", "error"}; `error` explains "error" and "abort", and `error_status` is
    the HTTP status that failure maps to: 4xx when the request's own input is the cause, 503 when the
    server is shutting down, 500 otherwise (ARCHITECTURE.md invariant 5: a request's failure is its own).
    """

    rid: str
    token_ids: tuple[int, ...] = ()
    text: str = ""
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error_status: int = 500
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (OpenAI prompt_tokens_details)
    # Asked for: one per token of `token_ids`; and, on the first output that carries a token, one per
    # prompt position from `prompt_logprobs_start` on (None for position 0, which has no logprob).
    logprobs: tuple[TokenLogprob, ...] = ()
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


# == disaggregation (prefill/decode transfer frames; owner: dsv4/disagg) =========================
#
# Control frames travel as msgpack over UCX multi-buffer tag messages; payload bytes travel as raw
# buffers over tagged messages announced by a PayloadHeader. Every frame carries `version`: a receiver
# decodes `FrameHead` first, so a frame of another version is counted and dropped, not misread.

PD_PROTOCOL_VERSION = 1


class StateRegion(msgspec.Struct, frozen=True, array_like=True):
    """One region of a page or slot unit: `rows` rows of `row_bytes` at byte `offset`."""

    name: str
    offset: int
    rows: int
    row_bytes: int


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What both sides must agree on before a byte of state moves between them."""

    protocol_version: int
    model_hash: str  # hash of the model config (and weights identity) both sides serve
    page_size: int
    page_bytes: int
    slot_bytes: int
    page_layout: tuple[StateRegion, ...]
    slot_layout: tuple[StateRegion, ...]
    index_key_dtype: str
    kv_cache_dtype: str


class Destination(msgspec.Struct, frozen=True, array_like=True):
    """A page or slot of the decode side, named with the generation it was allocated under."""

    index: int
    generation: int


class FrameHead(msgspec.Struct, frozen=True, kw_only=True):
    """The part of every frame readable whatever its kind or version (other fields are ignored)."""

    kind: str
    version: int


class _Frame(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    version: int = PD_PROTOCOL_VERSION


class Hello(_Frame, tag="hello"):
    instance_id: str  # changes on every start, so a restarted peer is recognised as new
    role: str  # "decode" (the side that connects) or "prefill"
    capabilities: Capabilities


class PrefillLimits(msgspec.Struct, frozen=True, kw_only=True):
    """What one prefill instance can take; unlike `Capabilities`, instances may differ. (Page size and
    index-key dtype travel in `Capabilities`, which must match.)"""

    context_length: int  # the most tokens one request may hold: its prompt + the one token sampled
    pool_tokens: int  # pages in its pool x page size

    def refusal(self, prompt_tokens: int, page_size: int) -> str | None:
        """None when a prompt of `prompt_tokens` fits, else why not (the prefill engine's own checks)."""
        if prompt_tokens + 1 > self.context_length:
            return (f"prompt ({prompt_tokens} tokens) + 1 exceeds the prefill instance's context limit of "
                    f"{self.context_length} tokens")
        if -(-prompt_tokens // page_size) * page_size > self.pool_tokens:
            return f"prompt ({prompt_tokens} tokens) exceeds the prefill instance's pool of {self.pool_tokens} tokens"
        return None


class HelloAck(_Frame, tag="hello_ack"):
    instance_id: str
    accepted: bool
    error: str | None = None
    capabilities: Capabilities | None = None
    limits: PrefillLimits | None = None  # the prefill side's, when it accepts


class PrefillRequest(_Frame, tag="prefill"):
    room: int  # chosen by decode, unique per decode process
    rid: str
    prompt_ids: tuple[int, ...]
    sampling: SamplingParams
    pages: tuple[Destination, ...]  # one per ceil(len(prompt) / page_size), in page-table order
    slot: Destination
    timeout_s: float  # seconds the decode side waits from sending this; clocks are not shared
    verify: bool = False


class PayloadHeader(_Frame, tag="payload"):
    """Announces one raw buffer sent next on tag `payload_tag(room, seq)`."""

    room: int
    seq: int
    target: str  # "page" or "slot"
    index: int  # position in the request's page table (0 for the slot)
    generation: int  # the destination's generation from the PrefillRequest
    nbytes: int
    checksum: int  # CRC-32 of the bytes as sent


class Commit(_Frame, tag="commit"):
    """Sent after every payload of the room; completes the transfer when it matches."""

    room: int
    page_generations: tuple[int, ...]
    slot_generation: int
    first_token: int
    num_payloads: int
    prompt_checksum: int  # CRC-32 of the prompt ids the sender computed (int64 little-endian)
    page_checksums: tuple[int, ...] | None = None  # verify mode: CRC-32 of each source page
    slot_checksum: int | None = None
    # When the request asked for them: the first token's logprob, and its prompt logprobs.
    first_logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


class Abort(_Frame, tag="abort"):
    room: int
    reason: str
    # The HTTP status the failure maps to (`RequestOutput.error_status`): 4xx when the request's own
    # input is the cause (a prompt the prefill instance refuses), 5xx otherwise.
    status: int = 500


class AbortAck(_Frame, tag="abort_ack"):
    room: int


class Drain(_Frame, tag="drain"):
    """Asks the prefill side to confirm it will write nothing more for `room`."""

    room: int


class DrainAck(_Frame, tag="drain_ack"):
    """No payload of `room` is or will be in flight from the sender (idempotent: an unknown room
    is trivially drained)."""

    room: int


class Heartbeat(_Frame, tag="heartbeat"):
    seq: int
    ready: bool = True
    load: int = 0  # requests the sender has in flight
    reasons: tuple[str, ...] = ()


PdFrame = Hello | HelloAck | PrefillRequest | PayloadHeader | Commit | Abort | AbortAck | Drain | DrainAck | Heartbeat
