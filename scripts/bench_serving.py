#!/usr/bin/env python3
"""Serving benchmark in the shape of SGLang's bench_serving and vLLM's benchmark_serving, with HF
transformers measured in the same run as the baseline.

Modes:
  --url URL     load an already running server (no HF baseline, no startup time)
  --model DIR   start `python -m dsv4 serve --model DIR --dtype D` for each --dtype, load it, stop
                it, then run HF's batched `generate` on the same prompts
  --suite       what `make bench` runs: --model on the `small` checkpoint in float32 and bfloat16,
                the targets of issue 12 as ratios against HF, the concurrency-1 decode step at
                --tp-size 2 against 1, and the CPU kernel benchmark. --quick makes every part smaller.

Per run (one JSON file each in --output-dir, default bench_results/<timestamp>/): TTFT, TPOT, ITL
and E2E (mean, median, p90, p99), output and total tok/s, request throughput, completed and failed
requests (definitions: scripts/bench/metrics.py). Runs: a concurrency sweep (--max-concurrency)
per --dataset-name, with HF on the same prompts in batches of the concurrency; then, in the last
dtype, a request-rate sweep (Poisson arrivals, --request-rate), one shared-prefix run with the
server's prefix-cache hit rate (--shared-prefix-concurrency) and an abort storm
(--storm-concurrency). Also measured: the server's startup to ready, the machine's memory
bandwidth (at the start, and just before and after each dtype's concurrency-1 run), and that run's
decode step against weight bytes read per step / the faster of the bandwidths read beside it; and the
widest concurrency run's weight products at this CPU's fp32 pace for them, against HF's run: how many
times HF's fp32 throughput a server multiplying at that pace could reach here.
Plots (PNG): throughput against concurrency for dsv4 and HF, and ITL over time across the storm.
Every request and every wait is bounded; a server it starts is always stopped.
"""

from __future__ import annotations

import argparse
import math
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # dsv4 from this checkout, installed or not

from bench.client import ROOT, ServerProcess, run_client, run_load
from bench.datasets import DATASETS
from bench.plots import draw_all
from bench.runner import Results, Run, Storm, Workload, measure_dtype, prompts_for, ratio_table
from bench.targets import format_targets, target_rows

QUICK = {"input_len": 128, "output_len": 16, "max_concurrency": "1,4", "request_rate": "2,inf", "num_prompts": 4,
         "gsp_num_groups": 2, "gsp_prompts_per_group": 2, "gsp_system_prompt_len": 256, "gsp_question_len": 32,
         "storm_concurrency": 4, "storm_output_len": 24, "storm_after_tokens": 4}
DEFAULTS = {"input_len": 256, "output_len": 32, "max_concurrency": "1,4,8,16,32", "request_rate": "1,2,4,inf",
            "num_prompts": 0, "gsp_num_groups": 4, "gsp_prompts_per_group": 4, "gsp_system_prompt_len": 512,
            "gsp_question_len": 64, "storm_concurrency": 16, "storm_output_len": 64, "storm_after_tokens": 8}


