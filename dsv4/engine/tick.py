"""The lockstep tick: the engine's only step function (ARCHITECTURE.md invariant 1).

    inbox (new requests, aborts) + deadline expiries
      -> Scheduler.schedule(): the immutable, sequence-numbered TickPlan
      -> in the forward thread: [TP: broadcast the plan] -> PD installs -> runner.forward(plan.batch)
         -> [TP: the consensus vector] -> sampling
      -> the host-tier loads the plan recorded start (the pools know the units they name now)
      -> tokens, text and finishes delivered to each request's queue

With --tp-size N this is rank 0's tick; the other ranks run its mirror (dsv4/engine/follower.py),
collective for collective, on the plan they receive. Only rank 0 samples; the tokens reach the
other ranks in the next plan's chunks. With a group, a tick runs even when idle (an empty plan at
most every IDLE_WAKE_S), so a follower waiting for the next plan never waits past the deadline.

Everything but the forward and sampling runs on the event loop thread, which is the only one that
touches scheduler state; so aborts and deadlines take effect at tick boundaries by construction,
and the loop stays free to answer /health while a forward runs.

Logprobs (dsv4/engine/logprobs.py) are computed in the forward thread beside sampling, from the
same raw logits, only for the rows whose request asked; prompt logprobs from the runner's
`prompt_logits`, gathered on the request chunk by chunk and delivered with its first token.

A request's error stays the request's (ARCHITECTURE.md invariant 5): whatever goes wrong while
admitting one request, sampling its token, checking its stops, detokenising or delivering its
output ends that request alone with the cause (counted in dsv4_request_errors_total{stage}); the
tick goes on. Only a failure of the shared forward, or of the loop itself, is the instance's.

With --verify-indexer, the runner's check of the forward's indexer selections comes back with the
sampled tokens; disagreements are counted, logged and shown per request, and with `fail` a request
whose selection failed gets an error instead of the token sampled from it.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from dsv4.config import FaultInjection, RankDelay
from dsv4.dist.collectives import TpGroup
from dsv4.engine.forward_thread import ForwardThread
from dsv4.engine.grammar import Constraints, GrammarError
from dsv4.engine.indexer_check import IndexerVerifier
from dsv4.engine.install import MAX_INSTALLS_PER_TICK, InstallFailed, PendingInstall, receive_installs
from dsv4.engine.logprobs import PromptLogprobJob, prompt_jobs, prompt_logprobs, token_logprobs
from dsv4.engine.metrics import EngineMetrics
from dsv4.engine.output import TextStream
from dsv4.engine.request import AdmissionError, Request
from dsv4.engine.sampling import History, sample, stop_reason
from dsv4.engine.scheduler import Scheduler
from dsv4.protocol import RequestOutput, SamplingParams, TickPlan, TokenLogprob

log = logging.getLogger(__name__)


def consensus(group: TpGroup, seq: int, landed: list[bool]) -> tuple[list[int], list[bool]]:
    """The tick's consensus vector, issued by every rank at the same point of every tick (MIN over
    ranks): slot r holds the tick rank r completed, slot size+i whether the plan's install i landed on
    this rank. Returns each rank's completed tick, and whether each install landed on every rank."""
    mine = {group.rank: seq} | {group.size + i: int(ok) for i, ok in enumerate(landed)}
    vector = group.agree(mine, group.size + MAX_INSTALLS_PER_TICK)
    return vector[:group.size], [v == 1 for v in vector[group.size:group.size + len(landed)]]


class RankDelays:
    """This rank's injected delays (`--fault-inject delay:rankR:PHASE:P:DURATION`), drawn from a
    generator seeded per rank."""

    def __init__(self, delays: tuple[RankDelay, ...], rank: int) -> None:
        self._delays = [d for d in delays if d.rank == rank]
        self._random = random.Random(rank)

    def sleep(self, phase: str, tick: int) -> None:
        for delay in self._delays:
            if delay.phase == phase and self._random.random() < delay.probability:
                log.info("injected delay of %.3f s at %s of tick %d", delay.seconds, phase, tick)
                time.sleep(delay.seconds)


def rank_faults(faults: FaultInjection, rank: int) -> RankDelays:
    return RankDelays(faults.rank_delays, rank)


class TickFailed(RuntimeError):
    """A tick could not complete; the tick loop stops and says why."""


class InjectedFault(TickFailed):
    pass


