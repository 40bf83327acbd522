"""DeepSeek-V4 chat layer: prompt encoding and completion parsing (batch and streaming).

The V4 chat format has no Jinja template: it is defined by DeepSeek's official encoder
``encoding/encoding_dsv4.py`` (MIT licence, Copyright (c) DeepSeek).  This module
re-implements that encoder's logic and reproduces its output byte for byte; every literal
string of the format is read from ``chat_constants.json`` beside this file (a copy of the
fixture constants, with their ``_source``/``_license`` provenance).  Pure stdlib.

Public API
----------
``encode_messages(messages, tools=None, thinking=False, *, context=None,
drop_thinking=True, add_default_bos_token=True, reasoning_effort=None) -> str``
    OpenAI-style messages -> prompt text.
``parse_completion(text, thinking=False, tools=None) -> dict``
    A whole completion -> ``{"reasoning_content", "content", "tool_calls"}``; raises
    ``ChatParseError`` for text the official parser rejects.
``StreamingChatParser(thinking=False, tools=None)``
    One per request: ``feed(text_delta) -> [delta]`` then ``finish(finish_reason) ->
    ([delta], final_info)``; deltas are OpenAI ``chat.completion.chunk`` ``delta`` dicts.

How the server calls it
-----------------------
From an OpenAI chat request:

* ``messages`` -> ``messages`` as received (dicts; they are never mutated).
* ``tools`` -> ``tools``, except ``tool_choice == "none"``: pass ``tools=None`` so no tool
  section is rendered; for a named ``tool_choice`` pass only that tool.  Top-level tools are
  attached to the leading system message, or to an empty one inserted for them (what
  SGLang's server does before calling the official encoder).
* ``thinking`` -> ``chat_template_kwargs["thinking"]`` when the request sets it, else
  ``reasoning_effort in ("high", "max")``, else the server default.
* ``reasoning_effort`` -> ``"max"`` or ``"high"`` as sent; any other value (OpenAI's
  "low"/"medium") -> ``None``.  Only "max" changes the prompt, and only in thinking mode.

The prompt ends with ``<think>`` in thinking mode and ``</think>`` in chat mode, so the
completion starts with the reasoning (thinking) or the answer (chat).  Detokenise with
special tokens kept (DSML, ``</think>`` and EOS are single special tokens), create
``StreamingChatParser(thinking=..., tools=<names of the tools sent, or None>)`` and feed it.

Parser policy (both parsers)
----------------------------
Text the official parser accepts is parsed exactly as it parses it, quirks included:
a completion cut right after ``\\n\\n<｜DSML｜tool_calls`` has zero calls; one that ends after
a complete ``name="..."`` line, after a parameter's ``>\\n`` or right after
``</｜DSML｜invoke`` counts that call as complete; a string value followed by ``<\\n``
before the closing marker loses that newline; ``string="true"`` values are kept raw, the
others are JSON.  Everything it rejects is rejected, and so are two things it lets through
that a server must not: a ``string="false"`` value that is not strict JSON (NaN and
Infinity included; the official arguments string would not be JSON), and a tool name not
in ``tools`` when a tool list is given.  Rejection never puts markup into ``content`` or
``reasoning_content`` (the text before the offending marker is kept) and never loses a
call that was complete: ``ChatParseError.partial`` holds the reasoning, content and
complete calls parsed before the error.  Tool-call markup before ``</think>`` is an error,
not a call.  The streaming parser stops emitting at the error and reports it in ``finish``.

Official encoder behaviour deliberately not reproduced (it crashes or renders "None"
there): list ``content`` on non-tool messages is flattened (text parts joined by a space,
as SGLang's server does; other parts become ``[Unsupported <type>]``); ``None`` content
renders as ""; tool-call ``arguments`` given as a dict are used as is, and JSON that is
not an object is wrapped like non-JSON text (``{"arguments": <raw text>}``).
"""

