"""Receive buffers owned by transfers.

A transfer posts UCX receives only into buffers it acquired here, and gives them back only when
no receive into them can still complete: its receive tasks have ended and either the sender
proved it is drained (commit, drain acknowledgement, its own abort) or the link was fenced.
A reused buffer therefore never sees a late byte from its previous transfer. A buffer whose receive
never ended, even after its link was fenced, is abandoned: counted, and never handed out again.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np


class StagingPool:
    def __init__(self, max_free_per_size: int = 256):
        self._free: dict[int, list[np.ndarray]] = defaultdict(list)
        self._max_free = max_free_per_size
        self.in_use = 0
        self.bytes_in_use = 0
        self.abandoned = 0

    def acquire(self, nbytes: int) -> np.ndarray:
        free = self._free[nbytes]
        buf = free.pop() if free else np.empty(nbytes, dtype=np.uint8)
        self.in_use += 1
        self.bytes_in_use += nbytes
        return buf

    def release(self, buf: np.ndarray) -> None:
        self._forget(buf)
        if len(self._free[buf.nbytes]) < self._max_free:
            self._free[buf.nbytes].append(buf)

    def abandon(self, buf: np.ndarray) -> None:
        """`buf` may still be written by a receive that never ended: it is never handed out again."""
        self._forget(buf)
        self.abandoned += 1

    def _forget(self, buf: np.ndarray) -> None:
        self.in_use -= 1
        self.bytes_in_use -= buf.nbytes
