"""Completion parsing, whole (``parse_completion``) and streaming (``StreamingChatParser``), as
DeepSeek's official parser parses (policy in the package docstring)."""

import json
import re
import uuid

from dsv4.chat.constants import BOS, DSML, EOS, THINK_END, THINK_START
from dsv4.chat.constants import FORMAT as _C
from dsv4.chat.constants import to_json as _to_json

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
        return self._after_invoke_item(marker)

    def _after_invoke_item(self, marker):
        """After an invoke's name or one of its parameters: another parameter, or the invoke's end."""
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
        return self._after_invoke_item(marker)

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
