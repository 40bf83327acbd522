"""Grammars of what the model must write, in llguidance's Lark dialect (pure text; the engine
compiles them): a JSON answer that follows a schema, and a DSML tool-call block whose every call
names a given tool and whose arguments follow that tool's parameter schema.

Both cover the whole completion as the parser reads it (dsv4.chat.parser): in thinking mode the
reasoning first, then ``</think>``, then the answer; in chat mode the answer at once (the prompt
already closed the reasoning), after any forced start the prompt already holds. The end of
sentence is not part of a grammar: the engine allows it exactly where the grammar may end.

Markers are written as the caller's ``marker(text)`` terms: ``<[id]>`` for a marker that is one
token, so that the model writes the token it was trained on and a text lexeme can never contain it
(those tokens are special to the matcher). Text lexemes (reasoning, raw string values) also
exclude every marker spelled as plain characters, so the parser cannot read a marker where the
grammar saw text.

A tool's arguments are its declared properties, in declaration order, the required ones always;
a plain string property (no constraint but enum, minLength, maxLength) is written raw
(``string="true"``), as the model was trained to, and every other property as JSON
(``string="false"``) validated by its schema. JSON is written compactly with Python's
separators, as the encoder renders it in prompts.
"""

import json
from collections.abc import Callable

from dsv4.chat.constants import BOS, DSML, EOS, THINK_END, THINK_START
from dsv4.chat.constants import FORMAT as _C

# llguidance JSON options: no free whitespace (a model could fill max_tokens with it), and the
# separators of json.dumps, which is how every JSON value in the prompt is written.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
_STRING_KEYWORDS = {"type", "description", "title", "enum", "minLength", "maxLength", "examples", "default"}

Marker = Callable[[str], str]
# A newline before "<", and "<" before "/" or a marker, are lexemes of their own: llguidance's lexer
# does not split a longer literal ("\n</") it has started when the text turns out to be another
# ("\n" then "<" then a marker token), so alternatives must part at a lexeme boundary.
_NL, _CLOSE = '"\\n"', '"<" "/"'


def json_answer(schema: dict, thinking: bool, marker: Marker) -> str:
    """The whole completion of a reply that is one JSON value following `schema`."""
    return _grammar(thinking, marker, ["answer: " + _json(schema)])


def tool_calls(tools: list[dict], thinking: bool, marker: Marker, *, named: bool = False,
               forced_start: str = "", alternative_schema: dict | None = None) -> str:
    """The whole completion of a reply that is a tool-call block calling only `tools` (OpenAI tool
    dicts). `forced_start`: the start of the block that the prompt already holds (chat mode), up to
    the first call's name when `named` (then tools[0] is that call's tool). `alternative_schema`:
    the reply may instead be a JSON answer following it (response_format with tool_choice "auto")."""
    dsml = marker(DSML)
    tails = "(" + " | ".join(f"tail_{i}" for i in range(len(tools))) + ")"
    rules = [f"block_rest: ({_NL} invoke)* {_NL} {_CLOSE} {dsml} {_literal('tool_calls>')}",
             f"invoke: {_literal('<')} {dsml} {_literal('invoke')} {tails}"]
    for i, tool in enumerate(tools):
        rules += _tool_rules(i, tool.get("function", tool), dsml)
    if forced_start and named:
        rules.append(f"answer: args_0_0_first {_NL} {_CLOSE} {dsml} {_literal('invoke>')} block_rest")
    elif forced_start:
        rules.append(f"answer: {tails} block_rest")
    else:
        block = (f"{_literal(_C['sep_before_tool_calls_block'] + '<')} {dsml} {_literal('tool_calls>' + chr(10))} "
                 "invoke block_rest")
        if alternative_schema is None:
            rules.append(f"answer: {block}")
        else:
            rules += [f"answer: {block} | json_answer", "json_answer: " + _json(alternative_schema)]
    return _grammar(thinking and not forced_start, marker, rules)