class Inbox:
    """What reaches the engine between ticks. Event-loop thread only."""

    def __init__(self) -> None:
        self.requests: list[Request] = []
        self.aborts: dict[str, str] = {}  # rid -> reason; the first reason wins
        self.adopted: list[tuple[Request, Adopted]] = []  # PD decode: (request, its first token)
        self.installs: list[PendingInstall] = []  # PD decode: received states for the pools of every rank
        self._wakeup = asyncio.Event()

    def put_request(self, req: Request) -> None:
        self.requests.append(req)
        self._wakeup.set()

    def put_abort(self, rid: str, reason: str) -> None:
        self.aborts.setdefault(rid, reason)
        self._wakeup.set()

    def put_adopted(self, req: Request, first: Adopted) -> None:
        self.adopted.append((req, first))
        self._wakeup.set()

    def put_install(self, pending: PendingInstall) -> None:
        self.installs.append(pending)
        self._wakeup.set()

    def wake(self) -> None:
        """Ends a wait without a delivery (something outside the inbox changed: a host-tier copy landed)."""
        self._wakeup.set()

    def __bool__(self) -> bool:
        return bool(self.requests or self.aborts or self.adopted or self.installs)

    def take(self) -> tuple[list[Request], dict[str, str]]:
        taken = self.requests, self.aborts
        self.requests, self.aborts = [], {}
        self._wakeup.clear()
        return taken

    def take_adopted(self) -> list[tuple[Request, Adopted]]:
        taken, self.adopted = self.adopted, []
        return taken

    def take_installs(self, limit: int) -> list[PendingInstall]:
        taken, self.installs = self.installs[:limit], self.installs[limit:]
        return taken

    async def wait(self, timeout: float) -> None:
        """At once while the inbox holds something; else until something arrives or a wake comes (since the last
        take or wait), or `timeout` seconds pass."""
        if not self:
            try:
                async with asyncio.timeout(timeout):
                    await self._wakeup.wait()
            except TimeoutError:
                pass
        if not self:  # (a bare wake is consumed here, so that the next wait waits)
            self._wakeup.clear()


@dataclass(frozen=True)
class Adopted:
    """PD decode: what the prefill side sampled (and, when asked, its logprobs)."""

    token: int
    logprob: TokenLogprob | None = None
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None


@dataclass
class Sampled:
    """What the forward thread hands back for one tick: per sampled chunk, its token (or the
    Exception that failed it) and its logprob when asked; per request, the prompt logprobs its
    chunks returned (or the Exception)."""

    tokens: list[int | Exception]
    logprobs: list[TokenLogprob | Exception | None]
    prompt_logprobs: dict[str, list[TokenLogprob] | Exception]
    grammar_ended: set[str]  # requests whose grammar ended with this tick's token


class _Decoding:
    """A live request's text state; it survives a retraction, as the text already delivered does."""

    def __init__(self, req: Request, detokenizer) -> None:
        self.text = TextStream(detokenizer, req.sampling.stop, req.sampling.hidden_token_ids)


