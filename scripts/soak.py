"""Soak: a prefill/decode pair under memory pressure, aborts and frame faults for a fixed time.

Starts a prefill, a decode and a colocated reference instance (the built-in tiny model, float32) on
127.0.0.1, then keeps --concurrency requests in flight for --duration seconds: mixed prompt
lengths, the decode pool at a quarter of what the requests in flight would need, --abort-fraction
of them aborted by the client at a random moment, and --fault-rate of every PD frame (of any kind,
on both sides) dropped, delayed, duplicated or corrupted, a quarter each. Then checks: no request failed for memory
pressure (pressure waits or preempts, never fails), none hung past its deadline, neither instance
holds requests, transfers, pages or slots, both are ready, and completed outputs equal the
reference's (greedy). Failures that the injected frame faults cause are allowed: they must fail
clearly, with a reason (an unexpected exception in a transfer task is a bug, not a clear reason).
Prints a summary table (with --json, one JSON object instead); exit status 0 only when every check
passed.

    python scripts/soak.py                      # 5 minutes
    python scripts/soak.py --duration 60        # what `make test` runs (tests/disagg/test_soak.py)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
from abort_storm import generate, get_json, wait_quiet

from dsv4.dist.ranks import free_port

REPO = Path(__file__).resolve().parents[1]
VOCAB = 500
PAGE = 128
PRESSURE_WORDS = ("no free pages", "pages", "preempt", "pool")


class Servers:
    def __init__(self, args, log_dir: Path):
        demand = args.concurrency * (args.max_prompt + args.max_new_tokens)
        pool = max(PAGE * 4, demand // 4 // PAGE * PAGE)
        self.pool_tokens = pool
        model = ["--model", str(args.model)] if args.model else []
        # Three servers on this machine's cores: a third of them each (engines that share cores need a share).
        threads = max(1, len(os.sched_getaffinity(0)) // 3)
        common = [*model, "--dtype", "float32", "--max-running-requests", str(args.concurrency), "--chunked-prefill-size",
                  "512", "--request-timeout", str(args.request_timeout), "--log-level", "warning",
                  "--cpu-threads", str(threads)]
        each = args.fault_rate / 4  # of every frame: a quarter each dropped, delayed, duplicated, corrupted
        faults = f"drop:*:{each},delay:*:{each}:100ms,duplicate:*:{each},corrupt:*:{each}"
        bootstrap = free_port()
        self.urls = {}
        specs = {
            "prefill": [*common, "--max-total-tokens", "16384", "--disaggregation-mode", "prefill",
                        "--disaggregation-bootstrap-port", str(bootstrap), "--fault-inject", faults],
            "decode": [*common, "--max-total-tokens", str(pool), "--disaggregation-mode", "decode",
                       "--prefill-addr", f"127.0.0.1:{bootstrap}", "--verify-transfers", "--fault-inject", faults],
            "reference": [*common, "--max-total-tokens", "16384"],
        }
        self.procs = {}
        for name, extra in specs.items():
            port = free_port()
            self.urls[name] = f"http://127.0.0.1:{port}"
            with open(log_dir / f"{name}.log", "ab") as log:
                self.procs[name] = subprocess.Popen([sys.executable, "-m", "dsv4", "serve", "--port", str(port),
                                                     *extra], cwd=REPO, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True)

    async def ready(self, session, timeout: float = 180.0) -> None:
        end = time.monotonic() + timeout
        for name, url in self.urls.items():
            while True:
                if self.procs[name].poll() is not None:
                    raise SystemExit(f"{name} exited with {self.procs[name].returncode}")
                try:
                    if (await get_json(session, f"{url}/health/ready"))[0] == 200:
                        break
                except (aiohttp.ClientError, TimeoutError):
                    pass
                if time.monotonic() > end:
                    raise SystemExit(f"{name} not ready within {timeout:.0f} s")
                await asyncio.sleep(0.3)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


async def one(session, args, rng: random.Random, url: str, stats: dict, completed: list) -> None:
    prompt = [rng.randrange(2, VOCAB) for _ in range(rng.randint(1, args.max_prompt))]
    new_tokens = rng.randint(args.max_new_tokens // 4, args.max_new_tokens)
    abort_after = rng.uniform(0, 2.0) if rng.random() < args.abort_fraction else None
    task = asyncio.ensure_future(generate(session, url, prompt, new_tokens, args.request_timeout + 30))
    try:
        if abort_after is None:
            result = await task
        else:
            done, _ = await asyncio.wait({task}, timeout=abort_after)
            if not done:
                task.cancel()  # the client gives up: its connection closes
                stats["aborted"] += 1
                return
            result = task.result()
    except TimeoutError:
        stats["hung"] += 1
        return
    except (aiohttp.ClientError, asyncio.CancelledError) as e:
        stats["client_errors"] += 1
        stats["examples"].append(f"client error: {e!r}")
        return
    finish = result.get("meta_info", {}).get("finish_reason")
    if finish == "length":
        stats["completed"] += 1
        completed.append((prompt, new_tokens, result["output_ids"]))
        return
    message = str(result.get("error", {}).get("message", result))
    pressure = any(word in message for word in PRESSURE_WORDS)
    stats["failed_pressure" if pressure else "failed_faults"] += 1
    if not pressure and not clear(message):
        stats["unclear_failures"] += 1
    if pressure or not clear(message) or len(stats["examples"]) < 5:
        stats["examples"].append(message[:200])


def clear(message: str) -> bool:
    """A failure that says what went wrong; an unexpected exception in a transfer task is a bug."""
    return bool(message.strip()) and "task failed" not in message


async def still_not_ready(session, urls: dict[str, str], timeout: float) -> dict[str, list]:
    """Instances not ready after `timeout` (a link fenced by a fault is re-established meanwhile)."""
    end = time.monotonic() + timeout
    while True:
        answers = {name: await get_json(session, f"{url}/health/ready") for name, url in urls.items()}
        not_ready = {name: body.get("reasons") for name, (status, body) in answers.items() if status != 200}
        if not not_ready or time.monotonic() > end:
            return not_ready
        await asyncio.sleep(0.5)


async def soak(args) -> bool:
    log_dir = Path(tempfile.mkdtemp(prefix="dsv4-soak-"))
    servers = Servers(args, log_dir)
    stats = {k: 0 for k in ("started", "completed", "aborted", "failed_pressure", "failed_faults",
                            "unclear_failures", "hung", "client_errors")}
    stats["examples"] = []
    completed: list = []
    try:
        async with aiohttp.ClientSession() as session:
            await servers.ready(session)
            rng = random.Random(args.seed)
            decode = servers.urls["decode"]
            end = time.monotonic() + args.duration
            inflight: set[asyncio.Task] = set()
            while time.monotonic() < end:
                while len(inflight) < args.concurrency:
                    stats["started"] += 1
                    inflight.add(asyncio.ensure_future(one(session, args, rng, decode, stats, completed)))
                _, inflight = await asyncio.wait(inflight, timeout=0.5, return_when=asyncio.FIRST_COMPLETED)
            if inflight:
                await asyncio.wait(inflight)
            held = await wait_quiet(session, [decode, servers.urls["prefill"]], timeout=30)
            leaked = {url: h for url, h in held.items() if any(h.values())}
            not_ready = await still_not_ready(session, servers.urls, timeout=15)
            wrong = 0
            checks = completed[: args.check_requests]
            references = await asyncio.gather(*(generate(session, servers.urls["reference"], p, n,
                                                         args.request_timeout + 30) for p, n, _ in checks))
            for (_, _, got), want in zip(checks, references):
                wrong += got != want.get("output_ids")
    finally:
        servers.stop()
    rows = [
        ("duration (s)", args.duration), ("decode pool (tokens)", servers.pool_tokens),
        ("requests started", stats["started"]), ("completed", stats["completed"]), ("aborted by client", stats["aborted"]),
        ("failed by frame faults (allowed)", stats["failed_faults"]),
        ("  of them without a clear reason", stats["unclear_failures"]),
        ("failed for pressure", stats["failed_pressure"]), ("hung", stats["hung"]),
        ("client errors", stats["client_errors"]),
        ("leaked (instances holding anything)", len(leaked)), ("instances not ready", len(not_ready)),
        ("outputs checked / wrong", f"{len(checks)} / {wrong}"),
    ]
    passed = (stats["failed_pressure"] == 0 and stats["unclear_failures"] == 0 and stats["hung"] == 0
              and stats["client_errors"] == 0 and not leaked and not not_ready and wrong == 0
              and stats["completed"] > 0)
    if args.json:
        print(json.dumps({**stats, "checked": len(checks), "wrong": wrong,
                          "leaked": leaked, "not_ready": not_ready, "pool_tokens": servers.pool_tokens,
                          "logs": str(log_dir), "passed": passed}))
        return passed
    width = max(len(name) for name, _ in rows)
    print(f"soak summary (logs in {log_dir})")
    for name, value in rows:
        print(f"  {name:<{width}}  {value}")
    for example in stats["examples"][:8]:
        print(f"  e.g. {example}")
    if leaked:
        print(f"  leaked: {leaked}")
    if not_ready:
        print(f"  not ready: {not_ready}")
    print("PASSED" if passed else "FAILED")
    return passed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=None,
                   help="checkpoint to serve (default: the built-in); completions must run to their length, so "
                        "a random `make-tiny` checkpoint, which never stops early at EOS, suits best")
    p.add_argument("--duration", type=float, default=300.0, help="seconds of load (default 5 minutes)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-prompt", type=int, default=400)
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--abort-fraction", type=float, default=0.3)
    p.add_argument("--fault-rate", type=float, default=0.05, help="share of frames faulted, all fault kinds together")
    p.add_argument("--request-timeout", type=float, default=60.0)
    p.add_argument("--check-requests", type=int, default=48, help="completed outputs checked against the reference")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    sys.exit(0 if asyncio.run(soak(p.parse_args())) else 1)


if __name__ == "__main__":
    main()
