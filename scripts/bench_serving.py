#!/usr/bin/env python3
"""Serving benchmark: a concurrency sweep against a dsv4 server, with HF transformers as baseline.

Modes:
  --url URL              sweep a server that is already running
  --model DIR            start `python -m dsv4 serve --model DIR` on a free port, sweep it, stop it
  --suite                what `make bench` runs: build the `small` checkpoint once, sweep dsv4 at
                         concurrency 1, 8 and 32, run the HF baseline on the same prompts in the
                         same run, print the ratio, the concurrency-1 decode step at --tp-size 2
                         against 1, then run the kernel benchmark on CPU.
  --baseline hf          also time HF `DeepseekV4ForCausalLM.generate` on the same checkpoint and
                         the first level's prompts (greedy, one prompt at a time: HF's V4 cache
                         has no batched prefill over padded prompts) and print dsv4/HF ratios
                         for every level.

Per concurrency level it reports TTFT, TPOT and ITL (mean/p50/p99), output tok/s and failures.
Every request and the whole run are bounded by timeouts; a server it starts is always stopped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class RequestResult:
    ok: bool
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    output_tokens: int = 0
    error: str = ""


@dataclass
class LevelResult:
    concurrency: int
    results: list[RequestResult]
    wall: float

    @property
    def good(self) -> list[RequestResult]:
        return [r for r in self.results if r.ok]

    @property
    def output_tok_s(self) -> float:
        return sum(r.output_tokens for r in self.good) / self.wall if self.wall else 0.0


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def summarize(values: list[float]) -> str:
    if not values:
        return "      n/a"
    ms = [v * 1000 for v in values]
    return f"{statistics.fmean(ms):8.1f} {percentile(ms, 50):8.1f} {percentile(ms, 99):8.1f}"


def make_prompts(n: int, input_len: int, vocab_low: int, vocab_high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    lengths = [max(1, int(input_len * rng.uniform(0.5, 1.5))) for _ in range(n)]
    return [[rng.randrange(vocab_low, vocab_high) for _ in range(length)] for length in lengths]


async def one_request(session: aiohttp.ClientSession, url: str, prompt: list[int], output_len: int,
                      timeout: float) -> RequestResult:
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
        "stream": True,
    }
    start = time.perf_counter()
    last = start
    result = RequestResult(ok=False)
    try:
        async with session.post(url + "/generate", json=body, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            if resp.status != 200:
                result.error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
                return result
            seen = 0
            async for raw in resp.content:
                line = raw.decode().strip()
                if not line.startswith("data:") or line == "data: [DONE]":
                    continue
                event = json.loads(line[5:])
                if "error" in event:
                    result.error = str(event["error"])[:200]
                    return result
                new = len(event.get("output_ids", []))  # each event carries only its new ids
                if new:
                    now = time.perf_counter()
                    if seen == 0:
                        result.ttft = now - start
                    else:
                        # Tokens that arrive together share the gap since the last event.
                        result.itls.extend([(now - last) / new] * new)
                    last, seen = now, seen + new
            result.output_tokens = seen
            result.e2e = time.perf_counter() - start
            result.ok = seen > 0
            if not result.ok:
                result.error = "no tokens"
    except (TimeoutError, aiohttp.ClientError) as e:
        result.error = f"{type(e).__name__}: {e}"[:200]
    return result


async def run_level(url: str, prompts: list[list[int]], concurrency: int, output_len: int,
                    timeout: float) -> LevelResult:
    gate = asyncio.Semaphore(concurrency)
    async with aiohttp.ClientSession() as session:
        async def bounded(prompt):
            async with gate:
                return await one_request(session, url, prompt, output_len, timeout)

        start = time.perf_counter()
        results = await asyncio.gather(*(bounded(p) for p in prompts))
        return LevelResult(concurrency, list(results), time.perf_counter() - start)


def print_levels(levels: list[LevelResult]) -> None:
    print(f"{'conc':>4} {'ok':>4} {'fail':>4} {'out tok/s':>10} | {'TTFT ms mean/p50/p99':>26} | "
          f"{'TPOT ms mean/p50/p99':>26} | {'ITL ms mean/p50/p99':>26}")
    for level in levels:
        good = level.good
        tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in good if r.output_tokens > 1]  # per request
        itls = [v for r in good for v in r.itls]
        print(f"{level.concurrency:>4} {len(good):>4} {len(level.results) - len(good):>4} "
              f"{level.output_tok_s:>10.1f} | {summarize([r.ttft for r in good])} | {summarize(tpots)} | "
              f"{summarize(itls)}")
        for r in level.results:
            if not r.ok:
                print(f"     failure: {r.error}")
                break


def tpot(level: LevelResult) -> float:
    """Mean time per output token after the first: the decode step, seen from the client."""
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in level.good if r.output_tokens > 1]
    return statistics.fmean(tpots) if tpots else float("nan")


def tp_decode_step(model_dir: Path, server_args: list[str], prompts: list[list[int]], output_len: int,
                   timeout: float) -> float:
    """The concurrency-1 decode step of a `--tp-size 2` server on the same checkpoint and prompts."""
    server = ServerProcess(model_dir, [*server_args, "--tp-size", "2"], ready_timeout=300)
    try:
        server.wait_ready()
        return tpot(asyncio.run(run_level(server.url, prompts, 1, output_len, timeout)))
    finally:
        server.stop()


def hf_baseline(model_dir: Path, prompts: list[list[int]], output_len: int) -> tuple[float, float]:
    """(output tok/s, mean TTFT s) of HF transformers' generate, one prompt at a time."""
    import torch
    from transformers import DeepseekV4ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens, ttfts, start = 0, [], time.perf_counter()
    with torch.inference_mode():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            t0 = time.perf_counter()
            model(ids)  # the prefill alone, for TTFT
            ttfts.append(time.perf_counter() - t0)
            out = model.generate(ids, max_new_tokens=output_len, min_new_tokens=output_len, do_sample=False)
            tokens += out.shape[1] - ids.shape[1]
    elapsed = time.perf_counter() - start - sum(ttfts)
    return tokens / elapsed, statistics.fmean(ttfts)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """A `dsv4 serve` child process that is always stopped."""

    def __init__(self, model_dir: Path, extra: list[str], ready_timeout: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dsv4", "serve", "--model", str(model_dir), "--port", str(self.port), *extra]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        self.ready_timeout = ready_timeout

    def wait_ready(self) -> None:
        import urllib.request

        deadline = time.monotonic() + self.ready_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode}")
            try:
                with urllib.request.urlopen(self.url + "/health/ready", timeout=2) as resp:
                    if resp.status == 200:
                        return
            except OSError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not ready within {self.ready_timeout}s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)


