"""The forward thread (dsv4.engine.forward_thread): jobs run one at a time on one thread, in the order they
were handed over; a job's result or exception reaches its awaiter; closing stops the thread after the job
in flight and cancels the jobs not started."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
import time

import pytest

from dsv4.engine.forward_thread import ForwardThread


async def test_jobs_run_in_order_on_one_thread_and_answer_their_awaiters():
    thread = ForwardThread("test-forward")
    ran = []

    def job(i: int) -> tuple[int, str]:
        ran.append(i)
        return i * i, threading.current_thread().name

    try:
        futures = [thread.run(job, i) for i in range(20)]
        results = await asyncio.wait_for(asyncio.gather(*futures), 10)
    finally:
        thread.close(wait=True)
    assert ran == list(range(20))
    assert results == [(i * i, "test-forward") for i in range(20)]


async def test_an_exception_reaches_the_awaiter_and_the_thread_goes_on():
    thread = ForwardThread("test-forward")

    def fail() -> None:
        raise ValueError("broken forward")

    try:
        with pytest.raises(ValueError, match="broken forward"):
            await asyncio.wait_for(thread.run(fail), 10)
        assert await asyncio.wait_for(thread.run(lambda: 7), 10) == 7
    finally:
        thread.close(wait=True)


async def test_close_cancels_the_jobs_not_started_and_the_thread_ends():
    thread = ForwardThread("test-forward")
    started, release = threading.Event(), threading.Event()

    def slow() -> str:
        started.set()
        release.wait(10)
        return "done"

    in_flight = thread.run(slow)
    queued = [thread.run(lambda: "never") for _ in range(3)]
    assert await asyncio.to_thread(started.wait, 10)
    thread.close()
    with pytest.raises(RuntimeError, match="closed"):
        thread.run(lambda: None)
    release.set()
    assert await asyncio.wait_for(in_flight, 10) == "done"  # (the job in flight finishes)
    for future in queued:
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(future, 10)
    start = time.monotonic()
    await asyncio.to_thread(thread.close, wait=True)  # (closing again waits for the thread's end)
    assert time.monotonic() - start < 5 and not thread._thread.is_alive()


def test_the_interpreter_exits_after_the_job_in_flight():
    """An open thread does not keep the process alive, and a job still running at exit finishes before the
    interpreter tears down (a forward inside torch then would abort the process)."""
    script = (
        "import asyncio, time\n"
        "from dsv4.engine.forward_thread import ForwardThread\n"
        "async def main():\n"
        "    thread = ForwardThread('t')\n"
        "    thread.run(lambda: (time.sleep(0.5), print('finished', flush=True)))\n"
        "    await asyncio.sleep(0.1)\n"
        "asyncio.run(main())\n"
        "print('exiting', flush=True)\n"
    )
    done = subprocess.run([sys.executable, "-c", script], check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["exiting", "finished"]
