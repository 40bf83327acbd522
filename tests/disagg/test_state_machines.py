"""Both transfer state machines over real UCX loopback, with fake engines on either side."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

import pytest
from pd_fakes import PAGE_SIZE, FakeDecodeTarget, FakePrefillSource, expected_state
from pd_helpers import FAST, wait_until

from dsv4.disagg.contracts import RequestFailed
from dsv4.disagg.decode import RemotePrefill
from dsv4.disagg.prefill import PrefillServer, PrefillState
from dsv4.disagg.transfer import DecodeState
from dsv4.protocol import GenerationRequest, SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=8)


def request(rid: str, length: int, deadline: float | None = None) -> GenerationRequest:
    prompt = tuple((i * 7 + length) % 1000 for i in range(length))
    return GenerationRequest(rid=rid, input_ids=prompt, sampling=GREEDY, deadline=deadline)


async def run(pair, req, timeout: float = 15.0):
    async with asyncio.timeout(timeout):
        return [o async for o in pair.decode.submit(req)]


def served_correctly(pair, req, outs) -> bool:
    expected = expected_state(req.input_ids)
    got = pair.target.admitted.get(req.rid)
    return (
        outs[-1].finish_reason == "length"
        and outs[-1].token_ids == (expected.first_token,)
        and got is not None
        and got[1] == [p.tobytes() for p in expected.pages]
        and got[2] == expected.slot.tobytes()
    )


async def assert_no_leaks(pair):
    await pair.settle()
    assert pair.target.leaked() == {}
    assert pair.decode.staging.in_use == 0
    assert not pair.prefill.debug()["transfers"]


async def test_mixed_lengths_arrive_byte_exact(make_pair):
    pair = await make_pair(verify=True)
    reqs = [request(f"r{i}", random.Random(i).randint(1, 5 * PAGE_SIZE)) for i in range(24)]
    results = await asyncio.gather(*(run(pair, r) for r in reqs))
    assert all(served_correctly(pair, r, outs) for r, outs in zip(reqs, results))
    await assert_no_leaks(pair)
    assert pair.decode.metrics.sample("dsv4_pd_transfers", outcome="done") == 24
    assert pair.prefill.metrics.sample("dsv4_pd_transfers", outcome="committed") == 24


async def _state_reached(pair, rid, state: DecodeState, timeout=5.0):
    await wait_until(lambda: rid in pair.decode.transfers and pair.decode.transfers[rid].state is state,
                     timeout, f"{rid} to reach {state.value}")


async def test_decode_abort_while_bootstrapping(make_pair):
    pair = await make_pair(target=FakeDecodeTarget(num_pages=1))  # 3 pages never fit: stays bootstrapping
    task = asyncio.ensure_future(run(pair, request("a", 3 * PAGE_SIZE)))
    await _state_reached(pair, "a", DecodeState.BOOTSTRAPPING)
    await asyncio.sleep(0.1)
    assert pair.decode.abort("a", "client disconnected")
    outs = await task
    assert outs[-1].finish_reason == "abort" and "client disconnected" in outs[-1].error
    await assert_no_leaks(pair)


@pytest.mark.parametrize("then", ["peer_ready_again", "client_aborts"])
async def test_a_peer_not_ready_while_a_transfer_waits_for_its_destination_only_delays_it(make_pair, then):
    # A busy prefill (a tick past --tick-stall-timeout) reports not ready for a while; a transfer
    # that picked it and then waited for pages sent it nothing yet, so it waits for it again,
    # holding its destination until it is served or ends.
    target = FakeDecodeTarget()
    destination_free, destination_taken = asyncio.Event(), asyncio.Event()
    allocate = target.allocate

    async def gated_allocate(*args):
        if not destination_free.is_set():
            return None
        destination_taken.set()
        return await allocate(*args)

    target.allocate = gated_allocate
    pair = await make_pair(target=target)
    req = request("n", 3 * PAGE_SIZE)
    task = asyncio.ensure_future(run(pair, req))
    await _state_reached(pair, "n", DecodeState.BOOTSTRAPPING)
    pair.source.not_ready_reasons = ["tick 7 has not completed in 6.0 s with work pending"]
    await wait_until(lambda: not pair.decode.peers[0].usable, 5, "the peer to report not ready")
    destination_free.set()
    await asyncio.wait_for(destination_taken.wait(), 5)
    await asyncio.sleep(0.3)
    assert not task.done(), (await task)[-1].error
    assert pair.decode.transfers["n"].state is DecodeState.BOOTSTRAPPING
    if then == "peer_ready_again":
        pair.source.not_ready_reasons = []
        assert served_correctly(pair, req, await task)
    else:
        assert pair.decode.abort("n", "client disconnected")
        outs = await task
        assert outs[-1].finish_reason == "abort" and "client disconnected" in outs[-1].error
    await assert_no_leaks(pair)


async def test_decode_abort_while_waiting_for_prefill_cancels_the_computation(make_pair):
    source = FakePrefillSource()
    source.gate = asyncio.Event()
    pair = await make_pair(source=source)
    task = asyncio.ensure_future(run(pair, request("w", 200)))
    await _state_reached(pair, "w", DecodeState.WAITING_FOR_PREFILL)
    await wait_until(lambda: source.running, 5, "the computation to start")
    pair.decode.abort("w")
    outs = await task
    assert outs[-1].finish_reason == "abort"
    await assert_no_leaks(pair)
    assert len(source.cancelled) == 1
    assert pair.decode.metrics.sample("dsv4_pd_drains") == 1
    assert pair.prefill.metrics.sample("dsv4_pd_aborts", origin="decode") == 1


async def test_decode_abort_mid_transfer_waits_for_drain_before_release(make_pair):
    pair = await make_pair(prefill_faults="delay:payload:1.0:150ms")
    task = asyncio.ensure_future(run(pair, request("t", 4 * PAGE_SIZE)))
    await _state_reached(pair, "t", DecodeState.TRANSFERRING)
    held = pair.target.allocator.pages.num_free
    pair.decode.abort("t")
    outs = await task
    assert outs[-1].finish_reason == "abort"
    # The answer is immediate; the pages come back only once the prefill side proved it drained.
    assert pair.target.allocator.pages.num_free == held
    await assert_no_leaks(pair)
    assert "t" not in pair.target.admitted
    assert pair.decode.metrics.sample("dsv4_pd_drains") == 1


async def test_abort_racing_the_commit_is_never_admitted(make_pair):
    target = FakeDecodeTarget()
    gate = asyncio.Event()
    install = target.install

    async def slow_install(*args):
        await gate.wait()
        return await install(*args)

    target.install = slow_install
    pair = await make_pair(target=target)
    task = asyncio.ensure_future(run(pair, request("c", 300)))
    await _state_reached(pair, "c", DecodeState.INSTALLING)
    pair.decode.abort("c", "client disconnected")
    gate.set()
    outs = await task
    assert outs[-1].finish_reason == "abort"
    assert "c" not in target.admitted  # the success after the failure was downgraded
    await assert_no_leaks(pair)


async def assert_pair_still_serves(pair, count: int = 8, timeout: float = 5.0):
    """Invariant 5: the failure was one request's; both sides stay ready and serve promptly."""
    assert pair.decode.ready() == (True, []) and pair.prefill.ready() == (True, [])
    assert not pair.decode.supervisor.deaths and not pair.prefill.supervisor.deaths
    reqs = [request(f"after-{i}", 20 * i + 30) for i in range(count)]  # 30 .. 170: none of 100
    started = time.monotonic()
    results = await asyncio.gather(*(run(pair, r) for r in reqs))
    assert all(served_correctly(pair, r, outs) for r, outs in zip(reqs, results))
    assert time.monotonic() - started < timeout
    await assert_no_leaks(pair)