import copy
import json
import re
import uuid
from pathlib import Path

_C = json.loads(Path(__file__).with_name("chat_constants.json").read_text(encoding="utf-8"))

BOS = _C["bos_token"]
EOS = _C["eos_token"]
THINK_START = _C["thinking_start_token"]
THINK_END = _C["thinking_end_token"]
DSML = _C["dsml_token"]
_USER = _C["user_sp_token"]
_ASSISTANT = _C["assistant_sp_token"]
_LATEST_REMINDER = _C["latest_reminder_sp_token"]
_TASK_TOKENS = {
    key[len("task_"):-len("_token")]: value
    for key, value in _C.items()
    if key.startswith("task_") and key.endswith("_token")
}
_REASONING_EFFORTS = (None, "high", "max")
_ROLES = {"system", "user", "assistant", "tool", "developer", "latest_reminder"}


def _to_json(value):
    # The official encoder serialises with Python's json.dumps defaults (", ", ": ",
    # float repr) and keeps non-ASCII raw; the model was trained on exactly that text.
    return json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------------------------------
# Encoding
# ----------------------------------------------------------------------------------------


def encode_messages(messages, tools=None, thinking=False, *, context=None, drop_thinking=True,
                    add_default_bos_token=True, reasoning_effort=None):
    """Render OpenAI-style ``messages`` into a DeepSeek-V4 prompt.

    ``tools``: OpenAI tool list, rendered in the system prompt (see module docstring).
    ``thinking``: thinking mode (prompt ends ``<think>``) or chat mode (``</think>``).
    ``context``: messages already in the KV cache; only the new ``messages`` are rendered,
    without BOS.  ``drop_thinking``: drop reasoning of turns before the last user message
    (never when tools are present).  ``add_default_bos_token``: prefix BOS (no context only).
    ``reasoning_effort``: None, "high" or "max" ("max" adds a prefix in thinking mode).
    Message-level ``tools``/``response_format`` (system, developer), ``task`` and ``wo_eos``
    work as in the official encoder.  Top-level ``tools`` always attach to ``messages``
    (as in the fixtures); with ``context``, put them on the context's system message.
    """
    if reasoning_effort not in _REASONING_EFFORTS:
        raise ValueError(f"reasoning_effort must be one of {_REASONING_EFFORTS}, got {reasoning_effort!r}")
    context = [_copy_message(m) for m in context or ()]
    messages = [_copy_message(m) for m in messages]
    if tools:
        _attach_tools(messages, tools)

    new = _merge_tool_messages(messages)
    # The official encoder orders new tool results using the calls of the raw context too.
    _sort_tool_results(context + new)
    history = _merge_tool_messages(context)
    _sort_tool_results(history)
    conversation = history + new

    drop = drop_thinking and not any(m.get("tools") for m in conversation)
    first = len(history)
    if thinking and drop:
        conversation = _drop_thinking(conversation)
        first = len(_drop_thinking(history))
    last_user = _last_user_index(conversation)

    prompt = BOS if add_default_bos_token and not context else ""
    return prompt + "".join(
        _render_message(i, conversation, thinking, drop, reasoning_effort, last_user)
        for i in range(first, len(conversation))
    )


def _copy_message(msg):
    msg = copy.deepcopy(dict(msg))
    if msg.get("role") not in _ROLES:
        raise ValueError(f"unsupported message role {msg.get('role')!r}")
    if msg["role"] != "tool" and isinstance(msg.get("content"), list):
        msg["content"] = " ".join(_part_text(part) for part in msg["content"])
    return msg


def _part_text(part):
    if part.get("type") == "text":
        return part.get("text") or ""
    return _C["unsupported_block_template"].format(type=part.get("type"))


def _attach_tools(messages, tools):
    if not messages or messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": ""})
    messages[0]["tools"] = copy.deepcopy(list(tools))


