"""Real `python -m dsv4 serve` processes on 127.0.0.1 for end-to-end tests; every one is stopped."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import aiohttp

from tests.server.live_server import SHARED_CORES, free_port

REPO = Path(__file__).resolve().parents[2]


class Server:
    def __init__(self, name: str, log_dir: Path, *args: str):
        self.name = name
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), "--log-level", "warning", *SHARED_CORES, *args]
        self.log = log_dir / f"{name}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dsv4", "serve", *self.args], cwd=REPO,
                                         stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        return self

    async def wait_ready(self, timeout: float = 120.0) -> None:
        end = time.monotonic() + timeout
        async with aiohttp.ClientSession() as session:
            while time.monotonic() < end:
                if self.proc.poll() is not None:
                    raise AssertionError(f"{self.name} exited with {self.proc.returncode}: {self.tail()}")
                try:
                    async with session.get(f"{self.url}/health/ready", timeout=aiohttp.ClientTimeout(total=2)) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    pass
                await asyncio.sleep(0.3)
        raise AssertionError(f"{self.name} not ready within {timeout}s: {self.tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.kill()

    def tail(self, lines: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:]) if self.log.exists() else ""


async def generate(session, url: str, prompt, max_new_tokens: int = 4, timeout: float = 120.0) -> dict:
    body = {"input_ids": list(prompt), "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    async with session.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return await r.json()


async def get_json(session, url: str) -> tuple[int, dict]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return r.status, await r.json()
