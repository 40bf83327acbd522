"""ITL over time across an abort storm: `concurrency` streams decode together, and once each has
`storm_after` tokens a `fraction` of them is aborted at once (their connections closed, as clients
that give up do). Every token's gap to the one before it is kept with its arrival time, so the plot
shows whether the survivors stall when the storm lands, and how the step changes once the batch
shrinks. Afterwards the server must hold nothing and be ready (`scripts/abort_storm.py`'s checks).
"""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
from abort_storm import get_json, wait_quiet

from bench.client import Stream, stream_request
from bench.metrics import stats_ms


async def itl_across_storm(url: str, prompts: list[list[int]], output_len: int, fraction: float, storm_after: int,
                           timeout: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    streams = [Stream(p) for p in prompts]
    doomed = set(rng.sample(range(len(streams)), round(fraction * len(streams))))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        start = time.perf_counter()
        tasks = [asyncio.create_task(stream_request(url, s, output_len, timeout)) for s in streams]
        deadline = time.monotonic() + timeout
        while (any(s.tokens < storm_after and not t.done() for s, t in zip(streams, tasks))
               and time.monotonic() < deadline):
            await asyncio.sleep(0.005)
        storm_at = time.perf_counter()
        for i in doomed:
            tasks[i].cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        finished = time.perf_counter()
        held = (await wait_quiet(session, [url], 30.0))[url]
        ready = (await get_json(session, f"{url}/health/ready"))[0] == 200

    points = []  # (seconds since start, gap ms, aborted)
    for i, s in enumerate(streams):
        for (before, _), (at, n) in zip(s.events, s.events[1:]):
            points += [(at - start, (at - before) / n * 1000, i in doomed)] * n
    survivors = [p for p in points if not p[2]]
    storm = storm_at - start
    return {
        "concurrency": len(prompts),
        "aborted": len(doomed),
        "abort_fraction": fraction,
        "storm_at": storm,
        "duration": finished - start,
        "survivors_completed": sum(s.result().ok for i, s in enumerate(streams) if i not in doomed),
        "itl_before_ms": stats_ms([gap / 1000 for t, gap, _ in survivors if t <= storm]),
        "itl_after_ms": stats_ms([gap / 1000 for t, gap, _ in survivors if t > storm]),
        "held_after": held,
        "ready_after": ready,
        "points": points,
    }


def format_storm(record: dict) -> str:
    before, after = record["itl_before_ms"], record["itl_after_ms"]
    return (f"abort storm: {record['aborted']} of {record['concurrency']} streams aborted at "
            f"{record['storm_at']:.2f} s; survivors completed {record['survivors_completed']}/"
            f"{record['concurrency'] - record['aborted']}; survivors' ITL before the storm median "
            f"{before['median']:.1f} ms p99 {before['p99']:.1f} ms, after median {after['median']:.1f} ms "
            f"p99 {after['p99']:.1f} ms; held after settling {record['held_after']}, "
            f"ready {record['ready_after']}")
