"""DeepSeek-V4 chat layer: prompt encoding and completion parsing (batch and streaming).

The V4 chat format has no Jinja template: it is defined by DeepSeek's official encoder
``encoding/encoding_dsv4.py`` (MIT licence, Copyright (c) DeepSeek).  This module
re-implements that encoder's logic and reproduces its output byte for byte; every literal
string of the format is read from ``chat_constants.json`` beside this file (a copy of the
fixture constants, with their ``_source``/``_license`` provenance).  Pure stdlib.

Public API
----------
Re-exported here from ``constants``, ``encoder`` and ``parser``; ``grammar`` builds the grammars
of constrained replies (JSON answers, DSML tool-call blocks).

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

from dsv4.chat.constants import BOS, DSML, EOS, THINK_END, THINK_START
from dsv4.chat.encoder import encode_messages
from dsv4.chat.parser import ChatParseError, StreamingChatParser, parse_completion

__all__ = ["BOS", "DSML", "EOS", "THINK_END", "THINK_START", "ChatParseError", "StreamingChatParser",
           "encode_messages", "parse_completion"]
