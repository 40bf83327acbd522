"""From ServerArgs to a loaded model: checkpoint directory, config, weights, tokenizer, runner; and, with
--tp-size N, this node's ranks and the group they form (docs/TENSOR_PARALLEL.md)."""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

import dsv4.weights
from dsv4.config import ModelConfig, ServerArgs
from dsv4.config.server_args import cpu_has_fast_bf16
from dsv4.dist.collectives import TpGroup
from dsv4.dist.ranks import RankProcesses, free_port
from dsv4.engine.runner import TORCH_DTYPES, ModelRunner, cpu_forward_threads, resolve_device
from dsv4.model.sharding import ShardPlan
from dsv4.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "dsv4-demo"
# Trained by scripts/train_demo.py and shipped as package data (README: "The built-in demo model").
BUILTIN_CHECKPOINT = Path(__file__).resolve().parents[1] / "demo_model"


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner


def load_model(args: ServerArgs, group: TpGroup | None = None) -> LoadedModel:
    """The model, or with `group` this rank's shard of it (only its part of the checkpoint is kept).

    On the CPU it loads on a thread of its own, which ends with the load, so that the forward thread
    is the only one with OpenMP workers: once libgomp manages more threads than there are cores it
    stops spinning between parallel regions, and every small parallel op of a forward then waits for
    a sleeping worker to wake. Measured on 2 cores (`small`, bf16, alternated runs): a 256-token
    prefill 270 and 292 ms against 307 and 362 after loading on the calling thread; one layer's
    grouped expert matmuls, timed on the forward thread, 0.9..1.1 ms against 2.3..2.6.

    Spinning workers are fast only on cores of their own: so each rank's forwards get its share of
    the cores (`cpu_forward_threads`, read here on the caller's thread, whose count a caller may have
    set), and engine processes started apart that share cores need `--cpu-threads` (three servers on
    2 cores, at two threads each, missed the deadlines of half their requests)."""
    if resolve_device(args.device).type != "cpu":  # (a CUDA device is per thread: load on the caller's)
        return _load_model(args, group)
    args = dataclasses.replace(args, cpu_threads=cpu_forward_threads(args))
    loader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dsv4-load")
    try:
        return loader.submit(_load_model, args, group).result()
    finally:
        loader.shutdown(wait=False)  # (an interrupted caller does not wait for the load)


def _load_model(args: ServerArgs, group: TpGroup | None) -> LoadedModel:
    path = checkpoint_path(args)
    config = ModelConfig.from_json(path)
    shard = ShardPlan(config, group.rank, group.size) if group is not None else ShardPlan(config)
    weights = dsv4.weights.load_state_dict(path, config, TORCH_DTYPES[args.dtype], select=shard.select)
    tokenizer = Tokenizer.from_dir(path)
    runner = ModelRunner(config, weights, args, shard=shard, reduce=group)
    name = BUILTIN_MODEL_NAME if args.model is None else path.name
    log.info("loaded %s from %s (%s on %s, %d pages of %d tokens, %d slots)",
             name, path, args.dtype, runner.device, runner.num_pages, args.page_size, runner.num_slots)
    if runner.device.type == "cpu":
        log.info("dtype %s; this CPU %s", args.dtype, "multiplies bf16 in hardware (AVX512-BF16/AMX)"
                 if cpu_has_fast_bf16() else "has no bf16 matmul (AVX512-BF16/AMX): --dtype auto picks float32")
        log.info("CPU forward: every forward on %d torch threads (--cpu-threads; engine processes that share "
                 "cores need a share each); %d cores available to this process; model pieces %s",
                 runner.cpu_threads, len(os.sched_getaffinity(0)), "compiled" if runner.compiled else "eager")
    if group is not None:
        log.info("rank %d of %d: %d bytes of weights (experts %d..%d of %d)", group.rank, group.size,
                 sum(t.nbytes for t in weights.values()), shard.experts.start, shard.experts.stop - 1,
                 config.n_routed_experts)
    return LoadedModel(name, config, tokenizer, runner)


def settle_heap() -> None:
    """Once a serving process has started (model loaded, pieces compiled): collects the garbage of startup,
    then freezes what remains out of the cyclic garbage collector, which would otherwise walk all of it in
    every full collection. `small`'s server holds ~350,000 objects after startup, and a full collection over
    them took ~165 ms on 2 cores; serving adds long-lived objects (~19,000 in 90 s at concurrency 32), and a
    full collection runs once they reach a quarter of the old ones: every few minutes, each a 165 ms stall of
    every stream. Frozen objects are still freed when their last reference goes; only cycles among them are
    never collected."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("gc: %d objects of startup frozen out of the cyclic collector (a full collection over them took "
             "%.0f ms)", gc.get_freeze_count(), (time.perf_counter() - started) * 1000)


def checkpoint_path(args: ServerArgs) -> Path:
    if args.model:
        return Path(args.model)
    log.info("no --model given: serving the built-in demo model %s", BUILTIN_CHECKPOINT)
    return BUILTIN_CHECKPOINT


def join_group(args: ServerArgs, rank: int, addr: str) -> TpGroup:
    """Joins the group of `args.tp_size` ranks as `rank` (on CUDA, on the node's GPU of that rank)."""
    per_node = args.tp_size // args.nnodes
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", rank % per_node)
        torch.cuda.set_device(device)
    return TpGroup.join(rank, args.tp_size, addr, args.dist_timeout, join_timeout=args.dist_join_timeout,
                        ranks_per_node=per_node, device=device)


def start_node(args: ServerArgs) -> tuple[TpGroup, RankProcesses]:
    """This node's first rank: checks that the model shards `args.tp_size` ways (before any process
    starts), starts the node's other ranks and joins the group."""
    ShardPlan(ModelConfig.from_json(checkpoint_path(args)), 0, args.tp_size)
    addr = args.dist_init_addr or f"127.0.0.1:{free_port()}"
    per_node = args.tp_size // args.nnodes
    first = args.node_rank * per_node
    ranks = RankProcesses(args, addr, range(first + 1, first + per_node))
    try:
        group = join_group(args, first, addr)
    except BaseException:
        ranks.stop()
        raise
    group.dead_rank = lambda: ranks.wait_dead(1.0)
    return group, ranks
