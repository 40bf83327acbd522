#!/usr/bin/env python3
"""Prefix-cache benchmark, in-process on one engine:

- TTFT of a prompt whose first `--cached` tokens another request computed before (the hit is the
  longest page-aligned prefix), against a cold prefill of a prompt of the same length, and against
  the same cold prefill with --disable-radix-cache (which does not end prefill chunks at pages);
- the same hit served from the host tier (--enable-hierarchical-cache, a device pool of two prompts
  and a prompt that fills it in between, so the cached pages were evicted to the host), against a
  cold prefill on that engine: printed as a ratio with its target (>= 5x);
- the hit rate (cached / prompt tokens) of a shared-prefix workload: `--sessions` requests sharing a
  `--system`-token prefix, each with its own tail.

Every wait is bounded by --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time

from dsv4.config import ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.protocol import GenerationRequest, SamplingParams
from dsv4.tiny import make_tiny


async def first_token(engine, rid: str, prompt: list[int], timeout: float) -> tuple[float, int]:
    """Seconds to the first output, and the cached tokens it reports."""
    request = GenerationRequest(rid=rid, input_ids=tuple(prompt),
                                sampling=SamplingParams(max_new_tokens=1, temperature=0.0, ignore_eos=True))
    started = time.perf_counter()
    async with asyncio.timeout(timeout):
        outputs = [out async for out in engine.submit(request)]
    if outputs[-1].finish_reason != "length":
        raise RuntimeError(f"{rid}: {outputs[-1]}")
    return time.perf_counter() - started, outputs[-1].cached_tokens


async def run_engine(args: ServerArgs, fn):
    model = load_model(args)
    engine = Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name)
    await engine.start()
    try:
        return await fn(engine, model.config.vocab_size)
    finally:
        await engine.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=("tiny", "small"))
    parser.add_argument("--device", default=None)
    parser.add_argument("--prompt-len", type=int, default=4096)
    parser.add_argument("--cached", type=int, default=4096 - 16)
    parser.add_argument("--sessions", type=int, default=32)
    parser.add_argument("--system", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=600.0)
    opts = parser.parse_args()
    checkpoint = make_tiny(tempfile.mkdtemp(prefix="bench-prefix-"), preset=opts.preset)
    args = ServerArgs(model=str(checkpoint), device=opts.device, chunked_prefill_size=opts.prompt_len,
                      max_total_tokens=opts.prompt_len * 8, max_running_requests=opts.sessions)
    rng = random.Random(0)

    def fresh(vocab, n):
        return [rng.randrange(3, vocab) for _ in range(n)]

    async def cold_ttft(engine, vocab):
        await first_token(engine, "warmup", fresh(vocab, opts.prompt_len), opts.timeout)
        return min([(await first_token(engine, f"cold-{i}", fresh(vocab, opts.prompt_len), opts.timeout))[0]
                    for i in range(opts.repeats)])

    async def ttfts(engine, vocab):
        cold = await cold_ttft(engine, vocab)
        hit, cached = [], 0
        for i in range(opts.repeats):
            donor = fresh(vocab, opts.prompt_len)
            await first_token(engine, f"donor-{i}", donor, opts.timeout)
            prompt = donor[: opts.cached] + fresh(vocab, opts.prompt_len - opts.cached)
            seconds, cached = await first_token(engine, f"hit-{i}", prompt, opts.timeout)
            hit.append(seconds)
        return cold, min(hit), cached

    async def host_ttfts(engine, vocab):
        cold = await cold_ttft(engine, vocab)
        hit, cached = [], 0
        registry = engine.metrics.registry
        for i in range(opts.repeats):
            donor = fresh(vocab, opts.prompt_len)
            await first_token(engine, f"host-donor-{i}", donor, opts.timeout)
            # As large as the device pool: every cached page of the donor moves to the host tier.
            await first_token(engine, f"push-{i}", fresh(vocab, 2 * opts.prompt_len - 8), opts.timeout)
            before = registry.get_sample_value("dsv4_prefix_cache_hit_tokens_total", {"tier": "host"})
            prompt = donor[: opts.cached] + fresh(vocab, opts.prompt_len - opts.cached)
            seconds, cached = await first_token(engine, f"host-hit-{i}", prompt, opts.timeout)
            from_host = registry.get_sample_value("dsv4_prefix_cache_hit_tokens_total", {"tier": "host"}) - before
            if from_host != cached:
                raise RuntimeError(f"{cached} tokens cached but {from_host:g} of them from the host tier")
            hit.append(seconds)
        return cold, min(hit), cached

    async def hit_rate(engine, vocab):
        system = fresh(vocab, opts.system)
        prompts = [system + fresh(vocab, rng.randint(16, 256)) for _ in range(opts.sessions)]
        await first_token(engine, "first", prompts[0], opts.timeout)  # the first session computes the prefix
        results = await asyncio.gather(*(first_token(engine, f"s{i}", p, opts.timeout)
                                         for i, p in enumerate(prompts[1:])))
        return sum(c for _, c in results) / sum(len(p) for p in prompts[1:])

    # Each figure is printed as soon as it is measured, the host tier's (the target) first.
    host = ServerArgs(**{**vars(args), "max_total_tokens": 2 * opts.prompt_len, "enable_hierarchical_cache": True,
                         "hicache_ratio": 4.0})
    host_cold, host_hit, host_cached = await run_engine(host, host_ttfts)
    print(f"preset {opts.preset}, prompt {opts.prompt_len} tokens, {opts.cached} shared (whole pages are cached, "
          f"the last token is computed)")
    print(f"TTFT with the hit on the host tier ({host_cached} tokens loaded back): cold {host_cold * 1e3:.1f} ms, "
          f"host hit {host_hit * 1e3:.1f} ms: {host_cold / host_hit:.1f}x (target >= 5x)", flush=True)
    cold, hit, cached = await run_engine(args, ttfts)
    off = ServerArgs(**{**vars(args), "disable_radix_cache": True})
    cold_off = await run_engine(off, cold_ttft)
    print(f"TTFT cold {cold * 1e3:.1f} ms, hit (device tier, {cached} tokens) {hit * 1e3:.1f} ms: {cold / hit:.1f}x; "
          f"cold with --disable-radix-cache {cold_off * 1e3:.1f} ms", flush=True)
    rate = await run_engine(args, hit_rate)
    print(f"shared-prefix hit rate: {rate:.1%} of prompt tokens ({opts.sessions} sessions, {opts.system}-token prefix)")


if __name__ == "__main__":
    asyncio.run(main())
