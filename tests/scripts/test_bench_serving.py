"""`scripts/bench_serving.py` end to end on the tiny checkpoint with a tiny sweep: every run's JSON
holds every metric, the shared-prefix run its hit rate, the summary the bandwidth and startup
figures, and both plots are drawn. The figures themselves are not judged (timing is not a test)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "scripts"))

from bench.metrics import metric_keys


@pytest.mark.timeout(480)  # ~40 s on quiet cores; room for a loaded machine
def test_the_benchmark_writes_every_metric_and_both_plots(tiny_ckpt, tmp_path):
    out = tmp_path / "results"
    cmd = [sys.executable, str(REPO / "scripts" / "bench_serving.py"), "--model", str(tiny_ckpt),
           "--max-concurrency", "1,2", "--request-rate", "inf", "--num-prompts", "2", "--input-len", "16",
           "--output-len", "4", "--gsp-num-groups", "2", "--gsp-prompts-per-group", "2",
           "--gsp-system-prompt-len", "128", "--gsp-question-len", "8", "--shared-prefix-concurrency", "1",
           "--storm-concurrency", "4", "--storm-output-len", "12", "--storm-after-tokens", "3",
           "--server-args=--page-size 128", "--bandwidth-gib", "0.25", "--request-timeout", "60",
           "--output-dir", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=420, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]

    runs = {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}
    expected = {"dsv4-float32-random-c1", "dsv4-float32-random-c2", "dsv4-float32-random-rateinf",
                "dsv4-float32-generated-shared-prefix-c1", "hf-float32-random-c1", "hf-float32-random-c2",
                "abort-storm-float32", "summary"}
    assert expected <= set(runs), sorted(runs)
    for name in expected - {"abort-storm-float32", "summary"}:
        run = runs[name]
        missing = [k for k in metric_keys() if k not in run or math.isnan(run[k])]
        assert not missing, (name, missing)
        assert run["completed"] == run["num_prompts"] and run["failed"] == 0, run
        assert run["output_throughput"] > 0 and run["total_output_tokens"] == run["completed"] * 4
    hit = runs["dsv4-float32-generated-shared-prefix-c1"]
    # One at a time, the second prompt of each group finds its 128-token prefix cached.
    assert hit["prefix_cache_prompt_tokens"] == 4 * 136
    assert hit["prefix_cache_hit_tokens"] == 2 * 128 and hit["prefix_cache_hit_rate"] == pytest.approx(256 / 544)

    storm = runs["abort-storm-float32"]
    assert storm["aborted"] == 3 and storm["survivors_completed"] == 1 and storm["ready_after"]
    assert not any(storm["held_after"].values()) and storm["points"]
    summary = runs["summary"]
    floor = summary["compute_floor"]  # of the c=2 run, against HF's
    assert floor["floor_s"] > 0 and floor["hf_s"] == runs["hf-float32-random-c2"]["duration"]
    assert floor["most_x_hf"] == pytest.approx(floor["hf_s"] / floor["floor_s"])
    assert summary["bandwidth"]["read_gbps"] > 0 and summary["decode_floor_s"]["float32"] > 0
    # The floor divides by the faster of the probes beside the c=1 run (only that run is bracketed).
    beside = runs["dsv4-float32-random-c1"]["bandwidth_beside_gbps"]
    assert len(beside) == 2 and min(beside) > 0 and "bandwidth_beside_gbps" not in runs["dsv4-float32-random-c2"]
    bandwidth = summary["bandwidth"]
    assert bandwidth["floor_gbps_float32"] == max(beside)
    assert summary["decode_floor_s"]["float32"] == pytest.approx(
        bandwidth["decode_weight_bytes_float32"] / (max(beside) * 1e9))
    assert 0 < summary["startup_s"]["float32"] < 200
    assert "Output token throughput (tok/s):" in done.stdout and "x the floor" in done.stdout
    for png in ("throughput_vs_concurrency.png", "itl_abort_storm.png"):
        assert (out / png).stat().st_size > 10_000, png