def small_checkpoint() -> Path:
    from dsv4.config import cache_dir
    from dsv4.tiny import make_tiny

    path = cache_dir() / "bench-small-bf16"
    if not (path / "config.json").exists():
        print(f"building the small checkpoint into {path} (once)", flush=True)
        make_tiny(path, preset="small", fmt="bf16", seed=0)
    return path


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--url", help="load an already running server")
    target.add_argument("--model", type=Path, help="start servers on this checkpoint")
    target.add_argument("--suite", action="store_true", help="the `make bench` suite on the small checkpoint")
    p.add_argument("--quick", action="store_true", help="smaller defaults everywhere (flags given still win)")
    p.add_argument("--dtype", default=None, help="comma-separated (default: float32; the suite: float32,bfloat16)")
    p.add_argument("--dataset-name", default="random", help=f"comma-separated, of {', '.join(DATASETS)}")
    p.add_argument("--random-input-len", "--input-len", dest="input_len", type=int)
    p.add_argument("--random-output-len", "--output-len", dest="output_len", type=int)
    p.add_argument("--num-prompts", type=int, help="per run (default: max(8, concurrency); a rate run 16)")
    p.add_argument("--max-concurrency", help="the concurrency sweep, comma-separated ('' skips it)")
    p.add_argument("--request-rate", help="the rate sweep in req/s, comma-separated, inf allowed ('' skips it)")
    p.add_argument("--gsp-num-groups", type=int)
    p.add_argument("--gsp-prompts-per-group", type=int)
    p.add_argument("--gsp-system-prompt-len", type=int)
    p.add_argument("--gsp-question-len", type=int)
    p.add_argument("--shared-prefix-concurrency", type=int, default=8, help="one shared-prefix run (0 skips it)")
    p.add_argument("--storm-concurrency", type=int, help="streams in the abort storm (0 skips it)")
    p.add_argument("--storm-output-len", type=int)
    p.add_argument("--storm-after-tokens", type=int, help="the storm lands once every stream has this many")
    p.add_argument("--storm-abort-fraction", type=float, default=0.75)
    p.add_argument("--baseline", choices=["none", "hf"], default="hf", help="HF needs --model or --suite")
    p.add_argument("--server-args", default="", help="extra `dsv4 serve` flags (--server-args=\"--flag value\")")
    p.add_argument("--no-tp-compare", action="store_true", help="suite: skip the --tp-size 2 decode step")
    p.add_argument("--no-kernels", action="store_true", help="suite: skip the kernel benchmark")
    p.add_argument("--bandwidth-gib", type=float, default=1.0, help="the memory bandwidth test's size")
    p.add_argument("--output-dir", type=Path, help="default: bench_results/<timestamp>")
    p.add_argument("--request-timeout", type=float, default=600)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.dtype = (args.dtype or ("float32,bfloat16" if args.suite else "float32")).split(",")
    args.dataset_name = args.dataset_name.split(",")
    if unknown := set(args.dataset_name) - set(DATASETS):
        p.error(f"--dataset-name: unknown {sorted(unknown)}; expected {', '.join(DATASETS)}")
    args.max_concurrency = [int(c) for c in args.max_concurrency.split(",") if c]
    args.request_rate = [float(r) for r in args.request_rate.split(",") if r]
    if args.url:
        args.baseline = "none"
    args.output_dir = args.output_dir or ROOT / "bench_results" / time.strftime("%Y%m%d-%H%M%S")
    return args


def plan(args) -> tuple[list[Run], list[Run]]:
    """The runs of every dtype, and those the last dtype adds."""
    hf = args.baseline == "hf"
    # (the random c=1 run's decode step is set against the bandwidth floor: probes bracket it)
    every = [Run(d, c, hf=hf, probed=not args.url and d == "random" and c == 1)
             for d in args.dataset_name for c in args.max_concurrency]
    last = [Run(d, None, rate) for d in args.dataset_name for rate in args.request_rate]
    if args.shared_prefix_concurrency:
        last.append(Run("generated-shared-prefix", args.shared_prefix_concurrency, sweep=False))
    return every, last


def decode_bound(model_dir: Path, dtypes: list[str], gib: float, context: int) -> tuple[dict, dict]:
    """The machine's memory bandwidth at the start, and per dtype the decode step's floor: weight bytes
    read at contexts of up to `context` tokens / bandwidth (`read_as_served` revises the bytes for a
    server that reads bf16 copies, `set_floors` the bandwidth to that beside the c=1 run)."""
    from bench.baseline import decode_weight_bytes, memory_bandwidth

    bandwidth = memory_bandwidth(gib)
    print(f"\nmemory bandwidth (best of 5 over {gib:g} GiB): read {bandwidth['read_gbps']:.1f} GB/s, "
          f"copy {bandwidth['copy_gbps']:.1f} GB/s", flush=True)
    bound = {}
    for dtype in dtypes:
        weight_bytes = decode_weight_bytes(model_dir, dtype, context)
        bound[dtype] = weight_bytes / (bandwidth["read_gbps"] * 1e9)
        bandwidth[f"decode_weight_bytes_{dtype}"] = weight_bytes
    return bandwidth, bound


