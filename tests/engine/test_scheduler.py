"""The scheduler alone: pure Python, no clock, no runner."""

import random

import pytest

from dsv4.engine.request import AdmissionError, Request, RequestState
from dsv4.engine.scheduler import INIT_RATIO, MIN_RATIO, RATIO_DECAY, Scheduler
from dsv4.memory.allocator import PageSlotAllocator
from dsv4.protocol import SamplingParams

P = 128


def make(num_pages=8, num_slots=4, budget=64, max_context=10_000):
    return Scheduler(PageSlotAllocator(num_pages, num_slots), page_size=P, token_budget=budget, max_context=max_context)


def req(rid, prompt_len, max_new=16):
    return Request(rid=rid, prompt_ids=tuple(range(prompt_len)), sampling=SamplingParams(max_new_tokens=max_new),
                   arrival=0.0, deadline=1e9)


def tick(s: Scheduler, token=lambda chunk: 7):
    """One tick with a fake sampler (token 7 unless told); max_new_tokens finishes."""
    plan = s.schedule()
    for chunk in plan.batch.chunks:
        if chunk.sample:
            r = s.get(chunk.rid)
            r.output_ids.append(token(chunk))
            if len(r.output_ids) == r.sampling.max_new_tokens:
                s.finish(r, "length")
    return plan


def test_budget_is_shared_by_decodes_and_prefill_chunks():
    s = make(budget=16)
    for i in range(3):
        s.add(req(f"d{i}", 4))
    tick(s)  # three 4-token prefills fit in 16
    s.add(req("long", 100))
    plan = tick(s)
    sizes = {c.rid: len(c.token_ids) for c in plan.batch.chunks}
    assert sizes == {"d0": 1, "d1": 1, "d2": 1, "long": 13}
    plan = tick(s)
    assert sum(len(c.token_ids) for c in plan.batch.chunks) == 16
    long_chunk = next(c for c in plan.batch.chunks if c.rid == "long")
    assert long_chunk.start_pos == 13 and not long_chunk.sample


def test_prefill_chunks_cover_the_prompt_in_order_and_sample_at_the_end():
    s = make(budget=97)
    s.add(req("a", 300))
    starts = []
    while not s.get("a").output_ids:
        plan = tick(s)
        (c,) = plan.batch.chunks
        starts.append((c.start_pos, len(c.token_ids), c.sample))
        assert c.token_ids == tuple(range(c.start_pos, c.start_pos + len(c.token_ids)))
    assert starts == [(0, 97, False), (97, 97, False), (194, 97, False), (291, 9, True)]


def test_admission_waits_for_pages_and_is_fcfs():
    s = make(num_pages=4, budget=512)
    s.add(req("a", 300, max_new=2))  # 3 pages
    s.add(req("b", 200, max_new=2))  # 2 pages: must wait for a
    s.add(req("c", 10, max_new=2))  # 1 page would fit, but must not overtake b
    plan = tick(s)
    assert [c.rid for c in plan.batch.chunks] == ["a"]
    assert s.get("b").state is RequestState.WAITING and s.get("c").state is RequestState.WAITING
    plan = tick(s)  # a decodes its second token and finishes
    assert s.get("a") is None and s.allocator.pages.num_free == 4
    plan = tick(s)
    assert [c.rid for c in plan.batch.chunks] == ["b", "c"]
    assert plan.finished == ("a",)


def test_admission_needs_a_free_slot():
    s = make(num_slots=1)
    s.add(req("a", 5))
    s.add(req("b", 5))
    plan = tick(s)
    assert [c.rid for c in plan.batch.chunks] == ["a"]
    assert s.get("b").state is RequestState.WAITING


def test_decode_grows_a_page_at_the_boundary():
    s = make(budget=128)
    s.add(req("a", 128, max_new=4))
    plan = tick(s)
    assert len(plan.batch.chunks[0].page_ids) == 1
    plan = tick(s)  # feeds the first sampled token at position 128
    (c,) = plan.batch.chunks
    assert c.start_pos == 128 and len(c.page_ids) == 2 and c.sample
    assert len(c.page_generations) == 2


