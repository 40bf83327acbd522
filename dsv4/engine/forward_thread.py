"""The one thread an engine's forwards run on, in the order they are handed over (ARCHITECTURE.md
invariant 1), while the event loop stays free.

A job goes over through a C queue and its result comes back through the loop's thread-safe call: the two
hops of a tick. Through ThreadPoolExecutor and `run_in_executor` (two futures chained in Python, a work
item, a lock and a condition each way) they took ~90 us each in a c=1 decode tick of `small`, the caches
cold from the forward's weights; through this 46 us there and 57 back.
"""

from __future__ import annotations

import asyncio
import atexit
import queue
import threading
import weakref
from collections.abc import Callable
from typing import Any

_open: weakref.WeakSet[ForwardThread] = weakref.WeakSet()


class ForwardThread:
    def __init__(self, name: str):
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        # (a daemon, so that an open one does not keep the process alive; closed at exit: a forward still
        # running while the interpreter tears down would meet torch's teardown, which aborts)
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()
        _open.add(self)

    def run(self, fn: Callable[..., Any], *args) -> asyncio.Future:
        """`fn(*args)` on the thread, after every job handed over before it; its result (or exception) in
        the returned future of the calling loop."""
        if self._closed:
            raise RuntimeError("the forward thread is closed")
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._jobs.put((loop, future, fn, args))
        return future

    def close(self, wait: bool = False) -> None:
        """Stops the thread after the job in flight, if any (`wait`: until then); jobs not yet started are
        cancelled. Closing again only waits."""
        if not self._closed:
            self._closed = True
            while True:  # (cancel what has not started; the thread then meets the end marker)
                try:
                    loop, future, _, _ = self._jobs.get_nowait()
                except queue.Empty:
                    break
                _answer(loop, future.cancel)
            self._jobs.put(None)
        if wait and self._thread is not threading.current_thread():
            self._thread.join()

    def _serve(self) -> None:
        while (job := self._jobs.get()) is not None:
            loop, future, fn, args = job
            try:
                result = fn(*args)
            except BaseException as e:  # noqa: BLE001 -- whatever the job raised is the awaiting caller's
                _answer(loop, _settle, future, None, e)
            else:
                _answer(loop, _settle, future, result, None)


@atexit.register
def _close_open() -> None:
    for thread in list(_open):
        thread.close(wait=True)


def _answer(loop: asyncio.AbstractEventLoop, callback: Callable[..., Any], *args) -> None:
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:  # the loop is closed: nobody awaits the answer
        pass


def _settle(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # (cancelled: its awaiter gave up)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
