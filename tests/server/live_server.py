"""Real `python -m dsv4 serve` processes for end-to-end tests: started on 127.0.0.1 on free
ports (`free_port`, re-exported), polled until ready with a timeout, and always stopped."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

from dsv4.dist.ranks import free_port

REPO = Path(__file__).resolve().parents[2]
READY_TIMEOUT_S = 120.0  # the first start may build caches; two cores are shared
STOP_TIMEOUT_S = 15.0
# A test's servers share the machine's cores with each other and with the test process: one forward
# thread each, as engines that share cores must be given (ServerArgs.cpu_threads).
SHARED_CORES = ("--cpu-threads", "1")


def http_status(url: str, timeout: float = 2.0) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            return response.status
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return None


class LiveServer:
    def __init__(self, ckpt: Path, log_path: Path, *extra_args: str):
        self.log_path = log_path
        self.base = ""
        self._command = [sys.executable, "-m", "dsv4", "serve", "--model", str(ckpt), "--host", "127.0.0.1",
                         "--dtype", "float32", *SHARED_CORES, *extra_args]
        self._process: subprocess.Popen | None = None

    def start(self) -> None:
        port = free_port()
        self.base = f"http://127.0.0.1:{port}"
        with open(self.log_path, "wb") as log:
            self._process = subprocess.Popen([*self._command, "--port", str(port)], cwd=REPO, stdout=log,
                                             stderr=subprocess.STDOUT)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        while http_status(f"{self.base}/health/ready") != 200:
            if self._process.poll() is not None:
                raise AssertionError(f"server exited with {self._process.returncode}:\n{self._log_tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"server not ready in {READY_TIMEOUT_S} s:\n{self._log_tail()}")
            time.sleep(0.2)

    def send_signal(self, sig: int) -> None:
        self._process.send_signal(sig)

    def wait_exit(self, timeout: float) -> int:
        """The exit code; raises subprocess.TimeoutExpired if the process outlives `timeout`."""
        return self._process.wait(timeout=timeout)

    def stop(self) -> None:
        if self._process is None:
            return
        self._process.terminate()
        try:
            self._process.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(timeout=STOP_TIMEOUT_S)

    def _log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]


@contextlib.contextmanager
def live_servers(*servers: LiveServer):
    """Starts the servers together (startup is mostly imports: overlapping them saves time)."""
    try:
        for server in servers:
            server.start()
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()