def failing_source(error: BaseException) -> FakePrefillSource:
    source = FakePrefillSource()

    async def broken(rid, prompt_ids, sampling):
        if len(prompt_ids) == 100:
            raise error
        return await FakePrefillSource.compute(source, rid, prompt_ids, sampling)

    source.compute = broken
    return source


async def test_prefill_failure_is_sent_to_decode_and_names_the_peer(make_pair):
    pair = await make_pair(source=failing_source(RuntimeError("prefill engine out of memory")))
    outs = await run(pair, request("p", 100))
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 500
    assert "prefill engine out of memory" in outs[-1].error
    assert pair.decode.peers[0].addr in outs[-1].error
    await assert_no_leaks(pair)
    assert pair.decode.metrics.sample("dsv4_pd_aborts", origin="prefill") == 1
    # An unexpected exception while serving one room is that room's failure, counted, not the instance's.
    assert pair.prefill.metrics.sample("dsv4_pd_request_task_errors", task="room") == 1
    await assert_pair_still_serves(pair)


async def test_a_prompt_the_prefill_refuses_gets_its_4xx_and_the_pair_stays_ready(make_pair):
    # The prefill's advertised limits admit the prompt, but its engine refuses it (limits are a
    # hint: the prefill's own check has the last word).
    pair = await make_pair(source=failing_source(RequestFailed("prompt (100 tokens) exceeds the context limit", 400)))
    outs = await run(pair, request("long", 100))
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 400
    assert "exceeds the context limit" in outs[-1].error
    assert "long" not in pair.target.admitted
    await assert_no_leaks(pair)
    assert pair.prefill.metrics.sample("dsv4_pd_request_task_errors", task="room") == 0
    await assert_pair_still_serves(pair)


