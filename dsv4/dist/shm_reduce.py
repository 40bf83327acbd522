"""All-reduce through shared memory for the ranks of one node on the CPU (dsv4.dist.collectives uses it).

gloo's all_reduce of a decode step's [1, 512] fp32 rows took 1.1..1.3 ms on a 2-core machine (its
broadcast 0.19 ms, a socket round trip 35 us), and a tensor-parallel decode step makes two per layer.
Here each rank copies its tensor into its slot of a file in /dev/shm, publishes the collective's
sequence number in its flag, waits until every rank's flag has it, and folds the slots in rank order:
every rank computes the same sums in the same order, so their results are bitwise equal.

Two buffers alternate by sequence parity: a rank that reaches collective n + 2 has seen every
flag at n + 1, which each rank raises only after it has read buffer n. This relies on x86's ordering of
stores (the slot before the flag) and of loads (the flag before the slot): used on x86-64 Linux only.

A wait has the group's deadline and notices a peer process that died (its pid, from the file's header,
gone or a zombie) within POLL_LIVENESS_S, as gloo's broken socket does at once.
"""

from __future__ import annotations

import mmap
import os
import platform
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import torch

SLOT_BYTES = 4 << 20  # the largest tensor reduced here; larger ones go through gloo
POLL_LIVENESS_S = 0.05
SPIN_POLLS = 200  # polls before each further one yields the core
_HEADER_BYTES = 4096  # flags [size] int64, then pids [size] int64
_FOLDED = {torch.float32: torch.float32, torch.bfloat16: torch.float32, torch.float16: torch.float32,
           torch.int64: torch.int64}


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in ("x86_64", "AMD64") and Path("/dev/shm").is_dir()


def file_bytes(size: int) -> int:
    return _HEADER_BYTES + 2 * size * SLOT_BYTES


def room_for(size: int) -> bool:
    """Whether /dev/shm has room for a group of `size` ranks' file: a tmpfs writes its pages as they are
    first touched, and one past its limit (a container's 64 MB default) is a SIGBUS, not an error."""
    return shutil.disk_usage("/dev/shm").free >= file_bytes(size)


def new_path() -> str:
    return f"/dev/shm/dsv4-tp-{uuid.uuid4().hex}"


class PeerDied(RuntimeError):
    pass


class ShmReducer:
    """One rank's view of the group's file at `path` (created by rank 0 with `create`)."""

    def __init__(self, path: str, rank: int, size: int, *, create: bool) -> None:
        self.rank, self.size, self.seq = rank, size, 0
        length = file_bytes(size)
        fd = os.open(path, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o600)
        try:
            if create:
                os.ftruncate(fd, length)
            self._map = mmap.mmap(fd, length)
        finally:
            os.close(fd)
        self._flags = np.frombuffer(self._map, dtype=np.int64, count=size)
        self._pids = np.frombuffer(self._map, dtype=np.int64, count=size, offset=size * 8)
        self._pids[rank] = os.getpid()
        self._slots = torch.frombuffer(self._map, dtype=torch.uint8, offset=_HEADER_BYTES,
                                       count=2 * size * SLOT_BYTES).view(2, size, SLOT_BYTES)

    @staticmethod
    def serves(tensor: torch.Tensor) -> bool:
        return (tensor.device.type == "cpu" and tensor.dtype in _FOLDED
                and tensor.numel() * tensor.element_size() <= SLOT_BYTES)

    def all_reduce(self, tensor: torch.Tensor, op: str, deadline: float) -> None:
        """`tensor` (`serves`) becomes the sum ("sum") or minimum ("min") over the ranks, in place.
        Raises TimeoutError past `deadline` (time.monotonic()), PeerDied when a peer process is gone."""
        self.seq += 1
        parity = self.seq % 2
        count = tensor.numel()
        self._slot(parity, self.rank, tensor.dtype, count).copy_(tensor.reshape(-1))
        self._flags[self.rank] = self.seq  # after the slot: x86 keeps stores in order
        self._wait(deadline)
        slots = [self._slot(parity, r, tensor.dtype, count) for r in range(self.size)]
        folded = slots[0].to(_FOLDED[tensor.dtype], copy=True)  # (never in place: the slots are every rank's)
        for slot in slots[1:]:
            if op == "sum":
                folded.add_(slot)
            else:
                torch.minimum(folded, slot, out=folded)
        tensor.copy_(folded.view(tensor.shape))

    def close(self) -> None:
        self._flags = self._pids = self._slots = None
        self._map.close()

    def _slot(self, parity: int, rank: int, dtype: torch.dtype, count: int) -> torch.Tensor:
        return self._slots[parity, rank].view(dtype)[:count]

    def _wait(self, deadline: float) -> None:
        polls, checked = 0, time.monotonic()
        while int(self._flags.min()) < self.seq:
            polls += 1
            if polls > SPIN_POLLS:
                os.sched_yield()
                now = time.monotonic()
                if now >= deadline:
                    raise TimeoutError(f"not every rank reached the collective (flags {self._flags.tolist()}, "
                                       f"waiting for {self.seq})")
                if now - checked >= POLL_LIVENESS_S:
                    checked = now
                    self._check_peers()

    def _check_peers(self) -> None:
        for rank, pid in enumerate(self._pids.tolist()):
            if rank != self.rank and pid and not _alive(pid):
                raise PeerDied(f"rank {rank}'s process {pid} is gone")


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] not in ("Z", "X")
