"""DeepSeek-V4 prompt encoding: byte-exact against the official encoder's fixtures."""

import copy
import json
from pathlib import Path

import pytest

from dsv4 import chat
from dsv4.chat import encode_messages

DATA = Path(__file__).resolve().parent.parent / "data" / "dsv4_encoding"
ENCODE_CASES = [json.loads(line) for line in (DATA / "encode_cases.jsonl").read_text("utf-8").splitlines() if line]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def encode_case(case, **overrides):
    kwargs = copy.deepcopy(case.get("kwargs", {}))
    thinking = kwargs.pop("thinking_mode", "chat") == "thinking"
    kwargs.update(overrides)
    return encode_messages(copy.deepcopy(case["messages"]), tools=copy.deepcopy(case.get("tools")),
                           thinking=thinking, **kwargs)


@pytest.mark.parametrize("case", ENCODE_CASES, ids=[c["name"] for c in ENCODE_CASES])
def test_fixture_case_is_byte_exact(case):
    assert encode_case(case) == case["expected"]


def test_package_constants_are_the_fixture_constants():
    packaged = json.loads((Path(chat.__file__).with_name("chat_constants.json")).read_text("utf-8"))
    assert packaged == json.loads((DATA / "encoding_constants.json").read_text("utf-8"))
    assert packaged["_license"].startswith("MIT")


def test_tools_section_matches_the_pre_rendered_template():
    constants = json.loads((DATA / "encoding_constants.json").read_text("utf-8"))
    prompt = encode_messages([{"role": "user", "content": "hi"}], tools=[WEATHER])
    schema = json.dumps(WEATHER["function"], ensure_ascii=False)
    assert constants["tools_template_with_tokens"].format(tool_schemas=schema) in prompt


def test_inputs_are_not_mutated():
    for case in ENCODE_CASES:
        original = copy.deepcopy(case)
        kwargs = dict(case.get("kwargs", {}))
        thinking = kwargs.pop("thinking_mode", "chat") == "thinking"
        encode_messages(case["messages"], tools=case.get("tools"), thinking=thinking, **kwargs)
        assert case == original


def test_top_level_tools_equal_message_level_tools():
    user = {"role": "user", "content": "Weather in Oslo?"}
    system = {"role": "system", "content": "Be brief."}
    assert encode_messages([system, user], tools=[WEATHER]) == encode_messages([{**system, "tools": [WEATHER]}, user])
    inserted = encode_messages([{"role": "system", "content": "", "tools": [WEATHER]}, user], thinking=True)
    assert encode_messages([user], tools=[WEATHER], thinking=True) == inserted


def test_no_tools_renders_no_tool_section():
    # tool_choice="none": the server passes tools=None (or []), so nothing is rendered.
    messages = [{"role": "user", "content": "hi"}]
    assert encode_messages(messages, tools=None) == encode_messages(messages, tools=[]) == (
        chat.BOS + "<｜User｜>hi<｜Assistant｜>" + chat.THINK_END
    )


def test_tools_keep_reasoning_of_earlier_turns():
    messages = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b", "reasoning_content": "why"},
        {"role": "user", "content": "c"},
    ]
    assert "<think>why</think>b" not in encode_messages(messages, thinking=True)
    assert "<think>why</think>b" in encode_messages(messages, tools=[WEATHER], thinking=True)
    assert "<think>why</think>b" in encode_messages(messages, thinking=True, drop_thinking=False)


def test_context_renders_only_the_new_suffix():
    case = next(c for c in ENCODE_CASES if c["name"] == "chat_multiturn_reasoning_ignored")
    messages = case["messages"]
    full = encode_messages(messages)
    head = encode_messages(messages[:3])
    assert full == head + encode_messages(messages[3:], context=messages[:3])


def test_content_parts_are_flattened():
    parts = [{"type": "text", "text": "describe"}, {"type": "image_url", "image_url": {"url": "x"}},
             {"type": "text", "text": "this"}]
    prompt = encode_messages([{"role": "user", "content": parts}])
    assert "<｜User｜>describe [Unsupported image_url] this<｜Assistant｜>" in prompt


def test_arguments_forms():
    def render(arguments):
        call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}
        return encode_messages([{"role": "user", "content": "x"},
                                {"role": "assistant", "content": "", "tool_calls": [call]}])

    assert render({"a": 1, "b": "s"}) == render('{"a": 1, "b": "s"}')
    # JSON that is not an object is kept as text, like non-JSON (the official encoder crashes).
    assert '<｜DSML｜parameter name="arguments" string="true">[1, 2]</｜DSML｜parameter>' in render("[1, 2]")
    assert '<｜DSML｜parameter name="arguments" string="true">oops</｜DSML｜parameter>' in render("oops")


def test_none_contents_render_empty():
    prompt = encode_messages([
        {"role": "user", "content": None},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "t", "content": None},
    ])
    assert prompt.endswith("<｜User｜><tool_result></tool_result><｜Assistant｜></think>")
    assert "None" not in prompt


@pytest.mark.parametrize("messages, kwargs", [
    ([{"role": "user", "content": "x"}], {"reasoning_effort": "medium"}),
    ([{"role": "robot", "content": "x"}], {}),
    ([{"role": "user", "content": "x", "task": "nope"}], {}),
    ([{"role": "developer", "content": ""}], {}),
])
def test_invalid_input_raises_value_error(messages, kwargs):
    with pytest.raises(ValueError):
        encode_messages(messages, **kwargs)
