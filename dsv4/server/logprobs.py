"""Logprobs in each API's shape, from the engine's TokenLogprob entries (dsv4/engine/logprobs.py:
raw logits, before sampling processors and temperature).

- chat (OpenAI): `{"content": [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}`
- completions (OpenAI legacy): `{tokens, token_logprobs, top_logprobs: [{token: logprob}], text_offset}`;
  the first prompt token (echo) has null logprobs; each top dict also holds the chosen token, as
  vLLM's does, so it may have one entry more than asked; tokens whose texts are equal share one key
  (the most likely one's value).
- native (SGLang): `[logprob, token_id, text or null]` tuples, and lists of them for the top ones.

A token's text is its bytes decoded as UTF-8 (a token that ends inside a character shows U+FFFD;
`bytes` holds the exact bytes). JSON has no -inf: logprobs are clamped at -9999.0, as vLLM does.
"""

from __future__ import annotations

from collections.abc import Sequence

from dsv4.protocol import TokenLogprob

MIN_LOGPROB = -9999.0


def _value(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


class TokenText:
    """Token id -> (text, bytes), memoised per request."""

    def __init__(self, tokenizer):
        self._tokenizer = tokenizer
        self._seen: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        entry = self._seen.get(token_id)
        if entry is None:
            raw = self._tokenizer.token_bytes(token_id)
            entry = self._seen[token_id] = (raw.decode("utf-8", "replace"), raw)
        return entry

    def text(self, token_id: int) -> str:
        return self(token_id)[0]


def chat_content(text: TokenText, entries: Sequence[TokenLogprob]) -> list[dict]:
    """OpenAI chat's `logprobs.content` items."""

    def item(token_id: int, logprob: float) -> dict:
        token, raw = text(token_id)
        return {"token": token, "logprob": _value(logprob), "bytes": list(raw)}

    return [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]


class CompletionLogprobs:
    """OpenAI completions' `logprobs` object of one choice, built token by token."""

    def __init__(self, text: TokenText, text_offset: int):
        self._text = text
        self._offset = text_offset
        self.tokens: list[str] = []
        self.token_logprobs: list[float | None] = []
        self.top_logprobs: list[dict[str, float] | None] = []
        self.text_offset: list[int] = []

    def add(self, token_id: int, entry: TokenLogprob | None) -> None:
        """One token; `entry` None for the first prompt token, which has no logprob."""
        token = self._text.text(token_id)
        self.tokens.append(token)
        self.text_offset.append(self._offset)
        self._offset += len(token)
        if entry is None:
            self.token_logprobs.append(None)
            self.top_logprobs.append(None)
            return
        self.token_logprobs.append(_value(entry.logprob))
        top: dict[str, float] = {}
        for t, lp in entry.top:  # tokens with the same text share a key: the most likely one's
            top.setdefault(self._text.text(t), _value(lp))
        top.setdefault(token, _value(entry.logprob))
        self.top_logprobs.append(top)

    def extend(self, token_ids: Sequence[int], entries: Sequence[TokenLogprob | None]) -> None:
        for token_id, entry in zip(token_ids, entries, strict=True):
            self.add(token_id, entry)

    def take(self) -> dict:
        """The object so far, and start anew (streaming sends each chunk's own tokens)."""
        out = {"tokens": self.tokens, "token_logprobs": self.token_logprobs, "top_logprobs": self.top_logprobs,
               "text_offset": self.text_offset}
        self.tokens, self.token_logprobs, self.top_logprobs, self.text_offset = [], [], [], []
        return out


def native_entries(text: TokenText | None, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int]
                   ) -> tuple[list[list], list[list | None]]:
    """SGLang's (token_logprobs, top_logprobs): `[logprob, token_id, text]` per token (text None
    unless `text` is given; logprob None for the first prompt token), and per token its top list."""

    def triple(token_id: int, logprob: float | None) -> list:
        return [None if logprob is None else _value(logprob), token_id, None if text is None else text.text(token_id)]

    values, tops = [], []
    for token_id, entry in zip(token_ids, entries, strict=True):
        values.append(triple(token_id, None if entry is None else entry.logprob))
        tops.append(None if entry is None else [triple(t, lp) for t, lp in entry.top])
    return values, tops
