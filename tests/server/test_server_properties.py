"""Property tests (hypothesis) at the HTTP edge: whatever body arrives on whatever route —
well-typed or not, extreme numbers, odd unicode, deep nesting, huge strings, bytes that are not
JSON — the answer is a 2xx or a 4xx JSON error, never a 5xx, and the server is ready afterwards.

Two servers: the fake engine in-process (fast, so most examples exercise the whole HTTP layer)
and a real `python -m dsv4 serve` on the tiny checkpoint (the tokenizer, the scheduler and the
sampler behind it). The examples are the same on every run; `pytest --hypothesis-seed N` draws
others.
"""

from __future__ import annotations

import asyncio
import json
import threading
import urllib.error
import urllib.request
from typing import Self

import pytest
from aiohttp import web
from fake_engine import FakeEngine
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from live_server import LiveServer, http_status, live_servers

from dsv4.chat import DSML
from dsv4.config import ServerArgs
from dsv4.server.app import build_app
from dsv4.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(600)

ROUTES = ("/v1/chat/completions", "/v1/completions", "/generate", "/tokenize", "/detokenize")
FAKE_EXAMPLES = 1700
REAL_EXAMPLES = 600
REAL_CONTEXT = 40  # bounds every generation the real engine runs

# -- strategies ------------------------------------------------------------------------------------

EDGE_INTS = [0, 1, -1, 2, 7, 2**31 - 1, 2**31, -(2**31) - 1, 2**63 - 1, 2**63, -(2**63), -(2**63) - 1, 2**64,
             2**64 + 5, 10**30, -(10**30)]
ints = st.one_of(st.integers(-3, 40), st.sampled_from(EDGE_INTS), st.integers())
floats = st.one_of(st.floats(-3, 3), st.sampled_from([0.0, -0.0, 1e-300, 5e-324, 1.0, 2.0, 2.0000001, 1e308, -1e308]),
                   st.floats(allow_nan=False, allow_infinity=False))
ODD_TEXT = ["", "\x00", "\u200b\u202e", "\ufeff", "<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>", "<think>",
            "</think>", "<｜DSML｜tool_calls>", "\n\n<｜DSML｜invoke name=\"f\">", "😀" * 10, "a\udc80b", "\ud800",
            "名" * 50, "\r\n\t", "{\"json\": true}", "x" * 70_000]
texts = st.one_of(st.text(max_size=40), st.sampled_from(ODD_TEXT))
json_values = st.recursive(st.none() | st.booleans() | ints | floats | texts,
                           lambda kids: st.lists(kids, max_size=4) | st.dictionaries(texts, kids, max_size=4),
                           max_leaves=10)
stops = st.one_of(st.none(), texts, st.lists(texts, max_size=18))
token_lists = st.lists(ints, max_size=6)

SAMPLING = {"max_tokens": ints, "temperature": floats, "top_p": floats, "top_k": ints, "seed": ints, "stop": stops,
            "stop_token_ids": token_lists, "ignore_eos": st.booleans(), "n": ints, "stream": st.booleans(),
            "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans()}),
            "presence_penalty": floats, "frequency_penalty": floats, "repetition_penalty": floats, "min_p": floats,
            "logit_bias": st.dictionaries(texts, floats, max_size=2), "user": texts, "model": texts}

function = st.fixed_dictionaries({"name": st.sampled_from(["get_weather", "search", "f"]) | texts},
                                 optional={"description": texts, "parameters": json_values})
tools = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["function", "code"]), "function": function}),
                 max_size=3)
tool_calls = st.lists(st.fixed_dictionaries(
    {"id": texts, "type": st.just("function"),
     "function": st.fixed_dictionaries({"name": texts, "arguments": st.sampled_from(['{"city": "Paris"}', "{}", "[1]",
                                                                                      "not json"]) | texts})}),
    max_size=2)
content = st.one_of(st.none(), texts, st.lists(st.fixed_dictionaries(
    {"type": st.sampled_from(["text", "image_url"])}, optional={"text": texts}), max_size=3))
message = st.fixed_dictionaries(
    {"role": st.sampled_from(["user", "assistant", "system", "tool", "developer", "wizard"])},
    optional={"content": content, "tool_calls": tool_calls, "tool_call_id": st.sampled_from(["c1"]) | texts,
              "reasoning_content": texts, "name": texts})
