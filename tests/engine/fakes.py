"""A scripted stand-in for ModelRunner, and what it would generate greedily.

Next-token logits are a pure function of the tokens fed so far, so the engine's output can be
checked token for token whatever the batching and chunking. The fake also checks what the real
pools check: (id, generation) of every page and slot, slot continuity and page coverage. Its
"slot state" is the token history, so prefix-cache snapshots and restores copy histories.
"""

from __future__ import annotations

import time

import torch

from dsv4.memory.pools import StaleReference


def next_token(history: list[int], vocab: int, avoid: frozenset[int]) -> int:
    token = (sum((i + 1) * t for i, t in enumerate(history[-8:])) + 7 * len(history)) % vocab
    while token in avoid:
        token = (token + 1) % vocab
    return token


def fake_greedy(prompt: list[int], max_new: int, vocab: int, avoid: frozenset[int]) -> list[int]:
    history = list(prompt)
    for _ in range(max_new):
        history.append(next_token(history, vocab, avoid))
    return history[len(prompt):]


class ScriptedRunner:
    def __init__(self, *, vocab: int, num_pages: int, num_slots: int, page_size: int,
                 avoid: frozenset[int] = frozenset(), forward_delay: float = 0.0):
        self.vocab, self.num_pages, self.num_slots, self.page_size = vocab, num_pages, num_slots, page_size
        self.num_snapshots = num_pages  # as ModelRunner: one boundary snapshot per page
        self.avoid = avoid
        self.forward_delay = forward_delay
        self.forwards = 0
        self._history: dict[int, list[int]] = {}
        self._page_generation = [-1] * num_pages
        self._slot_generation = [-1] * (num_slots + self.num_snapshots)

    def begin_tenancies(self, page_handouts, slot_handouts) -> None:
        for record, handouts in ((self._page_generation, page_handouts), (self._slot_generation, slot_handouts)):
            for i, generation in handouts:  # in allocation order: an id may appear more than once
                assert generation > record[i], f"unit {i} handed out again under generation {generation}"
                record[i] = generation

    def forward(self, batch):
        self.forwards += 1
        if self.forward_delay:
            time.sleep(self.forward_delay)
        rows = []
        self._copy(batch.restores)
        slots = [c.slot for c in batch.chunks]
        assert len(set(slots)) == len(slots), "two chunks share a slot"
        for c in batch.chunks:
            self._bind(self._slot_generation, "slot", c.slot, c.slot_generation)
            for page, generation in zip(c.page_ids, c.page_generations, strict=True):
                self._bind(self._page_generation, "page", page, generation)
            assert len(c.page_ids) * self.page_size >= c.start_pos + len(c.token_ids), "pages do not cover the chunk"
            history = self._history.setdefault(c.slot, [])
            if c.start_pos == 0:
                history.clear()
            assert c.start_pos == len(history), f"{c.rid}: chunk starts at {c.start_pos}, slot holds {len(history)}"
            history.extend(c.token_ids)
            if c.sample:
                logits = torch.zeros(self.vocab)
                logits[next_token(history, self.vocab, self.avoid)] = 4.0
                rows.append(logits)
        self._copy(batch.snapshots)
        return torch.stack(rows) if rows else torch.empty(0, self.vocab)

    def _copy(self, copies) -> None:
        for c in copies:
            self._bind(self._slot_generation, "slot", c.src, c.src_generation)
            self._bind(self._slot_generation, "slot", c.dst, c.dst_generation)
            self._history[c.dst] = list(self._history.get(c.src, []))

    @staticmethod
    def _bind(record: list[int], kind: str, i: int, generation: int) -> None:
        if generation != record[i]:
            raise StaleReference(f"{kind} {i} generation {generation}, current {record[i]}")
