"""Prefill/decode disaggregation on an Engine: the engine side of docs/PD_ENGINE_HOOKS.md.

`engine_for(args)` is what `python -m dsv4 serve` serves: a plain Engine, or a `PdEngine` that
wraps one with the prefill side (a UCX bootstrap listener computing prompts for decode instances)
or the decode side (requests prefilled remotely, then decoded here). The server sees the same API.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import json
import math
import zlib
from dataclasses import asdict

import msgspec

from dsv4.config import ServerArgs
from dsv4.disagg.contracts import ExportedState, RequestFailed
from dsv4.disagg.decode import RemotePrefill
from dsv4.disagg.faults import TransferFaults
from dsv4.disagg.prefill import PrefillServer
from dsv4.engine.engine import Engine
from dsv4.engine.install import InstallFailed
from dsv4.engine.request import AdmissionError, Request
from dsv4.engine.tick import Adopted
from dsv4.protocol import PD_PROTOCOL_VERSION, Capabilities, GenerationRequest, PrefillLimits, StateRegion


def engine_for(args: ServerArgs):
    engine = Engine.from_args(args)
    return engine if args.disaggregation_mode == "null" else PdEngine(engine, args)


def capabilities_of(engine: Engine) -> Capabilities:
    pools = engine.runner.pools
    config = {k: v for k, v in asdict(engine.model_config).items() if k != "extra"}
    identity = json.dumps({"config": config, "dtype": engine.args.dtype, "model": engine.model_name},
                          sort_keys=True, default=str)
    return Capabilities(
        protocol_version=PD_PROTOCOL_VERSION,
        model_hash=hashlib.sha256(identity.encode()).hexdigest()[:16],
        page_size=pools.page_size,
        page_bytes=pools.page_bytes,
        slot_bytes=pools.slot_bytes,
        page_layout=tuple(StateRegion(r.name, r.offset, r.rows, r.row_bytes) for r in pools.page_layout()),
        slot_layout=tuple(StateRegion(r.name, r.offset, r.rows, r.row_bytes) for r in pools.slot_layout()),
        index_key_dtype=pools.index_format,
        kv_cache_dtype=pools.main_format,
    )


class EnginePrefillSource:
    """Computes a prompt in the local engine and copies its state out before release."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.capabilities = capabilities_of(engine)
        self.limits = PrefillLimits(context_length=engine.max_context,
                                    pool_tokens=engine.allocator.pages.capacity * engine.args.page_size)

    async def compute(self, rid, prompt_ids, sampling) -> ExportedState:
        pools = self.engine.runner.pools
        exported: asyncio.Future[ExportedState] = asyncio.get_running_loop().create_future()

        def export(req: Request) -> None:  # at the tick boundary, before the pages are released
            pages = [pools.page_view(h.id, h.generation).cpu().numpy().copy() for h in req.pages]
            slot = pools.slot_view(req.slot.id, req.slot.generation).cpu().numpy().copy()
            exported.set_result(ExportedState(req.output_ids[0], pages, slot, [zlib.crc32(p) for p in pages],
                                              zlib.crc32(slot)))

        request = GenerationRequest(rid=rid, input_ids=tuple(prompt_ids),
                                    sampling=msgspec.structs.replace(sampling, max_new_tokens=1))
        try:
            outputs = self.engine.submit(request, export_state=export)
        except AdmissionError as e:  # the prompt is the cause: the client gets a 400
            raise RequestFailed(str(e), 400) from None
        first_logprob, prompt_logprobs = None, None
        async for out in outputs:
            if out.finished and not exported.done():
                raise RequestFailed(out.error or f"the prompt ended without state ({out.finish_reason})",
                                    out.error_status)
            if out.token_ids:  # the one token: its logprobs travel to the decode side in the Commit
                first_logprob = out.logprobs[0] if out.logprobs else None
                prompt_logprobs = out.prompt_logprobs
        return dataclasses.replace(exported.result(), first_logprob=first_logprob, prompt_logprobs=prompt_logprobs)

    def ready(self) -> tuple[bool, list[str]]:
        return self.engine.ready()


