"""The load generator: streaming /generate requests against a dsv4 server, at a bounded concurrency
or at Poisson arrivals, and a `dsv4 serve` child process that is always stopped.

Every request is bounded by its own timeout, so every run is bounded too.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Self

import aiohttp
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


async def stream_request(session: aiohttp.ClientSession, url: str, stream: Stream, output_len: int,
                         timeout: float) -> None:
    """Sends `stream.prompt` greedily with ignore_eos and records every event's arrival on `stream`."""
    body = {
        "input_ids": stream.prompt,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    stream.sent = time.perf_counter()
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                stream.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    stream.error = str(event["error"])[:200]
                    return
                new = len(event.get("output_ids", []))  # each event carries only its new ids
                if new:
                    stream.events.append((time.perf_counter(), new))
                stream.finish_reason = event.get("meta_info", {}).get("finish_reason") or stream.finish_reason
    except (TimeoutError, aiohttp.ClientError) as e:
        stream.error = f"{type(e).__name__}: {e}"[:200]


async def run_load(url: str, prompts: list[list[int]], output_len: int, timeout: float,
                   concurrency: int | None = None, rate: float = float("inf"),
                   seed: int = 0) -> tuple[list[RequestResult], float]:
    """Sends every prompt, at most `concurrency` at once (None: no limit), starting them at Poisson
    arrivals of `rate` per second (inf: all at once). Returns the results and the wall time."""
    gate = asyncio.Semaphore(concurrency or len(prompts))
    rng = random.Random(seed)
    streams = [Stream(p) for p in prompts]
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        async def one(stream: Stream) -> None:
            async with gate:
                await stream_request(session, url, stream, output_len, timeout)

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