chat_body = st.fixed_dictionaries(
    {"messages": st.lists(message, max_size=4)},
    optional={**SAMPLING, "max_completion_tokens": ints, "logprobs": st.booleans(), "top_logprobs": ints,
              "tools": tools, "tool_choice": st.sampled_from(["auto", "none", "required", "sometimes"])
              | st.fixed_dictionaries({"type": st.just("function"),
                                       "function": st.fixed_dictionaries({"name": texts})}),
              "response_format": st.fixed_dictionaries(
                  {"type": st.sampled_from(["text", "json_object", "json_schema", "xml"])},
                  optional={"json_schema": st.fixed_dictionaries({}, optional={"schema": json_values})}),
              "reasoning_effort": st.sampled_from(["high", "max", "low", "extreme"]) | texts,
              "chat_template_kwargs": st.dictionaries(st.sampled_from(["thinking", "other"]), json_values,
                                                      max_size=2),
              "parallel_tool_calls": st.booleans()})
completion_body = st.fixed_dictionaries(
    {"prompt": texts | token_lists | st.lists(texts | token_lists, max_size=3)},
    optional={**SAMPLING, "logprobs": ints, "echo": st.booleans(), "suffix": texts, "best_of": ints})
native_sampling = st.fixed_dictionaries({}, optional={
    "max_new_tokens": ints, "temperature": floats, "top_p": floats, "top_k": ints, "seed": ints, "stop": stops,
    "stop_token_ids": token_lists, "ignore_eos": st.booleans()})
generate_body = st.fixed_dictionaries({}, optional={"text": texts, "input_ids": token_lists,
                                                    "sampling_params": native_sampling | json_values,
                                                    "stream": st.booleans()})
tokenize_body = st.fixed_dictionaries({}, optional={"prompt": texts, "messages": st.lists(message, max_size=3),
                                                   "tools": tools, "model": texts})
detokenize_body = st.fixed_dictionaries({}, optional={"tokens": token_lists, "model": texts})
WELL_TYPED = {"/v1/chat/completions": chat_body, "/v1/completions": completion_body, "/generate": generate_body,
              "/tokenize": tokenize_body, "/detokenize": detokenize_body}


@st.composite
def mutated(draw, body_strategy):
    """A well-typed body with one field replaced by, or one field added as, any JSON value."""
    body = draw(body_strategy)
    key = draw(st.sampled_from(sorted(body)) | texts) if body else draw(texts)
    body[key] = draw(json_values)
    return body


def encode(body) -> bytes:
    # allow_nan: NaN and Infinity are not JSON, which is part of what is being sent
    return json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass")


