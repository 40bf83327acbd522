"""Logprobs through every route equal log_softmax of the reference model's logits (fp32, 1e-4).

The server is built in-process (`build_app`) over a real Engine on the tiny checkpoint, fp32 with
fp32 indexer keys (the reference's), a prefill budget of 48 tokens (prompt logprobs cross chunk
boundaries) and the prefix cache on. Every returned logprob (output tokens, prompt tokens with
echo / logprob_start_len, and the top alternatives: values, ids and order) is checked against one
full-sequence reference forward over prompt + output: the logprobs are the raw logits', before
temperature and every processor.
"""

from __future__ import annotations

import json

import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.reference.model import load_reference_model
from dsv4.server.app import build_app
from dsv4.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-4
PROMPT = [(7 * i + 3) % 500 + 2 for i in range(130)]  # three prefill chunks of 48


@pytest.fixture(scope="module")
def reference(tiny_ckpt):
    model = load_reference_model(tiny_ckpt, dtype=torch.float32, index_key_dtype="fp32")

    def logprobs(ids: list[int]) -> torch.Tensor:
        """[len(ids), vocab]: row p is the distribution of the token at p + 1."""
        with torch.no_grad():
            return model(torch.tensor([ids]))[0].float().log_softmax(-1)

    return logprobs


@pytest.fixture
async def client(tiny_ckpt):
    args = ServerArgs(model=str(tiny_ckpt), dtype="float32", index_key_dtype="fp32", chunked_prefill_size=48,
                      max_running_requests=4)
    engine = Engine.from_args(args)
    await engine.start()
    client = TestClient(TestServer(build_app(engine, args)))
    await client.start_server()
    try:
        yield client
    finally:
        await client.close()
        await engine.stop()


async def post(client, path: str, body: dict) -> dict:
    response = await client.post(path, json=body)
    payload = await response.json()
    assert response.status == 200, payload
    return payload


async def post_stream(client, path: str, body: dict) -> list[dict]:
    response = await client.post(path, json={**body, "stream": True})
    assert response.status == 200, await response.text()
    events = []
    for line in (await response.text()).splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            events.append(json.loads(line[len("data: "):]))
    return events


def check(expected: torch.Tensor, position: int, token: int, logprob: float, top: list[tuple[int, float]], k: int):
    """The logprob of `token` at sequence position `position` and its top-k (ids, values, order)."""
    row = expected[position - 1]
    assert abs(logprob - row[token].item()) < TOLERANCE, (position, logprob, row[token].item())
    assert len(top) == k
    values, ids = row.topk(k) if k else (row[:0], row[:0].long())
    for rank, ((top_id, top_value), want_id, want_value) in enumerate(zip(top, ids.tolist(), values.tolist())):
        assert abs(top_value - want_value) < TOLERANCE, (position, rank, top_value, want_value)
        assert top_id == want_id or abs(row[top_id].item() - want_value) < TOLERANCE, (position, rank)
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


async def test_completions_echo_logprobs_equal_reference(client, reference, tiny_ckpt):
    tokenizer = Tokenizer.from_dir(tiny_ckpt)

    def text_of(token: int) -> str:
        return tokenizer.token_bytes(token).decode("utf-8", "replace")

    body = {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "echo": True, "logprobs": 3, "ignore_eos": True}
    whole = await post(client, "/v1/completions", body)
    generated = await post(client, "/generate", {"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 5, "temperature": 0, "ignore_eos": True}})
    ids = PROMPT + generated["output_ids"]
    expected = reference(ids)
    logprobs = whole["choices"][0]["logprobs"]
    assert len(logprobs["tokens"]) == len(ids) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"])
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for p in range(1, len(ids)):
        row = expected[p - 1]
        assert abs(logprobs["token_logprobs"][p] - row[ids[p]].item()) < TOLERANCE, p
        # the three most likely and the chosen token (as vLLM), keyed by text: equal texts share
        # the most likely one's key
        want: dict[str, float] = {}
        values, top_ids = row.topk(3)
        for token, value in zip(top_ids.tolist(), values.tolist(), strict=True):
            want.setdefault(text_of(token), value)
        want.setdefault(text_of(ids[p]), row[ids[p]].item())
        assert logprobs["top_logprobs"][p] == pytest.approx(want, abs=TOLERANCE), p
    assert logprobs["text_offset"] == sorted(logprobs["text_offset"])
    # streamed: the chunks' logprobs concatenate to the same
    events = await post_stream(client, "/v1/completions", body)
    streamed = [v for e in events for c in e["choices"] if c["logprobs"] for v in c["logprobs"]["token_logprobs"]]
    assert streamed == logprobs["token_logprobs"]
    assert "".join(c["text"] for e in events for c in e["choices"]) == whole["choices"][0]["text"]


async def test_prompt_only_echo_and_the_prefix_cache(client, reference):
    """max_tokens 0 with echo returns the prompt and its logprobs alone; asked twice, the second is
    not served from the prefix cache where it needs logits, so both agree with the reference."""
    expected = reference(PROMPT)
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}
    for _ in range(2):
        result = await post(client, "/v1/completions", body)
        logprobs = result["choices"][0]["logprobs"]
        assert result["usage"]["completion_tokens"] == 0
        assert len(logprobs["token_logprobs"]) == len(PROMPT)
        for p in range(1, len(PROMPT)):
            assert abs(logprobs["token_logprobs"][p] - expected[p - 1, PROMPT[p]].item()) < TOLERANCE, p
    plain = await post(client, "/v1/completions", {"prompt": PROMPT, "max_tokens": 2})
    assert plain["choices"][0]["logprobs"] is None


@pytest.mark.parametrize("stream", [False, True])
async def test_generate_logprobs_equal_reference(client, reference, stream):
    start = 50
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 0.7, "seed": 3,
                                                    "ignore_eos": True},
            "return_logprob": True, "top_logprobs_num": 4, "logprob_start_len": start}
    if stream:
        events = await post_stream(client, "/generate", body)
        meta = {key: [x for e in events for x in e["meta_info"][key]] for key in
                ("input_token_logprobs", "input_top_logprobs", "output_token_logprobs", "output_top_logprobs")}
        output_ids = [t for e in events for t in e["output_ids"]]
    else:
        result = await post(client, "/generate", body)
        meta, output_ids = result["meta_info"], result["output_ids"]
    ids = PROMPT + output_ids
    expected = reference(ids)
    assert len(meta["input_token_logprobs"]) == len(PROMPT) - start
    assert len(meta["output_token_logprobs"]) == len(output_ids) == 4
    entries = zip(meta["input_token_logprobs"] + meta["output_token_logprobs"],
                  meta["input_top_logprobs"] + meta["output_top_logprobs"], strict=True)
    for p, ((logprob, token, text), top) in enumerate(entries, start=start):
        assert token == ids[p] and text is None
        # sampled at temperature 0.7: the logprobs are still the raw logits' (before temperature)
        check(expected, p, token, logprob, [(t, v) for v, t, _ in top], 4)