def _grammar(thinking: bool, marker: Marker, rules: list[str]) -> str:
    start = f"start: REASONING {marker(THINK_END)} answer" if thinking else "start: answer"
    # A raw string value runs up to the "</" before its closing marker token, which ends it.
    return "\n".join([start, *rules, f"REASONING: {_text('*')}", f"RAW_VALUE: {_text('*', '<')}"]) + "\n"


def _tool_rules(i: int, function: dict, dsml: str) -> list[str]:
    parameters = function.get("parameters") or {}
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or ())
    definitions = {key: parameters[key] for key in ("$defs", "definitions") if key in parameters}
    name_line = _literal(' name="' + function["name"] + '">\n')
    rules = [f"tail_{i}: {name_line} args_{i}_0_first {_NL} {_CLOSE} {dsml} {_literal('invoke>')}"]
    names = list(properties)
    for j, name in enumerate(names):
        rules += _parameter(f"{i}_{j}", name, properties[name], definitions, dsml)
    # args_i_j_first / args_i_j_more: the parameters from the j-th on, before any or after some.
    for j in range(len(names) + 1):
        for first in (True, False):
            rule = f"args_{i}_{j}_{'first' if first else 'more'}"
            if j == len(names):
                rules.append(f'{rule}: ""')
                continue
            take = ("" if first else _NL + " ") + f"param_{i}_{j} args_{i}_{j + 1}_more"
            skip = f"args_{i}_{j + 1}_{'first' if first else 'more'}"
            rules.append(f"{rule}: {take}" if names[j] in required else f"{rule}: {take} | {skip}")
    return rules


def _parameter(suffix: str, name: str, schema, definitions: dict, dsml: str) -> list[str]:
    """The rules of one parameter, from its opening "<" to its closing marker."""
    header = _literal('parameter name="' + name + '" string=')
    rule = f"param_{suffix}: {_literal('<')} {dsml} {header}"
    close = f"{dsml} {_literal('parameter>')}"
    if not _is_raw_string(schema):
        value = _json({**schema, **definitions} if isinstance(schema, dict) else schema)
        as_json = _literal('"false">')
        return [f"{rule} {as_json} {value} {_literal('</')} {close}"]
    raw = _literal('"true">')
    if "enum" in schema:  # each raw value with the "</" that ends it
        values = " | ".join(_literal(value + "</") for value in schema["enum"])
        return [f"{rule} {raw} ({values}) {close}"]
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    if low == 0 and high is None:
        return [f"{rule} {raw} RAW_VALUE {close}"]
    bound = f"{{{low},{'' if high is None else int(high)}}}"
    return [f"{rule} {raw} RAW_{suffix} {close}", f"RAW_{suffix}: {_text(bound, '<')}"]


def _is_raw_string(schema) -> bool:
    return (isinstance(schema, dict) and schema.get("type") == "string" and set(schema) <= _STRING_KEYWORDS
            and all(isinstance(v, str) for v in schema.get("enum", ())))


def _text(repeat: str, closer: str = "") -> str:
    """A text lexeme: `repeat` characters, no marker spelled out among them, then `closer` and "/"
    when `closer` is given."""
    markers = "|".join(_regex_escape(text) for text in (BOS, EOS, THINK_START, THINK_END, DSML))
    tail = _regex_escape(closer + "/") if closer else ""
    return f"/(?s:.){repeat}{tail}/ & ~/(?s:.*)({markers})(?s:.*)/"


def _json(schema) -> str:
    """An embedded JSON schema, with dsv4's JSON options."""
    if isinstance(schema, dict):
        schema = {**schema, "x-guidance": JSON_OPTIONS}
    return "%json " + json.dumps(schema, ensure_ascii=False)


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def _regex_escape(text: str) -> str:
    return "".join("\\" + ch if ch in r"\/.^$|?*+()[]{}" else ch for ch in text)
