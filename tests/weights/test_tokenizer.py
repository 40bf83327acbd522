"""The tiny checkpoint's tokenizer and the incremental detokeniser."""

import random
import time

import pytest

from dsv4.tokenizer import IncrementalDetokenizer, Tokenizer, TokenizerError

# The DeepSeek-V4 special tokens (official encoder's constants), each of which must be one id.
V4_SPECIAL_TOKENS = [
    "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>",
    "｜DSML｜", "<｜latest_reminder｜>", "<｜action｜>", "<｜query｜>", "<｜authority｜>", "<｜domain｜>",
    "<｜title｜>", "<｜read_url｜>",
]
TEXTS = [
    "Hello, world! The function returns the sum of two numbers.",
    "你好，世界！今天天气很好。日本語のテキストです。",
    "emoji 😀👍🏽 and flags 🇫🇷, math ∑ √2 ≈ 1.414, accents: déjà vu, naïve",
    (
        '\n\n<｜DSML｜tool_calls>\n<｜DSML｜invoke name="get_weather">\n<｜DSML｜parameter name="city" string="true">'
        "巴黎</｜DSML｜parameter>\n</｜DSML｜invoke>\n</｜DSML｜tool_calls>"
    ),
    "<think>Let me think 🤔 about it.</think>The answer is 42.",
    "  leading spaces, tabs\tand\r\nnewlines  ",
]


@pytest.fixture(scope="module")
def tok(tiny_ckpt) -> Tokenizer:
    return Tokenizer.from_dir(tiny_ckpt)


def _stream(tok, ids):
    detok = IncrementalDetokenizer(tok)
    return [detok.push(i) for i in ids] + [detok.flush()]


def test_special_ids(tok):
    assert (tok.bos_id, tok.eos_id) == (0, 1)
    assert tok.encode("<think>") == [tok.think_start_id]
    assert tok.encode("</think>") == [tok.think_end_id]
    assert tok.encode("｜DSML｜") == [tok.dsml_id]
    assert tok.parse_token_ids == {tok.think_start_id, tok.think_end_id, tok.dsml_id}


@pytest.mark.parametrize("token", V4_SPECIAL_TOKENS)
def test_special_tokens_are_single_ids_inside_text(tok, token):
    ids = tok.encode(f"abc{token}def")
    assert len(tok.encode(token)) == 1
    assert tok.encode(token)[0] in ids
    assert tok.decode(ids) == f"abc{token}def"


def test_add_bos(tok):
    assert tok.encode("hi", add_bos=True) == [tok.bos_id, *tok.encode("hi")]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip(tok, text):
    assert tok.decode(tok.encode(text)) == text


def test_common_words_are_single_tokens(tok):
    assert len(tok.encode("The answer is the function")) == 5


def test_skip_special_keeps_the_parser_markers(tok):
    ids = tok.encode("<｜User｜>hi<｜Assistant｜><think>x</think>｜DSML｜y<｜end▁of▁sentence｜>", add_bos=True)
    assert tok.decode(ids, skip_special=True) == "hi<think>x</think>｜DSML｜y"


def test_decode_agrees_with_the_tokenizers_library(tok):
    ids = random.Random(1).choices(range(tok.vocab_size), k=3000)
    assert tok.decode(ids) == tok.inner.decode(ids, skip_special_tokens=False)
    assert tok.decode(ids, skip_special=True) == tok.inner.decode(ids, skip_special_tokens=True)


def test_ids_outside_the_vocabulary_decode_to_nothing(tok):
    assert tok.decode([tok.vocab_size, *tok.encode("ok"), -1]) == "ok"


@pytest.mark.parametrize("text", TEXTS)
def test_stream_equals_full_decode_and_never_splits_a_character(tok, text):
    ids = tok.encode(text, add_bos=True) + [tok.eos_id]
    chunks = _stream(tok, ids)
    assert "".join(chunks) == tok.decode(ids, skip_special=True) == text
    assert not any("\ufffd" in chunk for chunk in chunks)


def _byte_token_ids(tok) -> dict[int, int]:
    """byte value -> id of the token that is exactly that byte."""
    return {token_bytes[0]: i for i, token_bytes in enumerate(tok._full) if len(token_bytes) == 1}


def test_stream_emits_each_character_as_soon_as_its_last_byte_arrives(tok):
    by_byte = _byte_token_ids(tok)
    assert len(by_byte) == 256
    text = "a😀b你é"
    emitted, expected = "", ""
    detok = IncrementalDetokenizer(tok)
    for char in text:
        encoded = char.encode()
        for k, byte in enumerate(encoded):
            emitted += detok.push(by_byte[byte])
            assert emitted == (expected + char if k == len(encoded) - 1 else expected)
        expected += char
    assert detok.flush() == ""


def test_stream_equals_full_decode_for_random_ids_and_splits(tok):
    """Random ids include specials, EOS, and byte tokens that break UTF-8 sequences in random places."""
    rng = random.Random(0)
    by_byte = _byte_token_ids(tok)
    for _ in range(50):
        ids = []
        for _ in range(rng.randrange(1, 60)):
            choice = rng.random()
            if choice < 0.5:  # bytes of a random multi-byte character, possibly cut short
                raw = rng.choice("é你😀∑🇫").encode()
                ids += [by_byte[b] for b in raw[: rng.randrange(1, len(raw) + 1)]]
            else:
                ids.append(rng.randrange(tok.vocab_size))
        chunks = _stream(tok, ids)
        assert "".join(chunks) == tok.decode(ids, skip_special=True)
        assert not any("<｜end▁of▁sentence｜>" in chunk or "<｜begin▁of▁sentence｜>" in chunk for chunk in chunks)


def test_eos_and_bos_are_never_text(tok):
    assert _stream(tok, [tok.bos_id, tok.eos_id]) == ["", "", ""]


def test_unfinished_character_is_flushed_as_replacement(tok):
    detok = IncrementalDetokenizer(tok)
    by_byte = _byte_token_ids(tok)
    assert detok.push(by_byte["😀".encode()[0]]) == ""
    assert detok.flush() == "\ufffd"


def test_detokeniser_is_fast(tok):
    ids = random.Random(2).choices(range(tok.vocab_size), k=20000)
    start = time.perf_counter()
    _stream(tok, ids)
    assert time.perf_counter() - start < 2.0  # >= 10k tokens/s even on a loaded machine


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(TokenizerError, match="tokenizer.json"):
        Tokenizer.from_dir(tmp_path)