def _merge_tool_messages(messages):
    """V4 has no tool role: tool results (and user text following them) become blocks of
    one user turn, exactly as the official ``merge_tool_messages`` groups them."""
    merged = []
    for msg in messages:
        role = msg["role"]
        last = merged[-1] if merged else None
        extends_user = last is not None and last["role"] == "user" and "content_blocks" in last
        if role == "tool":
            block = {"type": "tool_result", "tool_use_id": msg.get("tool_call_id", ""), "content": msg.get("content")}
            if extends_user:
                last["content_blocks"].append(block)
            else:
                merged.append({"role": "user", "content_blocks": [block]})
        elif role == "user":
            block = {"type": "text", "text": msg.get("content") or ""}
            if extends_user and last.get("task") is None:
                last["content_blocks"].append(block)
            else:
                user = {"role": "user", "content_blocks": [block]}
                user.update((key, msg[key]) for key in ("task", "wo_eos") if key in msg)
                merged.append(user)
        else:
            merged.append(msg)
    return merged


def _sort_tool_results(messages):
    """Put each user turn's tool results in the order of the latest assistant's calls."""
    order = {}
    for msg in messages:
        if msg["role"] == "assistant" and msg.get("tool_calls"):
            order = {}
            for position, call in enumerate(msg["tool_calls"]):
                call_id = call.get("id") or call.get("function", {}).get("id", "")
                if call_id:
                    order[call_id] = position
        elif msg["role"] == "user" and msg.get("content_blocks"):
            blocks = msg["content_blocks"]
            results = [b for b in blocks if b.get("type") == "tool_result"]
            if len(results) > 1 and order:
                ranked = iter(sorted(results, key=lambda b: order.get(b.get("tool_use_id", ""), 0)))
                msg["content_blocks"] = [next(ranked) if b.get("type") == "tool_result" else b for b in blocks]


def _last_user_index(messages):
    for index in range(len(messages) - 1, -1, -1):
        if messages[index]["role"] in ("user", "developer"):
            return index
    return -1


def _drop_thinking(messages):
    """Before the last user turn: strip assistant reasoning and drop developer turns."""
    last_user = _last_user_index(messages)
    kept = []
    for index, msg in enumerate(messages):
        if msg["role"] in ("user", "system", "latest_reminder") or index >= last_user:
            kept.append(msg)
        elif msg["role"] == "assistant":
            kept.append({key: value for key, value in msg.items() if key != "reasoning_content"})
    return kept


def _render_message(index, messages, thinking, drop_thinking, reasoning_effort, last_user):
    msg = messages[index]
    role = msg["role"]
    out = _C["reasoning_effort_max_prefix"] if index == 0 and thinking and reasoning_effort == "max" else ""
    if role == "system":
        out += _C["system_msg_template"].format(content=msg.get("content") or "") + _system_sections(msg)
    elif role == "developer":
        if not msg.get("content"):
            raise ValueError("a developer message needs non-empty content")
        out += _C["user_msg_template"].format(content=_USER + msg["content"] + _system_sections(msg))
    elif role == "user":
        out += _USER + _render_user_content(msg)
    elif role == "latest_reminder":
        out += _LATEST_REMINDER + _C["latest_reminder_msg_template"].format(content=msg.get("content") or "")
    else:
        follows_task = index > 0 and messages[index - 1].get("task") is not None
        keeps_reasoning = thinking and not follows_task and (not drop_thinking or index > last_user)
        reasoning = ""
        if keeps_reasoning:
            reasoning = _C["thinking_template"].format(reasoning_content=msg.get("reasoning_content") or "")
            reasoning += THINK_END
        out += _render_assistant(msg, reasoning)
    return out + _transition(index, messages, thinking, drop_thinking, last_user)


