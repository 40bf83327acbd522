"""A fake engine for each side of a transfer: deterministic state bytes, real allocator, no model."""

from __future__ import annotations

import asyncio
import zlib

import numpy as np

from dsv4.disagg.contracts import ExportedState
from dsv4.memory.allocator import PageSlotAllocator
from dsv4.protocol import PD_PROTOCOL_VERSION, Capabilities, PrefillLimits, RequestOutput, StateRegion

PAGE_SIZE = 128
PAGE_BYTES = 24 * 1024  # above UCX's eager limit on TCP, so payloads go by rendezvous as real pages do
SLOT_BYTES = 40 * 1024


def capabilities(**overrides) -> Capabilities:
    fields = {
        "protocol_version": PD_PROTOCOL_VERSION,
        "model_hash": "fake-model",
        "page_size": PAGE_SIZE,
        "page_bytes": PAGE_BYTES,
        "slot_bytes": SLOT_BYTES,
        "page_layout": (StateRegion("layers.2.compressed", 0, 32, 584),
                        StateRegion("layers.2.index_keys", 18688, 32, 132)),
        "slot_layout": (StateRegion("layers.0.window", 0, 64, 584),),
        "index_key_dtype": "fp8",
        "kv_cache_dtype": "fp8_e4m3",
    }
    return Capabilities(**(fields | overrides))


def expected_state(prompt_ids) -> ExportedState:
    """What a correct prefill of `prompt_ids` produces (the oracle for received bytes)."""
    seed = zlib.crc32(np.asarray(prompt_ids, dtype=np.int64).tobytes())
    rng = np.random.default_rng(seed)
    num_pages = -(-len(prompt_ids) // PAGE_SIZE)
    pages = [rng.integers(0, 256, PAGE_BYTES, dtype=np.uint8) for _ in range(num_pages)]
    slot = rng.integers(0, 256, SLOT_BYTES, dtype=np.uint8)
    return ExportedState(
        first_token=seed % 1000,
        pages=pages,
        slot=slot,
        page_checksums=[zlib.crc32(p) for p in pages],
        slot_checksum=zlib.crc32(slot),
    )


class FakePrefillSource:
    def __init__(self, compute_s: float = 0.0, context_length: int = 1 << 20, **caps):
        self.capabilities = capabilities(**caps)
        self.limits = PrefillLimits(context_length=context_length, pool_tokens=1 << 20)
        self.compute_s = compute_s
        self.gate: asyncio.Event | None = None  # when set, computations wait for it
        self.running: set[str] = set()
        self.cancelled: list[str] = []
        self.not_ready_reasons: list[str] = []

    async def compute(self, rid, prompt_ids, sampling) -> ExportedState:
        self.running.add(rid)
        try:
            if self.gate is not None:
                await self.gate.wait()
            await asyncio.sleep(self.compute_s)
            return expected_state(prompt_ids)
        except asyncio.CancelledError:
            self.cancelled.append(rid)
            raise
        finally:
            self.running.discard(rid)

    def ready(self):
        return not self.not_ready_reasons, list(self.not_ready_reasons)


class FakeDecodeTarget:
    """Pages, slots and pools of a decode engine; an admitted request finishes at once."""

    def __init__(self, num_pages: int = 64, num_slots: int = 16, corrupt_install: bool = False, **caps):
        self.capabilities = capabilities(**caps)
        self.allocator = PageSlotAllocator(num_pages, num_slots)
        self.pages = np.zeros((num_pages, PAGE_BYTES), dtype=np.uint8)
        self.slots = np.zeros((num_slots, SLOT_BYTES), dtype=np.uint8)
        self.corrupt_install = corrupt_install
        self.admitted: dict[str, tuple[int, list[bytes], bytes]] = {}  # rid -> (first token, pages, slot)

    async def allocate(self, req, num_pages):
        a = self.allocator
        if a.slots.num_free == 0 or a.pages.num_free < num_pages:
            return None
        return a.pages.allocate(req.rid, num_pages), a.slots.allocate(req.rid)[0]

    async def release(self, rid, pages, slot):
        for h in pages:
            self.allocator.pages.free(h)
        self.allocator.slots.free(slot)

    async def install(self, rid, pages, slot, page_data, slot_data):
        for h, data in zip(pages, page_data):
            self.allocator.pages.check(h)
            self.pages[h.id] = data
        self.allocator.slots.check(slot)
        self.slots[slot.id] = slot_data
        if self.corrupt_install and pages:
            self.pages[pages[0].id, 0] ^= 0xFF
        return [zlib.crc32(self.pages[h.id]) for h in pages], zlib.crc32(self.slots[slot.id])

    def admit(self, req, pages, slot, first_token, first_logprob=None, prompt_logprobs=None):
        self.admitted[req.rid] = (
            first_token,
            [self.pages[h.id].tobytes() for h in pages],
            self.slots[slot.id].tobytes(),
        )

        async def outputs():
            await self.release(req.rid, pages, slot)  # the request finishes after its first token
            yield RequestOutput(rid=req.rid, token_ids=(first_token,), finished=True, finish_reason="length",
                                prompt_tokens=len(req.input_ids), completion_tokens=1)

        return outputs()

    def leaked(self) -> dict:
        a = self.allocator
        return {k: v for k, v in a.snapshot().items()} if (
            a.pages.num_free != a.pages.capacity or a.slots.num_free != a.slots.capacity) else {}