def test_requests_that_can_never_fit_are_rejected_at_submit():
    s = make(num_pages=2, max_context=1000)
    with pytest.raises(AdmissionError, match=r"prompt \(200 tokens\) \+ max_new_tokens \(100\) needs up to 3 KV pages "
                                             r"of 128 tokens; the pool has 2 \(256 tokens"):
        s.add(req("big", 200, max_new=100))  # 299 rows need 3 pages
    with pytest.raises(AdmissionError, match=r"= 1010 exceeds the context limit of 1000 tokens$"):
        s.add(req("long", 990, max_new=20))
    with pytest.raises(AdmissionError, match=r"= 257 exceeds the context limit of 256 tokens \(the KV pool"):
        make(num_pages=2, max_context=256).add(req("pool", 200, max_new=57))
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
    plan = tick(s)
    assert plan.aborted == ("a", "w") and not plan.batch.chunks and not s.has_work()


def test_page_shortage_retracts_the_youngest_which_resumes_with_its_tokens():
    s = make(num_pages=2, budget=256)
    s.add(req("old", 128, max_new=8))
    s.add(req("young", 128, max_new=8))
    s.new_token_ratio = 0.0  # admit on the bet that nothing grows, to lose it at once
    tick(s, token=lambda c: 100)  # both prefilled; each needs a second page for its first decode
    plan = tick(s)
    young = s.get("young")
    assert plan.retracted == ("young",) and [c.rid for c in plan.batch.chunks] == ["old"]
    assert young.state is RequestState.WAITING and young.pages == [] and young.slot is None
    assert young.output_ids == [100] and young.retractions == 1
    assert young.last_retraction == "2 running decodes needed a new KV page and 0 of 2 were free"
    assert s.new_token_ratio == pytest.approx(1.0 - RATIO_DECAY)  # a lost bet: admit conservatively again
    while s.get("old") is not None:
        plan = tick(s)
    plan = tick(s)  # the pages are free again: the recompute of prompt + generated token samples the next one
    (c,) = plan.batch.chunks
    assert (c.rid, c.start_pos, c.sample, len(c.page_ids)) == ("young", 0, True, 2)
    assert c.token_ids == (*range(128), 100)
    assert young.last_event == "recompute 0..129"
    while s.has_work():
        tick(s)
    assert young.output_ids == [100] + [7] * 7 and young.finish_reason == "length"
    assert s.allocator.snapshot() == {"free_pages": 2, "total_pages": 2, "free_slots": 4, "total_slots": 4}


def test_recompute_is_chunked_under_the_budget_and_samples_once_at_its_end():
    s = make(num_pages=3, budget=97)
    s.add(req("a", 200, max_new=100))
    while len(s.get("a").output_ids) < 60:
        tick(s)
    a = s.get("a")
    s._retract(a, "test")
    chunks = []
    while len(a.output_ids) == 60:
        (c,) = tick(s).batch.chunks
        chunks.append((c.start_pos, len(c.token_ids), c.sample))
        assert c.token_ids == tuple(a.token_at(p) for p in range(c.start_pos, c.start_pos + len(c.token_ids)))
    assert chunks == [(0, 97, False), (97, 97, False), (194, 66, True)]  # 200 + 60 tokens, then decodes


def test_retraction_is_by_arrival_and_a_retracted_request_queues_ahead_of_new_ones():
    s = make(num_pages=3, budget=512)
    for rid in ("a", "b", "c"):
        s.add(req(rid, 128, max_new=4))
    s.new_token_ratio = 0.0
    tick(s)
    s.add(req("late", 10, max_new=4))
    plan = tick(s)  # three decodes need a page, none is free: c, then b go back
    assert plan.retracted == ("c", "b") and [c.rid for c in plan.batch.chunks] == ["a"]
    assert [r.rid for r in s.waiting] == ["b", "c", "late"]