def read_as_served(model_dir: Path, results, context: int, bandwidth: dict) -> None:
    """Where a server's decode steps read bf16 copies of its fp32 weights, its floor is the bytes it
    reads, not the dtype's (kept as `decode_weight_bytes_<dtype>_in_dtype`)."""
    from bench.baseline import decode_weight_bytes

    for r in results:
        if r.bf16_copies:
            weight_bytes = decode_weight_bytes(model_dir, r.dtype, context, bf16_copies=r.bf16_copies)
            bandwidth[f"decode_weight_bytes_{r.dtype}_in_dtype"] = bandwidth[f"decode_weight_bytes_{r.dtype}"]
            bandwidth[f"decode_weight_bytes_{r.dtype}"] = weight_bytes


def set_floors(results, c1: Run | None, bandwidth: dict, bound: dict) -> None:
    """Each dtype's floor from the bandwidth beside its c=1 run: the faster of the probes just before
    and just after it (the stricter floor), or the start's where that run was not made. The step and
    its floor are then measured in the same state of the machine (`Run.probed`)."""
    for r in results:
        record = r.get("dsv4", c1) if c1 is not None else None
        beside = record.get("bandwidth_beside_gbps") if record else None
        gbps = max(beside) if beside else bandwidth["read_gbps"]
        bandwidth[f"floor_gbps_{r.dtype}"] = gbps
        bound[r.dtype] = bandwidth[f"decode_weight_bytes_{r.dtype}"] / (gbps * 1e9)


def print_bound(results, c1: Run, bandwidth: dict, bound: dict) -> None:
    for r in results:
        record = r.get("dsv4", c1)
        if record is None:
            continue
        step = record["mean_tpot_ms"]
        floor = bound[r.dtype] * 1000
        gbps = bandwidth[f"floor_gbps_{r.dtype}"]
        beside = record.get("bandwidth_beside_gbps")
        where = (f"the faster of {beside[0]:.1f} and {beside[1]:.1f} GB/s read just before and after the run"
                 if beside else "read at the start")
        print(f"decode step c=1 ({r.dtype}): {step:.1f} ms; weights read per step "
              f"{bandwidth[f'decode_weight_bytes_{r.dtype}'] / 1e6:.1f} MB / {gbps:.1f} GB/s ({where}; "
              f"{bandwidth['read_gbps']:.1f} at the start) = {floor:.2f} ms floor; the step takes {step / floor:.1f}x "
              f"the floor")
        in_dtype = bandwidth.get(f"decode_weight_bytes_{r.dtype}_in_dtype")
        if in_dtype is not None:
            floor_in_dtype = in_dtype / (gbps * 1e9) * 1000
            print(f"  (it reads bf16 copies of the {r.dtype} weights ({' and '.join(r.bf16_copies)}), which hold "
                  f"bf16 values: in "
                  f"{r.dtype} they weigh {in_dtype / 1e6:.1f} MB, a {floor_in_dtype:.2f} ms floor, "
                  f"{step / floor_in_dtype:.1f}x)")


