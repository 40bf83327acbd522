"""An OpenAI chat request rendered as a DeepSeek-V4 prompt (dsv4.chat does the rendering).

Decides which tools the model sees (tool_choice), whether it thinks, where response_format
goes, and, for a forced tool call in chat mode, the start of the DSML block the model is made to
continue from: the parser is fed that start as if the model had written it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import msgspec

from dsv4 import chat
from dsv4.server import validation as v
from dsv4.server.errors import bad_request

# OpenAI's values plus DeepSeek's "max"; dsv4.chat only distinguishes "high" and "max".
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "max")
_BLOCK_START = f"\n\n<{chat.DSML}tool_calls>\n<{chat.DSML}invoke"
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


@dataclass(frozen=True)
class ChatPrompt:
    text: str  # the prompt, including any forced start of the completion
    thinking: bool
    tool_names: list[str]  # what the parser accepts; empty: any call is an error
    tools: list[dict]  # the tools shown (OpenAI tool dicts)
    forced_start: str  # completion text the prompt already holds; fed to the parser first


def build_chat_prompt(body: v.ChatCompletionBody) -> ChatPrompt:
    if not body.messages:
        raise bad_request("messages must not be empty", param="messages")
    _check_tool_turns(body.messages)
    tools = _tools_shown(body)
    thinking, effort = _thinking(body)
    messages = [msgspec.to_builtins(m) for m in body.messages]
    _attach_response_format(messages, body.response_format)
    try:
        text = chat.encode_messages(messages, tools=tools or None, thinking=thinking, reasoning_effort=effort)
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise bad_request(f"messages cannot be rendered: {e}", param="messages") from None
    except RecursionError:
        raise v.too_deep() from None
    forced = _forced_start(body.tool_choice, tools, thinking)
    names = [tool["function"]["name"] for tool in tools]
    return ChatPrompt(text=text + forced, thinking=thinking, tool_names=names, tools=tools, forced_start=forced)


def _check_tool_turns(messages: list[v.ChatMessage]) -> None:
    """A tool result answers a call the assistant made just before it (OpenAI's rule), and a call's
    arguments are a JSON object: the prompt would otherwise show the model a conversation that never
    happened."""
    open_calls: set[str] | None = None  # ids of the last assistant turn's calls, while results may follow
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if message.role == "assistant":
            open_calls = None
            for j, call in enumerate(message.tool_calls or ()):
                try:
                    arguments = msgspec.json.decode(call.function.arguments)
                except (msgspec.DecodeError, RecursionError):
                    arguments = None
                if not isinstance(arguments, dict):
                    raise bad_request("tool call arguments must be a JSON object serialised as a string",
                                      param=f"{where}.tool_calls[{j}].function.arguments")
            if message.tool_calls:
                open_calls = {call.id for call in message.tool_calls if call.id is not None}
        elif message.role == "tool":
            if open_calls is None:
                raise bad_request("a tool message must follow an assistant message with tool_calls",
                                  param=f"{where}.role")
            if not message.tool_call_id:
                raise bad_request("a tool message needs the tool_call_id it answers", param=f"{where}.tool_call_id")
            if open_calls and message.tool_call_id not in open_calls:
                raise bad_request(f"tool_call_id {message.tool_call_id!r} answers no call of the preceding "
                                  "assistant message", param=f"{where}.tool_call_id")
        else:
            open_calls = None


def _tools_shown(body: v.ChatCompletionBody) -> list[dict]:
    tools = []
    for i, raw in enumerate(body.tools or ()):
        tool = v.decode_part(raw, v.ToolDef, f"tools[{i}]")
        if tool.type != "function":
            raise bad_request(f"tool type {tool.type!r} is not supported; use 'function'", param=f"tools[{i}].type")
        if not _TOOL_NAME.fullmatch(tool.function.name):
            # OpenAI's rule; it also keeps every name writable in a DSML invoke line.
            raise bad_request(f"tool name {tool.function.name!r} must match {_TOOL_NAME.pattern}",
                              param=f"tools[{i}].function.name")
        # The raw dict keeps the client's key order, which the prompt reproduces.
        tools.append(msgspec.json.decode(raw))
    choice = body.tool_choice
    if choice is None or choice == "auto":
        return tools
    if choice == "none":
        return []
    if not tools:
        raise bad_request("tool_choice requires tools", param="tool_choice")
    if choice == "required":
        return tools
    if isinstance(choice, str):
        raise bad_request(f"tool_choice must be 'none', 'auto', 'required' or a named function, got {choice!r}",
                          param="tool_choice")
    named = [tool for tool in tools if tool["function"]["name"] == choice.function.name]
    if not named:
        raise bad_request(f"tool_choice names {choice.function.name!r}, which is not in tools", param="tool_choice")
    return named[:1]


def _thinking(body: v.ChatCompletionBody) -> tuple[bool, str | None]:
    effort = body.reasoning_effort
    if effort is not None and effort not in REASONING_EFFORTS:
        raise bad_request(f"reasoning_effort must be one of {REASONING_EFFORTS}, got {effort!r}",
                          param="reasoning_effort")
    effort = effort if effort in ("high", "max") else None
    requested = (body.chat_template_kwargs or {}).get("thinking")
    if requested is None:
        return effort is not None, effort
    if not isinstance(requested, bool):
        raise bad_request("chat_template_kwargs.thinking must be a boolean", param="chat_template_kwargs.thinking")
    return requested, effort


def _attach_response_format(messages: list[dict], response_format: msgspec.Raw) -> None:
    """The encoder renders a system message's `response_format` (as the official one does)."""
    if bytes(response_format) in (b"", b"null"):
        return
    parsed = v.decode_part(response_format, v.ResponseFormat, "response_format")
    if parsed.type == "text":
        return
    if parsed.type not in ("json_object", "json_schema"):
        raise bad_request(f"response_format type {parsed.type!r} is not supported", param="response_format.type")
    if parsed.type == "json_schema" and (parsed.json_schema is None or parsed.json_schema.schema is None):
        raise bad_request("response_format json_schema needs a schema", param="response_format.json_schema")
    if not messages or messages[0].get("role") != "system":
        messages.insert(0, {"role": "system", "content": ""})
    messages[0]["response_format"] = msgspec.json.decode(response_format)


def _forced_start(choice, tools: list[dict], thinking: bool) -> str:
    """In chat mode the completion starts at once, so a required call can be started for the
    model; in thinking mode the reasoning comes first and the call cannot be forced."""
    if thinking or choice is None or isinstance(choice, str) and choice != "required":
        return ""
    if choice == "required":
        return _BLOCK_START
    return f'{_BLOCK_START} name="{tools[0]["function"]["name"]}">\n'
