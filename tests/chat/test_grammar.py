"""The grammars of constrained replies accept what the encoder renders (the text the model was
trained on, which the parser reads back) and refuse what breaks a schema."""

from __future__ import annotations

import json

import llguidance
import pytest

from dsv4 import chat
from dsv4.chat import grammar as chat_grammar
from dsv4.engine import grammar
from dsv4.tiny import build_tokenizer
from dsv4.tokenizer import Tokenizer

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7}, "code": {"type": "string", "maxLength": 4}},
        "required": ["city", "days"]}}},
    {"type": "function", "function": {"name": "noop"}},
]
CALLS = [("get_weather", {"city": "Paris </x>", "days": 3, "code": "ab"}), ("noop", {})]
FORCED = f"\n\n<{chat.DSML}tool_calls>\n<{chat.DSML}invoke"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer(build_tokenizer())


@pytest.fixture(scope="module")
def constraints(tokenizer):
    return grammar.Constraints(tokenizer, tokenizer.vocab_size, frozenset({tokenizer.eos_id}))


def rendered_block(calls) -> str:
    """The tool-call block exactly as the encoder renders an assistant turn with `calls`."""
    message = {"role": "assistant", "content": "", "tool_calls": [
        {"function": {"name": name, "arguments": json.dumps(args)}} for name, args in calls]}
    text = chat.encode_messages([{"role": "user", "content": "hi"}, message], tools=TOOLS)
    return text[text.rindex(f"\n\n<{chat.DSML}tool_calls"):-len(chat.EOS)]


def accepts(constraints, tokenizer, lark: str, text: str) -> bool:
    compiled = grammar.from_lark(lark)
    assert grammar.grammar_error(compiled) == ""
    matcher = llguidance.LLMatcher(constraints._llg_tokenizer, compiled, log_level=0)
    ids = tokenizer.encode(text)
    return (matcher.try_consume_tokens(ids) == len(ids) and matcher.consume_token(tokenizer.eos_id)
            and matcher.is_stopped())


def test_tool_call_grammars_accept_the_rendered_block(constraints, tokenizer):
    marker = grammar.marker_terms(tokenizer)
    block = rendered_block(CALLS)
    assert accepts(constraints, tokenizer, chat_grammar.tool_calls(TOOLS, False, marker), block)
    assert accepts(constraints, tokenizer, chat_grammar.tool_calls(TOOLS, True, marker), "Hm.</think>" + block)
    forced = chat_grammar.tool_calls(TOOLS, False, marker, forced_start=FORCED)
    assert accepts(constraints, tokenizer, forced, block[len(FORCED):])
    named_start = FORCED + ' name="get_weather">\n'
    one_call = rendered_block(CALLS[:1])
    named = chat_grammar.tool_calls(TOOLS[:1], False, marker, forced_start=named_start, named=True)
    assert accepts(constraints, tokenizer, named, one_call[len(named_start):])
    parsed = chat.parse_completion(block + chat.EOS, tools=TOOLS)["tool_calls"]
    assert [(call["name"], call["arguments"]) for call in parsed] == CALLS


@pytest.mark.parametrize("calls", [
    [("get_weather", {"city": "Paris", "days": 9})],  # above the maximum
    [("get_weather", {"city": "Paris", "days": 3, "code": "abcde"})],  # beyond maxLength
    [("get_weather", {"city": "Paris"})],  # a required parameter missing
    [("get_weather", {"city": "Paris", "days": 3, "unit": "kelvin"})],  # not in the enum
    [("get_weather", {"days": 3, "city": "Paris"})],  # not in declaration order
    [("get_weather", {"city": "x｜DSML｜y", "days": 3})],  # a marker spelled out in a raw value
    [("lookup", {})],  # not a tool shown
])
def test_tool_call_grammar_refuses_what_breaks_a_schema(constraints, tokenizer, calls):
    lark = chat_grammar.tool_calls(TOOLS, False, grammar.marker_terms(tokenizer))
    assert not accepts(constraints, tokenizer, lark, rendered_block(calls))


def test_json_answer_follows_the_schema_after_any_reasoning(constraints, tokenizer):
    marker = grammar.marker_terms(tokenizer)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"],
              "additionalProperties": False}
    assert accepts(constraints, tokenizer, chat_grammar.json_answer(schema, False, marker), '{"a": 5}')
    assert not accepts(constraints, tokenizer, chat_grammar.json_answer(schema, False, marker), '{"a": "5"}')
    assert accepts(constraints, tokenizer, chat_grammar.json_answer(schema, True, marker), 'So.</think>{"a": 5}')
    assert not accepts(constraints, tokenizer, chat_grammar.json_answer(schema, True, marker),
                       'So <think> x</think>{"a": 5}')