def print_compute_floor(model_dir: Path, fp32, widest: Run, context: int) -> dict | None:
    """The widest random run's weight products in fp32 at this CPU's pace for them, against HF's fp32 run
    of the same requests (`fp32`: the float32 results, or None): the most the output tok/s there of any fp32
    server that multiplies at that pace can be HF's (None: no such runs)."""
    from bench.baseline import product_flops, product_seconds

    mine, hf = (fp32.get("dsv4", widest), fp32.get("hf", widest)) if fp32 is not None else (None, None)
    if mine is None or hf is None:
        return None
    # every prompt token and every generated one but each request's last goes through the layers; each
    # generated token is sampled through the head
    forward_tokens = mine["total_input_tokens"] + mine["total_output_tokens"] - mine["completed"]
    sampled = mine["total_output_tokens"]
    layers, head = product_flops(model_dir, context)
    flops = forward_tokens * layers + sampled * head
    prompt = mine["total_input_tokens"] // max(mine["completed"], 1)
    # products of a prompt's rows and of four prompts' (a longer prefill chunk), the faster: the lower floor,
    # so that the ceiling is not understated
    floors = []
    for rows in (prompt, 4 * prompt):
        layer_s, head_s = product_seconds(model_dir, rows, context)
        floors.append((forward_tokens * layer_s + sampled * head_s, rows))
    floor, rows = min(floors)
    print(f"\nc={widest.concurrency} run (float32): its weight products, {flops / 1e12:.2f} TFLOP, at this CPU's "
          f"fp32 pace for each ({rows} rows; {flops / floor / 1e9:.0f} GFLOP/s overall) take {floor:.1f} s, against "
          f"HF's {hf['duration']:.1f} s for the run: no fp32 server multiplying at this pace passes "
          f"{hf['duration'] / floor:.1f}x HF's "
          f"output tok/s (dsv4: {mine['duration']:.1f} s, {hf['duration'] / mine['duration']:.2f}x)")
    return {"tflop": flops / 1e12, "gflops": flops / floor / 1e9, "floor_s": floor, "hf_s": hf["duration"],
            "dsv4_s": mine["duration"], "most_x_hf": hf["duration"] / floor}


def tp_compare(model_dir: Path, args, work: Workload, results: Results, c1: Run, prompts: list[list[int]],
               fp32_c1: dict | None) -> dict | None:
    """The concurrency-1 decode step of a `--tp-size 2` server against TP=1 (float32, same prompts).
    On a 2-core machine the two ranks share the cores the one rank had: a figure, not a target."""
    if fp32_c1 is None:
        return None
    server = ServerProcess(model_dir, ["--dtype", "float32", "--tp-size", "2", *args.server_args.split()],
                           600, results.folder / "server-float32-tp2.log")
    with server:
        done, _ = run_client(run_load(server.url, prompts, work.output_len, work.request_timeout, c1.concurrency))
    steps = [r.tpot for r in done if r.ok and r.tpot is not None]
    two = sum(steps) / len(steps) * 1000 if steps else math.nan
    one = fp32_c1["mean_tpot_ms"]
    print(f"\ndecode step at concurrency 1 (float32): TP=1 {one:.1f} ms, TP=2 {two:.1f} ms "
          f"(TP=2 / TP=1 = {two / one:.2f}); TP=2 ready in {server.ready_seconds:.1f} s")
    return {"tp1_ms": one, "tp2_ms": two, "tp2_startup_s": server.ready_seconds}