def _system_sections(msg):
    out = ""
    if msg.get("tools"):
        schemas = _C["sep_tool_schemas"].join(_to_json(tool.get("function", tool)) for tool in msg["tools"])
        out += _C["sep_before_tools_section"] + _C["tools_template"].format(
            tool_schemas=schemas, dsml_token=DSML, thinking_start_token=THINK_START, thinking_end_token=THINK_END
        )
    if msg.get("response_format"):
        out += _C["sep_before_response_format_section"] + _C["response_format_template"].format(
            schema=_to_json(msg["response_format"])
        )
    return out


def _render_user_content(msg):
    blocks = msg.get("content_blocks")
    if not blocks:
        return msg.get("content") or ""
    parts = []
    for block in blocks:
        if block.get("type") == "text":
            parts.append(block.get("text") or "")
        elif block.get("type") == "tool_result":
            parts.append(_C["tool_output_template"].format(content=_tool_result_text(block.get("content"))))
        else:
            parts.append(_C["unsupported_block_template"].format(type=block.get("type")))
    return _C["sep_user_content_blocks"].join(parts)


def _tool_result_text(content):
    if isinstance(content, list):
        return _C["sep_tool_result_text_parts"].join(_part_text(part) for part in content)
    return content or ""


def _render_assistant(msg, reasoning):
    calls = ""
    if msg.get("tool_calls"):
        invokes = _C["sep_invokes"].join(_render_invoke(call["function"]) for call in msg["tool_calls"])
        calls = _C["sep_before_tool_calls_block"] + _C["tool_calls_template"].format(
            dsml_token=DSML, tc_block_name=_C["tool_calls_block_name"], tool_calls=invokes
        )
    template = _C["assistant_msg_wo_eos_template"] if msg.get("wo_eos") else _C["assistant_msg_template"]
    return template.format(reasoning=reasoning, content=msg.get("content") or "", tool_calls=calls)


def _render_invoke(function):
    params = [
        _C["parameter_template"].format(
            dsml_token=DSML,
            key=key,
            is_str=_C["parameter_string_true"] if isinstance(value, str) else _C["parameter_string_false"],
            value=value if isinstance(value, str) else _to_json(value),
        )
        for key, value in _call_arguments(function.get("arguments")).items()
    ]
    return _C["tool_call_template"].format(
        dsml_token=DSML, name=function["name"], arguments=_C["sep_parameters"].join(params)
    )


def _call_arguments(arguments):
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except (TypeError, ValueError):
        parsed = None
    # Official quirk: arguments that are not a JSON object become one raw string parameter.
    return parsed if isinstance(parsed, dict) else {"arguments": arguments}


def _transition(index, messages, thinking, drop_thinking, last_user):
    """What follows a message when the next one is not a user-side turn: a task token,
    or the assistant header that opens (``<think>``) or skips (``</think>``) reasoning."""
    if index + 1 < len(messages) and messages[index + 1]["role"] not in ("assistant", "latest_reminder"):
        return ""
    msg = messages[index]
    task = msg.get("task")
    if task is not None:
        if task not in _TASK_TOKENS:
            raise ValueError(f"unknown task {task!r}; expected one of {sorted(_TASK_TOKENS)}")
        if task != "action":
            return _TASK_TOKENS[task]
        return _ASSISTANT + (THINK_START if thinking else THINK_END) + _TASK_TOKENS[task]
    if msg["role"] in ("user", "developer"):
        opens_thinking = thinking and (not drop_thinking or index >= last_user)
        return _ASSISTANT + (THINK_START if opens_thinking else THINK_END)
    return ""


# ----------------------------------------------------------------------------------------
# Parsing
# ----------------------------------------------------------------------------------------

_TOOLS_START = _C["parser_tool_calls_start"]
_TOOLS_END = _C["parser_tool_calls_end"]
_INVOKE_START = _C["parser_invoke_start"]
_INVOKE_END = _C["parser_invoke_end"]
_PARAM_START = _C["parser_parameter_start"]
_PARAM_END = _C["parser_parameter_end"]
_TAG_TAIL = _C["parser_tag_tail"]
# re.match, not fullmatch: the official findall lets "$" match before a final "\n", which
# is what accepts the encoder's zero-argument form 'name="f">\n\n'.
_NAME_RE = re.compile(_C["parser_tool_name_regex"], re.DOTALL)


