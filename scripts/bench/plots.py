"""PNG plots of a results folder (no torch, no dsv4: it reads only the JSON files).

    python scripts/bench/plots.py bench_results/<timestamp>    # redraws the plots of a run

throughput_vs_concurrency.png  output tok/s against concurrency, dsv4 and HF, one line per dtype
itl_abort_storm.png            every token's gap to the previous one against wall time, survivors
                               and aborted streams apart, the storm marked
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt

THROUGHPUT_PNG = "throughput_vs_concurrency.png"
STORM_PNG = "itl_abort_storm.png"


def load_runs(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def throughput_vs_concurrency(runs: list[dict], out: Path) -> Path | None:
    """One line per (backend, dtype) over the concurrency-sweep runs; None when there are none."""
    lines: dict[tuple[str, str, str], list[tuple[int, float]]] = {}
    for run in runs:
        if run.get("kind") == "concurrency":
            line = (run["backend"], run["dtype"], run["dataset"])
            lines.setdefault(line, []).append((run["concurrency"], run["output_throughput"]))
    if not lines:
        return None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    colors = {key: f"C{i}" for i, key in enumerate(sorted({k[1:] for k in lines}))}  # one per dtype+dataset
    for (backend, dtype, dataset), points in sorted(lines.items()):
        points.sort()
        style = "-o" if backend == "dsv4" else "--s"
        label = f"{backend} {dtype}" + ("" if dataset == "random" else f" {dataset}")
        ax.plot([c for c, _ in points], [t for _, t in points], style, color=colors[dtype, dataset], label=label)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({c for points in lines.values() for c, _ in points}))
    ax.get_xaxis().set_major_formatter(matplotlib.ticker.ScalarFormatter())
    ax.set_xlabel("concurrency (requests in flight; HF: batch size)")
    ax.set_ylabel("output tokens / s")
    ax.set_title("Output throughput against concurrency (same prompts, same run)")
    return _save(fig, ax, out / THROUGHPUT_PNG)


def itl_abort_storm(runs: list[dict], out: Path) -> Path | None:
    storms = [run for run in runs if run.get("kind") == "abort-storm"]
    if not storms:
        return None
    storm = storms[0]
    fig, ax = plt.subplots(figsize=(8, 4.5))
    # The survivors are drawn last, on top: before the storm every stream steps together.
    for aborted, color, label in ((True, "tab:red", "aborted streams"), (False, "tab:blue", "surviving streams")):
        points = [(t, gap) for t, gap, was_aborted in storm["points"] if was_aborted == aborted]
        if points:
            ax.scatter([t for t, _ in points], [gap for _, gap in points], s=6, color=color, alpha=0.6, label=label)
    ax.axvline(storm["storm_at"], color="black", linestyle="--",
               label=f"storm: {storm['aborted']} of {storm['concurrency']} aborted")
    ax.set_yscale("log")
    ax.set_xlabel("seconds since the first request")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_title(f"ITL across an abort storm ({storm['dtype']})")
    return _save(fig, ax, out / STORM_PNG)


def _save(fig, ax, path: Path) -> Path:
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_all(folder: Path) -> list[Path]:
    runs = load_runs(folder)
    return [p for p in (throughput_vs_concurrency(runs, folder), itl_abort_storm(runs, folder)) if p is not None]


if __name__ == "__main__":
    for drawn in draw_all(Path(sys.argv[1])):
        print(drawn)
