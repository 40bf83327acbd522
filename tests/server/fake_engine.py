"""A stand-in for dsv4.engine.Engine with the same API: a scripted, deterministic token stream.

Tokens are characters (id = code point), so any reply text round-trips exactly, special tokens
included; each token arrives after `token_delay` seconds, as if one decode tick passed.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace

import msgspec
from prometheus_client import CollectorRegistry, Counter

from dsv4.engine.request import AdmissionError
from dsv4.protocol import GenerationRequest, RequestOutput, SamplingParams, TokenLogprob

VOCAB_SIZE = 0x110000


class CharTokenizer:
    think_start_id = think_end_id = None  # no special tokens: every id is one character
    max_token_bytes = 1

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    encode_without_gil = encode

    def decode(self, ids) -> str:
        return "".join(chr(i) for i in ids)

    def token_bytes(self, token_id: int) -> bytes:
        return chr(token_id).encode("utf-8", "surrogatepass")


@dataclass
class _Live:
    request: GenerationRequest
    abort_reason: str | None = None
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class FakeEngine:
    def __init__(self, reply: str = "Hello from the fake engine.", *, max_context: int = 256, token_delay: float = 0.001):
        self.tokenizer = CharTokenizer()
        self.model_config = SimpleNamespace(vocab_size=VOCAB_SIZE, eos_token_id=1)
        self.model_name = "fake-model"
        self.max_context = max_context
        self.token_delay = token_delay
        self.reply_for = lambda request: reply  # tests swap this for per-request scripts
        self.fail_after: int | None = None  # emit an "error" output after this many tokens
        self.refusal: str | None = None  # submit() raises AdmissionError with this message
        self.not_ready_reasons: list[str] = []
        self.submitted: list[GenerationRequest] = []
        self.aborted: dict[str, str] = {}
        self.live: dict[str, _Live] = {}
        self.metrics = SimpleNamespace(registry=CollectorRegistry())
        self.ticks = Counter("dsv4_fake_ticks", "fake engine ticks", registry=self.metrics.registry)
        self.stopped: str | None = None
        self.death: str | None = None
        self.died = asyncio.Event()

    async def start(self) -> None:
        pass

    async def stop(self, reason: str = "engine stopped") -> None:
        self.stopped = reason
        for live in list(self.live.values()):
            live.abort_reason = reason
            live.wake.set()

    def alive(self) -> tuple[bool, str | None]:
        return self.death is None, self.death

    async def until_dead(self) -> str:
        await self.died.wait()
        return self.death

    def die(self, reason: str) -> None:
        """What the real engine does when its tick loop dies."""
        self.death = reason
        self.died.set()

    def submit(self, request: GenerationRequest):
        if self.refusal:
            raise AdmissionError(self.refusal)
        self.submitted.append(request)
        live = _Live(request)
        self.live[request.rid] = live
        return self._run(live)

    def abort(self, rid: str, reason: str = "client disconnected") -> None:
        self.aborted[rid] = reason
        live = self.live.get(rid)
        if live is not None:
            live.abort_reason = reason
            live.wake.set()

    def ready(self) -> tuple[bool, list[str]]:
        return not self.not_ready_reasons, list(self.not_ready_reasons)

    def debug_requests(self) -> dict:
        return {"requests": [{"rid": rid} for rid in self.live], "free_pages": 8, "total_pages": 8,
                "free_slots": 4 - len(self.live), "total_slots": 4, "tick": 0}

    async def _run(self, live: _Live):
        request = live.request
        reply = self.reply_for(request)
        limit = request.sampling.max_new_tokens
        try:
            for n, char in enumerate(reply[:limit], start=1):
                try:
                    await asyncio.wait_for(live.wake.wait(), self.token_delay)
                except TimeoutError:
                    pass
                self.ticks.inc()
                if live.abort_reason is not None:
                    yield self._last(request, "abort", error=live.abort_reason)
                    return
                if self.fail_after is not None and n > self.fail_after:
                    yield self._last(request, "error", error="injected failure")
                    return
                yield RequestOutput(rid=request.rid, token_ids=(ord(char),), text=char,
                                    prompt_tokens=len(request.input_ids), completion_tokens=n,
                                    logprobs=_logprobs(request.sampling, [ord(char)]),
                                    prompt_logprobs=_prompt_logprobs(request) if n == 1 else None)
            last = self._last(request, "length" if len(reply) >= limit else "stop")
            yield last if reply[:limit] else msgspec.structs.replace(last, prompt_logprobs=_prompt_logprobs(request))
        finally:
            self.live.pop(request.rid, None)

    @staticmethod
    def _last(request: GenerationRequest, reason: str, error: str | None = None) -> RequestOutput:
        return RequestOutput(rid=request.rid, finished=True, finish_reason=reason, error=error,
                             prompt_tokens=len(request.input_ids))


def _logprobs(sampling: SamplingParams, token_ids: list[int]) -> tuple[TokenLogprob, ...]:
    """Made-up logprobs in the engine's shape: each token certain-ish, its top list itself repeated."""
    if sampling.logprobs is None:
        return ()
    return tuple(TokenLogprob(t, -0.5, ((t, -0.5),) * sampling.logprobs) for t in token_ids)


def _prompt_logprobs(request: GenerationRequest) -> tuple[TokenLogprob | None, ...] | None:
    sampling = request.sampling
    if sampling.prompt_logprobs is None:
        return None
    start = sampling.prompt_logprobs_start
    entries = [TokenLogprob(t, -1.0, ((t, -1.0),) * sampling.prompt_logprobs)
               for t in request.input_ids[max(start, 1):]]
    return (None, *entries) if start == 0 else tuple(entries)
