"""The tensor-parallel group: the only module that calls torch.distributed (ARCHITECTURE.md invariant 1;
tests/dist/test_collectives_scan.py holds every other module to that).

Every collective is named ("all_reduce(attn.out)"), timed into the `dsv4_collective_seconds`
histogram by op, and runs under the group's deadline (`--dist-timeout`, given to
init_process_group, which gloo and NCCL enforce). A collective that fails or misses its deadline
raises `CollectiveError` naming the rank, the op and the tick: the group cannot go on, so the
tick loop dies with that message (and every rank exits non-zero).

Wire bytes are msgspec msgpack (a TickPlan), never pickle: `broadcast_plan` sends a fixed-size
header (length, seq) and then the bytes. `broadcast_bytes` sends raw state (PD installs) whose
length every rank knows from the plan.

A CPU group whose ranks all run on one node all-reduces through shared memory (dsv4.dist.shm_reduce:
a decode step's rows in microseconds, against gloo's ~1.2 ms on 2 cores); larger tensors and other
groups through the backend. The same deadline holds, and a peer process that dies is noticed within
shm_reduce.POLL_LIVENESS_S.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist

from dsv4.dist import shm_reduce
from dsv4.protocol import TickPlan

JOIN_POLL_S = 0.05
DEATH_NOTICE_S = 2.0  # how long a failed collective waits to see which rank process died
_NO_VALUE = torch.iinfo(torch.int64).max  # MIN-reduce identity


class GroupError(RuntimeError):
    """The group could not form, or a collective failed or missed its deadline. Fatal."""


class CollectiveError(GroupError):
    pass


class TpGroup:
    def __init__(self, rank: int, size: int, ranks_per_node: int, timeout: float, device: torch.device) -> None:
        self.rank, self.size, self.ranks_per_node = rank, size, ranks_per_node
        self.timeout, self.device = timeout, device
        self.tick = 0  # the tick whose collectives run now: named in every error
        # (op label, seconds) after each collective: the engine's histogram on rank 0.
        self.observe: Callable[[str, float], None] | None = None
        # Rank 0: a rank process known to have died, in words ("rank 1 exited, killed by SIGKILL").
        self.dead_rank: Callable[[], str | None] | None = None
        self.slowest: tuple[str, float, int] | None = None  # (op, seconds, tick) of the slowest collective yet
        self._plan_encoder = msgspec.msgpack.Encoder()
        self._plan_decoder = msgspec.msgpack.Decoder(TickPlan)
        self._shm: shm_reduce.ShmReducer | None = None  # the node's shared-memory all-reduce, where it serves

    @classmethod
    def join(cls, rank: int, size: int, addr: str, timeout: float, *, join_timeout: float, ranks_per_node: int,
             device: torch.device) -> TpGroup:
        """Forms the group through rank 0's store at `addr` (HOST:PORT, rank 0 listens there); waits at
        most `join_timeout` seconds for every rank, then names the ranks that never joined. `timeout`:
        every collective's deadline."""
        host, _, port = addr.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), size, is_master=rank == 0,
                                  timeout=datetime.timedelta(seconds=join_timeout), wait_for_workers=False)
        except (RuntimeError, dist.DistError) as e:
            raise GroupError(f"rank {rank}: could not reach rank 0's rendezvous at {addr} within {join_timeout:g} s "
                             f"({type(e).__name__}: {e})") from None
        group = cls(rank, size, ranks_per_node, timeout, device)
        shared = device.type == "cpu" and ranks_per_node == size > 1 and shm_reduce.supported()
        path = shm_reduce.new_path() if shared and rank == 0 and shm_reduce.room_for(size) else None
        try:
            if shared:  # before any rank is let in: each maps the file before the group forms
                group._map_shared_memory(store, path, addr, join_timeout)
            store.set(f"joined/{rank}", "1")
            if rank == 0:
                group._await_ranks(store, addr, join_timeout)
            backend = "nccl" if device.type == "cuda" else "gloo"
            try:
                dist.init_process_group(backend, store=store, rank=rank, world_size=size,
                                        timeout=datetime.timedelta(seconds=timeout))
            except (RuntimeError, dist.DistError) as e:
                raise GroupError(f"rank {rank}: the group at {addr} did not form ({type(e).__name__}: {e})") from None
        finally:
            if rank == 0 and path is not None:  # every rank has it mapped, or never will: nothing left behind
                Path(path).unlink(missing_ok=True)
        return group

    def _map_shared_memory(self, store, path: str | None, addr: str, join_timeout: float) -> None:
        """Rank 0 creates the node's shared-memory file at `path` (None: no room, every rank keeps gloo's
        all-reduce) and names it in the store; every other rank maps the file rank 0 names."""
        if self.rank == 0:
            if path is not None:
                self._shm = shm_reduce.ShmReducer(path, 0, self.size, create=True)
            store.set("shm_reduce", path or "")
            return
        try:
            shared_path = store.get("shm_reduce").decode()
            if shared_path:
                self._shm = shm_reduce.ShmReducer(shared_path, self.rank, self.size, create=False)
        except (RuntimeError, dist.DistError, OSError) as e:
            raise GroupError(f"rank {self.rank}: no shared-memory file from rank 0 at {addr} within "
                             f"{join_timeout:g} s ({type(e).__name__}: {e})") from None

    def _await_ranks(self, store, addr: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        missing = list(range(1, self.size))
        while missing:
            missing = [r for r in missing if not store.check([f"joined/{r}"])]
            if missing and time.monotonic() > deadline:
                named = ", ".join(f"rank {r} (node {r // self.ranks_per_node})" for r in missing)
                raise GroupError(f"{named} did not join the group at {addr} within {timeout:g} s")
            time.sleep(JOIN_POLL_S if missing else 0)

    def close(self) -> None:
        if self._shm is not None:
            self._shm.close()
            self._shm = None
        if dist.is_initialized():
            dist.destroy_process_group()

    # -- the collectives ---------------------------------------------------------------------------
    def all_reduce_sum(self, tensor: torch.Tensor, name: str) -> torch.Tensor:
        """Sums `tensor` across ranks, in place (on the group's device); returns it."""
        if self._shm is not None and self._shm.serves(tensor):
            self._run("all_reduce", name, lambda: self._shm.all_reduce(tensor, "sum", self._deadline()))
            return tensor
        if tensor.device == self.device:
            self._run("all_reduce", name, lambda: dist.all_reduce(tensor))
            return tensor
        moved = tensor.to(self.device)
        self._run("all_reduce", name, lambda: dist.all_reduce(moved))
        return tensor.copy_(moved)

    def broadcast_plan(self, plan: TickPlan | None) -> TickPlan:
        """Rank 0 sends `plan`; every other rank passes None and receives it."""
        if self.rank == 0:
            data = self._plan_encoder.encode(plan)
            header = torch.tensor([len(data), plan.seq], dtype=torch.int64, device=self.device)
        else:
            header = torch.zeros(2, dtype=torch.int64, device=self.device)
        self._run("broadcast", "plan.header", lambda: dist.broadcast(header, src=0))
        length, seq = header.tolist()
        if self.rank == 0:
            payload = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device)
        else:
            self.tick = seq
            payload = torch.empty(length, dtype=torch.uint8, device=self.device)
        self._run("broadcast", "plan", lambda: dist.broadcast(payload, src=0))
        if self.rank == 0:
            return plan
        received = self._plan_decoder.decode(payload.cpu().numpy().tobytes())
        if received.seq != seq:
            raise CollectiveError(f"rank {self.rank}: plan of tick {received.seq} came under header of tick {seq}")
        return received

    def broadcast_bytes(self, data: torch.Tensor, name: str) -> torch.Tensor:
        """Rank 0's uint8 `data` to every rank; the others pass a tensor of the same length (known from
        the plan) to receive into. Returns the bytes on the CPU."""
        moved = data.to(self.device)
        self._run("broadcast", name, lambda: dist.broadcast(moved, src=0))
        return moved.cpu()

    def agree(self, mine: dict[int, int], slots: int) -> list[int]:
        """The tick's consensus vector: `slots` int64 values, each the MIN over ranks of what each rank
        put there (`mine`: slot -> value; a slot a rank leaves out does not constrain it)."""
        vector = torch.full((slots,), _NO_VALUE, dtype=torch.int64)
        for slot, value in mine.items():
            vector[slot] = value
        vector = vector.to(self.device)
        if self._shm is not None and self._shm.serves(vector):
            self._run("all_reduce", "consensus", lambda: self._shm.all_reduce(vector, "min", self._deadline()))
        else:
            self._run("all_reduce", "consensus", lambda: dist.all_reduce(vector, op=dist.ReduceOp.MIN))
        return vector.tolist()

    @property
    def shared_memory(self) -> bool:
        """Whether this group all-reduces (its tensors up to shm_reduce.SLOT_BYTES) through shared memory."""
        return self._shm is not None

    def _deadline(self) -> float:
        return time.monotonic() + self.timeout

    def _dead_rank_within(self, seconds: float) -> str | None:
        """Rank 0: the rank process found dead within `seconds`. A peer's connection breaks while
        its process is still exiting, before the exit can be seen, so a collective that fails at
        once waits this long to name the rank behind it."""
        if self.dead_rank is None:
            return None
        deadline = time.monotonic() + seconds
        while (dead := self.dead_rank()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return dead

    def _run(self, op: str, name: str, call: Callable[[], object]) -> None:
        label = f"{op}({name})"
        started = time.monotonic()
        try:
            call()
        except Exception as e:  # any backend failure ends the group: it is named here
            raise CollectiveError(self._failure(label, time.monotonic() - started, e)) from e
        seconds = time.monotonic() - started
        if self.observe is not None:
            self.observe(label, seconds)
        if self.slowest is None or seconds > self.slowest[1]:
            self.slowest = (label, seconds, self.tick)

    def _failure(self, label: str, seconds: float, error: Exception) -> str:
        timed_out = seconds >= 0.9 * self.timeout  # the backend enforces the deadline; its clock starts later
        # A deadline missed names the late rank as it is now: waiting longer would let a rank that was
        # only slow reach the collective, find the group gone and exit, and be misnamed as dead.
        dead = self._dead_rank_within(0.0 if timed_out else DEATH_NOTICE_S)
        if dead is not None:
            return f"{dead}: {label} of tick {self.tick} failed on rank {self.rank}"
        others = [r for r in range(self.size) if r != self.rank]
        who = f"rank {others[0]}" if len(others) == 1 else "a rank of " + ", ".join(map(str, others))
        if timed_out:
            return f"{who} did not reach {label} of tick {self.tick} within {self.timeout:g} s"
        return f"{label} of tick {self.tick} failed on rank {self.rank} ({who} lost?): {type(error).__name__}: {error}"
