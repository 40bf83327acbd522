"""Abort storm against a prefill/decode pair: liveness, leaks and correctness after mass aborts.

Drives a decode instance with rounds of concurrent requests, aborting a fraction of them at random
moments (by closing the connection, as a client that gives up does; many land mid-transfer), then
checks that no request hung past its deadline, that both instances hold no pages, slots or
transfers, that both are ready, and that the next requests are served correctly (greedy output
equal to a reference instance's, normally a colocated one). Prints a summary table; with --json,
one JSON object instead. Exit status 0 only when every check passed.

    python scripts/abort_storm.py --decode-url http://127.0.0.1:30000 --prefill-url http://127.0.0.1:30001 \
        --reference-url http://127.0.0.1:30002 --rounds 10 --concurrency 200 --abort-fraction 0.9
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time

import aiohttp


def make_prompts(rng: random.Random, count: int, max_len: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(1, max_len))] for _ in range(count)]


async def generate(session, url: str, prompt: list[int], max_new_tokens: int, timeout: float) -> dict:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    async with session.post(f"{url}/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as r:
        return await r.json()


async def get_json(session, url: str) -> tuple[int, dict]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=10)) as r:
        return r.status, await r.json()


def holdings(debug: dict) -> dict:
    """What an instance still holds: requests, transfers, pages and slots not free."""
    return {
        "requests": len(debug.get("requests", [])),
        "transfers": len(debug.get("disaggregation", {}).get("transfers", [])),
        "pages_held": debug["total_pages"] - debug["free_pages"],
        "slots_held": debug["total_slots"] - debug["free_slots"],
    }


async def wait_quiet(session, urls: list[str], timeout: float) -> dict[str, dict]:
    end = time.monotonic() + timeout
    while True:
        held = {url: holdings((await get_json(session, f"{url}/debug/requests"))[1]) for url in urls}
        if all(not any(h.values()) for h in held.values()) or time.monotonic() > end:
            return held
        await asyncio.sleep(0.2)


async def storm_round(session, args, rng: random.Random, prompts) -> dict:
    outcomes = {"completed": 0, "aborted": 0, "failed": 0, "hung": 0}

    async def one(prompt):
        abort_at = rng.uniform(0.0, args.abort_window) if rng.random() < args.abort_fraction else None
        request = generate(session, args.decode_url, prompt, args.max_new_tokens, args.request_timeout + 5)
        try:
            if abort_at is not None:
                await asyncio.wait_for(request, abort_at)
            else:
                result = await asyncio.wait_for(request, args.request_timeout + 5)
                reason = result.get("meta_info", {}).get("finish_reason")
                outcomes["completed" if reason in ("length", "stop") else "failed"] += 1
                return
        except TimeoutError:
            outcomes["aborted" if abort_at is not None else "hung"] += 1
            return
        except aiohttp.ClientError:
            outcomes["failed"] += 1
            return
        outcomes["completed"] += 1  # finished before its abort came

    await asyncio.gather(*(one(p) for p in prompts))
    return outcomes


async def throughput(session, url: str, prompts, max_new_tokens: int, timeout: float) -> float:
    """Generated tokens per second for `prompts` sent at once."""
    started = time.monotonic()
    results = await asyncio.gather(*(generate(session, url, p, max_new_tokens, timeout) for p in prompts))
    tokens = sum(len(r.get("output_ids", [])) for r in results)
    return tokens / (time.monotonic() - started)


async def correct_outputs(session, args, prompts) -> tuple[int, list[str]]:
    def send(url):
        return asyncio.gather(*(generate(session, url, p, args.max_new_tokens, args.request_timeout) for p in prompts))

    got = await send(args.decode_url)
    wanted = await send(args.reference_url) if args.reference_url else [None] * len(prompts)
    problems = []
    correct = 0
    for i, (prompt, result, want) in enumerate(zip(prompts, got, wanted)):
        ok = result.get("meta_info", {}).get("finish_reason") in ("length", "stop")
        if want is not None:
            ok = ok and result.get("output_ids") == want.get("output_ids")
        correct += ok
        if not ok:
            problems.append(f"prompt {i} ({len(prompt)} tokens): got {result}")
    return correct, problems


async def run(args) -> dict:
    rng = random.Random(args.seed)
    urls = [args.decode_url] + ([args.prefill_url] if args.prefill_url else [])
    # Idle pooled connections are dropped well before the server's keep-alive timeout (5 s by default)
    # closes them: a request sent on a connection the server is closing fails with ServerDisconnectedError
    # (seen once, on a loaded machine, after the storm).
    connector = aiohttp.TCPConnector(keepalive_timeout=1.0)
    async with aiohttp.ClientSession(connector=connector) as session:
        probe = make_prompts(rng, args.throughput_requests, args.max_prompt_len, args.vocab)
        await throughput(session, args.decode_url, probe, args.max_new_tokens, args.request_timeout)  # warm-up
        before = [await throughput(session, args.decode_url, probe, args.max_new_tokens, args.request_timeout)
                  for _ in range(args.throughput_samples)]
        rounds = []
        for _ in range(args.rounds):
            started = time.monotonic()
            prompts = make_prompts(rng, args.concurrency, args.max_prompt_len, args.vocab)
            outcome = await storm_round(session, args, rng, prompts)
            outcome["seconds"] = round(time.monotonic() - started, 2)
            rounds.append(outcome)
        held = await wait_quiet(session, urls, args.settle_timeout)
        ready = {url: (await get_json(session, f"{url}/health/ready"))[0] == 200 for url in urls}
        after_prompts = make_prompts(rng, args.check_requests, args.max_prompt_len, args.vocab)
        correct, problems = await correct_outputs(session, args, after_prompts)
        after = [await throughput(session, args.decode_url, probe, args.max_new_tokens, args.request_timeout)
                 for _ in range(args.throughput_samples)]
    hung = sum(r["hung"] for r in rounds)
    leaked = {url: h for url, h in held.items() if any(h.values())}
    return {
        "rounds": rounds,
        "hung": hung,
        "leaked": leaked,
        "ready": ready,
        "correct_after": correct,
        "checked_after": len(after_prompts),
        "problems": problems[:5],
        # Best of the samples on each side: on a shared machine the best is the least disturbed.
        "throughput_before": round(max(before), 2),
        "throughput_after": round(max(after), 2),
        "throughput_samples": {"before": [round(x, 2) for x in before], "after": [round(x, 2) for x in after]},
        "passed": hung == 0 and not leaked and all(ready.values()) and correct == len(after_prompts),
    }


def print_table(summary: dict) -> None:
    print(f"{'round':>5} {'completed':>9} {'aborted':>7} {'failed':>6} {'hung':>4} {'seconds':>7}")
    for i, r in enumerate(summary["rounds"], 1):
        print(f"{i:>5} {r['completed']:>9} {r['aborted']:>7} {r['failed']:>6} {r['hung']:>4} {r['seconds']:>7}")
    print(f"hung requests:            {summary['hung']}")
    print(f"leaked (after settling):  {summary['leaked'] or 'none'}")
    print(f"ready:                    {summary['ready']}")
    print(f"correct after the storm:  {summary['correct_after']}/{summary['checked_after']}")
    ratio = summary["throughput_after"] / summary["throughput_before"] if summary["throughput_before"] else 0.0
    print(f"throughput before/after:  {summary['throughput_before']} / {summary['throughput_after']} tokens/s "
          f"(best of {summary['throughput_samples']}); after/before {ratio:.3f}, "
          f"{'within' if ratio >= 0.95 else 'NOT within'} 5%")
    for problem in summary["problems"]:
        print(f"  {problem}")
    print("PASSED" if summary["passed"] else "FAILED")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--decode-url", required=True)
    p.add_argument("--prefill-url", help="checked for leaks and readiness too")
    p.add_argument("--reference-url", help="an instance whose greedy outputs are correct (e.g. colocated)")
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--concurrency", type=int, default=200)
    p.add_argument("--abort-fraction", type=float, default=0.9)
    p.add_argument("--abort-window", type=float, default=3.0, help="aborts land uniformly in [0, this) seconds")
    p.add_argument("--max-prompt-len", type=int, default=300)
    p.add_argument("--max-new-tokens", type=int, default=4)
    p.add_argument("--vocab", type=int, default=500, help="prompt token ids are drawn from [2, vocab)")
    p.add_argument("--request-timeout", type=float, default=120.0)
    p.add_argument("--settle-timeout", type=float, default=30.0)
    p.add_argument("--check-requests", type=int, default=64)
    p.add_argument("--throughput-requests", type=int, default=16)
    p.add_argument("--throughput-samples", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    summary = asyncio.run(run(args))
    if args.json:
        print(json.dumps(summary))
    else:
        print_table(summary)
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
