"""Reads an SSE body the strict way: every event is exactly `data: <payload>` plus a blank line."""

from __future__ import annotations

import json


def parse_sse(raw: bytes) -> list:
    """Decoded JSON payloads in order, with the final `[DONE]` as the string "[DONE]"."""
    text = raw.decode("utf-8")
    assert text.endswith("\n\n"), f"stream does not end with a blank line: {text[-40:]!r}"
    events = []
    for block in text[:-2].split("\n\n"):
        assert block.startswith("data: ") and "\n" not in block, f"bad SSE frame {block!r}"
        payload = block[len("data: "):]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    assert events and events[-1] == "[DONE]" and "[DONE]" not in events[:-1], events[-3:]
    return events[:-1]
