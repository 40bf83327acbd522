"""The load generator: streaming /generate requests against a dsv4 server, at a bounded concurrency
or at Poisson arrivals, and a `dsv4 serve` child process that is always stopped.

Every request is bounded by its own timeout, so every run is bounded too.
"""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Self
from urllib.parse import urlsplit

import aiohttp
import msgspec
import uvloop
from prometheus_client.parser import text_string_to_metric_families

from bench.metrics import RequestResult
from dsv4.dist.ranks import free_port

ROOT = Path(__file__).resolve().parents[2]
HIT_TOKENS = "dsv4_prefix_cache_hit_tokens_total"  # by tier; the rate sums them
PROMPT_TOKENS = "dsv4_prompt_tokens_total"


class Stream:
    """One streamed request's token arrivals: (perf_counter time, tokens in that event)."""

    def __init__(self, prompt: list[int]):
        self.prompt = prompt
        self.sent = 0.0
        self.events: list[tuple[float, int]] = []
        self.finish_reason: str | None = None
        self.error = ""

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.events)

    def result(self) -> RequestResult:
        tokens = self.tokens
        ok = not self.error and self.finish_reason in ("length", "stop") and tokens > 0
        result = RequestResult(ok=ok, prompt_tokens=len(self.prompt), output_tokens=tokens,
                               error=self.error or ("" if ok else f"finish_reason {self.finish_reason}, {tokens} tokens"))
        if self.events:
            result.ttft = self.events[0][0] - self.sent
            result.e2e = self.events[-1][0] - self.sent
            previous = self.events[0][0]
            for at, n in self.events[1:]:
                result.itls.extend([(at - previous) / n] * n)  # tokens of one event share its gap
                previous = at
        return result


def run_client(main: Coroutine):
    """`main` to its end on a uvloop event loop, as the server runs: asyncio's own loop cost the load
    generator ~50 us more CPU per streamed token (StreamedResponse)."""
    return uvloop.run(main)


class StreamedResponse(asyncio.Protocol):
    """One POST on a connection of its own, read as it arrives: the status line and headers, then the
    body (chunked, or of a Content-Length, or to the close), whose SSE events `on_event(arrival time,
    data bytes)` gets as each completes, stamped with the time its last piece arrived.

    In place of aiohttp's client: on a 2-core machine the load generator's CPU is taken from the server
    it measures. At c=1 (`small`, fp32) the client spent 102..157 us of CPU per streamed token through
    aiohttp, 51 through this on uvloop (`run_client`), and the server's mean TPOT read 78 us lower
    (runs of the two clients alternated against one server)."""

    def __init__(self, on_event: Callable[[float, bytes], None]):
        self.on_event = on_event
        self.done: asyncio.Future = asyncio.get_running_loop().create_future()
        self.status: int | None = None
        self.body = bytearray()  # a failed response's body (its events otherwise go to on_event)
        self._head = bytearray()
        self._chunked = False
        self._left: int | None = None  # the body's bytes still to come (Content-Length), or the chunk's
        self._crlf = 0  # bytes of the CRLF after a chunk's data still to come
        self._raw = bytearray()  # chunked framing not yet decoded
        self._events = bytearray()  # SSE text not yet ending an event

    def data_received(self, data: bytes) -> None:
        try:
            self._received(time.perf_counter(), data)
        except ValueError as e:  # a malformed response or event (msgspec's DecodeError is a ValueError)
            if not self.done.done():
                self.done.set_exception(e)

    def _received(self, now: float, data: bytes) -> None:
        if self.status is None:
            self._head += data
            end = self._head.find(b"\r\n\r\n")
            if end < 0:
                return
            head, data = bytes(self._head[:end]).decode("latin-1").split("\r\n"), bytes(self._head[end + 4:])
            self.status = int(head[0].split()[1])
            fields = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head[1:])}
            self._chunked = "chunked" in fields.get("transfer-encoding", "").lower()
            if not self._chunked and "content-length" in fields:
                self._left = int(fields["content-length"])
        if self._chunked:
            self._raw += data
            self._dechunk(now)
        else:
            if self._left is not None:
                data = data[:self._left]
                self._left -= len(data)
            self._deliver(now, data)
            if self._left == 0:
                self._finish()

    def _dechunk(self, now: float) -> None:
        while self._raw and not self.done.done():
            if self._crlf:  # (what ends a chunk's data)
                taken = min(self._crlf, len(self._raw))
                del self._raw[:taken]
                self._crlf -= taken
            elif self._left is None:  # a chunk's size line
                end = self._raw.find(b"\r\n")
                if end < 0:
                    return
                self._left = int(bytes(self._raw[:end]).split(b";")[0], 16)
                del self._raw[:end + 2]
                if self._left == 0:
                    self._finish()
            else:  # its data, as far as it has come
                taken = min(self._left, len(self._raw))
                self._deliver(now, bytes(self._raw[:taken]))
                del self._raw[:taken]
                self._left -= taken
                if self._left == 0:
                    self._left, self._crlf = None, 2

    def _deliver(self, now: float, data: bytes) -> None:
        if self.status != 200:
            self.body += data
            return
        self._events += data
        while (end := self._events.find(b"\n\n")) >= 0:
            for line in bytes(self._events[:end]).split(b"\n"):
                if line.startswith(b"data:"):
                    self.on_event(now, line[5:].strip())
            del self._events[:end + 2]

    def _finish(self) -> None:
        if not self.done.done():
            self.done.set_result(None)

    def connection_lost(self, exc: Exception | None) -> None:
        if self.done.done():
            return
        if self._left is None and not self._chunked and self.status is not None:
            self._finish()  # a body read to the close
        else:
            self.done.set_exception(ConnectionError(f"connection lost before the response ended: {exc}"))


