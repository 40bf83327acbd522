"""Test-only transfer faults at run time (off by default).

`--fault-inject` is parsed in one place, `dsv4.config.FaultInjection`; its `ACTION:...` items are:

  drop:KIND:P              the frame is not sent (a payload's header and body go together)
  delay:KIND:P:DURATION    the sender waits DURATION first (e.g. 200ms, 2s), keeping its order
  duplicate:KIND:P         the frame (and a payload's body) is sent twice
  corrupt:KIND:P           one byte is flipped after the checksum was taken
  stall:prefill:DURATION   every prefill computation sleeps DURATION first
  kill:transfer_task       the first prefill transfer task raises, as if it had hit an unexpected frame

KIND is a frame kind (`payload`, `commit`, `abort`, ... as tagged in dsv4/protocol.py) or `*`.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from dsv4.config import FaultInjection


class InjectedFault(RuntimeError):
    """Raised where `kill:transfer_task` asks for it."""


@dataclass(frozen=True)
class SendDecision:
    drop: bool = False
    delay_s: float = 0.0
    duplicate: bool = False
    corrupt: bool = False


class TransferFaults:
    def __init__(self, config: FaultInjection | None = None, seed: int | None = None):
        config = config or FaultInjection()
        self.frame_faults = config.frame_faults
        self.stall_prefill_s = config.stall_prefill_seconds
        self._kill_transfer_task = config.kill_transfer_task
        self.rng = random.Random(seed)

    @classmethod
    def parse(cls, spec: str | None, seed: int | None = None) -> TransferFaults:
        return cls(FaultInjection.parse(spec), seed)

    def on_send(self, kind: str) -> SendDecision:
        hits = {"drop": False, "duplicate": False, "corrupt": False}
        delay = 0.0
        for fault in self.frame_faults:
            if fault.kind in ("*", kind) and self.rng.random() < fault.probability:
                if fault.action == "delay":
                    delay = max(delay, fault.delay_seconds)
                else:
                    hits[fault.action] = True
        return SendDecision(delay_s=delay, **hits)

    def take_kill(self) -> bool:
        """True once: the next transfer task should die."""
        kill, self._kill_transfer_task = self._kill_transfer_task, False
        return kill