async def test_decode_refuses_before_any_transfer_a_prompt_no_prefill_can_take(make_pair):
    pair = await make_pair(source=FakePrefillSource(context_length=200))
    too_long = request("too-long", 200)  # 200 + the one token sampled there > 200
    assert "context limit of 200 tokens" in pair.decode.refusal(too_long)
    assert pair.decode.refusal(request("fits", 199)) is None
    outs = await run(pair, too_long)  # submitted anyway: refused in bootstrapping, nothing allocated or sent
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 400
    assert pair.prefill.metrics.sample("dsv4_pd_transfers", outcome="committed") == 0
    assert not pair.prefill.metrics.sample("dsv4_pd_aborts", origin="decode")
    await assert_pair_still_serves(pair)


async def test_decode_routes_a_prompt_only_to_a_prefill_that_can_take_it(make_pair):
    pair = await make_pair(source=FakePrefillSource(context_length=200))
    big = PrefillServer(FakePrefillSource(), timeouts=FAST)
    await big.start()
    decode = RemotePrefill(FakeDecodeTarget(), [f"127.0.0.1:{pair.prefill.port}", f"127.0.0.1:{big.port}"],
                           timeouts=FAST)
    await decode.start()
    try:
        await wait_until(lambda: all(p.usable for p in decode.peers), 10, "both peers")
        long_ones = [request(f"long-{i}", 300 + i) for i in range(4)]
        for outs in await asyncio.gather(*(_collect(decode, r) for r in long_ones)):
            assert outs[-1].finish_reason == "length", outs[-1].error
        assert big.metrics.sample("dsv4_pd_transfers", outcome="committed") == 4
        assert pair.prefill.metrics.sample("dsv4_pd_transfers", outcome="committed") == 0
    finally:
        await decode.stop()
        await big.stop()


async def _collect(decode, req, timeout: float = 15.0):
    async with asyncio.timeout(timeout):
        return [o async for o in decode.submit(req)]


async def test_an_unencodable_request_fails_alone_and_the_decode_stays_ready(make_pair):
    pair = await make_pair()
    # Bypasses the HTTP edge's validation: a seed msgpack cannot carry reaches the decode side.
    bad = GenerationRequest(rid="huge-seed", input_ids=tuple(range(50)),
                            sampling=SamplingParams(temperature=1.0, seed=1 << 70, max_new_tokens=4))
    outs = await run(pair, bad)
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 400
    assert "cannot be encoded" in outs[-1].error
    await assert_pair_still_serves(pair)


async def test_requests_waiting_for_a_prefill_are_dispatched_when_one_comes_back(make_pair):
    pair = await make_pair()
    port = pair.prefill.port
    await pair.prefill.stop()
    await wait_until(lambda: not pair.decode.ready()[0], 5, "decode to report the lost peer")
    waiting = [asyncio.ensure_future(run(pair, request(f"w{i}", 90 + i))) for i in range(3)]
    await wait_until(lambda: len(pair.decode.transfers) == 3, 5, "the requests to wait")
    assert all(t.state is DecodeState.BOOTSTRAPPING for t in pair.decode.transfers.values())
    revived = PrefillServer(FakePrefillSource(), port=port, timeouts=FAST)
    await revived.start()
    try:
        # Well within FAST.bootstrap (3 s): the peer's return wakes them; no new request is needed.
        async with asyncio.timeout(2.0):
            results = await asyncio.gather(*waiting)
        assert all(outs[-1].finish_reason == "length" for outs in results), [o[-1].error for o in results]
    finally:
        await revived.stop()