def _parameter_pieces():
    """Split the parameter template into the literals around its fields:
    ' name="', '" string="', '">' and the '<' that precedes the closing marker."""
    key, flag, value = "\0key", "\0flag", "\0value"
    sample = _C["parameter_template"].format(dsml_token=DSML, key=key, is_str=flag, value=value)
    opening, rest = sample.split(key)
    flag_sep, rest = rest.split(flag)
    value_open, closing = rest.split(value)
    return opening[len(_PARAM_START):], flag_sep, value_open, closing[:closing.index(_PARAM_END)]


_NAME_PREFIX, _FLAG_SEP, _VALUE_OPEN, _VALUE_CLOSE = _parameter_pieces()
_HEADER_IS_STRING = {
    _FLAG_SEP + _C["parameter_string_true"] + _VALUE_OPEN: True,
    _FLAG_SEP + _C["parameter_string_false"] + _VALUE_OPEN: False,
}
# The official regex wants the value followed by "<" then the end of the parameter text,
# and its "$" also matches before one final "\n"; a bare closer is a format error.
_VALUE_ENDS = (_VALUE_CLOSE + _PARAM_END, _VALUE_CLOSE + "\n" + _PARAM_END, _PARAM_END)
# Stray DSML in text is an error; stopping at the "<" or "</" that opens its tag keeps
# that bit of markup out of the text kept before the error.
_DSML_TAGS = (_PARAM_START.split(DSML)[0] + DSML, _INVOKE_END.split(DSML)[0] + DSML, DSML)
_REASONING_MARKERS = (THINK_END, _TOOLS_START, BOS, EOS, THINK_START, *_DSML_TAGS)
_CONTENT_MARKERS = (EOS, _TOOLS_START, BOS, THINK_START, THINK_END, *_DSML_TAGS)
_ITEM_SEP = _C["decoded_arguments_item_sep"]
_KEY_SEP = _C["decoded_arguments_key_value_sep"]


class ChatParseError(ValueError):
    """A completion the parser rejects.  ``partial`` is the result parsed before the error:
    reasoning and content without markup, and every tool call that was complete."""

    def __init__(self, message, partial):
        super().__init__(message)
        self.partial = partial


def parse_completion(text, thinking=False, tools=None):
    """Parse a whole completion (raw text after the prompt, EOS included when generation
    stopped normally) as the official parser does.

    Returns ``{"reasoning_content", "content", "tool_calls"}``, each call
    ``{"name", "arguments" (dict), "arguments_json" (the official arguments string)}``.
    ``tools``: optional list of tool names or OpenAI tool dicts; a call to another name is
    rejected.  Raises ``ChatParseError`` (see the module docstring for the policy).
    """
    parser = StreamingChatParser(thinking=thinking, tools=tools)
    parser.feed(text)
    info = parser._complete("strict")
    result = {
        "reasoning_content": info["reasoning_content"],
        "content": info["content"],
        "tool_calls": [{key: call[key] for key in ("name", "arguments", "arguments_json")}
                       for call in info["tool_calls"]],
    }
    if info["parse_error"]:
        raise ChatParseError(info["error"], result)
    return result


def _tool_names(tools):
    if tools is None:
        return None
    return {tool if isinstance(tool, str) else tool.get("function", tool)["name"] for tool in tools}


