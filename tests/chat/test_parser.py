"""Whole-completion parsing: agrees with the official parser, and the rejection policy."""

import json
from pathlib import Path

import pytest

from dsv4.chat import BOS, DSML, EOS, THINK_END, THINK_START, ChatParseError, parse_completion

DATA = Path(__file__).resolve().parent.parent / "data" / "dsv4_encoding"
PARSE_CASES = [json.loads(line) for line in (DATA / "parse_cases.jsonl").read_text("utf-8").splitlines() if line]
ERROR_CASES = {c["name"]: c for c in PARSE_CASES if c.get("error")}

BLOCK = f"\n\n<{DSML}tool_calls>\n"
END_BLOCK = f"</{DSML}tool_calls>"


def invoke(name, *params):
    body = "\n".join(f'<{DSML}parameter name="{k}" string="{s}">{v}</{DSML}parameter>' for k, s, v in params)
    return f'<{DSML}invoke name="{name}">\n{body}\n</{DSML}invoke>\n'


def assert_clean(result):
    for text in (result["reasoning_content"], result["content"]):
        for token in (BOS, EOS, THINK_START, THINK_END, DSML):
            assert token not in (text or "")


@pytest.mark.parametrize("case", PARSE_CASES, ids=[c["name"] for c in PARSE_CASES])
def test_fixture_case(case):
    if case.get("error"):
        with pytest.raises(ChatParseError) as caught:
            parse_completion(case["text"], thinking=case["thinking"])
        assert_clean(caught.value.partial)
        return
    got = parse_completion(case["text"], thinking=case["thinking"])
    expected = case["expected"]
    assert (got["reasoning_content"] or "") == expected["reasoning_content"]
    assert (got["content"] or "") == expected["content"]
    assert got["tool_calls"] == expected["tool_calls"]
    for call in got["tool_calls"]:
        assert json.loads(call["arguments_json"]) == call["arguments"]


@pytest.mark.parametrize("name, partial", [
    # A call that was complete survives the rejection of what follows it.
    ("err_text_after_tool_calls_block", {"content": "", "calls": ["get_time"]}),
    ("err_truncated_after_invoke_close", {"content": "", "calls": ["get_time"]}),
    # DSML before </think>: rejected, the reasoning before it kept, nothing parsed as a call.
    ("err_think_dsml_before_think_close", {"reasoning": "I should call the tool now.", "calls": []}),
    ("err_single_newline_before_block", {"reasoning": "r", "content": "Sure.\n", "calls": []}),
    ("err_parameter_closer_inside_string_value", {"calls": []}),
    ("err_eos_inside_reasoning", {"reasoning": "thinking", "content": "", "calls": []}),
    ("err_text_after_eos", {"content": "Answer.", "calls": []}),
    ("err_chat_truncated_no_eos", {"content": "The answer is probably", "calls": []}),
])
def test_rejection_keeps_clean_partial_result(name, partial):
    case = ERROR_CASES[name]
    with pytest.raises(ChatParseError) as caught:
        parse_completion(case["text"], thinking=case["thinking"])
    got = caught.value.partial
    assert_clean(got)
    assert [call["name"] for call in got["tool_calls"]] == partial["calls"]
    assert got["reasoning_content"] == partial.get("reasoning", "")
    if "content" in partial:
        assert got["content"] == partial["content"]


@pytest.mark.parametrize("tools", [["get_time"], [{"type": "function", "function": {"name": "get_time"}}]])
def test_unknown_tool_name_is_rejected_when_tools_are_given(tools):
    text = BLOCK + invoke("get_time") + invoke("rm_rf", ("path", "true", "/")) + END_BLOCK + EOS
    assert [c["name"] for c in parse_completion(text)["tool_calls"]] == ["get_time", "rm_rf"]
    with pytest.raises(ChatParseError, match="unknown tool 'rm_rf'") as caught:
        parse_completion(text, tools=tools)
    assert [c["name"] for c in caught.value.partial["tool_calls"]] == ["get_time"]
    assert parse_completion(BLOCK + invoke("get_time") + END_BLOCK + EOS, tools=tools)["tool_calls"]


@pytest.mark.parametrize("raw", ["NaN", "-Infinity", "{'a': 1}", "[1,", "", "1 2"])
def test_non_json_value_is_rejected(raw):
    # The official parser pastes the raw text into its arguments string, which is then not JSON.
    with pytest.raises(ChatParseError, match="not JSON"):
        parse_completion(BLOCK + invoke("f", ("a", "false", raw)) + END_BLOCK + EOS)


@pytest.mark.parametrize("tail, arguments", [
    ("", {}),                                                              # just after the name line
    ("\n", {}),                                                            # the zero-argument form
    (f'<{DSML}parameter name="a" string="true">v</{DSML}parameter>\n', {"a": "v"}),
    (f'<{DSML}parameter name="a" string="true">v</{DSML}parameter>\n</{DSML}invoke', {"a": "v"}),
])
def test_official_quirk_truncated_calls_that_are_accepted(tail, arguments):
    text = f'{BLOCK}<{DSML}invoke name="f">\n{tail}'
    assert parse_completion(text)["tool_calls"] == [
        {"name": "f", "arguments": arguments, "arguments_json": json.dumps(arguments)}
    ]


@pytest.mark.parametrize("tail, complete_calls", [
    (f'<{DSML}parameter name="a" string="true">v', []),
    (f'<{DSML}parameter name="a" string="true">v</{DSML}parameter>', []),
    (f'<{DSML}parameter name="a" str', []),
    (f'<{DSML}parameter name="a" string="true">v</{DSML}parameter>\n</{DSML}invoke>', ["f"]),
    (f'</{DSML}invoke>\n<{DSML}invoke name="g">\n<{DSML}parameter name="a" string="true">v<', ["f"]),
])
def test_truncated_calls_that_are_rejected(tail, complete_calls):
    with pytest.raises(ChatParseError) as caught:
        parse_completion(f'{BLOCK}<{DSML}invoke name="f">\n{tail}')
    assert [call["name"] for call in caught.value.partial["tool_calls"]] == complete_calls


@pytest.mark.parametrize("raw, value", [
    (f"ls 2>&1 <{DSML}invoke name=\"x\"> {THINK_END} {EOS} {THINK_START}<", None),
    ("é😀 中文\n\t\"q\" \\<", None),
    ("<", ""),
    ("a<<", "a<"),
    ("x<\n", "x"),          # the official regex's "$" also matches before a final newline
])
def test_string_values_are_kept_raw(raw, value):
    # A string value may hold anything but the closing marker, markup and special tokens included.
    text = BLOCK + f'<{DSML}invoke name="f">\n<{DSML}parameter name="a" string="true">{raw}/{DSML}parameter>'
    text += f"\n</{DSML}invoke>\n{END_BLOCK}{EOS}"
    expected = raw[:-1] if value is None else value
    (call,) = parse_completion(text)["tool_calls"]
    assert call["arguments"] == {"a": expected}
    assert call["arguments_json"] == json.dumps({"a": expected}, ensure_ascii=False)


def test_empty_tool_call_block():
    assert parse_completion("Hi" + BLOCK + END_BLOCK + EOS) == {"reasoning_content": "", "content": "Hi",
                                                                "tool_calls": []}