async def test_prefill_sending_deadline_fences_the_link_and_decode_recovers(make_pair):
    pair = await make_pair(prefill_faults="delay:payload:1.0:400ms",
                           prefill_timeouts=dataclasses.replace(FAST, transfer=0.3))
    outs = await run(pair, request("slow", 3 * PAGE_SIZE))
    assert outs[-1].finish_reason == "error" and pair.decode.peers[0].addr in outs[-1].error
    assert pair.prefill.metrics.sample("dsv4_pd_fenced_leases") == 1
    await assert_no_leaks(pair)
    await wait_until(lambda: pair.decode.ready()[0], 10, "decode to reconnect")


async def test_kill_transfer_task_fault_fails_that_request_only(make_pair):
    # The wedge this project exists to prevent: a prefill transfer task dying on something unexpected.
    pair = await make_pair(prefill_faults="kill:transfer_task")
    outs = await run(pair, request("k", 100))
    assert outs[-1].finish_reason == "error" and "kill:transfer_task" in outs[-1].error
    assert pair.prefill.metrics.sample("dsv4_pd_request_task_errors", task="room") == 1
    await assert_no_leaks(pair)
    await assert_pair_still_serves(pair)


async def test_prefill_not_ready_stops_decode_routing_and_says_why(make_pair):
    source = FakePrefillSource()
    pair = await make_pair(source=source)
    source.not_ready_reasons.append("engine tick loop died at tick 7")
    await wait_until(lambda: not pair.decode.ready()[0], 5, "decode to stop trusting the prefill peer")
    assert "tick loop died" in pair.decode.ready()[1][0]
    source.not_ready_reasons.clear()
    await wait_until(lambda: pair.decode.ready()[0], 5, "decode to trust it again")


async def test_request_deadline_in_every_waiting_state(make_pair):
    source = FakePrefillSource()
    source.gate = asyncio.Event()
    pair = await make_pair(source=source)
    started = time.monotonic()
    outs = await run(pair, request("d", 100, deadline=time.monotonic() + 0.5))
    assert outs[-1].finish_reason == "error"
    assert "deadline exceeded in state waiting_for_prefill" in outs[-1].error
    assert time.monotonic() - started < 1.5
    await assert_no_leaks(pair)
    assert source.cancelled


async def test_prefill_queued_state_has_a_deadline(make_pair):
    source = FakePrefillSource()
    source.gate = asyncio.Event()
    pair = await make_pair(source=source)
    pair.prefill._compute_permits = asyncio.Semaphore(1)
    first = asyncio.ensure_future(run(pair, request("q1", 50, deadline=time.monotonic() + 0.6)))
    second = asyncio.ensure_future(run(pair, request("q2", 60, deadline=time.monotonic() + 0.6)))
    await wait_until(lambda: any(r.state is PrefillState.QUEUED for p in pair.prefill._peers.values()
                                 for r in p.rooms.values()), 5, "a queued room")
    for outs in await asyncio.gather(first, second):
        assert outs[-1].finish_reason == "error" and "deadline" in outs[-1].error
    await assert_no_leaks(pair)


async def test_duplicated_frames_are_harmless(make_pair):
    pair = await make_pair(prefill_faults="duplicate:*:1.0", decode_faults="duplicate:*:1.0", verify=True)
    reqs = [request(f"u{i}", 90 * (i + 1)) for i in range(6)]
    results = await asyncio.gather(*(run(pair, r) for r in reqs))
    assert all(served_correctly(pair, r, outs) for r, outs in zip(reqs, results))
    assert pair.decode.metrics.sample("dsv4_pd_dropped_frames", reason="duplicate") >= 6
    await assert_no_leaks(pair)


async def test_commit_before_payload_is_rejected(make_pair):
    pair = await make_pair(prefill_faults="drop:payload:1.0")
    outs = await run(pair, request("x", 300))
    assert outs[-1].finish_reason == "error" and "commit before payload" in outs[-1].error
    assert "x" not in pair.target.admitted
    await assert_no_leaks(pair)


async def test_corrupt_payload_is_never_served(make_pair):
    pair = await make_pair(prefill_faults="corrupt:payload:1.0")
    outs = await run(pair, request("z", 300))
    assert outs[-1].finish_reason == "error" and "checksum" in outs[-1].error
    assert "z" not in pair.target.admitted
    await assert_no_leaks(pair)


async def test_verify_mode_catches_bytes_that_changed_after_receipt(make_pair):
    pair = await make_pair(target=FakeDecodeTarget(corrupt_install=True), verify=True)
    outs = await run(pair, request("v", 300))
    assert outs[-1].finish_reason == "error" and "checksum mismatch on pages [0]" in outs[-1].error
    assert "v" not in pair.target.admitted
    await assert_no_leaks(pair)