async def stream_request(url: str, stream: Stream, output_len: int, timeout: float) -> None:
    """Sends `stream.prompt` greedily with ignore_eos and records every event's arrival on `stream`.
    Cancelled, it closes its connection, as a client that gives up does."""
    body = msgspec.json.encode({
        "input_ids": stream.prompt,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    })
    where = urlsplit(url)

    def on_event(at: float, data: bytes) -> None:
        if data == b"[DONE]" or stream.error:
            return
        event = msgspec.json.decode(data)
        if "error" in event:
            stream.error = str(event["error"])[:200]
            return
        new = len(event.get("output_ids", ()))  # each event carries only its new ids
        if new:
            stream.events.append((at, new))
        stream.finish_reason = event.get("meta_info", {}).get("finish_reason") or stream.finish_reason

    stream.sent = time.perf_counter()
    transport = response = None
    try:
        async with asyncio.timeout(timeout):
            transport, response = await asyncio.get_running_loop().create_connection(
                lambda: StreamedResponse(on_event), where.hostname, where.port)
            transport.write(b"POST /generate HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s"
                            % (where.netloc.encode(), len(body), body))
            await response.done
        if response.status != 200:
            stream.error = f"HTTP {response.status}: {bytes(response.body[:200]).decode(errors='replace')}"
    except (TimeoutError, OSError, ValueError) as e:  # (ValueError: a malformed response or event)
        stream.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        if response is not None and not response.done.done():
            response.done.cancel()  # (given up: the close that follows is no error to report)
        if transport is not None:
            transport.close()


async def run_load(url: str, prompts: list[list[int]], output_len: int, timeout: float,
                   concurrency: int | None = None, rate: float = float("inf"),
                   seed: int = 0) -> tuple[list[RequestResult], float]:
    """Sends every prompt, at most `concurrency` at once (None: no limit), starting them at Poisson
    arrivals of `rate` per second (inf: all at once). Returns the results and the wall time."""
    gate = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    streams = [Stream(p) for p in prompts]

    async def one(stream: Stream) -> None:
        async with gate:
            await stream_request(url, stream, output_len, timeout)

    start = time.perf_counter()
    tasks = []
    for stream in streams:
        tasks.append(asyncio.create_task(one(stream)))
        if rate != float("inf"):
            await asyncio.sleep(rng.expovariate(rate))
    await asyncio.gather(*tasks)
    wall = time.perf_counter() - start
    return [s.result() for s in streams], wall


async def scrape_counters(url: str, names: tuple[str, ...] = (HIT_TOKENS, PROMPT_TOKENS)) -> dict[str, float]:
    """The sums over labels of the named samples in the server's /metrics."""
    async with (aiohttp.ClientSession() as session,
                session.get(url + "/metrics", timeout=aiohttp.ClientTimeout(total=10)) as resp):
        text = await resp.text()
    totals = dict.fromkeys(names, 0.0)
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in totals:
                totals[sample.name] += sample.value
    return totals


class ServerProcess:
    """A `dsv4 serve` child process that is always stopped; its output goes to `log`."""

    def __init__(self, model_dir: Path, extra: list[str], ready_timeout: float, log: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.ready_timeout = ready_timeout
        self.log = log
        cmd = [sys.executable, "-m", "dsv4", "serve", "--model", str(model_dir), "--port", str(self.port), *extra]
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("wb") as out:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT)
        self.ready_seconds = float("nan")

    def wait_ready(self) -> float:
        """Seconds from the process start to /health/ready answering 200 (loading and any compile)."""
        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}; see {self.log}")
            try:
                with urllib.request.urlopen(self.url + "/health/ready", timeout=2) as resp:
                    if resp.status == 200:
                        self.ready_seconds = time.perf_counter() - self.started
                        return self.ready_seconds
            except OSError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"server not ready within {self.ready_timeout}s; see {self.log}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def __enter__(self) -> Self:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()
