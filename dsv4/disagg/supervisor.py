"""Supervised background coroutines: a task that dies is recorded with its reason, never lost.

A critical task (a link's reader, the heartbeat, the reaper) is expected to run until stopped;
if it ends for any reason the instance is not ready and says which task and why.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(self, name: str, on_death=None):
        self.name = name
        self._tasks: set[asyncio.Task] = set()
        self.deaths: dict[str, str] = {}  # task name -> why it ended
        self._on_death = on_death  # called with the task name (metrics)
        self._stopping = False

    def spawn(self, name: str, coro: Coroutine, *, critical: bool = True) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro, name=f"{self.name}:{name}")
        self._tasks.add(task)
        task.add_done_callback(lambda t: self._ended(name, t, critical))
        return task

    def _ended(self, name: str, task: asyncio.Task, critical: bool) -> None:
        self._tasks.discard(task)
        if self._stopping:
            return
        if task.cancelled():
            reason = "cancelled" if critical else None
        elif task.exception() is not None:
            exc = task.exception()
            reason = f"{type(exc).__name__}: {exc}"
            log.error("%s: task %s died", self.name, name, exc_info=exc)
        else:
            reason = "returned" if critical else None
        if reason is not None:
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
