"""Serving metrics as SGLang's bench_serving and vLLM's benchmark_serving define them.

Per request: TTFT (send to first token), E2E (send to last token), TPOT = (E2E - TTFT) / (output
tokens - 1) (the decode step seen by the client, first token excluded), and ITLs (the gaps between
consecutive streamed tokens). Per run: the mean, median, p90 and p99 of each, over requests (TTFT,
TPOT, E2E) or over all gaps of all requests (ITL), and throughputs over the run's wall time.
Percentiles interpolate linearly between order statistics, as numpy's default does. Pure Python:
the plots and the unit tests use it without torch or dsv4.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass, field

STATS = ("mean", "median", "p90", "p99")
LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between the closest ranks; nan for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = q / 100 * (len(ordered) - 1)
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratio(numerator: float, denominator: float) -> float:
    """nan where either side is missing (a run that failed) or the denominator is 0."""
    if not denominator or math.isnan(denominator) or math.isnan(numerator):
        return math.nan
    return numerator / denominator


def stats_ms(values: list[float]) -> dict[str, float]:
    """mean/median/p90/p99 of seconds, in milliseconds."""
    ms = [v * 1000 for v in values]
    return {
        "mean": statistics.fmean(ms) if ms else math.nan,
        "median": percentile(ms, 50),
        "p90": percentile(ms, 90),
        "p99": percentile(ms, 99),
    }


def summarize(results: list[RequestResult], duration: float) -> dict:
    """The run's figures under vLLM's JSON names (mean_ttft_ms, p99_itl_ms, output_throughput, ...)."""
    good = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in good)
    output_tokens = sum(r.output_tokens for r in good)
    per_metric = {
        "ttft": [r.ttft for r in good],
        "tpot": [r.tpot for r in good if r.tpot is not None],
        "itl": [gap for r in good for gap in r.itls],
        "e2e": [r.e2e for r in good],
    }
    summary = {
        "duration": duration,
        "completed": len(good),
        "failed": len(results) - len(good),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(good) / duration if duration > 0 else math.nan,
        "output_throughput": output_tokens / duration if duration > 0 else math.nan,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else math.nan,
    }
    for metric, values in per_metric.items():
        for stat, value in stats_ms(values).items():
            summary[f"{stat}_{metric}_ms"] = value
    summary["errors"] = sorted({r.error for r in results if not r.ok})[:5]
    return summary


def metric_keys() -> list[str]:
    """Every key `summarize` writes: what a result file must hold."""
    return ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "total_token_throughput"] + [f"{s}_{m}_ms" for m in LATENCIES for s in STATS]


def request_records(results: list[RequestResult]) -> list[dict]:
    """Per-request raw figures for the result file (ITLs left out: the summary has their spread)."""
    return [{k: v for k, v in asdict(r).items() if k != "itls"} for r in results]


def format_summary(title: str, s: dict) -> str:
    """A vLLM/SGLang-style result block."""
    rows = [
        ("Successful requests:", f"{s['completed']}"),
        ("Failed requests:", f"{s['failed']}"),
        ("Benchmark duration (s):", f"{s['duration']:.2f}"),
        ("Total input tokens:", f"{s['total_input_tokens']}"),
        ("Total generated tokens:", f"{s['total_output_tokens']}"),
        ("Request throughput (req/s):", f"{s['request_throughput']:.2f}"),
        ("Output token throughput (tok/s):", f"{s['output_throughput']:.2f}"),
        ("Total token throughput (tok/s):", f"{s['total_token_throughput']:.2f}"),
    ]
    if "prefix_cache_hit_rate" in s:
        rows.append(("Prefix cache hit rate:", f"{s['prefix_cache_hit_rate']:.1%}"))
    headings = {"ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
                "itl": "Inter-token Latency", "e2e": "End-to-end Latency"}
    lines = [f"{' ' + title + ' ':=^50}"] + [f"{a:<40}{b:>10}" for a, b in rows]
    for metric, heading in headings.items():
        lines.append(f"{heading:-^50}")
        for stat in STATS:
            label = f"{stat.capitalize() if stat in ('mean', 'median') else stat.upper()} {metric.upper()} (ms):"
            lines.append(f"{label:<40}{s[f'{stat}_{metric}_ms']:>10.2f}")
    for error in s.get("errors", []):
        lines.append(f"failure: {error}")
    lines.append("=" * 50)
    return "\n".join(lines)