def test_admission_reserves_pages_for_the_growth_of_running_requests():
    s = make(num_pages=8, budget=512)
    for i in range(4):
        s.add(req(f"r{i}", 100, max_new=400))  # 1 page now, 4 at the end
    s.new_token_ratio = 1.0
    plan = tick(s)
    assert [c.rid for c in plan.batch.chunks] == ["r0", "r1"]  # 1 + 3 pages each: two can finish
    while s.has_work():
        s.new_token_ratio = 1.0
        plan = tick(s)
        assert not plan.retracted and len(s.running) <= 2
    s = make(num_pages=8, budget=512)
    for i in range(4):
        s.add(req(f"r{i}", 100, max_new=400))
    s.new_token_ratio = MIN_RATIO
    assert len(tick(s).batch.chunks) == 4  # 4 + ceil(0.1 x 12) = 6 of 8 pages


def test_the_new_token_ratio_decays_while_requests_run_and_resets_when_idle():
    s = make()
    assert s.new_token_ratio == INIT_RATIO
    s.add(req("a", 10, max_new=3))
    tick(s)
    tick(s)
    assert s.new_token_ratio == pytest.approx(INIT_RATIO - 2 * RATIO_DECAY)
    while s.has_work():
        tick(s)
    assert s.new_token_ratio == INIT_RATIO
    s.new_token_ratio = MIN_RATIO + RATIO_DECAY / 2
    s.add(req("b", 10, max_new=3))
    tick(s)
    assert s.new_token_ratio == MIN_RATIO


def test_under_constant_pressure_every_request_finishes_and_none_is_retracted_before_progress():
    """The reserve is bet away every tick. Each request's chunks must feed its own tokens in order from
    0 after every (re)admission; a request is retracted only after sampling since it was admitted."""
    protected = 0  # retractions of an older request while a younger one was prefilling
    for seed in range(6):
        protected += run_under_pressure(random.Random(seed))
    assert protected > 0


def run_under_pressure(rng: random.Random) -> int:
    s = make(num_pages=6, num_slots=5, budget=rng.choice([5, 40, 300]))
    reqs = [req(f"r{i}", rng.randint(1, 300), max_new=rng.randint(1, 400)) for i in range(12)]
    by_rid = {r.rid: r for r in reqs}
    fed: dict[str, int] = {}  # rid -> tokens fed since (re)admission
    sampled_since_admission: dict[str, bool] = {}
    protected = 0
    pending = list(reqs)
    while pending or s.has_work():
        if pending and rng.random() < 0.3:
            s.add(pending.pop(0))
        s.new_token_ratio = 0.0
        prefilling = [r for r in s.running if r.prefilling]
        plan = tick(s, token=lambda c: (c.start_pos + len(c.token_ids)) % 97)  # a function of the position
        for rid in plan.retracted:
            assert sampled_since_admission[rid], f"{rid} retracted again before making progress"
            protected += any(r.arrival_index > by_rid[rid].arrival_index for r in prefilling)
        for c in plan.batch.chunks:
            if c.start_pos == 0:
                fed[c.rid] = 0
                sampled_since_admission[c.rid] = False
            assert c.start_pos == fed[c.rid], f"{c.rid}: chunk at {c.start_pos} after {fed[c.rid]} tokens"
            r = by_rid[c.rid]
            assert c.token_ids == tuple(r.token_at(p) for p in range(c.start_pos, c.start_pos + len(c.token_ids)))
            fed[c.rid] += len(c.token_ids)
            sampled_since_admission[c.rid] |= c.sample
    for r in reqs:
        assert r.finish_reason == "length"
        assert r.output_ids == [(len(r.prompt_ids) + i) % 97 for i in range(r.sampling.max_new_tokens)]
    assert s.allocator.snapshot() == {"free_pages": 6, "total_pages": 6, "free_slots": 5, "total_slots": 5}
    assert sum(r.retractions for r in reqs) > 0
    return protected


def test_plan_sequence_numbers_increase():
    s = make()
    s.add(req("a", 3, max_new=3))
    seqs = [tick(s).seq for _ in range(4)]
    assert seqs == [1, 2, 3, 4]
