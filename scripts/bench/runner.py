"""One dtype's measurements: a dsv4 server's runs (concurrency sweep, request-rate sweep, shared
prefix, abort storm), then HF's batched `generate` on the same prompts once the server is stopped,
each run's figures printed and written to one JSON file in the results folder.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from bench.client import HIT_TOKENS, PROMPT_TOKENS, ServerProcess, run_client, run_load, scrape_counters
from bench.datasets import random_prompts, shared_prefix_prompts
from bench.metrics import format_summary, ratio, request_records, summarize
from bench.storm import format_storm, itl_across_storm


@dataclass
class Workload:
    input_len: int = 256
    output_len: int = 32
    # 0: a concurrency run sends max(8, concurrency), a rate run 16 (medians over 2 requests, as c=1 had,
    # moved its ratios by up to 0.2x between runs on a shared 2-core machine)
    num_prompts: int = 0
    gsp_num_groups: int = 4
    gsp_prompts_per_group: int = 4
    gsp_system_prompt_len: int = 512
    gsp_question_len: int = 64
    request_timeout: float = 600.0
    seed: int = 0


@dataclass
class Run:
    """A dsv4 run: `concurrency` requests at most in flight (None: no limit), arriving at `rate` per
    second (inf: all at once); with `hf`, HF runs the same prompts in batches of `concurrency`."""

    dataset: str
    concurrency: int | None
    rate: float = math.inf
    hf: bool = False
    sweep: bool = True  # False: a run of its own, not a point of a sweep
    # the memory bandwidth measured just before and just after the run (the run whose decode step is set
    # against the bandwidth floor): the machine's bandwidth moves between states that last seconds to
    # minutes (45..80 GB/s here), so a floor from a probe minutes away may be another state's
    probed: bool = False

    @property
    def kind(self) -> str:
        if not self.sweep:
            return "single"
        return "concurrency" if self.rate == math.inf and self.concurrency else "rate"

    @property
    def label(self) -> str:
        if self.rate == math.inf and self.concurrency:
            return f"{self.dataset}-c{self.concurrency}"
        return f"{self.dataset}-rate{self.rate:g}"


@dataclass
class Storm:
    concurrency: int = 16
    output_len: int = 64
    fraction: float = 0.75
    after_tokens: int = 8


@dataclass
class DtypeResult:
    dtype: str
    startup_s: float = math.nan
    runs: dict[tuple[str, str], dict] = field(default_factory=dict)  # (backend, label) -> record
    storm: dict | None = None
    hf_load_s: float = math.nan
    # the kinds of fp32 weights whose bf16 copies the server's decode steps read (its log says;
    # bench.baseline._BF16_COPIES)
    bf16_copies: tuple[str, ...] = ()

    def get(self, backend: str, run: Run) -> dict | None:
        return self.runs.get((backend, run.label))


class Results:
    """The results folder: one JSON file per run."""

    def __init__(self, folder: Path):
        self.folder = folder
        folder.mkdir(parents=True, exist_ok=True)

    def save(self, name: str, record: dict) -> None:
        (self.folder / f"{name}.json").write_text(json.dumps(record, indent=1, allow_nan=True) + "\n")


def prompts_for(run: Run, work: Workload, index: int) -> list[list[int]]:
    """Each run its own seed, so no run's prompts are a prefix hit on another's."""
    seed = work.seed * 1000 + index
    if run.dataset == "generated-shared-prefix":
        return shared_prefix_prompts(work.gsp_num_groups, work.gsp_prompts_per_group, work.gsp_system_prompt_len,
                                     work.gsp_question_len, seed)
    n = work.num_prompts or (max(8, run.concurrency) if run.kind == "concurrency" else 16)
    return random_prompts(n, work.input_len, seed)


def _record(backend: str, dtype: str, run: Run, work: Workload, results, wall: float) -> dict:
    return {"backend": backend, "dtype": dtype, "kind": run.kind, "dataset": run.dataset,
            "concurrency": run.concurrency, "request_rate": run.rate, "num_prompts": len(results),
            "output_len": work.output_len, **summarize(results, wall), "requests": request_records(results)}


def probe_bandwidth(gib: float) -> float:
    """GB/s read now (bench.baseline.memory_bandwidth): the server is idle, its threads asleep."""
    from bench.baseline import memory_bandwidth

    return memory_bandwidth(gib)["read_gbps"]


async def _dsv4_run(url: str, dtype: str, run: Run, work: Workload, prompts) -> dict:
    before = await scrape_counters(url)
    results, wall = await run_load(url, prompts, work.output_len, work.request_timeout, run.concurrency, run.rate,
                                   seed=work.seed)
    record = _record("dsv4", dtype, run, work, results, wall)
    after = await scrape_counters(url)
    prompt_tokens = after[PROMPT_TOKENS] - before[PROMPT_TOKENS]
    if run.dataset == "generated-shared-prefix":
        record["prefix_cache_hit_tokens"] = after[HIT_TOKENS] - before[HIT_TOKENS]
        record["prefix_cache_prompt_tokens"] = prompt_tokens
        record["prefix_cache_hit_rate"] = record["prefix_cache_hit_tokens"] / prompt_tokens if prompt_tokens else 0.0
    return record


def warmup_prompt(work: Workload) -> list[int]:
    """The request each backend serves before it is measured, of the workload's prompt length: the
    first forward of that size pays once for what later ones reuse (a server's allocator growth and
    its prefill thread pool; HF's lazy inits), as SGLang's bench_serving warms up on a real prompt.
    Shares no prefix with any measured prompt."""
    return random_prompts(1, work.input_len, work.seed * 1000 + 998)[0]


def measure_server(url: str, dtype: str, runs: list[Run], work: Workload, results: Results, out: DtypeResult,
                   storm: Storm | None, bandwidth_gib: float = 1.0) -> None:
    run_client(run_load(url, [warmup_prompt(work)], 4, work.request_timeout))  # first-request costs stay out
    for index, run in enumerate(runs):
        before = probe_bandwidth(bandwidth_gib) if run.probed else None
        record = run_client(_dsv4_run(url, dtype, run, work, prompts_for(run, work, index)))
        if run.probed:
            record["bandwidth_beside_gbps"] = [before, probe_bandwidth(bandwidth_gib)]
        out.runs[("dsv4", run.label)] = record
        results.save(f"dsv4-{dtype}-{run.label}", record)
        print(format_summary(f"dsv4 {dtype} {run.label}", record), flush=True)
    if storm is not None:
        prompts = random_prompts(storm.concurrency, work.input_len, work.seed * 1000 + 999)
        record = run_client(itl_across_storm(url, prompts, storm.output_len, storm.fraction, storm.after_tokens,
                                              work.request_timeout, work.seed))
        record.update(kind="abort-storm", backend="dsv4", dtype=dtype)
        out.storm = record
        results.save(f"abort-storm-{dtype}", record)
        print(format_storm(record), flush=True)


def measure_hf(model_dir: Path, dtype: str, runs: list[Run], work: Workload, results: Results,
               out: DtypeResult) -> None:
    import time

    from bench.baseline import HFBaseline

    started = time.perf_counter()
    hf = HFBaseline(model_dir, dtype, warmup_prompt(work))
    out.hf_load_s = time.perf_counter() - started
    for index, run in enumerate(runs):
        if not run.hf:
            continue
        done, wall = hf.run(prompts_for(run, work, index), run.concurrency, work.output_len)
        record = {**_record("hf", dtype, run, work, done, wall), "torch_threads": hf.threads}
        out.runs[("hf", run.label)] = record
        results.save(f"hf-{dtype}-{run.label}", record)
        title = f"HF {dtype} {run.label} (batch {run.concurrency}, {hf.threads} threads)"
        print(format_summary(title, record), flush=True)


def measure_dtype(model_dir: Path, dtype: str, server_args: list[str], runs: list[Run], work: Workload,
                  results: Results, storm: Storm | None = None, ready_timeout: float = 600,
                  bandwidth_gib: float = 1.0) -> DtypeResult:
    from dsv4.model.compile import BF16_COPIES_LOGGED  # (torch: imported where a server is measured)
    from dsv4.model.model import KERNEL_COPIES_LOGGED

    out = DtypeResult(dtype)
    server = ServerProcess(model_dir, ["--dtype", dtype, *server_args], ready_timeout,
                           results.folder / f"server-{dtype}.log")
    with server:
        out.startup_s = server.ready_seconds
        print(f"\ndsv4 server ({dtype}) ready in {out.startup_s:.1f} s", flush=True)
        measure_server(server.url, dtype, runs, work, results, out, storm, bandwidth_gib)
    log = server.log.read_text(errors="replace")
    out.bf16_copies = tuple(kind for kind, line in KERNEL_COPIES_LOGGED.items()
                            if BF16_COPIES_LOGGED in log or line in log)
    # HF runs after the server has stopped: neither competes with the other for the cores.
    measure_hf(model_dir, dtype, runs, work, results, out)
    return out


def ratio_table(result: DtypeResult, runs: list[Run]) -> str:
    """dsv4 against HF for each run both made: output tok/s, TTFT and TPOT (median)."""
    header = (f"{'run':>28} | {'out tok/s dsv4':>14} {'HF':>8} {'x':>6} | {'TTFT ms dsv4':>12} {'HF':>8} {'x':>6} | "
              f"{'TPOT ms dsv4':>12} {'HF':>8} {'x':>6}")
    lines = [header]
    for run in runs:
        mine, theirs = result.get("dsv4", run), result.get("hf", run)
        if mine is None:
            continue
        row = f"{run.label:>28} | {mine['output_throughput']:>14.1f} "
        if theirs is None:
            lines.append(row + f"{'-':>8} {'-':>6} | {mine['median_ttft_ms']:>12.1f} {'-':>8} {'-':>6} | "
                               f"{mine['median_tpot_ms']:>12.1f} {'-':>8} {'-':>6}")
            continue
        lines.append(row + f"{theirs['output_throughput']:>8.1f} "
                           f"{ratio(mine['output_throughput'], theirs['output_throughput']):>5.2f}x | "
                           f"{mine['median_ttft_ms']:>12.1f} {theirs['median_ttft_ms']:>8.1f} "
                           f"{ratio(theirs['median_ttft_ms'], mine['median_ttft_ms']):>5.2f}x | "
                           f"{mine['median_tpot_ms']:>12.1f} {theirs['median_tpot_ms']:>8.1f} "
                           f"{ratio(theirs['median_tpot_ms'], mine['median_tpot_ms']):>5.2f}x")
    return "\n".join(lines)
