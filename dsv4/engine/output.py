"""One request's text as it is generated: incremental detokenisation and stop strings (torch-free)."""

from __future__ import annotations


class TextStream:
    """Turns tokens into text deltas, never delivering text that may begin a stop string.

    A stop string can only start in text not yet delivered: delivered text never ends with a
    prefix of a stop string. So each push searches the undelivered tail alone.
    """

    def __init__(self, detokenizer, stop: tuple[str, ...], hidden_token_ids: tuple[int, ...] = ()):
        self._detokenizer = detokenizer
        self._stop = stop
        self._hidden = frozenset(hidden_token_ids)
        self._text = ""
        self._sent = 0  # characters of _text already delivered
        self.stopped = False  # a stop string appeared; the text ends before it

    def push(self, token_id: int) -> str:
        if token_id in self._hidden:
            return ""
        self._text += self._detokenizer.push(token_id)
        hits = [i for i in (self._text.find(s, self._sent) for s in self._stop) if i >= 0]
        if hits:
            self.stopped = True
            return self._deliver(min(hits))
        return self._deliver(len(self._text) - self._held_back())

    def finish(self) -> str:
        """The rest of the text, when generation ends for any reason but a stop string."""
        if self.stopped:
            return ""
        self._text += self._detokenizer.flush()
        return self._deliver(len(self._text))

    def _held_back(self) -> int:
        """Length of the longest undelivered suffix that is a proper prefix of a stop string."""
        unsent = len(self._text) - self._sent
        for n in range(min(unsent, max((len(s) for s in self._stop), default=1) - 1), 0, -1):
            if any(s.startswith(self._text[-n:]) for s in self._stop):
                return n
        return 0

    def _deliver(self, end: int) -> str:
        delta = self._text[self._sent : end]
        self._sent = max(self._sent, end)
        return delta
