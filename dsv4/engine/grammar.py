"""Grammar-constrained decoding with llguidance: one matcher per constrained request, its token
mask computed off the hot path and applied on the logits' device.

A constrained request carries its grammar in `SamplingParams.grammar` (llguidance's serialised
grammar, compiled and validated by the server before admission). Its matcher is built on the
grammar thread when the request is admitted (or adopted after a PD transfer, where the first token
was sampled under the same grammar on the prefill side), and is advanced only by the tokens the
request samples: a retracted request recomputes rows, never tokens, so its matcher stays where it
was. Each tick, the masks of the constrained rows are computed on the grammar thread (llguidance
spreads the rows over its own threads) while the forward runs; the forward thread waits for them,
fills the disallowed logits with -inf on the logits' device, samples, and advances the matchers. A
batch without constrained rows does none of this. Only the grammar thread and, during a tick, the
forward thread touch matchers, one after the other: a tick's masks are submitted after the previous
tick's tokens were consumed.

End of sentence: the matcher allows EOS exactly where the grammar may end, and only EOS once it
cannot go on; a grammar that has ended finishes the request ("stop") whatever `ignore_eos` says.
A matcher error (a grammar llguidance cannot build, a token it refuses) ends its request alone.
"""

from __future__ import annotations

import functools
import json
import os
from concurrent.futures import Future, ThreadPoolExecutor

import llguidance
import llguidance.numpy
import numpy as np
import torch

from dsv4.chat import DSML, THINK_END
from dsv4.chat.grammar import JSON_OPTIONS

MASK_THREADS = max(1, min(8, (os.cpu_count() or 2) - 1))


class GrammarError(ValueError):
    """A grammar that cannot constrain a request, or a matcher that refused a token."""


def from_lark(lark: str) -> str:
    return llguidance.LLMatcher.grammar_from_lark(lark)


def from_json_schema(schema: dict | str) -> str:
    return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)


def from_regex(regex: str) -> str:
    return llguidance.LLMatcher.grammar_from_regex(regex)


def grammar_error(grammar: str) -> str:
    """Why `grammar` cannot be used (empty when it can). Independent of the tokenizer: its token
    references are checked when a matcher is built."""
    return llguidance.LLMatcher.validate_grammar(grammar)


def marker_terms(tokenizer):
    """`marker(text)` for dsv4.chat.grammar: the special-token term of a marker that is one token of
    `tokenizer`, else the marker as text."""
    ids = {THINK_END: getattr(tokenizer, "think_end_id", None), DSML: getattr(tokenizer, "dsml_id", None)}

    def marker(text: str) -> str:
        token = ids.get(text)
        return f"<[{token}]>" if token is not None else json.dumps(text, ensure_ascii=False)

    return marker


class _TokenizerView:
    """What llguidance.TokenizerWrapper reads: every id's bytes, with the tokenizer's added tokens
    (BOS, EOS, role, think and DSML markers) special, so that no text lexeme can contain one."""

    def __init__(self, tokenizer, vocab_size: int):
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(vocab_size)]
        self.special_token_ids = sorted(tokenizer.added_token_ids)

    def __call__(self, text) -> list[int]:
        if isinstance(text, bytes):
            text = text.decode("utf-8", "replace")
        return self._tokenizer.encode(text)


class Constraints:
    """The matchers of the live constrained requests (rid -> its matcher, being built or built)."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        self._tokenizer, self._vocab_size, self._eos_ids = tokenizer, vocab_size, sorted(eos_ids)
        self._matchers: dict[str, Future[llguidance.LLMatcher]] = {}
        # One thread: a request's matcher is built before any mask of it is computed.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-grammar")

    @functools.cached_property
    def _llg_tokenizer(self) -> llguidance.LLTokenizer:
        view = _TokenizerView(self._tokenizer, self._vocab_size)
        return llguidance.LLTokenizer(llguidance.TokenizerWrapper(view), n_vocab=self._vocab_size,
                                      eos_token=self._eos_ids)

    @functools.cached_property
    def _executor(self) -> llguidance.LLExecutor:
        return llguidance.LLExecutor(MASK_THREADS)

    def add(self, rid: str, grammar: str, consumed: tuple[int, ...] = ()) -> None:
        """Starts building `rid`'s matcher, advanced past `consumed` (PD: the first token)."""
        self._matchers[rid] = self._thread.submit(self._build, grammar, consumed)

    def forget(self, rid: str) -> None:
        self._matchers.pop(rid, None)

    def __contains__(self, rid: str) -> bool:
        return rid in self._matchers

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)

    def _build(self, grammar: str, consumed: tuple[int, ...]) -> llguidance.LLMatcher:
        matcher = llguidance.LLMatcher(self._llg_tokenizer, grammar, log_level=0)
        if consumed:
            matcher.consume_tokens(list(consumed))  # a refusal is the matcher's error, reported at its first mask
        return matcher

    # -- per tick ---------------------------------------------------------------------------------
    def start_masks(self, rows: list[tuple[int, str]]) -> Future[tuple[np.ndarray, dict[int, str]]]:
        """Starts computing the masks of the (row, rid) pairs on the grammar thread: a bitmask with one
        row per pair, and why each row that cannot be sampled failed."""
        return self._thread.submit(self._masks, rows)

    def _masks(self, rows: list[tuple[int, str]]) -> tuple[np.ndarray, dict[int, str]]:
        bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), self._vocab_size)
        failed: dict[int, str] = {}
        live: list[tuple[llguidance.LLMatcher, int]] = []
        for k, (row, rid) in enumerate(rows):
            try:
                matcher = self._matchers[rid].result()
            except Exception as e:  # noqa: BLE001 -- a matcher that cannot be built fails its request
                failed[row] = f"the grammar cannot be used: {e}"
                continue
            if matcher.is_error():
                failed[row] = f"grammar: {matcher.get_error()}"
            else:
                live.append((matcher, k))
        if live:
            llguidance.numpy.fill_next_token_bitmask_par(self._executor, live, bitmask)
        for matcher, k in live:
            if matcher.is_error():
                failed[rows[k][0]] = f"grammar: {matcher.get_error()}"
            elif not bitmask[k].any():
                failed[rows[k][0]] = "grammar: no token is allowed"
        return bitmask, failed

    @staticmethod
    def apply(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> torch.Tensor:
        """`logits` with every token that row rows[k]'s mask disallows at -inf (a copy)."""
        device, vocab = logits.device, logits.shape[1]
        words = torch.from_numpy(bitmask).to(device, non_blocking=True)
        shifts = torch.arange(32, device=device, dtype=torch.int32)
        allowed = ((words[:, :, None] >> shifts) & 1).reshape(len(rows), -1)[:, :vocab].bool()
        index = torch.tensor(rows, device=device)
        logits = logits.clone()
        logits[index] = logits[index].masked_fill(~allowed, float("-inf"))
        return logits

    def advance(self, rid: str, token: int) -> bool:
        """Consumes `rid`'s sampled token; True when the grammar has ended with it. Raises GrammarError
        when the matcher refuses it."""
        matcher = self._matchers[rid].result()
        if not matcher.consume_token(token):
            raise GrammarError(f"grammar refused token {token}: {matcher.get_error()}")
        return matcher.is_stopped() and token in self._eos_ids
