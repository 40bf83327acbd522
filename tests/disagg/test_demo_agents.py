"""The production scenario on the built-in demo model: 64 concurrent multi-turn agent sessions (tools
offered, tool results fed back) against a prefill/decode pair with bf16 index keys and the prefix cache
with its host tier on, 30% of requests aborted mid-stream and retried. Every completed tool call must parse with valid
JSON arguments, and every session's transcript must equal the same session served alone (greedy, on a
colocated server, one request at a time). The servers get no --model: they serve the built-in, as
`make serve` does. Servers run in float32 so that greedy choices do not depend
on batching."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import pytest
from pd_processes import Server, free_port

from dsv4.engine.launch import BUILTIN_MODEL_NAME

pytestmark = pytest.mark.timeout(420)

SESSIONS = 64
ABORT_SHARE = 0.3
MAX_TOKENS = 40
MAX_REQUESTS_PER_SESSION = 4
COMMON = ("--dtype", "float32", "--index-key-dtype", "bf16",
          "--max-running-requests", "64", "--chunked-prefill-size", "1024", "--max-total-tokens", "65536",
          "--request-timeout", "120", "--enable-hierarchical-cache")
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Get the current weather for a city.",
                                      "parameters": {"type": "object", "properties": {
                                          "city": {"type": "string", "description": "The city name"}},
                                          "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "Get the current local time in a timezone.",
                                      "parameters": {"type": "object", "properties": {
                                          "timezone": {"type": "string", "description": "An IANA timezone"}},
                                          "required": ["timezone"]}}},
]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Cairo", "Denver", "Seoul", "Kyiv"]
TIMEZONES = ["Europe/Paris", "Asia/Tokyo", "America/Denver", "UTC"]


def session_turns(index: int) -> list[str]:
    rng = random.Random(index)
    first = f"What is the weather in {rng.choice(CITIES)}?"
    second = rng.choice([f"And in {rng.choice(CITIES)}?", f"What time is it in {rng.choice(TIMEZONES)}?",
                         "Thank you!"])
    return [first, second]


def tool_result(name: str, arguments: dict) -> str:
    """A deterministic fake tool: the same call always gets the same result."""
    if name == "get_weather":
        city = str(arguments.get("city", ""))
        return json.dumps({"city": city, "temp_c": len(city) * 3 % 35, "sky": "cloudy"})
    return json.dumps({"timezone": str(arguments.get("timezone", "")), "time": "12:34"})


class Stream:
    """One streamed chat completion, assembled from its SSE chunks."""

    def __init__(self):
        self.reasoning, self.content, self.calls, self.finish = "", "", {}, None

    def add(self, chunk: dict) -> None:
        for choice in chunk.get("choices", []):
            delta = choice.get("delta", {})
            self.reasoning += delta.get("reasoning_content") or ""
            self.content += delta.get("content") or ""
            for call in delta.get("tool_calls") or []:
                entry = self.calls.setdefault(call["index"], {"name": "", "arguments": ""})
                function = call.get("function") or {}
                entry["name"] += function.get("name") or ""
                entry["arguments"] += function.get("arguments") or ""
            self.finish = choice.get("finish_reason") or self.finish


async def stream_chat(http: aiohttp.ClientSession, url: str, messages: list[dict],
                      abort_after: int | None) -> Stream | None:
    """Streams one request; with `abort_after`, drops the connection after that many chunks and returns
    None (a reply shorter than that completes and is returned)."""
    body = {"model": BUILTIN_MODEL_NAME, "messages": messages, "tools": TOOLS, "temperature": 0, "max_tokens": MAX_TOKENS,
            "stream": True}
    result = Stream()
    async with http.post(f"{url}/v1/chat/completions", json=body, timeout=aiohttp.ClientTimeout(total=180)) as r:
        assert r.status == 200, await r.text()
        chunks = 0
        async for line in r.content:
            text = line.decode().strip()
            if not text.startswith("data: ") or text == "data: [DONE]":
                continue
            result.add(json.loads(text[len("data: "):]))
            chunks += 1
            if abort_after is not None and chunks >= abort_after:
                r.close()  # the client goes away mid-stream, as an impatient agent does
                return None
    return result


async def run_session(http, url: str, index: int, abort_rng: random.Random | None) -> tuple[list, int]:
    """The agent loop: ask, run the tools the model calls, feed results back, next turn. Returns the
    transcript (assistant turns as reasoning, content, calls, finish) and how many requests were aborted."""
    turns, messages, transcript, aborted = session_turns(index), [], [], 0
    for _ in range(MAX_REQUESTS_PER_SESSION):
        if not messages or messages[-1]["role"] == "assistant":
            if not turns:
                break
            messages.append({"role": "user", "content": turns.pop(0)})
        if abort_rng is not None and abort_rng.random() < ABORT_SHARE:
            aborted += await stream_chat(http, url, messages, abort_after=abort_rng.randint(1, 2)) is None
        reply = await stream_chat(http, url, messages, abort_after=None)
        calls = [reply.calls[i] for i in sorted(reply.calls)]
        # A call cut off by max_tokens streamed part of its arguments and is not a call; every call of a
        # reply that finished with "tool_calls" was parsed whole by the server: its arguments must be JSON.
        completed = calls if reply.finish == "tool_calls" else []
        for call in completed:
            assert isinstance(json.loads(call["arguments"]), dict), call
        transcript.append((reply.reasoning, reply.content, calls, reply.finish))
        assistant = {"role": "assistant", "content": reply.content}
        if completed:
            assistant["tool_calls"] = [{"id": f"call_{i}", "type": "function",
                                        "function": {"name": c["name"], "arguments": c["arguments"]}}
                                       for i, c in enumerate(completed)]
        messages.append(assistant)
        for i, call in enumerate(completed):
            messages.append({"role": "tool", "tool_call_id": f"call_{i}",
                             "content": tool_result(call["name"], json.loads(call["arguments"]))})
    return transcript, aborted


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    logs = tmp_path_factory.mktemp("demo-agents")
    bootstrap = free_port()
    prefill = Server("prefill", logs, *COMMON, "--disaggregation-mode", "prefill",
                     "--disaggregation-bootstrap-port", str(bootstrap))
    decode = Server("decode", logs, *COMMON, "--disaggregation-mode", "decode", "--prefill-addr",
                    f"127.0.0.1:{bootstrap}")
    alone = Server("alone", logs, *COMMON)
    every = (prefill, decode, alone)
    try:
        for server in every:
            server.start()

        async def ready():
            await asyncio.gather(*(server.wait_ready() for server in every))

        asyncio.run(ready())
        yield decode, alone
    finally:
        for server in every:
            server.stop()


async def test_64_agent_sessions_under_pd_and_aborts_equal_each_session_alone(servers):
    decode, alone = servers
    async with aiohttp.ClientSession() as http:
        together = await asyncio.gather(*(run_session(http, decode.url, i, random.Random(1000 + i))
                                          for i in range(SESSIONS)))
        by_itself = [(await run_session(http, alone.url, i, None))[0] for i in range(SESSIONS)]
    assert sum(aborted for _, aborted in together) >= SESSIONS * 0.2, "the scenario was meant to abort requests"
    calls = sum(len(turn[2]) for transcript, _ in together for turn in transcript if turn[3] == "tool_calls")
    differ = [i for i, ((got, _), want) in enumerate(zip(together, by_itself, strict=True)) if got != want]
    assert not differ, (f"{len(differ)} of {SESSIONS} sessions differ from the session served alone, e.g. "
                        f"{together[differ[0]][0]} vs {by_itself[differ[0]]}")
    assert calls > 0, "no session made a tool call: the scenario did not exercise the tool path"
