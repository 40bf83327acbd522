"""A follower rank (rank > 0): applies rank 0's plans, in order, and runs the same forward.

Its tick mirrors rank 0's (dsv4/engine/tick.py) collective for collective: receive the plan
(broadcast), the bytes of the plan's PD installs (broadcast, when it has any), forward (the model's
all_reduces), consensus vector. It decides nothing: the plan carries every change of state, and the
batch alone names the pages and slots the forward uses (their generations are checked by the
runner, as on rank 0). Sampling is rank 0's; the sampled tokens reach this rank in the next plan's
chunks.

Whether each install landed here is a rank-local fact: it goes into the consensus vector, and an
install that did not land fails that transfer on rank 0, not this rank. Any other failure (a
collective past its deadline, rank 0 gone, a local error) is fatal: the rank logs it and exits
non-zero, and its peers' next collective names it.
"""

from __future__ import annotations

import logging

import torch
import uvloop

from dsv4.config import ServerArgs
from dsv4.dist.collectives import TpGroup
from dsv4.engine.forward_thread import ForwardThread
from dsv4.engine.install import receive_installs
from dsv4.engine.runner import ModelRunner
from dsv4.engine.tick import consensus, rank_faults

log = logging.getLogger(__name__)


class Follower:
    def __init__(self, group: TpGroup, runner: ModelRunner, args: ServerArgs) -> None:
        self.group, self.runner = group, runner
        self._delays = rank_faults(args.faults, group.rank)
        self._seq = 0

    def tick(self) -> None:
        """One tick, on the forward thread."""
        group = self.group
        self._delays.sleep("plan", self._seq + 1)
        plan = group.broadcast_plan(None)
        if plan.seq != self._seq + 1:
            raise RuntimeError(f"rank {group.rank}: received the plan of tick {plan.seq} after tick {self._seq}")
        self._seq = plan.seq
        self.runner.begin_tenancies(plan.page_handouts, plan.slot_handouts)
        landed = receive_installs(self.runner.pools, plan.installs, group, None)
        self._delays.sleep("forward", plan.seq)
        with torch.inference_mode():
            self.runner.forward(plan.batch)
        self._delays.sleep("consensus", plan.seq)
        consensus(group, plan.seq, landed)

    async def run(self) -> None:
        thread = ForwardThread("dsv4-forward")
        try:
            while True:
                await thread.run(self.tick)
        finally:
            thread.close(wait=True)


def run_follower(args: ServerArgs, group: TpGroup) -> int:
    """Loads this rank's shard and follows rank 0 until the group ends; the process exit code (never 0:
    a follower's group only ends by failure or by being stopped)."""
    from dsv4.engine.launch import load_model, settle_heap

    try:
        runner = load_model(args, group).runner
        settle_heap()
        uvloop.run(Follower(group, runner, args).run())
    except Exception as e:  # noqa: BLE001 -- the rank's end, whatever ended it, is logged and fatal
        log.critical("rank %d exiting at tick %d: %s: %s", group.rank, group.tick, type(e).__name__, e)
    return 1