async def test_stale_generation_payload_is_rejected_and_counted(make_pair):
    source = FakePrefillSource()
    source.gate = asyncio.Event()
    pair = await make_pair(source=source)
    task = asyncio.ensure_future(run(pair, request("s", 200)))
    await _state_reached(pair, "s", DecodeState.WAITING_FOR_PREFILL)
    t = pair.decode.transfers["s"]
    room = next(r for p in pair.prefill._peers.values() for r in p.rooms.values())
    from dsv4.protocol import PayloadHeader

    stale = PayloadHeader(room=t.room, seq=0, target="page", index=0, generation=t.pages[0].generation - 1,
                          nbytes=pair.target.capabilities.page_bytes, checksum=0)
    await room.link.send(stale)
    outs = await task
    assert outs[-1].finish_reason == "error" and "generation" in outs[-1].error
    assert pair.decode.metrics.sample("dsv4_pd_dropped_frames", reason="stale_generation") == 1
    source.gate.set()
    await assert_no_leaks(pair)


async def test_lease_expiry_fences_a_peer_that_never_drains(make_pair):
    source = FakePrefillSource()
    source.gate = asyncio.Event()
    pair = await make_pair(source=source, prefill_faults="drop:drain_ack:1.0,drop:abort:1.0")
    task = asyncio.ensure_future(run(pair, request("l", 200)))
    await _state_reached(pair, "l", DecodeState.WAITING_FOR_PREFILL)
    pair.decode.abort("l")
    outs = await task
    assert outs[-1].finish_reason == "abort"
    await wait_until(lambda: pair.decode.metrics.sample("dsv4_pd_fenced_leases") == 1, FAST.lease + 3, "a fence")
    await assert_no_leaks(pair)
    # The decode side reconnects and serves again.
    await wait_until(lambda: pair.decode.ready()[0], 10, "readiness after the fence")
    source.gate.set()
    outs = await run(pair, request("l2", 200))
    assert served_correctly(pair, request("l2", 200), outs)


async def test_killed_prefill_fails_its_requests_and_decode_recovers(make_pair):
    source = FakePrefillSource()
    source.gate = asyncio.Event()
    pair = await make_pair(source=source)
    port = pair.prefill.port
    tasks = [asyncio.ensure_future(run(pair, request(f"k{i}", 150))) for i in range(4)]
    await wait_until(lambda: len(source.running) == 4, 5, "computations to start")
    await pair.prefill.stop()
    for outs in await asyncio.gather(*tasks):
        assert outs[-1].finish_reason == "error" and f"127.0.0.1:{port}" in outs[-1].error
    await wait_until(lambda: not pair.decode.ready()[0], 5, "decode to report the lost peer")
    assert "no prefill peer reachable" in pair.decode.ready()[1][0]
    assert pair.target.leaked() == {}
    # A prefill instance comes back on the same address: decode reconnects, turns ready and serves.
    revived = PrefillServer(FakePrefillSource(), port=port, timeouts=FAST)
    await revived.start()
    try:
        await wait_until(lambda: pair.decode.ready()[0], 10, "readiness with the new prefill instance")
        outs = await run(pair, request("k-after", 150))
        assert served_correctly(pair, request("k-after", 150), outs)
    finally:
        await revived.stop()


async def test_abort_storm_leaves_nothing_behind(make_pair):
    pair = await make_pair(prefill_faults="delay:payload:0.3:20ms")
    rng = random.Random(7)
    for round_ in range(3):
        reqs = [request(f"s{round_}-{i}", rng.randint(1, 4 * PAGE_SIZE)) for i in range(60)]
        tasks = [asyncio.ensure_future(run(pair, r, timeout=20)) for r in reqs]
        for r in reqs:
            if rng.random() < 0.9:
                asyncio.get_running_loop().call_later(rng.uniform(0, 0.3), pair.decode.abort, r.rid, "storm")
        results = await asyncio.gather(*tasks)  # none hangs: run() bounds each
        for r, outs in zip(reqs, results):
            assert outs[-1].finished
            if outs[-1].finish_reason == "length":
                assert served_correctly(pair, r, outs)
        await assert_no_leaks(pair)
    assert pair.decode.ready()[0] and pair.prefill.ready()[0]
    reqs = [request(f"after-{i}", 64 * (i + 1)) for i in range(16)]
    results = await asyncio.gather(*(run(pair, r) for r in reqs))
    assert all(served_correctly(pair, r, outs) for r, outs in zip(reqs, results))