@pytest.mark.parametrize("stream", [False, True])
async def test_chat_logprobs_equal_reference(client, reference, tiny_ckpt, stream):
    messages = [{"role": "user", "content": "Tell me about the red river and the blue moon, please."}]
    body = {"messages": messages, "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 5}
    prompt = (await post(client, "/tokenize", {"messages": messages}))["tokens"]
    if stream:
        events = await post_stream(client, "/v1/chat/completions", body)
        content = [x for e in events for c in e["choices"] if c.get("logprobs") for x in c["logprobs"]["content"]]
    else:
        content = (await post(client, "/v1/chat/completions", body))["choices"][0]["logprobs"]["content"]
    # the same greedy continuation of the same ids, for the token ids the chat shape does not carry
    output = (await post(client, "/generate", {"input_ids": prompt, "sampling_params": {
        "max_new_tokens": 6, "temperature": 0}}))["output_ids"]
    assert len(content) == len(output) > 0
    ids = prompt + output
    expected = reference(ids)
    tokenizer = Tokenizer.from_dir(tiny_ckpt)
    for i, item in enumerate(content):
        p = len(prompt) + i
        assert bytes(item["bytes"]) == tokenizer.token_bytes(ids[p])
        assert abs(item["logprob"] - expected[p - 1, ids[p]].item()) < TOLERANCE, i
        top = [(_id(tokenizer, t), t["logprob"]) for t in item["top_logprobs"]]
        check(expected, p, ids[p], item["logprob"], top, 5)


def _id(tokenizer: Tokenizer, entry: dict) -> int:
    """A top entry's token id, from its bytes (the first id with those bytes)."""
    raw = bytes(entry["bytes"])
    return next(i for i in range(tokenizer.vocab_size) if tokenizer.token_bytes(i) == raw)


async def test_n_choices_have_their_own_logprobs(client, reference):
    body = {"prompt": PROMPT[:40], "max_tokens": 4, "temperature": 1.0, "seed": 11, "n": 2, "logprobs": 2,
            "ignore_eos": True}
    result = await post(client, "/v1/completions", body)
    choices = result["choices"]
    assert len(choices) == 2
    streams = []
    for choice in choices:
        streams.append(choice["logprobs"]["token_logprobs"])
        assert len(choice["logprobs"]["token_logprobs"]) == 4
    assert streams[0] != streams[1]  # different samples, each with its own logprobs
    for index in range(2):  # each choice's logprobs are those of its own tokens, given its own prefix
        generated = await post(client, "/generate", {"input_ids": PROMPT[:40], "sampling_params": {
            "max_new_tokens": 4, "temperature": 1.0, "seed": 11 + index, "ignore_eos": True}})
        ids = PROMPT[:40] + generated["output_ids"]
        expected = reference(ids)
        for j, value in enumerate(streams[index]):
            p = 40 + j
            assert abs(value - expected[p - 1, ids[p]].item()) < TOLERANCE, (index, j)
