"""The processes of a node's other ranks: started by the node's first rank, watched, and stopped.

`python -m dsv4 serve --tp-size N` is one node's first rank (rank 0 on node 0) and starts the node's
other ranks as fresh interpreters (`python -m dsv4 rank ...`; never a fork of a process with
threads), each in its own session so a terminal's Ctrl-C reaches only the launcher, which stops
them. A rank whose parent dies is killed by the kernel (Linux: PR_SET_PDEATHSIG), and in any case
its next collective fails within the deadline: no rank outlives its group.

The ServerArgs travel as msgspec JSON on the child's command line (never pickle).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import random
import signal
import socket
import subprocess
import sys
import time

import msgspec

from dsv4.config import ServerArgs

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a one-machine group's rendezvous), below the kernel's
    ephemeral range: a port from bind(0) is an ephemeral one, which any process's outgoing connection
    may take before the rendezvous binds it (EADDRINUSE)."""
    ephemeral_low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError), open("/proc/sys/net/ipv4/ip_local_port_range") as f:
        ephemeral_low = int(f.read().split()[0])
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(10000, max(ephemeral_low, 10001))
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free TCP port on 127.0.0.1 in 10000..{ephemeral_low - 1}")


def die_with_parent() -> None:
    """Linux: the kernel SIGKILLs this process when the process that started it exits."""
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def encode_args(args: ServerArgs) -> str:
    return msgspec.json.encode(args).decode()


def decode_args(text: str) -> ServerArgs:
    return msgspec.json.decode(text, type=ServerArgs)


def exit_description(rank: int, code: int) -> str:
    if code < 0:
        return f"rank {rank} exited, killed by {signal.Signals(-code).name}"
    return f"rank {rank} exited with code {code}"


class RankProcesses:
    """This node's other ranks, as child processes."""

    def __init__(self, args: ServerArgs, addr: str, ranks: range) -> None:
        self._procs: dict[int, subprocess.Popen] = {}
        for rank in ranks:
            command = [sys.executable, "-m", "dsv4", "rank", "--rank", str(rank), "--dist-init-addr", addr,
                       "--server-args", encode_args(args)]
            self._procs[rank] = subprocess.Popen(command, start_new_session=True)
        if ranks:
            log.info("started ranks %d..%d (pids %s)", ranks[0], ranks[-1], [p.pid for p in self._procs.values()])

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs.values()]

    def dead(self) -> str | None:
        """The first rank found to have exited, in words; None while all run."""
        for rank, proc in self._procs.items():
            code = proc.poll()
            if code is not None:
                return exit_description(rank, code)
        return None

    def wait_dead(self, seconds: float) -> str | None:
        """As `dead`, waiting up to `seconds` for an exit (a failed collective often precedes the reap)."""
        deadline = time.monotonic() + seconds
        while (dead := self.dead()) is None and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead

    def stop(self, timeout: float = 5.0) -> None:
        """SIGTERM every rank still running, then SIGKILL what has not exited within `timeout`."""
        for proc in self._procs.values():
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + timeout
        for rank, proc in self._procs.items():
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("rank %d did not stop within %.0f s of SIGTERM: killing it", rank, timeout)
                proc.kill()
                proc.wait()