def _scan(buf, markers, final, start=0):
    """Find where ``buf[start:]`` stops being plain text.

    Returns ``(pos, marker)`` for the earliest complete marker, or ``(pos, None)`` where
    ``buf[:pos]`` is certainly free of markers: unless ``final``, a tail that could still
    grow into a marker is held back.  Earliest start wins, as with the official parser's
    nearest-stop search.
    """
    pos, found = len(buf), None
    for marker in markers:
        at = buf.find(marker, start)
        if at != -1 and at < pos:
            pos, found = at, marker
    if not final:
        longest = max(map(len, markers))
        for at in range(max(start, len(buf) - longest + 1), pos):
            tail = buf[at:]
            if any(len(tail) < len(marker) and marker.startswith(tail) for marker in markers):
                return at, None
    return pos, found


def _strict_json(raw):
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(raw, parse_constant=reject)


class StreamingChatParser:
    """Incremental parser for one completion; create one per request.

    ``feed(text)`` returns OpenAI ``delta`` dicts: ``{"reasoning_content": s}``,
    ``{"content": s}``, for a call first ``{"tool_calls": [{"index", "id", "type":
    "function", "function": {"name", "arguments": ""}}]}`` then ``{"tool_calls":
    [{"index", "function": {"arguments": fragment}}]}`` fragments whose concatenation is
    the call's JSON arguments object (string values stream as they are generated).  Text
    that could be the start of a marker is held back until it is resolved, so deltas
    never carry markup, whatever the chunking.

    ``finish(finish_reason)`` returns ``(deltas, info)``.  ``"length"`` means truncation:
    a cut-off marker is dropped and a call cut short is left out of ``info`` (its deltas
    were sent; ``info["incomplete_tool_call"]`` says so).  Any other reason means the text
    is complete, with the EOS possibly stripped.  ``info``: ``finish_reason`` ("tool_calls"
    when a call completed, "length", "stop", or "error"), ``parse_error`` (bool),
    ``error`` (message or None), ``incomplete_tool_call``, and the parsed
    ``reasoning_content``, ``content`` and ``tool_calls`` (``id``, ``name``, ``arguments``,
    ``arguments_json``), equal to ``parse_completion`` for any text it accepts.
    """

    def __init__(self, thinking=False, tools=None):
        self._tool_names = _tool_names(tools)
        self._state = self._in_reasoning if thinking else self._in_content
        self._buf = ""
        self._deltas = []
        self._reasoning = []
        self._content = []
        self._calls = []
        self._call = None
        self._param = None
        self._started_calls = 0
        self._error = None
        self._finished = False

    def feed(self, text):
        if self._finished:
            raise RuntimeError("feed() after finish()")
        if self._error is None:
            self._buf += text
            self._run(final=False)
        return self._take_deltas()

    def finish(self, finish_reason=None):
        if self._finished:
            raise RuntimeError("finish() called twice")
        info = self._complete("length" if finish_reason == "length" else "stop")
        return self._take_deltas(), info

    # -- driver --------------------------------------------------------------------------

    def _run(self, final):
        while self._error is None and self._state(final):
            pass

    def _take_deltas(self):
        deltas, self._deltas = self._deltas, []
        return deltas

    def _fail(self, message):
        self._error = message
        return False

    def _complete(self, mode):
        """Apply the end-of-text rules.  ``mode``: "strict" (the official parser on this
        exact text), "stop" (also accept text that would be complete with an EOS
        appended) or "length" (truncated: incomplete is not an error)."""
        self._finished = True
        incomplete = None
        if self._error is None:
            incomplete = self._end_of_text(mode)
            if incomplete is not None and mode != "length":
                self._error = incomplete
        if self._error is not None:
            reason = "error"
        elif mode == "length":
            reason = "length"
        else:
            reason = "tool_calls" if self._calls else "stop"
        return {
            "finish_reason": reason,
            "parse_error": self._error is not None,
            "error": self._error,
            "incomplete_tool_call": self._call is not None,
            "reasoning_content": "".join(self._reasoning),
            "content": "".join(self._content),
            "tool_calls": [dict(call) for call in self._calls],
        }

    def _end_of_text(self, mode):
        """Resolve what is still buffered; returns why the text is incomplete, or None."""
        if mode == "length" and self._state in (self._in_reasoning, self._in_content):
            self._buf = ""  # a marker cut off by the length limit, never text
        if self._state in (self._in_reasoning, self._in_content, self._after_block):
            self._run(final=True)  # nothing more is coming: held-back text is plain text
        if self._error is not None:
            return None
        state = self._state
        if state == self._in_reasoning:
            return f"missing {THINK_END}"
        if state == self._in_content:
            return None if mode == "stop" else f"missing {EOS}"
        if state == self._in_invoke_name and _NAME_RE.match(self._buf):
            # Official quirk: a complete name line at the very end is a zero-argument call.
            if self._open_call(self._buf):
                self._close_call()
            return None
        if state == self._in_param_tail and self._buf == _TAG_TAIL:
            self._close_call()
            return None
        if (state == self._in_block and not self._buf) or state in (self._after_block, self._after_eos):
            return None
        return "tool call block cut short"

    # -- states: each returns True when it moved on, False when it needs more text -------

    def _in_reasoning(self, final):
        pos, marker = _scan(self._buf, _REASONING_MARKERS, final)
        self._emit_text("reasoning_content", self._reasoning, pos)
        if marker is None:
            return False
        if marker == _TOOLS_START:
            return self._fail(f"tool call markup before {THINK_END}")
        if marker != THINK_END:
            return self._fail(f"unexpected {marker!r} in reasoning")
        self._buf = self._buf[len(marker):]
        self._state = self._in_content
        return True

    def _in_content(self, final):
        pos, marker = _scan(self._buf, _CONTENT_MARKERS, final)
        self._emit_text("content", self._content, pos)
        if marker is None:
            return False
        if marker not in (EOS, _TOOLS_START):
            return self._fail(f"unexpected {marker!r} in content")
        self._buf = self._buf[len(marker):]
        self._state = self._after_eos if marker == EOS else self._in_block
        return True

    def _after_eos(self, final):
        if self._buf:
            return self._fail(f"text after {EOS}")
        return False

    def _in_block(self, final):
        """Between invokes: '>\\n' then the next invoke or the end of the block."""
        marker = self._tag_tail_then((_INVOKE_START, _TOOLS_END), final)
        if marker is None:
            return False
        self._state = self._in_invoke_name if marker == _INVOKE_START else self._after_block
        return True

    def _in_invoke_name(self, final):
        pos, marker = _scan(self._buf, (_PARAM_START, _INVOKE_END), final)
        if marker is None or not self._open_call(self._buf[:pos]):
            return False
        self._buf = self._buf[pos + len(marker):]
        if marker == _INVOKE_END:
            self._close_call()
            self._state = self._in_block
        else:
            self._state = self._in_param_header
        return True

    def _in_param_header(self, final):
        head = self._buf[:len(_NAME_PREFIX)]
        if not _NAME_PREFIX.startswith(head):
            return self._fail(f"malformed parameter: expected {_NAME_PREFIX!r}")
        pos, marker = _scan(self._buf, (*_HEADER_IS_STRING, _PARAM_END), final, start=len(_NAME_PREFIX))
        if marker is None:
            return False
        if marker == _PARAM_END:
            return self._fail(f"malformed parameter: {self._buf[:pos]!r} has no string attribute")
        key = self._buf[len(_NAME_PREFIX):pos]
        if key in self._call["values"]:
            return self._fail(f"duplicate parameter {key!r}")
        is_string = _HEADER_IS_STRING[marker]
        self._param = (key, is_string, [])
        separator = "{" if not self._call["values"] else _ITEM_SEP
        self._emit_arguments(separator + _to_json(key) + _KEY_SEP + ('"' if is_string else ""))
        self._buf = self._buf[pos + len(marker):]
        self._state = self._in_param_value
        return True

    def _in_param_value(self, final):
        key, is_string, pieces = self._param
        pos, marker = _scan(self._buf, _VALUE_ENDS, final)
        if pos:
            piece, self._buf = self._buf[:pos], self._buf[pos:]
            pieces.append(piece)
            if is_string:
                self._emit_arguments(_to_json(piece)[1:-1])
        if marker is None:
            return False
        if marker == _PARAM_END:
            return self._fail(f"parameter {key!r} not closed by {_VALUE_CLOSE + _PARAM_END!r}")
        raw = "".join(pieces)
        if is_string:
            value = raw
            self._emit_arguments('"')
        else:
            try:
                value = _strict_json(raw)
            except ValueError:
                return self._fail(f"parameter {key!r} is not JSON: {raw!r}")
            self._emit_arguments(raw)
        self._call["values"][key] = value
        self._buf = self._buf[len(marker):]
        self._state = self._in_param_tail
        return True

    def _in_param_tail(self, final):
        marker = self._tag_tail_then((_PARAM_START, _INVOKE_END), final)
        if marker is None:
            return False
        if marker == _INVOKE_END:
            self._close_call()
            self._state = self._in_block
        else:
            self._state = self._in_param_header
        return True

    def _after_block(self, final):
        pos, marker = _scan(self._buf, (EOS,), final)
        if pos:
            return self._fail("text after the tool call block")
        if marker is None:
            return False
        self._buf = self._buf[len(marker):]
        self._state = self._after_eos
        return True

    # -- helpers -------------------------------------------------------------------------

    def _tag_tail_then(self, markers, final):
        """Consume '>\\n' and the marker after it; returns the marker, or None to wait
        (or on error: anything but exactly '>\\n' before the marker is malformed)."""
        pos, marker = _scan(self._buf, markers, final)
        gap = self._buf[:pos]
        if not _TAG_TAIL.startswith(gap) or (marker is not None and gap != _TAG_TAIL):
            self._fail(f"expected {_TAG_TAIL!r} before {' or '.join(markers)!r}")
            return None
        if marker is not None:
            self._buf = self._buf[pos + len(marker):]
        return marker

    def _open_call(self, name_line):
        match = _NAME_RE.match(name_line)
        if match is None:
            return self._fail(f"malformed tool call name: {name_line!r}")
        name = match.group(1)
        if self._tool_names is not None and name not in self._tool_names:
            return self._fail(f"unknown tool {name!r}")
        self._call = {"index": self._started_calls, "id": f"call_{uuid.uuid4().hex[:24]}", "name": name,
                      "values": {}, "arguments": []}
        self._started_calls += 1
        self._deltas.append({"tool_calls": [{
            "index": self._call["index"], "id": self._call["id"], "type": "function",
            "function": {"name": name, "arguments": ""},
        }]})
        return True

    def _close_call(self):
        call, self._call = self._call, None
        self._emit_arguments("}" if call["values"] else "{}", call)
        self._calls.append({"id": call["id"], "name": call["name"], "arguments": call["values"],
                            "arguments_json": "".join(call["arguments"])})

    def _emit_text(self, kind, sink, pos):
        text, self._buf = self._buf[:pos], self._buf[pos:]
        if not text:
            return
        sink.append(text)
        last = self._deltas[-1] if self._deltas else None
        if last is not None and kind in last:
            last[kind] += text
        else:
            self._deltas.append({kind: text})

    def _emit_arguments(self, fragment, call=None):
        call = call or self._call
        call["arguments"].append(fragment)
        last = self._deltas[-1]["tool_calls"][0] if self._deltas and "tool_calls" in self._deltas[-1] else None
        if last is not None and last["index"] == call["index"] and "id" not in last:
            last["function"]["arguments"] += fragment
        else:
            self._deltas.append({"tool_calls": [{"index": call["index"], "function": {"arguments": fragment}}]})