class Ticker:
    def __init__(
        self,
        scheduler: Scheduler,
        runner,
        *,
        new_detokenizer: Callable[[], object],
        eos_ids: frozenset[int],
        metrics: EngineMetrics,
        deliver: Callable[[RequestOutput], None],
        forward_deadline: float,
        faults: FaultInjection | None = None,
        clock: Callable[[], float] = time.monotonic,
        verify_indexer: str = "off",
        group: TpGroup | None = None,
        constraints: Constraints | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.runner = runner
        self.inbox = Inbox()
        self._new_detokenizer = new_detokenizer
        self._eos_ids = eos_ids
        self._metrics = metrics
        self._deliver = deliver
        self._forward_deadline = forward_deadline
        self._faults = faults or FaultInjection()
        self._clock = clock
        self._verify_indexer = verify_indexer  # off | count | full | fail (ServerArgs.verify_indexer)
        self._decoding: dict[str, _Decoding] = {}
        self._group = group
        self._constraints = constraints  # the matchers of constrained requests (dsv4/engine/grammar.py)
        self._delays = rank_faults(self._faults, 0)
        self.rank_ticks: list[int] = []  # TP: the last consensus vector (each rank's completed tick)
        # One thread: forwards run strictly in plan order, as every rank must apply them.
        self._forward_thread = ForwardThread("dsv4-forward")

    async def step(self) -> TickPlan:
        started = self._clock()
        new, aborts = self.inbox.take()
        for req in new:
            self._guarded(req, "admit", started, self._admit, req)
        for req, first in self.inbox.take_adopted():
            self._guarded(req, "adopt", started, self._adopt, req, first, started)
        for rid, reason in aborts.items():
            req = self.scheduler.abort(rid, reason)
            if req is not None:
                self._end(req, started)
        for req in self.scheduler.requests():
            if started >= req.deadline:
                self.scheduler.abort(
                    req.rid, f"deadline exceeded after {started - req.arrival:.1f} s", finish_reason="error"
                )
                self._end(req, started)
        plan = self.scheduler.schedule()
        for req in self.scheduler.take_failed():  # a host-tier load of a page it shares failed its check
            self._metrics.request_errors.labels(stage="hicache_load").inc()
            log.error("request %s: %s", req.rid, req.error)
            self._end(req, started)
        for rid in plan.retracted:
            self.scheduler.get(rid).retracted_at = started
        self._metrics.preemptions.inc(len(plan.retracted))
        installs = self.inbox.take_installs(MAX_INSTALLS_PER_TICK)
        if installs:
            plan = msgspec.structs.replace(plan, installs=tuple(p.install for p in installs))
        if plan.batch.chunks or plan.installs or plan.page_handouts or plan.slot_handouts or self._group is not None:
            # every rank applies every plan that changes anything
            landed = [False] * len(installs)  # unless the tick completes
            try:
                sampled, indexer_check, landed = await self._forward_and_sample(plan, installs)
            finally:
                self._settle_installs(installs, landed, f"it did not land on every rank in tick {plan.seq}")
            if self.scheduler.cache is not None:
                # The pools know the plan's handouts now: the host-tier loads it recorded may name them.
                self.scheduler.cache.start_pending()
            self._postprocess(plan, sampled, indexer_check, self._clock())
        self._metrics.ticks.inc()
        self._metrics.tick_duration.observe(self._clock() - started)
        return plan

    def _guarded(self, req: Request, stage: str, now: float, handle: Callable[..., None], *args) -> None:
        """Runs one request's handling; whatever it raises ends that request alone (invariant 5)."""
        try:
            handle(*args)
        except AdmissionError as e:
            req.error_status = 400
            self._fail_request(req, stage, e, now)
        except Exception as e:  # noqa: BLE001 -- any error in one request's handling is that request's
            self._fail_request(req, stage, e, now)

    def _admit(self, req: Request) -> None:
        decoding = _Decoding(req, self._new_detokenizer())
        self.scheduler.add(req)
        self._decoding[req.rid] = decoding
        if req.sampling.grammar is not None:
            self._grammars().add(req.rid, req.sampling.grammar)

    def _grammars(self) -> Constraints:
        if self._constraints is None:
            raise GrammarError("this engine does not constrain decoding")
        return self._constraints

    def _adopt(self, req: Request, first: Adopted, now: float) -> None:
        """PD decode: the request arrives with its prompt computed elsewhere and its first token
        sampled there; that token (with its logprobs) is delivered, and checked for stop, as if
        sampled here."""
        self.scheduler.adopt(req)
        self._decoding[req.rid] = _Decoding(req, self._new_detokenizer())
        if req.sampling.grammar is not None:  # the prefill side sampled the first token under it
            self._grammars().add(req.rid, req.sampling.grammar, consumed=(first.token,))
        req.output_ids.append(first.token)
        req.first_token_at = req.last_token_at = now
        self._metrics.generation_tokens.inc()
        self._metrics.time_to_first_token.observe(now - req.arrival)
        self._deliver_token(req, first.token, first.logprob, first.prompt_logprobs)

    @staticmethod
    def _settle_installs(installs: list[PendingInstall], landed: list[bool], why: str) -> None:
        """Answers each install's transfer (the first answer stands): the checksums every rank checked
        what landed against, or InstallFailed."""
        for pending, ok in zip(installs, landed, strict=True):
            if pending.done.done():
                continue
            if ok:
                pending.done.set_result((list(pending.install.page_checksums), pending.install.slot_checksum))
            else:
                pending.done.set_exception(InstallFailed(f"the state of {pending.install.rid}: {why}"))

    def fail_all(self, error: str) -> None:
        """Ends every live request with `error` (the tick loop is gone; nothing will be released).
        503: the requests were fine, the engine can no longer serve them."""
        queued, _ = self.inbox.take()
        queued += [req for req, _ in self.inbox.take_adopted()]
        installs = self.inbox.take_installs(len(self.inbox.installs))
        self._settle_installs(installs, [False] * len(installs), error)
        for req in [*self.scheduler.requests(), *queued]:
            req.finish_reason, req.error, req.error_status = "error", error, 503
            self._end(req, self._clock())

    def close(self, wait: bool = False) -> None:
        """Stops the forward thread after the forward in flight, if any (`wait`: until then)."""
        self._forward_thread.close(wait=wait)
        if self._constraints is not None:
            self._constraints.close()

    # -- forward and sample (worker thread) --------------------------------------------------------
    async def _forward_and_sample(self, plan: TickPlan, installs: list[PendingInstall]
                                  ) -> tuple[Sampled, IndexerVerifier | None, list[bool]]:
        sampled = [self.scheduler.get(c.rid) for c in plan.batch.chunks if c.sample]
        constrained = [(row, r.rid) for row, r in enumerate(sampled) if r.rid in (self._constraints or ())]
        # The masks are computed on the grammar thread while the forward runs.
        masks = self._constraints.start_masks(constrained) if constrained else None
        params = [r.sampling for r in sampled]
        positions = [r.num_tokens for r in sampled]  # where each sampled token will stand
        histories = [(r.prompt_ids, tuple(r.output_ids)) if r.sampling.needs_history else None for r in sampled]
        asking = {c.rid: self.scheduler.get(c.rid) for c in plan.batch.chunks if c.prompt_logits_from is not None}
        jobs = prompt_jobs(plan.batch.chunks, {rid: r.prompt_ids for rid, r in asking.items()},
                           {rid: r.sampling.prompt_logprobs for rid, r in asking.items()})
        data = [p.data for p in installs] if installs else None
        work = self._forward_thread.run(self._run, plan, params, positions, histories, jobs, data, constrained, masks)
        # (a timer that fails the awaited future: asyncio.timeout's context cost ~3 us a tick, this ~0.5)
        expiry = asyncio.get_running_loop().call_later(self._forward_deadline, _expire, work, plan.seq,
                                                       self._forward_deadline)
        try:
            return await work
        finally:
            expiry.cancel()

    def _run(self, plan: TickPlan, params: list[SamplingParams], positions: list[int], histories: list[History | None],
             jobs: list[PromptLogprobJob], install_data: list[np.ndarray] | None, constrained: list[tuple[int, str]],
             masks) -> tuple[Sampled, IndexerVerifier | None, list[bool]]:
        """The sampled tokens and logprobs (and the requests whose grammar ended), the runner's indexer
        check of this forward (None when not verified), and whether each of the plan's installs landed
        on every rank."""
        if plan.seq == self._faults.stall_at_tick:
            time.sleep(self._faults.stall_seconds)
        if plan.seq == self._faults.crash_at_tick:
            raise InjectedFault(f"injected crash at tick {plan.seq}")
        group = self._group
        if group is not None:
            self._delays.sleep("plan", plan.seq)
            group.tick = plan.seq
            group.broadcast_plan(plan)
        self.runner.begin_tenancies(plan.page_handouts, plan.slot_handouts)
        landed = receive_installs(self.runner.pools, plan.installs, group, install_data) if plan.installs else []
        if group is not None:
            self._delays.sleep("forward", plan.seq)
        with torch.inference_mode():
            logits = self.runner.forward(plan.batch)
            if group is not None:
                self._delays.sleep("consensus", plan.seq)
                self.rank_ticks, landed = consensus(group, plan.seq, landed)
                behind = [r for r, seq in enumerate(self.rank_ticks) if seq != plan.seq]
                if behind:
                    raise TickFailed(f"ranks {behind} did not complete tick {plan.seq}: {self.rank_ticks}")
            if logits.shape[0] != len(params):
                raise TickFailed(f"runner returned {logits.shape[0]} rows of logits for {len(params)} sampled chunks")
            indexer_check = self.runner.indexer_check if self._verify_indexer != "off" else None
            failed: dict[int, str] = {}
            constrained_logits = logits
            if constrained:
                bitmask, failed = masks.result()
                constrained_logits = self._constraints.apply(logits, [row for row, _ in constrained], bitmask)
            tokens = _sample_isolated(constrained_logits, params, positions, histories)
            ended = self._advance_grammars(constrained, tokens, failed) if constrained else set()
            # Logprobs come from the raw logits: before the grammar's mask, as before every processor.
            sampled = Sampled(tokens, _sampled_logprobs(logits, tokens, params),
                              _prompt_logprobs(self.runner.prompt_logits, jobs) if jobs else {}, ended)
            return sampled, indexer_check, landed

    def _advance_grammars(self, constrained: list[tuple[int, str]], tokens: list[int | Exception],
                          failed: dict[int, str]) -> set[str]:
        """Advances each constrained row's matcher with its token (a row whose mask or matcher failed
        gets the error instead); returns the requests whose grammar ended."""
        ended = set()
        for row, rid in constrained:
            if row in failed:
                tokens[row] = GrammarError(failed[row])
            elif not isinstance(tokens[row], Exception):
                try:
                    if self._constraints.advance(rid, tokens[row]):
                        ended.add(rid)
                except GrammarError as e:
                    tokens[row] = e
        return ended

    # -- delivery (event loop) --------------------------------------------------------------------------
    def _postprocess(self, plan: TickPlan, sampled: Sampled, indexer_check: IndexerVerifier | None,
                     now: float) -> None:
        failed = self._take_indexer_check(indexer_check) if indexer_check is not None else {}
        outcomes = iter(zip(sampled.tokens, sampled.logprobs, strict=True))
        for chunk in plan.batch.chunks:
            req = self.scheduler.get(chunk.rid)
            token, logprob = next(outcomes) if chunk.sample else (None, None)
            prompt = sampled.prompt_logprobs.get(chunk.rid, [])
            if chunk.rid in failed:
                self.scheduler.abort(chunk.rid, failed[chunk.rid], finish_reason="error")
                self._end(req, now)
            elif isinstance(token, Exception) or isinstance(logprob, Exception) or isinstance(prompt, Exception):
                error = next(e for e in (token, logprob, prompt) if isinstance(e, Exception))
                self._fail_request(req, "sample", error, now)
            else:
                req.prompt_logprobs += prompt
                if token is not None:
                    self._guarded(req, "deliver", now, self._accept, req, token, logprob, now,
                                  chunk.rid in sampled.grammar_ended)

    def _accept(self, req: Request, token: int, logprob: TokenLogprob | None, now: float, grammar_ended: bool) -> None:
        """Records one sampled token and delivers it."""
        metrics = self._metrics
        req.output_ids.append(token)
        metrics.generation_tokens.inc()
        if req.first_token_at is None:  # counted once: a retracted request recomputes its prompt
            metrics.prompt_tokens.inc(len(req.prompt_ids))
            req.first_token_at = now
            metrics.time_to_first_token.observe(now - req.arrival)
        else:
            metrics.inter_token_latency.observe(now - req.last_token_at)
        req.last_token_at = now
        first = len(req.output_ids) == 1
        self._deliver_token(req, token, logprob, req.delivered_prompt_logprobs() if first else None, grammar_ended)

    def _take_indexer_check(self, check: IndexerVerifier) -> dict[str, str]:
        """Counts, logs and records on each request a forward's indexer check; returns the requests
        to fail (rid -> error)."""
        self._metrics.indexer_verified.inc(check.verified)
        failed: dict[str, str] = {}
        for mismatch in check.mismatches:  # in layer order
            where = f"layer {mismatch.layer} position {mismatch.position}"
            self._metrics.indexer_mismatches.labels(layer=str(mismatch.layer)).inc(mismatch.count)
            log.warning("request %s: indexer cross-check failed at %s (%d selections): %s",
                        mismatch.rid, where, mismatch.count, mismatch.detail)
            req = self.scheduler.get(mismatch.rid)
            req.indexer_mismatches += mismatch.count
            req.last_indexer_mismatch = where
            if self._verify_indexer == "fail":
                failed.setdefault(mismatch.rid, f"indexer cross-check failed at {where}: {mismatch.detail}")
        return failed

    def _deliver_token(self, req: Request, token: int, logprob: TokenLogprob | None,
                       prompt_logprobs: tuple[TokenLogprob | None, ...] | None, grammar_ended: bool = False) -> None:
        """Delivers `token` (with its logprob, and with the prompt's logprobs on the first token)."""
        req.last_logprob = logprob
        logprobs = () if logprob is None else (logprob,)
        text_stream = self._decoding[req.rid].text
        # A grammar that ended did so with an end of sentence, whatever ignore_eos says.
        reason = "stop" if grammar_ended else stop_reason(token, len(req.output_ids), req.sampling, self._eos_ids)
        text = "" if reason == "stop" else text_stream.push(token)  # a stop token's text is not output
        if text_stream.stopped:
            reason = "stop"
        if reason is None:
            self._deliver(self._output(req, (token,), text, logprobs, prompt_logprobs))
            return
        text += text_stream.finish()
        if req.export_state is not None:
            req.export_state(req)
        self.scheduler.finish(req, reason)
        self._deliver(self._output(req, (token,), text, logprobs, prompt_logprobs))
        self._forget(req, req.last_token_at)

    def _fail_request(self, req: Request, stage: str, error: Exception, now: float) -> None:
        """Ends `req` alone with `error`, whatever it holds or has been sent; the tick goes on."""
        message = str(error) if isinstance(error, AdmissionError) else (
            f"request failed while the engine went on ({stage}): {type(error).__name__}: {error}")
        self._metrics.request_errors.labels(stage=stage).inc()
        if req.error_status >= 500:
            log.error("request %s: %s", req.rid, message, exc_info=error)
        if self.scheduler.get(req.rid) is req:
            self.scheduler.abort(req.rid, message, finish_reason="error")
        else:  # never admitted, or already released: only what it still holds is freed
            for handle in req.pages:
                self.scheduler.allocator.pages.free(handle)
            if req.slot is not None:
                self.scheduler.allocator.slots.free(req.slot)
            req.pages, req.slot = [], None
            req.finish_reason, req.error = "error", message
        self._end(req, now)

    def _end(self, req: Request, now: float) -> None:
        """Delivers the last output of a request that ended without a token (abort, deadline, error)."""
        self._deliver(self._output(req, (), ""))
        self._forget(req, now)

    def _output(self, req: Request, token_ids: tuple[int, ...], text: str, logprobs: tuple[TokenLogprob, ...] = (),
                prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None) -> RequestOutput:
        finished = req.finish_reason is not None
        return RequestOutput(
            rid=req.rid,
            token_ids=token_ids,
            text=text,
            finished=finished,
            finish_reason=req.finish_reason,
            error=req.error,
            prompt_tokens=len(req.prompt_ids),
            completion_tokens=len(req.output_ids),
            error_status=req.error_status,
            cached_tokens=req.cached_tokens,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _forget(self, req: Request, now: float) -> None:
        self._decoding.pop(req.rid, None)
        if self._constraints is not None:
            self._constraints.forget(req.rid)
        self._metrics.finished_requests.labels(reason=req.finish_reason).inc()
        self._metrics.e2e_latency.observe(now - req.arrival)


def _expire(work: asyncio.Future, seq: int, deadline: float) -> None:
    if not work.done():  # (the forward thread's late answer then finds it settled, and is dropped)
        work.set_exception(TickFailed(f"forward of tick {seq} did not return within {deadline:.0f} s"))


def _sample_isolated(logits: torch.Tensor, params: list[SamplingParams], positions: list[int],
                     histories: list[History | None]) -> list[int | Exception]:
    """Samples the batch; if that fails, samples row by row so that only the rows whose own
    parameters break sampling fail (an Exception in their place)."""
    try:
        return sample(logits, params, positions, histories)
    except Exception:
        log.exception("batched sampling failed; sampling row by row to isolate the request")
    tokens: list[int | Exception] = []
    for i, (p, position, history) in enumerate(zip(params, positions, histories, strict=True)):
        try:
            tokens += sample(logits[i : i + 1], [p], [position], [history])
        except Exception as e:  # noqa: BLE001 -- this row's failure is its request's, reported with it
            tokens.append(e)
    return tokens


def _sampled_logprobs(logits: torch.Tensor, tokens: list[int | Exception], params: list[SamplingParams]
                      ) -> list[TokenLogprob | Exception | None]:
    """The logprob of each sampled token whose request asked for logprobs (None elsewhere); if that
    fails, the Exception in place of each asking row."""
    rows = [i for i, (token, p) in enumerate(zip(tokens, params, strict=True))
            if p.logprobs is not None and not isinstance(token, Exception)]
    out: list[TokenLogprob | Exception | None] = [None] * len(tokens)
    if not rows:
        return out
    try:
        values = token_logprobs(logits[rows], [tokens[i] for i in rows], [params[i].logprobs for i in rows])
    except Exception as e:
        log.exception("logprobs of the sampled tokens failed")
        values = [e] * len(rows)
    for i, value in zip(rows, values, strict=True):
        out[i] = value
    return out


def _prompt_logprobs(logits: torch.Tensor | None, jobs: list[PromptLogprobJob]
                     ) -> dict[str, list[TokenLogprob] | Exception]:
    try:
        return prompt_logprobs(logits, jobs)
    except Exception as e:
        log.exception("prompt logprobs failed")
        return {job.rid: e for job in jobs}