class EngineDecodeTarget:
    """Destination pages and slots from the engine's allocator; received state into its pools."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.capabilities = capabilities_of(engine)
        # Transfers holding their destination, until adopted or released: the scheduler counts their
        # growth in the admission reserve as it counts a running request's.
        self._holding: dict[str, Request] = {}

    async def allocate(self, req, num_pages):
        # A transfer is an admission, under the scheduler's rule: behind every waiting (retracted)
        # request, and only with the growth reserve of the running requests and the transfers free.
        incoming = Request(rid=req.rid, prompt_ids=tuple(req.input_ids), sampling=req.sampling, arrival=0.0,
                           deadline=math.inf)
        if not self.engine.scheduler.admits(incoming, self._holding.values()):
            return None
        allocator = self.engine.allocator
        incoming.pages = self.engine.scheduler.take_pages(req.rid, num_pages)  # may evict cached pages
        incoming.slot = allocator.slots.allocate(req.rid)[0]
        self._holding[req.rid] = incoming
        return incoming.pages, incoming.slot

    async def release(self, rid, pages, slot) -> None:
        self._holding.pop(rid, None)
        for handle in pages:
            self.engine.allocator.pages.free(handle)
        self.engine.allocator.slots.free(slot)

    async def install(self, rid, pages, slot, page_data, slot_data):
        try:  # on every rank, through the plan (dsv4/engine/install.py)
            return await self.engine.install(rid, pages, slot, page_data, slot_data)
        except InstallFailed as e:
            raise RequestFailed(str(e)) from None

    def admit(self, req, pages, slot, first_token, first_logprob=None, prompt_logprobs=None):
        self._holding.pop(req.rid, None)  # the scheduler counts it from its adoption on
        return self.engine.submit_transferred(req, pages=pages, slot=slot,
                                              first=Adopted(first_token, first_logprob, prompt_logprobs))


class _Registries:
    """Several Prometheus registries rendered as one (`generate_latest` only calls `collect`)."""

    def __init__(self, *registries):
        self._registries = registries

    def collect(self):
        for registry in self._registries:
            yield from registry.collect()


class _Metrics:
    def __init__(self, *registries):
        self.registry = _Registries(*registries)


class PdEngine:
    """An Engine with one side of prefill/decode disaggregation attached; the server's API."""

    def __init__(self, engine: Engine, args: ServerArgs):
        self.engine = engine
        self.mode = args.disaggregation_mode
        faults = TransferFaults(args.faults)
        if self.mode == "decode":
            self.side = RemotePrefill(EngineDecodeTarget(engine), list(args.prefill_addr),
                                      verify=args.verify_transfers, faults=faults,
                                      max_queue_wait=args.max_queue_wait)
        else:
            self.side = PrefillServer(EnginePrefillSource(engine), port=args.disaggregation_bootstrap_port,
                                      faults=faults, max_concurrent=args.max_running_requests)
        self.metrics = _Metrics(engine.metrics.registry, self.side.metrics.registry)

    def __getattr__(self, name):  # tokenizer, model_name, max_context, model_config, ...
        return getattr(self.engine, name)

    async def start(self) -> None:
        await self.engine.start()
        await self.side.start()

    async def stop(self, reason: str = "engine stopped") -> None:
        await self.side.stop()
        await self.engine.stop(reason)

    def submit(self, req: GenerationRequest):
        if self.mode == "prefill":
            raise AdmissionError("this is a prefill instance (--disaggregation-mode prefill); "
                                 "send generation requests to a decode instance")
        self.engine.check_request(req)
        if req.rid in self.side.transfers:
            raise AdmissionError(f"request id {req.rid!r} is already in use")
        if (refusal := self.side.refusal(req)) is not None:
            raise AdmissionError(refusal)  # before any transfer: every prefill peer's limits refuse it
        return self.side.submit(req)

    def abort(self, rid: str, reason: str = "client disconnected") -> None:
        if self.mode == "decode" and self.side.abort(rid, reason):
            return
        self.engine.abort(rid, reason)

    def ready(self) -> tuple[bool, list[str]]:
        if self.mode == "prefill":
            return self.side.ready()  # includes the engine's readiness
        ok, reasons = self.engine.ready()
        side_ok, side_reasons = self.side.ready()
        return ok and side_ok, reasons + side_reasons

    def debug_requests(self) -> dict:
        return {**self.engine.debug_requests(), "disaggregation": self.side.debug()}
