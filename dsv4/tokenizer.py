"""tokenizer.json loading (HF `tokenizers`) and incremental detokenisation per request.

Decoding works on bytes: every id maps to the bytes it stands for (byte-level BPE symbols mapped
back through the GPT-2 byte alphabet; added tokens as their UTF-8 text), and text is produced by
a UTF-8 decoder, so streamed text is exactly the full decode and never holds half a character.
Streamed text skips special tokens (BOS, EOS, role and task markers; EOS is recognised by id),
while `<think>`, `</think>` and `｜DSML｜` are plain added tokens and stay in the text, because the
reasoning and tool-call parsers read them.
"""

from __future__ import annotations

import codecs
import functools
import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

BOS_TOKEN = "<｜begin▁of▁sentence｜>"
EOS_TOKEN = "<｜end▁of▁sentence｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML_TOKEN = "｜DSML｜"


class TokenizerError(ValueError):
    """A tokenizer directory dsv4 cannot use."""


def _byte_level_decoding() -> dict[str, int]:
    """ByteLevel symbol (one printable char per byte, GPT-2 style) -> the byte it stands for."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # The alphabet maps bytes 33..126, 161..172, 174..255 to themselves and the rest to U+0100 upward, in byte order.
    kept = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
    moved = [b for b in range(256) if b not in set(kept)]
    table = {chr(b): b for b in kept}
    table.update({chr(256 + i): b for i, b in enumerate(moved)})
    if set(table) != set(alphabet):
        raise TokenizerError("unexpected ByteLevel alphabet in this version of `tokenizers`")
    return table


class Tokenizer:
    """Encode/decode over a `tokenizers.Tokenizer`, with the DeepSeek-V4 special ids at hand."""

    def __init__(self, inner: HFTokenizer, bos_token: str = BOS_TOKEN, eos_token: str = EOS_TOKEN):
        self.inner = inner
        self.bos_id = self._required_id(bos_token)
        self.eos_id = self._required_id(eos_token)
        self.think_start_id = inner.token_to_id(THINK_START)
        self.think_end_id = inner.token_to_id(THINK_END)
        self.dsml_id = inner.token_to_id(DSML_TOKEN)
        self.vocab_size = inner.get_vocab_size(with_added_tokens=True)
        self._full, self._streamed = self._token_tables()

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        try:
            inner = HFTokenizer.from_file(str(file))
        except Exception as e:  # noqa: BLE001 -- tokenizers raises plain Exception for missing or malformed files
            raise TokenizerError(f"{file}: cannot load tokenizer ({e})") from None
        config = _read_tokenizer_config(file.parent / "tokenizer_config.json")
        return cls(inner, _token_text(config.get("bos_token")) or BOS_TOKEN, _token_text(config.get("eos_token")) or EOS_TOKEN)

    def _required_id(self, token: str) -> int:
        token_id = self.inner.token_to_id(token)
        if token_id is None:
            raise TokenizerError(f"tokenizer has no {token!r} token")
        return token_id

    def _token_tables(self) -> tuple[list[bytes], list[bytes]]:
        """Per id: the bytes it decodes to, and the bytes it streams as (nothing for special tokens)."""
        byte_of = _byte_level_decoding()
        added_tokens = self.inner.get_added_tokens_decoder()
        full: list[bytes] = [b""] * self.vocab_size
        for token, token_id in self.inner.get_vocab(with_added_tokens=False).items():
            if token_id in added_tokens:
                continue
            try:
                full[token_id] = bytes(byte_of[ch] for ch in token)
            except KeyError:
                raise TokenizerError(f"token {token!r} (id {token_id}) is not byte-level BPE") from None
        streamed = list(full)
        for token_id, added in added_tokens.items():
            full[token_id] = streamed[token_id] = added.content.encode()
            if added.special:
                streamed[token_id] = b""
        streamed[self.bos_id] = streamed[self.eos_id] = b""
        return full, streamed

    @property
    def parse_token_ids(self) -> set[int]:
        """Ids whose text the output parsers need (think markers, DSML)."""
        return {i for i in (self.think_start_id, self.think_end_id, self.dsml_id) if i is not None}

    @functools.cached_property
    def added_token_ids(self) -> frozenset[int]:
        """Ids of the added tokens: BOS, EOS, role, task, think and DSML markers."""
        return frozenset(self.inner.get_added_tokens_decoder())

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; special tokens written in the text become their single ids."""
        ids = self.inner.encode(text, add_special_tokens=False).ids
        return [self.bos_id, *ids] if add_bos else ids

    def encode_without_gil(self, text: str) -> list[int]:
        """`encode(text)` for a worker thread: the batch entry point of `tokenizers` releases the GIL
        while it works (the single one does not), so the event loop keeps turning."""
        return self.inner.encode_batch([text], add_special_tokens=False)[0].ids

    @functools.cached_property
    def max_token_bytes(self) -> int:
        """The most bytes one token stands for: a text of n characters has at least
        n / max_token_bytes tokens, a bound known before tokenising."""
        return max(len(b) for b in self._full)

    def stream_bytes(self, token_id: int) -> bytes:
        """The bytes one generated id adds to the output text (none for special or unknown ids)."""
        return self._streamed[token_id] if 0 <= token_id < self.vocab_size else b""

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one id stands for (special tokens included; none for ids outside the vocabulary)."""
        return self._full[token_id] if 0 <= token_id < self.vocab_size else b""

    def decode(self, ids: list[int], skip_special: bool = False) -> str:
        """Text of `ids`. With `skip_special`, special tokens (BOS, EOS, role and task markers) are
        dropped, while `<think>`, `</think>` and `｜DSML｜` stay. Ids outside the vocabulary (the
        embedding's padding rows) decode to nothing."""
        table = self._streamed if skip_special else self._full
        n = self.vocab_size
        return b"".join(table[i] for i in ids if 0 <= i < n).decode("utf-8", "replace")


class IncrementalDetokenizer:
    """Streams one request's text: `push(id)` returns only newly completed UTF-8 text.

    Everything pushed, plus `flush()`, equals `tokenizer.decode(ids, skip_special=True)`: BOS, EOS
    and other special tokens never become text, the parsers' markers do. An incomplete multi-byte
    character is held back until its last byte arrives; invalid bytes become U+FFFD exactly as in
    the full decode.
    """

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def push(self, token_id: int) -> str:
        return self._utf8.decode(self.tokenizer.stream_bytes(token_id))

    def flush(self) -> str:
        """Whatever is held back at the end of the stream (an unfinished character becomes U+FFFD)."""
        return self._utf8.decode(b"", final=True)


def _read_tokenizer_config(path: Path) -> dict:
    if not path.exists():
        return {}
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise TokenizerError(f"{path}: not valid JSON ({e})") from None
    return config if isinstance(config, dict) else {}


def _token_text(value) -> str | None:
    """tokenizer_config.json writes a token as a string or as {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None
