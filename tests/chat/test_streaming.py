"""Streaming parser: same result for every chunking, equal to parse_completion, clean deltas."""

import json
import random
import zlib
from pathlib import Path

import pytest

from dsv4.chat import BOS, DSML, EOS, THINK_END, THINK_START, ChatParseError, StreamingChatParser, parse_completion

DATA = Path(__file__).resolve().parent.parent / "data" / "dsv4_encoding"
PARSE_CASES = [json.loads(line) for line in (DATA / "parse_cases.jsonl").read_text("utf-8").splitlines() if line]
SPECIAL = (BOS, EOS, THINK_START, THINK_END, DSML)

BLOCK = f"\n\n<{DSML}tool_calls>\n"
END_BLOCK = f"</{DSML}tool_calls>"


def param(key, value, string=True):
    return f'<{DSML}parameter name="{key}" string="{"true" if string else "false"}">{value}</{DSML}parameter>'


def invoke(name, *params):
    return f'<{DSML}invoke name="{name}">\n' + "\n".join(params) + f"\n</{DSML}invoke>\n"


def collect(deltas):
    """Rebuild the message from OpenAI deltas, checking their shape on the way."""
    out = {"reasoning_content": "", "content": "", "tool_calls": []}
    for delta in deltas:
        ((kind, value),) = delta.items()
        if kind in ("reasoning_content", "content"):
            assert isinstance(value, str) and value
            out[kind] += value
            continue
        assert kind == "tool_calls"
        (call,) = value
        if "id" in call:  # a call's first delta: index, id, type, name, empty arguments
            assert call["index"] == len(out["tool_calls"]) and call["type"] == "function"
            assert call["id"].startswith("call_") and call["function"]["arguments"] == ""
            out["tool_calls"].append({"id": call["id"], "name": call["function"]["name"], "arguments_json": ""})
        else:  # then argument fragments of that call only
            assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            assert call["index"] == len(out["tool_calls"]) - 1
            out["tool_calls"][-1]["arguments_json"] += call["function"]["arguments"]
    for text in (out["reasoning_content"], out["content"]):
        assert not any(token in text for token in SPECIAL), text
    return out


def stream(chunks, thinking=False, tools=None, finish_reason="stop"):
    parser = StreamingChatParser(thinking=thinking, tools=tools)
    deltas = [delta for chunk in chunks for delta in parser.feed(chunk)]
    tail, info = parser.finish(finish_reason)
    streamed = collect(deltas + tail)
    # What was streamed is what finish reports, plus at most the call cut short.
    complete = streamed["tool_calls"][:len(info["tool_calls"])]
    assert complete == [{k: c[k] for k in ("id", "name", "arguments_json")} for c in info["tool_calls"]]
    assert len(streamed["tool_calls"]) - len(complete) == int(info["incomplete_tool_call"])
    for call in info["tool_calls"]:
        assert json.loads(call["arguments_json"]) == call["arguments"]
        assert isinstance(call["arguments"], dict)
    assert (streamed["reasoning_content"], streamed["content"]) == (info["reasoning_content"], info["content"])
    return without_ids(streamed), without_ids(info)


def without_ids(result):
    return {**result, "tool_calls": [{k: v for k, v in c.items() if k != "id"} for c in result["tool_calls"]]}


