"""Issue 12's targets, each printed as a figure, HF's figure from the same run, their ratio, the
target and whether it is met. Ratios are speedups (above 1: dsv4 is faster), except against the
bandwidth bound, where the ratio is how many times the bound the decode step takes.
"""

from __future__ import annotations

import math

from bench.metrics import ratio
from bench.runner import DtypeResult, Run


def target_rows(results: list[DtypeResult], c1: Run, cmax: Run, input_len: int, bound_s: dict[str, float]) -> list[dict]:
    """`bound_s`: dtype -> weight bytes / bandwidth, the decode step's memory-bound floor."""
    rows = []

    def row(figure, mine, theirs, factor, target, met):
        rows.append({"figure": figure, "dsv4": mine, "baseline": theirs, "ratio": factor, "target": target,
                     "met": met})

    def figure_of(result, backend, run, key):
        record = result.get(backend, run)
        return record[key] if record else math.nan

    for r in results:
        mine, hf = figure_of(r, "dsv4", c1, "mean_tpot_ms"), figure_of(r, "hf", c1, "mean_tpot_ms")
        factor = ratio(hf, mine)
        row(f"decode step c=1, mean ms ({r.dtype})", mine, hf, factor, ">= 3x HF", factor >= 3)
        if r.dtype == "float32":
            bound = bound_s[r.dtype] * 1000
            over = ratio(mine, bound)
            row("decode step c=1 / bandwidth bound, mean ms (float32)", mine, bound, over, "<= 2x the bound", over <= 2)
    for r in results:
        mine, hf = figure_of(r, "dsv4", cmax, "output_throughput"), figure_of(r, "hf", cmax, "output_throughput")
        factor = ratio(mine, hf)
        row(f"output tok/s c={cmax.concurrency} ({r.dtype})", mine, hf, factor, ">= 8x HF", factor >= 8)
    prefill = {r.dtype: figure_of(r, "dsv4", c1, "mean_ttft_ms") for r in results}
    faster = min(prefill, key=lambda dtype: math.inf if math.isnan(prefill[dtype]) else prefill[dtype])
    for r in results:
        mine, hf = prefill[r.dtype], figure_of(r, "hf", c1, "mean_ttft_ms")
        factor = ratio(hf, mine)
        judged = r.dtype == faster
        row(f"prefill of {input_len} tokens c=1, mean TTFT ms ({r.dtype})", mine, hf, factor,
            ">= 1.5x HF (faster dtype)" if judged else "(judged in the faster dtype)",
            factor >= 1.5 if judged else None)
    for r in results:
        row(f"startup to ready, s ({r.dtype}; HF: its load)", r.startup_s, r.hf_load_s, math.nan, "< 60 s",
            r.startup_s < 60)
    return rows


def format_targets(rows: list[dict]) -> str:
    lines = [f"{'figure':<56} {'dsv4':>9} {'HF/bound':>9} {'ratio':>7}  {'target':<30} met", "-" * 118]
    for r in rows:
        factor = "-" if math.isnan(r["ratio"]) else f"{r['ratio']:.2f}x"
        met = {True: "met", False: "NOT MET", None: "-"}[r["met"]]
        lines.append(f"{r['figure']:<56} {r['dsv4']:>9.1f} {r['baseline']:>9.1f} {factor:>7}  {r['target']:<30} {met}")
    return "\n".join(lines)
