"""Copy jobs between the device pools and the host pool, each with a completion fence.

One code path on every device: a single copy thread runs the jobs and sets each job's `Fence` when
its bytes have landed. On CUDA the thread issues the copies on its own copy stream (so they overlap
the forward on the default stream) and records an event on it, which it waits for before setting the
fence; on CPU the copies are plain memcpys on that thread. Whoever reads the destination waits for
the fence (or polls `done()`), never for the thread.

A job's parts move as one unit: the fence is set once, after every part, with one checksum over all
of them (CRC-32 of the destination bytes in order). A load may name the checksum its source had when
it was written; a mismatch is the job's error, and the fence still completes.

Injected delays (`--fault-inject delay:hicache_load|hicache_write:P:DURATION`) make a job runnable
only `DURATION` after submission; the thread always runs the earliest runnable job, so a delayed job
is overtaken by later ones (completions are reordered, not only late).
"""

from __future__ import annotations

import heapq
import logging
import random
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from dsv4.config import CopyDelay
from dsv4.memory.host import checksum_of

log = logging.getLogger(__name__)


class Fence:
    """Completion of one copy job. Set once, by the copy thread; read by anyone."""

    def __init__(self, kind: str, nbytes: int):
        self.kind = kind
        self.nbytes = nbytes
        self.submitted = time.monotonic()
        self.seconds: float | None = None  # submission to completion
        self.checksum: int | None = None  # CRC-32 of the destination bytes, when asked for
        self.error: str | None = None
        self._event = threading.Event()

    def done(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout: float) -> bool:
        return self._event.wait(timeout)

    def _complete(self, error: str | None = None) -> None:
        self.error = error
        self.seconds = time.monotonic() - self.submitted
        self._event.set()


@dataclass(order=True)
class _Job:
    runnable_at: float
    seq: int
    copies: Sequence[tuple[torch.Tensor, torch.Tensor]] = field(compare=False)  # (destination, source)
    fence: Fence = field(compare=False)
    checksum: bool = field(compare=False)
    expect: int | None = field(compare=False)
    then: Callable[[], None] | None = field(compare=False)


class CopyEngine:
    def __init__(self, device: torch.device, delays: Sequence[CopyDelay] = (), seed: int = 0,
                 on_complete: Callable[[], None] | None = None):
        """`on_complete`: called on the copy thread after each job's fence is set (whoever polls the fences
        may wait for it rather than poll again at once)."""
        self._device = device
        self._on_complete = on_complete
        self._delays = list(delays)
        self._random = random.Random(seed)
        self._stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self._jobs: list[_Job] = []
        self._seq = 0
        self._cv = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="dsv4-hicache-copy", daemon=True)
        self._thread.start()

    def submit(self, kind: str, copies: Sequence[tuple[torch.Tensor, torch.Tensor]], *, checksum: bool = False,
               expect: int | None = None, then: Callable[[], None] | None = None) -> Fence:
        """Queues `copies` (destination, source) as one job of `kind` ("hicache_load" or
        "hicache_write"); `checksum`: record the destination's CRC-32 on the fence; `expect`: fail
        the job unless the destination's CRC-32 equals it; `then`: run on the copy thread once the
        bytes have landed (and passed the check), before the fence is set."""
        fence = Fence(kind, sum(dst.numel() * dst.element_size() for dst, _ in copies))
        delay = sum(d.seconds for d in self._delays if d.kind == kind and self._random.random() < d.probability)
        with self._cv:
            if self._closed:
                raise RuntimeError("the host-tier copy engine is closed")
            self._seq += 1
            heapq.heappush(self._jobs, _Job(time.monotonic() + delay, self._seq, copies, fence, checksum, expect, then))
            self._cv.notify()
        return fence

    def close(self, timeout: float = 5.0) -> None:
        """Stops after the runnable jobs; jobs left unrun complete with an error."""
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout)
        with self._cv:
            for job in self._jobs:
                job.fence._complete("the copy engine was closed before this copy ran")
            self._jobs.clear()

    def _loop(self) -> None:
        # Copies on one thread: OpenMP workers of this thread's own would make libgomp throttle the
        # forward thread's (dsv4.engine.launch.load_model).
        torch.set_num_threads(1)
        while True:
            with self._cv:
                while True:
                    if self._closed:
                        return
                    now = time.monotonic()
                    if self._jobs and self._jobs[0].runnable_at <= now:
                        job = heapq.heappop(self._jobs)
                        break
                    self._cv.wait(None if not self._jobs else self._jobs[0].runnable_at - now)
            try:
                self._run(job)
            except Exception as e:  # a failed copy is its job's error; the thread goes on
                log.exception("host-tier copy failed")
                job.fence._complete(f"{type(e).__name__}: {e}")
            if self._on_complete is not None:
                self._on_complete()

    def _run(self, job: _Job) -> None:
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                for dst, src in job.copies:
                    dst.copy_(src, non_blocking=True)
                event = torch.cuda.Event()
                event.record(self._stream)
            event.synchronize()
        else:
            for dst, src in job.copies:
                dst.copy_(src)
        error = None
        if job.checksum or job.expect is not None:
            job.fence.checksum = checksum_of(tuple(dst for dst, _ in job.copies))
            if job.expect is not None and job.fence.checksum != job.expect:
                error = (f"checksum mismatch: the {job.fence.nbytes} bytes loaded have CRC-32 "
                         f"{job.fence.checksum:#010x}, written with {job.expect:#010x}")
        if error is None and job.then is not None:
            job.then()
        job.fence._complete(error)
