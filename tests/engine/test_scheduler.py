"""The scheduler alone: pure Python, no clock, no runner."""

import pytest

from dsv4.engine.request import AdmissionError, Request, RequestState
from dsv4.engine.scheduler import Scheduler
from dsv4.memory.allocator import PageSlotAllocator
from dsv4.protocol import SamplingParams

P = 128


def make(num_pages=8, num_slots=4, budget=64, max_context=10_000):
    return Scheduler(PageSlotAllocator(num_pages, num_slots), page_size=P, token_budget=budget, max_context=max_context)


def req(rid, prompt_len, max_new=16):
    return Request(rid=rid, prompt_ids=tuple(range(prompt_len)), sampling=SamplingParams(max_new_tokens=max_new),
                   arrival=0.0, deadline=1e9)


def tick(s: Scheduler):
    """One tick with a fake sampler: every sampled chunk gets token 7; max_new_tokens finishes."""
    plan, victims = s.schedule()
    for chunk in plan.batch.chunks:
        if chunk.sample:
            r = s.get(chunk.rid)
            r.output_ids.append(7)
            if len(r.output_ids) == r.sampling.max_new_tokens:
                s.finish(r, "length")
    return plan, victims


def test_budget_is_shared_by_decodes_and_prefill_chunks():
    s = make(budget=16)
    for i in range(3):
        s.add(req(f"d{i}", 4))
    tick(s)  # three 4-token prefills fit in 16
    s.add(req("long", 100))
    plan, _ = tick(s)
    sizes = {c.rid: len(c.token_ids) for c in plan.batch.chunks}
    assert sizes == {"d0": 1, "d1": 1, "d2": 1, "long": 13}
    plan, _ = tick(s)
    assert sum(len(c.token_ids) for c in plan.batch.chunks) == 16
    long_chunk = next(c for c in plan.batch.chunks if c.rid == "long")
    assert long_chunk.start_pos == 13 and not long_chunk.sample


def test_prefill_chunks_cover_the_prompt_in_order_and_sample_at_the_end():
    s = make(budget=97)
    s.add(req("a", 300))
    starts = []
    while not s.get("a").output_ids:
        plan, _ = tick(s)
        (c,) = plan.batch.chunks
        starts.append((c.start_pos, len(c.token_ids), c.sample))
        assert c.token_ids == tuple(range(c.start_pos, c.start_pos + len(c.token_ids)))
    assert starts == [(0, 97, False), (97, 97, False), (194, 97, False), (291, 9, True)]


def test_admission_waits_for_pages_and_is_fcfs():
    s = make(num_pages=4, budget=512)
    s.add(req("a", 300, max_new=2))  # 3 pages
    s.add(req("b", 200, max_new=2))  # 2 pages: must wait for a
    s.add(req("c", 10, max_new=2))  # 1 page would fit, but must not overtake b
    plan, _ = tick(s)
    assert [c.rid for c in plan.batch.chunks] == ["a"]
    assert s.get("b").state is RequestState.WAITING and s.get("c").state is RequestState.WAITING
    plan, _ = tick(s)  # a decodes its second token and finishes
    assert s.get("a") is None and s.allocator.pages.num_free == 4
    plan, _ = tick(s)
    assert [c.rid for c in plan.batch.chunks] == ["b", "c"]
    assert plan.finished == ("a",)


def test_admission_needs_a_free_slot():
    s = make(num_slots=1)
    s.add(req("a", 5))
    s.add(req("b", 5))
    plan, _ = tick(s)
    assert [c.rid for c in plan.batch.chunks] == ["a"]
    assert s.get("b").state is RequestState.WAITING


def test_decode_grows_a_page_at_the_boundary():
    s = make(budget=128)
    s.add(req("a", 128, max_new=4))
    plan, _ = tick(s)
    assert len(plan.batch.chunks[0].page_ids) == 1
    plan, _ = tick(s)  # feeds the first sampled token at position 128
    (c,) = plan.batch.chunks
    assert c.start_pos == 128 and len(c.page_ids) == 2 and c.sample
    assert len(c.page_generations) == 2


def test_requests_that_can_never_fit_are_rejected_at_submit():
    s = make(num_pages=2, max_context=1000)
    with pytest.raises(AdmissionError, match="pool has 2"):
        s.add(req("big", 200, max_new=100))  # 299 rows need 3 pages
    with pytest.raises(AdmissionError, match="context limit"):
        s.add(req("long", 990, max_new=20))
    with pytest.raises(AdmissionError, match="empty"):
        s.add(req("empty", 0))
    s.add(req("ok", 200, max_new=57))  # exactly 256 tokens incl. the last sampled one
    with pytest.raises(AdmissionError, match="already in use"):
        s.add(req("ok", 1))


def test_abort_frees_pages_and_slot_at_once():
    s = make()
    s.add(req("a", 200))
    s.add(req("w", 5))
    tick(s)
    assert s.allocator.pages.num_free < 8
    s.abort("a", "client disconnected")
    s.abort("w", "client disconnected")
    assert s.allocator.snapshot()["free_pages"] == 8 and s.allocator.slots.num_free == 4
    assert s.abort("a", "again") is None
    plan, _ = tick(s)
    assert plan.aborted == ("a", "w") and not plan.batch.chunks and not s.has_work()


def test_page_shortage_aborts_the_youngest_instead_of_wedging():
    s = make(num_pages=2, budget=256)
    s.add(req("old", 128, max_new=8))
    s.add(req("young", 128, max_new=8))
    tick(s)  # both prefilled; both now need a second page for their first decode
    plan, victims = tick(s)
    assert [v.rid for v in victims] == ["young"]
    assert victims[0].finish_reason == "error" and "out of KV cache pages" in victims[0].error
    assert [c.rid for c in plan.batch.chunks] == ["old"] and plan.aborted == ("young",)
    while s.has_work():
        tick(s)
    assert s.allocator.pages.num_free == 2


def test_plan_sequence_numbers_increase():
    s = make()
    s.add(req("a", 3, max_new=3))
    seqs = [tick(s)[0].seq for _ in range(4)]
    assert seqs == [1, 2, 3, 4]