@st.composite
def requests(draw):
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["typed", "typed", "typed", "mutated", "json", "bytes", "deep", "truncated"]))
    if kind == "typed":
        raw = encode(draw(WELL_TYPED[route]))
    elif kind == "mutated":
        raw = encode(draw(mutated(WELL_TYPED[route])))
    elif kind == "json":
        raw = encode(draw(json_values))
    elif kind == "bytes":
        raw = draw(st.binary(max_size=300))
    elif kind == "deep":
        depth = draw(st.integers(50, 20_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        field = draw(st.sampled_from(["messages", "prompt", "sampling_params", "tools", "extra"]))
        raw = f'{{"{field}": {opener * depth}1{closer * depth}}}'.encode()
    else:
        whole = encode(draw(WELL_TYPED[route]))
        raw = whole[: draw(st.integers(0, max(len(whole) - 1, 0)))]
    return route, raw


# -- servers and checks ----------------------------------------------------------------------------


class InProcessServer:
    """The fake-engine app served on 127.0.0.1 by its own event loop in a thread, as run_server
    serves it; the test talks to it over real sockets, like any client."""

    def __init__(self, engine: FakeEngine, args: ServerArgs):
        self._app = build_app(engine, args)
        self._args = args
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self.base = ""

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._runner = web.AppRunner(self._app, access_log=None, shutdown_timeout=1.0,
                                     keepalive_timeout=self._args.timeout_keep_alive)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        self._loop.run_until_complete(site.start())
        self.base = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> Self:
        self._thread.start()
        assert self._ready.wait(10), "in-process server did not start"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def post(base: str, route: str, raw: bytes) -> tuple[int, str, bytes]:
    request = urllib.request.Request(base + route, data=raw, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers.get_content_type(), response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers.get_content_type(), e.read()


def check_answer(status: int, content_type: str, body: bytes, raw: bytes) -> None:
    sent = raw[:300]
    assert status < 500, (status, body[:500], sent)
    if status != 200 or content_type != "text/event-stream":
        assert content_type == "application/json", (status, content_type, body[:300], sent)
        decoded = json.loads(body)
        if status >= 400:
            assert set(decoded["error"]) == {"message", "type", "param", "code"}, decoded
        return
    assert body.endswith(b"data: [DONE]\n\n"), (body[-300:], sent)
    for event in body.split(b"\n\n")[:-2]:
        payload = json.loads(event.removeprefix(b"data: "))
        assert "error" not in payload or payload["error"]["type"] != "server_error", (payload, sent)


# -- the properties --------------------------------------------------------------------------------


def well_formed_reply(prompt: str, tool_names: list[str]) -> str:
    """What a well-behaved model writes after the rendered `prompt`: reasoning closed in thinking
    mode, a forced tool call completed. The properties are about requests: a model that writes
    malformed DSML makes the reply a 500 invalid_model_output, which is the model's failure."""
    if prompt.endswith("<think>"):
        return "Thinking done.</think>Hello"
    if prompt.endswith(f"<{DSML}invoke"):  # tool_choice "required": the model picks the tool
        return f' name="{tool_names[0]}">\n</{DSML}invoke>\n</{DSML}tool_calls>'
    if prompt.endswith('">\n') and f"<{DSML}invoke name=" in prompt[-200:]:  # a named tool_choice
        return f"</{DSML}invoke>\n</{DSML}tool_calls>"
    return "Hello"


@pytest.fixture(scope="module")
def fake_server():
    engine = FakeEngine(token_delay=0.0)
    args = ServerArgs(served_model_name="fake-model", max_request_bytes=256 * 1024)
    with InProcessServer(engine, args) as server:
        yield server, engine


def test_http_bodies_never_get_a_5xx_fake_engine(fake_server):
    server, engine = fake_server
    sent: dict = {}  # the body being answered: requests are sent one at a time
    engine.reply_for = lambda request: well_formed_reply(
        engine.tokenizer.decode(request.input_ids), sent.get("tools", []))

    @settings(max_examples=FAKE_EXAMPLES, suppress_health_check=list(HealthCheck))
    @given(requests())
    def answer_is_never_5xx(request):
        route, raw = request
        sent.clear()
        sent["tools"] = tool_names(raw)
        check_answer(*post(server.base, route, raw), raw)

    answer_is_never_5xx()
    assert http_status(server.base + "/health/ready") == 200
    assert not engine.live


@pytest.fixture(scope="module")
def real_server(tiny_ckpt, tmp_path_factory):
    log = tmp_path_factory.mktemp("properties") / "server.log"
    server = LiveServer(tiny_ckpt, log, "--context-length", str(REAL_CONTEXT), "--max-total-tokens", "4096",
                        "--max-request-bytes", str(256 * 1024))
    with live_servers(server):
        yield server


def tool_names(raw: bytes) -> list[str]:
    try:
        body = json.loads(raw)
        return [tool["function"]["name"] for tool in body["tools"]]
    except (ValueError, RecursionError, TypeError, KeyError):
        return []


def test_http_bodies_never_get_a_5xx_real_engine(real_server, tiny_ckpt):
    # The random tiny model writes DSML markup and think markers at random, which the chat parser
    # rightly rejects as an invalid reply (a 500 that is the model's, not the request's): chat
    # bodies are served in chat mode without tools, and stop at DSML.
    dsml = Tokenizer.from_dir(tiny_ckpt).dsml_id

    @settings(max_examples=REAL_EXAMPLES, suppress_health_check=list(HealthCheck))
    @given(requests())
    def answer_is_never_5xx(request):
        route, raw = request
        if route == "/v1/chat/completions":
            try:
                body = json.loads(raw)
                if isinstance(body, dict):
                    for field in ("tools", "tool_choice", "reasoning_effort", "response_format"):
                        body.pop(field, None)
                    raw = encode({**body, "stop_token_ids": [dsml], "chat_template_kwargs": {"thinking": False}})
            except (ValueError, RecursionError):
                pass  # not JSON this test can rewrite: sent as drawn
        check_answer(*post(real_server.base, route, raw), raw)

    answer_is_never_5xx()
    assert http_status(real_server.base + "/health/ready") == 200