def small_checkpoint() -> Path:
    from dsv4.config import cache_dir
    from dsv4.tiny import make_tiny

    path = cache_dir() / "bench-small-bf16"
    if not (path / "config.json").exists():
        print(f"building the small checkpoint into {path} (once)", flush=True)
        make_tiny(path, preset="small", fmt="bf16", seed=0)
    return path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--url", help="sweep an already running server")
    target.add_argument("--model", type=Path, help="start a server on this checkpoint")
    target.add_argument("--suite", action="store_true", help="the `make bench` suite on the small checkpoint")
    parser.add_argument("--concurrency", default="1,8,32", help="comma-separated levels")
    parser.add_argument("--prompts-per-level", type=int, default=0, help="default: the concurrency, at least 4")
    parser.add_argument("--input-len", type=int, default=256)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--baseline", choices=["none", "hf"], default="none")
    parser.add_argument("--server-args", default="--dtype float32", help="extra `dsv4 serve` flags")
    parser.add_argument("--request-timeout", type=float, default=600)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model_dir = small_checkpoint() if args.suite else args.model
    if args.suite:
        args.baseline = "hf"
    levels = [int(c) for c in args.concurrency.split(",")]
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"] if model_dir else 256
    # Skip the special tokens at the bottom of the vocabulary so prompts are plain text bytes.
    prompt_sets = {
        c: make_prompts(args.prompts_per_level or max(4, c), args.input_len, 64, min(vocab, 300), args.seed + c)
        for c in levels
    }

    server = None
    url = args.url
    if model_dir is not None:
        server = ServerProcess(model_dir, args.server_args.split(), ready_timeout=300)
    try:
        if server is not None:
            server.wait_ready()
            url = server.url
        results = [asyncio.run(run_level(url, prompt_sets[c], c, args.output_len, args.request_timeout))
                   for c in levels]
    finally:
        if server is not None:
            server.stop()
    print(f"\ndsv4 serving benchmark ({url}; input ~{args.input_len}, output {args.output_len} tokens)")
    print_levels(results)

    if args.baseline == "hf":
        if model_dir is None:
            parser.error("--baseline hf needs --model or --suite")
        # HF generate serves one request at a time, so its throughput is the same at every level:
        # measure it once, on the first level's prompts, and compare every level against it.
        hf_prompts = prompt_sets[levels[0]]
        hf_tok_s, hf_ttft = hf_baseline(model_dir, hf_prompts, args.output_len)
        print(f"\nHF transformers baseline: same checkpoint, fp32, {len(hf_prompts)} of the same prompts one at a "
              f"time: {hf_tok_s:.1f} output tok/s, TTFT {hf_ttft * 1000:.1f} ms")
        print(f"{'conc':>4} {'dsv4 tok/s':>11} {'HF tok/s':>9} {'ratio':>7} | "
              f"{'dsv4 TTFT ms':>12} {'HF TTFT ms':>11} {'ratio':>7}")
        for level in results:
            ttft = statistics.fmean([r.ttft for r in level.good]) if level.good else float("nan")
            print(f"{level.concurrency:>4} {level.output_tok_s:>11.1f} {hf_tok_s:>9.1f} "
                  f"{level.output_tok_s / hf_tok_s:>6.2f}x | {ttft * 1000:>12.1f} {hf_ttft * 1000:>11.1f} "
                  f"{hf_ttft / ttft:>6.2f}x")
    if args.suite and 1 in levels:
        # On a 2-core machine the two ranks share the cores the one rank had: a figure, not a target.
        one = tpot(results[levels.index(1)])
        two = tp_decode_step(model_dir, args.server_args.split(), prompt_sets[1], args.output_len,
                             args.request_timeout)
        print(f"\ndecode step at concurrency 1: TP=1 {one * 1000:.1f} ms, TP=2 {two * 1000:.1f} ms "
              f"(TP=2 / TP=1 = {two / one:.2f})")
    if args.suite:
        bench_kernels = ROOT / "scripts" / "bench_kernels.py"
        if bench_kernels.exists():
            print("\nkernel benchmark (CPU fast path vs reference)", flush=True)
            subprocess.run([sys.executable, str(bench_kernels), "--device", "cpu"], cwd=ROOT, timeout=600, check=True)
        print("\nprefix cache (device and host tier TTFT, shared-prefix hit rate)", flush=True)
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_prefix_cache.py"), "--preset", "small"],
                       cwd=ROOT, timeout=1800, check=True)
    return 0 if all(level.good for level in results) else 1


if __name__ == "__main__":
    sys.exit(main())