def chunkings(text):
    yield [text]
    for cut in range(len(text) + 1):
        yield [text[:cut], text[cut:]]
    for size in range(1, 8):
        yield [text[i:i + size] for i in range(0, len(text), size)]
    rng = random.Random(zlib.crc32(text.encode()))
    for _ in range(20):
        cuts = sorted(rng.choices(range(len(text) + 1), k=rng.randint(1, 12)))
        yield [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def stream_every_way(text, thinking=False, tools=None, finish_reason="stop"):
    """Stream ``text`` under every chunking; all must agree.  Returns (streamed, info)."""
    reference = stream([text], thinking, tools, finish_reason)
    for chunks in chunkings(text):
        assert stream(chunks, thinking, tools, finish_reason) == reference, chunks
    return reference


def assert_agrees_with_parse_completion(text, thinking, tools, streamed, info):
    parsed = parse_completion(text, thinking=thinking, tools=tools)
    calls = [{"name": c["name"], "arguments_json": c["arguments_json"]} for c in parsed["tool_calls"]]
    assert streamed == {**parsed, "tool_calls": calls}
    assert {k: info[k] for k in parsed} == parsed
    assert not info["parse_error"] and not info["incomplete_tool_call"]


# Rejected fixtures that are only truncations: "length" is not an error for them, and with
# "stop" the chat one is complete once the (stripped) EOS is assumed.
TRUNCATED = {"err_chat_truncated_no_eos", "err_truncated_after_invoke_close"}


@pytest.mark.parametrize("finish_reason", ["stop", "length"])
@pytest.mark.parametrize("case", PARSE_CASES, ids=[c["name"] for c in PARSE_CASES])
def test_fixture_streams_the_same_for_every_chunking(case, finish_reason):
    streamed, info = stream_every_way(case["text"], case["thinking"], finish_reason=finish_reason)
    if not case.get("error"):
        assert_agrees_with_parse_completion(case["text"], case["thinking"], None, streamed, info)
        expected_reason = "tool_calls" if streamed["tool_calls"] else "stop"
        assert info["finish_reason"] == (finish_reason if finish_reason == "length" else expected_reason)
    elif finish_reason == "length" and case["name"] in TRUNCATED:
        assert info["finish_reason"] == "length" and not info["parse_error"]
    elif finish_reason == "stop" and case["name"] == "err_chat_truncated_no_eos":
        assert info["finish_reason"] == "stop" and info["content"] == case["text"]
    else:
        assert info["finish_reason"] == "error" and info["parse_error"] and info["error"]


WEATHER_OSLO = invoke("get_weather", param("city", "Oslo"))
ADVERSARIAL = [
    # (id, thinking, text, tools, finish_reason, expected: (reasoning, content, [(name, args)]) or "error")
    ("markup_in_string_params", False,
     BLOCK + invoke("run", param("cmd", f"ls 2>&1 | grep '<{DSML}invoke name=\"x\">' {THINK_END}{THINK_START}"),
                    param("note", f"{EOS}{BOS}</{DSML}invoke></{DSML}tool_calls> a<b <tool_result>")) + END_BLOCK + EOS,
     None, "stop",
     ("", "", [("run", {"cmd": f"ls 2>&1 | grep '<{DSML}invoke name=\"x\">' {THINK_END}{THINK_START}",
                        "note": f"{EOS}{BOS}</{DSML}invoke></{DSML}tool_calls> a<b <tool_result>"})])),
    ("unicode_cjk_emoji", True,
     "推理 🤔 𝔘𝔫𝔦</think>答案：😀 é" + BLOCK
     + invoke("translate", param("文本", "早上好 ☀️\n"), param("hints", '["礼貌", "😀"]', string=False)) + END_BLOCK + EOS,
     ["translate"], "stop",
     ("推理 🤔 𝔘𝔫𝔦", "答案：😀 é", [("translate", {"文本": "早上好 ☀️\n", "hints": ["礼貌", "😀"]})])),
    ("nested_json", False,
     BLOCK + invoke("f", param("o", '{"a": {"b": [1, {"c": null}], "d": "x\\"y<"}, "e": []}', string=False),
                    param("n", "1e-7", string=False), param("big", "12345678901234567890", string=False)) + END_BLOCK,
     None, "stop",
     ("", "", [("f", {"o": {"a": {"b": [1, {"c": None}], "d": 'x"y<'}, "e": []}, "n": 1e-7,
                      "big": 12345678901234567890})])),
    ("zero_argument_and_parallel_calls", True,
     "Three.</think>" + BLOCK + f'<{DSML}invoke name="get_time">\n\n</{DSML}invoke>\n' + WEATHER_OSLO
     + invoke("get_weather", param("city", "Lima"), param("unit", "fahrenheit")) + END_BLOCK + EOS,
     ["get_time", "get_weather"], "stop",
     ("Three.", "", [("get_time", {}), ("get_weather", {"city": "Oslo"}),
                     ("get_weather", {"city": "Lima", "unit": "fahrenheit"})])),
    ("trailing_lt_before_eos", False, "a < b <" + EOS, None, "stop", ("", "a < b <", [])),
    ("lookalikes_in_reasoning", True, f"a < b </thin k> <thinking> <|DSML|> <｜DS\n\n<｜{THINK_END}ok\n{EOS}",
     None, "stop", ("a < b </thin k> <thinking> <|DSML|> <｜DS\n\n<｜", "ok\n", [])),
    ("value_ends_with_lt_newline", False,
     BLOCK + invoke("f", f'<{DSML}parameter name="a" string="true">x<\n/{DSML}parameter>') + END_BLOCK + EOS,
     None, "stop", ("", "", [("f", {"a": "x"})])),
    ("partial_eos_at_end_stop", False, "Hello <｜end▁of", None, "stop", ("", "Hello <｜end▁of", [])),
    ("partial_eos_at_end_length", False, "Hello <｜end▁of", None, "length", ("", "Hello ", [])),
    ("partial_block_start_length", False, f"Let me check.\n\n<{DSML}tool_ca", None, "length",
     ("", "Let me check.", [])),
    ("partial_block_start_stop", False, f"Let me check.\n\n<{DSML}tool_ca", None, "stop", "error"),
    ("trailing_lt_at_end_length", True, "r</think>x <", None, "length", ("r", "x ", [])),
    ("name_line_at_end_is_a_call", False, BLOCK + f'<{DSML}invoke name="f">\n', None, "stop", ("", "", [("f", {})])),
    ("empty_chat", False, "", None, "stop", ("", "", [])),
    ("empty_thinking", True, "", None, "stop", "error"),
    ("dsml_before_think_close", True, "Plan." + BLOCK + WEATHER_OSLO + END_BLOCK + EOS, None, "stop", "error"),
    ("unknown_tool", False, BLOCK + WEATHER_OSLO + invoke("rm", param("p", "/")) + END_BLOCK + EOS,
     ["get_weather"], "stop", "error"),
    ("invalid_json_value", False, BLOCK + invoke("f", param("n", "NaN", string=False)) + END_BLOCK + EOS,
     None, "stop", "error"),
    ("text_after_block", False, BLOCK + WEATHER_OSLO + END_BLOCK + "Done." + EOS, None, "stop", "error"),
]


@pytest.mark.parametrize("name, thinking, text, tools, finish_reason, expected", ADVERSARIAL,
                         ids=[case[0] for case in ADVERSARIAL])
def test_adversarial_output(name, thinking, text, tools, finish_reason, expected):
    streamed, info = stream_every_way(text, thinking, tools, finish_reason)
    if expected == "error":
        assert info["finish_reason"] == "error" and info["parse_error"]
        with pytest.raises(ChatParseError):
            parse_completion(text, thinking=thinking, tools=tools)
        return
    reasoning, content, calls = expected
    assert (info["reasoning_content"], info["content"]) == (reasoning, content)
    assert [(c["name"], c["arguments"]) for c in info["tool_calls"]] == calls
    assert not info["parse_error"]
    if finish_reason == "length":
        assert info["finish_reason"] == "length"
    else:
        assert info["finish_reason"] == ("tool_calls" if calls else "stop")
        if text.endswith((EOS, END_BLOCK)) or calls:
            assert_agrees_with_parse_completion(text, thinking, tools, streamed, info)


def test_complete_calls_survive_an_error():
    text = BLOCK + WEATHER_OSLO + invoke("rm", param("p", "/")) + END_BLOCK + EOS
    streamed, info = stream_every_way(text, tools=["get_weather"])
    assert [c["name"] for c in info["tool_calls"]] == ["get_weather"]
    assert [c["name"] for c in streamed["tool_calls"]] == ["get_weather"]  # no header for the unknown one
    assert "unknown tool 'rm'" in info["error"]


def test_truncation_inside_a_call():
    text = BLOCK + WEATHER_OSLO + invoke("write_file", param("text", "partial text"))[:-40]
    streamed, info = stream_every_way(text, finish_reason="length")
    assert (info["finish_reason"], info["parse_error"], info["incomplete_tool_call"]) == ("length", False, True)
    assert [c["name"] for c in info["tool_calls"]] == ["get_weather"]
    assert [c["name"] for c in streamed["tool_calls"]] == ["get_weather", "write_file"]
    _, stopped = stream_every_way(text, finish_reason="stop")
    assert stopped["finish_reason"] == "error" and [c["name"] for c in stopped["tool_calls"]] == ["get_weather"]


def test_string_arguments_stream_before_the_value_closes():
    parser = StreamingChatParser(tools=["write"])
    opening = BLOCK + f'<{DSML}invoke name="write">\n<{DSML}parameter name="text" string="true">'
    deltas = parser.feed(opening) + parser.feed('line "one"\nline two')
    fragments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if "tool_calls" in d)
    assert fragments == '{"text": "line \\"one\\"\\nline two'
    tail, info = parser.finish("length")
    assert tail == [] and info["incomplete_tool_call"]


def test_parsers_share_no_state():
    texts = [case["text"] for case in PARSE_CASES if not case.get("error") and not case["thinking"]]
    alone = [stream([text]) for text in texts]
    parsers = [StreamingChatParser() for _ in texts]
    deltas = [[] for _ in texts]
    for position in range(max(map(len, texts)) + 1):
        for parser, text, sink in zip(parsers, texts, deltas):
            sink += parser.feed(text[position:position + 1])
    for parser, sink, (expected, expected_info) in zip(parsers, deltas, alone):
        tail, info = parser.finish("stop")
        assert without_ids(collect(sink + tail)) == expected and without_ids(info) == expected_info


def test_finish_ends_the_stream():
    parser = StreamingChatParser()
    parser.finish("stop")
    with pytest.raises(RuntimeError):
        parser.feed("more")
    with pytest.raises(RuntimeError):
        parser.finish("stop")
