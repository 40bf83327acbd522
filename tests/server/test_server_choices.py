"""n > 1: parallel sequences of one prompt, each its own engine request, streamed and collected
under their choice index; seeds per choice; one client disconnect ends them all."""

from __future__ import annotations

import asyncio

from sse_reader import parse_sse

HELLO = [{"role": "user", "content": "hi"}]


async def wait_until(predicate, timeout=5.0):
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


async def test_chat_choices_are_collected_in_order_with_summed_usage(client, engine):
    engine.reply_for = lambda request: f"reply of {request.rid.rsplit('-', 1)[1]}"
    response = await client.post("/v1/chat/completions", json={"messages": HELLO, "n": 3, "seed": 41,
                                                               "temperature": 0.7})
    assert response.status == 200, await response.text()
    body = await response.json()
    assert [c["index"] for c in body["choices"]] == [0, 1, 2]
    assert [c["message"]["content"] for c in body["choices"]] == ["reply of 0", "reply of 1", "reply of 2"]
    assert body["usage"]["completion_tokens"] == 3 * len("reply of 0")
    assert body["usage"]["prompt_tokens"] == len(engine.submitted[0].input_ids)  # the prompt counts once
    assert [r.sampling.seed for r in engine.submitted] == [41, 42, 43]
    assert len({r.rid for r in engine.submitted}) == 3


async def test_completion_choices_stream_under_their_index(client, engine):
    engine.reply_for = lambda request: "ab" if request.rid.endswith("-0") else "xyz"
    response = await client.post("/v1/completions", json={
        "prompt": "hi", "n": 2, "stream": True, "stream_options": {"include_usage": True}})
    events = parse_sse(await response.read())
    text = {0: "", 1: ""}
    finished = set()
    for event in events[:-1]:
        (choice,) = event["choices"]
        text[choice["index"]] += choice["text"]
        if choice["finish_reason"]:
            finished.add(choice["index"])
    assert text == {0: "ab", 1: "xyz"} and finished == {0, 1}
    assert events[-1]["usage"]["completion_tokens"] == 5


async def test_chat_stream_opens_every_choice(client, engine):
    response = await client.post("/v1/chat/completions", json={"messages": HELLO, "n": 2, "stream": True})
    events = parse_sse(await response.read())
    roles = [e["choices"][0]["index"] for e in events if e["choices"][0]["delta"].get("role") == "assistant"]
    assert sorted(roles) == [0, 1]
    finishes = [e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"]]
    assert sorted(finishes) == [0, 1]


async def test_the_first_choice_runs_alone_until_its_first_token(client, engine):
    """So that the others find its prompt's pages in the prefix cache."""
    engine.token_delay = 0.05
    started = []
    original_submit = engine.submit

    def submit(request):
        started.append((request.rid, len(engine.live)))
        return original_submit(request)

    engine.submit = submit
    response = await client.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 3})
    assert response.status == 200
    assert [rid.rsplit("-", 1)[1] for rid, _ in started] == ["0", "1", "2"]
    assert started[1][1] == 1  # choice 0 was live (and had answered) when choice 1 was submitted


async def test_a_disconnect_aborts_every_choice(client, engine):
    engine.reply_for = lambda request: "z" * 200
    engine.token_delay = 0.02
    response = await client.post("/v1/completions", json={"prompt": "hi", "n": 3, "max_tokens": 200, "stream": True})
    await response.content.readline()
    await wait_until(lambda: len(engine.live) == 3)
    response.close()
    await wait_until(lambda: len(engine.aborted) == 3)
    await wait_until(lambda: not engine.live)


async def test_one_failed_choice_fails_the_request_and_ends_the_others(client, engine):
    engine.reply_for = lambda request: "z" * 50
    engine.token_delay = 0.01
    engine.fail_after = 5
    response = await client.post("/v1/completions", json={"prompt": "hi", "n": 2, "max_tokens": 50})
    assert response.status == 500
    await wait_until(lambda: not engine.live)