async def test_receives_that_never_end_do_not_hold_pages_for_ever(make_pair):
    pair = await make_pair(prefill_faults="delay:payload:1.0:100ms")
    link = pair.decode.peers[0].link

    async def never_ends(room, seq, out):  # as if UCX never completed the receive, even when fenced
        await asyncio.Event().wait()

    link.recv_payload = never_ends
    outs = await run(pair, request("q", 2 * PAGE_SIZE))
    assert outs[-1].finish_reason == "error"  # a deadline, or the prefill fencing its unmatched send
    # Fenced, then bounded: the pages and slot come back; the staging buffers are never reused.
    await wait_until(lambda: not pair.decode.transfers, 4 * FAST.lease + 3, "the lease to end")
    assert pair.target.leaked() == {} and pair.decode.staging.in_use == 0
    assert pair.decode.staging.abandoned >= 1
    await wait_until(lambda: pair.decode.ready()[0], 10, "decode to reconnect")


async def test_pages_are_not_released_while_an_install_copy_may_still_run(make_pair):
    target = FakeDecodeTarget()
    copying, may_finish = asyncio.Event(), asyncio.Event()
    install, release = target.install, target.release
    events = []

    async def slow_install(*args):
        copying.set()
        await may_finish.wait()  # as a copy on the forward thread: cancelling the awaiter does not stop it
        events.append("copied")
        return await install(*args)

    async def recorded_release(rid, pages, slot):
        events.append("released")
        await release(rid, pages, slot)

    target.install, target.release = slow_install, recorded_release
    pair = await make_pair(target=target)
    task = asyncio.ensure_future(run(pair, request("i", 300)))
    await asyncio.wait_for(copying.wait(), 5)
    stopping = asyncio.ensure_future(pair.decode.stop())  # shutdown cancels the transfer mid-copy
    await asyncio.sleep(0.2)
    assert events == []
    may_finish.set()
    await asyncio.wait_for(stopping, 5)
    outs = await task
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 503
    assert events == ["copied", "released"] and target.leaked() == {}


async def test_an_install_slower_than_the_commit_timeout_is_served_and_decode_stays_ready(make_pair):
    """The commit timeout bounds the peer (the last payloads after its Commit); the copy into the pools
    then waits behind the engine's own ticks, which bound it, so a busy engine fails no transfer."""
    target = FakeDecodeTarget()
    install = target.install

    async def busy_engine_install(*args):
        await asyncio.sleep(1.0)
        return await install(*args)

    target.install = busy_engine_install
    pair = await make_pair(target=target, timeouts=dataclasses.replace(FAST, commit=0.2))
    req = request("slow", 300)
    task = asyncio.ensure_future(run(pair, req))
    await _state_reached(pair, "slow", DecodeState.INSTALLING)
    await asyncio.sleep(0.5)  # past the commit timeout, still installing
    assert pair.decode.transfers["slow"].state is DecodeState.INSTALLING
    assert pair.decode.ready() == (True, [])
    assert served_correctly(pair, req, await task)
    await assert_no_leaks(pair)


async def test_a_transfer_stuck_past_its_deadline_makes_decode_not_ready(make_pair):
    target = FakeDecodeTarget()
    never = asyncio.Event()

    async def stuck_install(*args):
        await never.wait()

    target.install = stuck_install
    pair = await make_pair(target=target)
    outs = await run(pair, request("s", 100, deadline=time.monotonic() + 1.0))
    assert outs[-1].finish_reason == "error"
    assert "request deadline exceeded in state installing" in outs[-1].error, outs[-1].error
    await wait_until(lambda: not pair.decode.ready()[0], 4 * FAST.lease + 3, "the stuck transfer to be reported")
    assert "stuck in state failed" in pair.decode.ready()[1][-1]
    never.set()
    await pair.settle()
    assert pair.decode.ready()[0] and pair.target.leaked() == {}


async def test_a_transfer_stopped_before_its_task_ran_still_ends_its_request(make_pair):
    pair = await make_pair()
    outputs = pair.decode.submit(request("unstarted", 40))
    await pair.decode.stop()  # cancels the transfer's task before its first step
    async with asyncio.timeout(5):
        outs = [o async for o in outputs]
    assert outs[-1].finish_reason == "error" and outs[-1].error_status == 503, outs[-1]
    assert pair.target.leaked() == {}