def main(argv=None) -> int:
    args = parse_args(argv)
    args.model_dir = small_checkpoint() if args.suite else args.model
    work = Workload(input_len=args.input_len, output_len=args.output_len, num_prompts=args.num_prompts,
                    gsp_num_groups=args.gsp_num_groups, gsp_prompts_per_group=args.gsp_prompts_per_group,
                    gsp_system_prompt_len=args.gsp_system_prompt_len, gsp_question_len=args.gsp_question_len,
                    request_timeout=args.request_timeout, seed=args.seed)
    storm = Storm(args.storm_concurrency, args.storm_output_len, args.storm_abort_fraction,
                  args.storm_after_tokens) if args.storm_concurrency else None
    every, last = plan(args)
    results = Results(args.output_dir)
    print(f"results: {results.folder}", flush=True)
    summary: dict = {"kind": "summary", "args": {k: str(v) for k, v in vars(args).items()}}

    if args.url:
        from bench.runner import DtypeResult, measure_server

        out = DtypeResult("server")
        measure_server(args.url, "server", every + last, work, results, out, storm)
        per_dtype = [out]
    else:
        bandwidth, bound = decode_bound(args.model_dir, args.dtype, args.bandwidth_gib, args.input_len + args.output_len)
        summary.update(bandwidth=bandwidth, decode_floor_s=bound)
        per_dtype = [measure_dtype(args.model_dir, dtype, args.server_args.split(),
                                   every + (last if i == len(args.dtype) - 1 else []), work, results,
                                   storm if i == len(args.dtype) - 1 else None, bandwidth_gib=args.bandwidth_gib)
                     for i, dtype in enumerate(args.dtype)]
        summary["startup_s"] = {r.dtype: r.startup_s for r in per_dtype}

    random_runs = [run for run in every if run.dataset == "random"]
    c1 = next((run for run in random_runs if run.concurrency == 1), None)
    if not args.url:  # (the summary holds these dicts: it sees the revisions)
        read_as_served(args.model_dir, per_dtype, args.input_len + args.output_len, bandwidth)
        set_floors(per_dtype, c1, bandwidth, bound)
    for r in per_dtype:
        print(f"\n{r.dtype}: dsv4 against HF (x: dsv4's speedup; medians)")
        print(ratio_table(r, every + last))
        if r.storm is not None:
            summary["abort_storm"] = {k: v for k, v in r.storm.items() if k != "points"}
    plots = draw_all(results.folder)  # before the TP=2 server: a failure there leaves the plots drawn
    print("\nplots: " + ", ".join(str(p) for p in plots))
    if not args.url and random_runs:
        widest = max(random_runs, key=lambda run: run.concurrency)
        fp32 = next((r for r in per_dtype if r.dtype == "float32"), None)
        if c1 is not None:
            print()
            print_bound(per_dtype, c1, bandwidth, bound)
        if args.suite and c1 is not None and args.baseline == "hf":
            rows = target_rows(per_dtype, c1, widest, args.input_len, bound)
            summary["targets"] = rows
            print("\nissue 12 targets (same run; HF/bound column: HF's figure, or the bandwidth floor)")
            print(format_targets(rows))
        if args.baseline == "hf":
            summary["compute_floor"] = print_compute_floor(args.model_dir, fp32, widest,
                                                           args.input_len + args.output_len)
        if args.suite and not args.no_tp_compare and c1 is not None and fp32 is not None:
            summary["tp_compare"] = tp_compare(args.model_dir, args, work, results, c1,
                                               prompts_for(c1, work, every.index(c1)), fp32.get("dsv4", c1))
    results.save("summary", summary)

    if args.suite and not args.no_kernels:
        bench_kernels = ROOT / "scripts" / "bench_kernels.py"
        print("\nkernel benchmark (CPU fast path vs reference)", flush=True)
        extra = ["--repeats", "1"] if args.quick else []
        subprocess.run([sys.executable, str(bench_kernels), "--device", "cpu", *extra], cwd=ROOT, timeout=900,
                       check=True)
    if args.suite:
        print("\nprefix cache (device and host tier TTFT, shared-prefix hit rate)", flush=True)
        extra = ["--preset", "tiny", "--prompt-len", "1024", "--cached", "1008", "--repeats", "1"] if args.quick else []
        subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_prefix_cache.py"), *extra], cwd=ROOT,
                       timeout=1800, check=True)
    return 0 if healthy(per_dtype) else 1


def healthy(per_dtype) -> bool:
    """Every dsv4 request completed, and the storm's survivors did and left the server ready and empty."""
    for r in per_dtype:
        for (backend, _), record in r.runs.items():
            if backend == "dsv4" and (record["failed"] or not record["completed"]):
                return False
        storm = r.storm
        if storm is not None and (storm["survivors_completed"] != storm["concurrency"] - storm["aborted"]
                                  or not storm["ready_after"] or any(storm["held_after"].values())):
            return False
    return True


if __name__ == "__main__":
    sys.exit(main())
