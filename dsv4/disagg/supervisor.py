"""Supervised background coroutines: a task that dies is recorded with its reason, never lost.

Three kinds, because only infrastructure may make an instance not ready (ARCHITECTURE.md
invariant 5):
- "service": runs until stopped (the reaper, the heartbeat, a peer's connection keeper); if it ends
  for any reason the instance is not ready and says which task and why.
- "connection": one link's reader; it ends when its link closes, but an exception is a death.
- "request": belongs to one request (a transfer, a room, one send or receive). Its failure is that
  request's: the task itself fails the request with its reason; an exception that still escapes is
  logged and counted, never a reason for the instance to be not ready.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine

log = logging.getLogger(__name__)

KINDS = ("service", "connection", "request")


class Supervisor:
    def __init__(self, name: str, on_death: Callable[[str], None] | None = None,
                 on_request_error: Callable[[str], None] | None = None):
        self.name = name
        self._tasks: set[asyncio.Task] = set()
        self.deaths: dict[str, str] = {}  # task name -> why it ended
        self._on_death = on_death  # called with the task name (metrics)
        self._on_request_error = on_request_error  # called with the task name (metrics)
        self._stopping = False

    def spawn(self, name: str, coro: Coroutine, *, kind: str = "service") -> asyncio.Task:
        if kind not in KINDS:
            raise ValueError(f"task kind {kind!r}: expected one of {KINDS}")
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._ended(name, t, kind))
        return task

    def _ended(self, name: str, task: asyncio.Task, kind: str) -> None:
        self._tasks.discard(task)
        if self._stopping:
            return
        exc = None if task.cancelled() else task.exception()
        if kind == "request":
            if exc is not None:
                log.error("%s: request task %s raised; the request failed, the instance did not", self.name, name,
                          exc_info=exc)
                if self._on_request_error:
                    self._on_request_error(name)
            return
        if exc is not None:
            reason = f"{type(exc).__name__}: {exc}"
            log.error("%s: task %s died", self.name, name, exc_info=exc)
        elif kind == "service":
            reason = "cancelled" if task.cancelled() else "returned"
        else:
            return
        self.deaths[name] = reason
        if self._on_death:
            self._on_death(name)

    def ready(self) -> tuple[bool, list[str]]:
        reasons = [f"{self.name} task {name} died: {why}" for name, why in sorted(self.deaths.items())]
        return not reasons, reasons

    async def stop(self, timeout: float = 5.0) -> None:
        self._stopping = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout)
