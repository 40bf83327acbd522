"""Prompt encoding: OpenAI-style messages -> a DeepSeek-V4 prompt, byte for byte as DeepSeek's
official ``encoding_dsv4.py`` renders it (see the package docstring)."""

import copy
import json

from dsv4.chat.constants import BOS, DSML, THINK_END, THINK_START
from dsv4.chat.constants import FORMAT as _C
from dsv4.chat.constants import to_json as _to_json

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
