"""Kernel benchmarks at DeepSeek-V4-Flash shapes.

--device cpu   the indexer's CPU fast path (the vectorised torch path the dispatcher picks on CPU)
               against the paged reference indexer, at 4K, 16K and 64K tokens of context, timed
               in the same run and reported as a speedup (what `make bench` reads); then the CPU
               path's C kernels at the `small` preset's shapes against the torch code they replace
               (where this CPU runs them): a bf16 prefill chunk's attention on AMX tiles, the bf16
               MoE of 1, 8 and 32 tokens. One torch thread by default: on a shared machine, a
               stolen core stalls a multi-threaded op several-fold and the ratio would measure the
               neighbours.
--device cuda  achieved memory bandwidth of the Triton kernels: indexer top-k at 8K, 64K and 1M
               tokens of context, and CSA decode attention (128 window + 512 selected rows) at
               batch 1, 32 and 128; GB/s and % of the device's peak (table below, or --peak-gbps).
--smoke        every case of the chosen suite once at a tiny size on CPU: checks the harness.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runnable from a checkout, installed or not

import torch

from dsv4.config.server_args import cpu_kernel_isa
from dsv4.kernels import cpu_attention, cpu_mhc, cpu_moe, cpu_project, dispatch
from dsv4.kernels.indexer_topk import indexer_topk_torch
from dsv4.kernels.rows import index_row_bytes, main_row_bytes, pack_index_rows, pack_main_rows
from dsv4.model import mhc, moe
from dsv4.model.attention import banded_sink_attention, project_inputs
from dsv4.reference.paged_ops import indexer_topk_paged

# Peak HBM bandwidth, GB/s, by a substring of torch.cuda.get_device_name(); longest match wins.
PEAK_GBPS = {
    "H200": 4800, "H100 NVL": 3900, "H100 PCIe": 2000, "H100": 3350, "H20": 4000, "GH200": 4000,
    "B200": 8000, "A100-SXM4-80GB": 2039, "A100": 1555, "L40S": 864,
}
INDEX_HEADS, INDEX_DIM, INDEX_TOPK = 64, 128, 512
HEADS, HEAD_DIM, ROPE_DIM, WINDOW = 64, 512, 64, 128
PAGE_SIZE = 128

CPU_CONTEXTS, CPU_BATCH = (4096, 16384, 65536), 4
CUDA_CONTEXTS, CUDA_INDEXER_BATCH, CUDA_BATCHES, ATTENTION_CONTEXT = (8192, 65536, 1 << 20), 1, (1, 32, 128), 65536
SMOKE_CONTEXTS, SMOKE_BATCHES = (1024, 2048), (1, 2)


DISTINCT_ROWS = 4096  # random rows packed on the host, then tiled over the pool on the device


def paged_pool(rows_per_request: int, batch: int, rows_per_page: int, packed_rows, device, gen):
    """A pool holding `batch` requests' rows in shuffled pages, and their page table. Bandwidth
    does not depend on what rows hold, so a few thousand distinct rows are repeated (at distinct
    addresses: every one is still read from memory)."""
    pages_each = -(-rows_per_request // rows_per_page)
    num_pages = batch * pages_each
    table = torch.randperm(num_pages, generator=gen).view(batch, pages_each).to(torch.int32)
    total = num_pages * rows_per_page
    distinct = packed_rows(min(total, DISTINCT_ROWS)).to(device)
    rows = distinct[torch.arange(total, device=device) % distinct.shape[0]]
    return rows.view(num_pages, rows_per_page, -1), table.to(device)


def indexer_inputs(context: int, batch: int, device: str, gen):
    """One decode token per request, each at the end of `context` tokens; fp8 keys."""
    rows = context // 4
    keys, table = paged_pool(rows, batch, PAGE_SIZE // 4, lambda n: pack_index_rows(
        torch.randn(n, INDEX_DIM, generator=gen), "fp8"), device, gen)
    q = torch.randn(batch, INDEX_HEADS, INDEX_DIM, generator=gen).to(device, torch.bfloat16)
    weights = (torch.randn(batch, INDEX_HEADS, generator=gen) * (INDEX_DIM * INDEX_HEADS) ** -0.5).to(device)
    token_req = torch.arange(batch, device=device)
    positions = torch.full((batch,), context - 1, device=device)
    return [q, weights, keys, "fp8", table, token_req, positions, INDEX_TOPK]


def indexer_bytes(context: int, batch: int) -> int:
    """Keys read, queries and weights read, fp32 scores written and read back, picks written."""
    rows = context // 4
    return batch * (rows * index_row_bytes("fp8", INDEX_DIM) + INDEX_HEADS * (INDEX_DIM * 2 + 4)
                    + rows * 4 * 2 + INDEX_TOPK * 4)


def attention_inputs(batch: int, context: int, device: str, gen):
    """CSA decode: each request at the end of `context` tokens attends to its 128-row window
    ring and 512 selected compressed rows; fp8 rows, bf16 queries."""
    def rows(n):
        return pack_main_rows(torch.randn(n, HEAD_DIM, generator=gen), "fp8_e4m3", ROPE_DIM)

    compressed_rows = context // 4
    compressed, table = paged_pool(compressed_rows, batch, PAGE_SIZE // 4, rows, device, gen)
    window = rows(batch * WINDOW).view(batch, WINDOW, -1).to(device)
    selected = torch.stack([torch.randperm(compressed_rows, generator=gen)[:INDEX_TOPK] for _ in range(batch)])
    q = torch.randn(batch, HEADS, HEAD_DIM, generator=gen).to(device, torch.bfloat16)
    sink = torch.randn(HEADS, generator=gen).to(device)
    positions = torch.full((batch,), context - 1, device=device)
    args = [q, sink, rows(batch).to(device), window, torch.arange(batch, device=device), positions,
            torch.arange(batch, device=device), positions.clone()]
    kwargs = {"row_format": "fp8_e4m3", "compressed": compressed, "page_table": table, "ratio": 4,
              "selected": selected.to(device, torch.int32)}
    return args, kwargs


def attention_bytes(batch: int) -> int:
    """Window and selected rows read once (HBM traffic), picks read, queries read, output written."""
    row = main_row_bytes("fp8_e4m3", HEAD_DIM, ROPE_DIM)
    return batch * ((WINDOW + INDEX_TOPK) * row + INDEX_TOPK * 4 + 2 * HEADS * HEAD_DIM * 2)


def time_cpu(*fns, repeats: int) -> list[float]:
    """Best-of-`repeats` seconds of each fn after a warm-up. Calls are interleaved so that every
    fn sees the same load on a shared machine, and the best time is the least disturbed one."""
    best = [float("inf")] * len(fns)
    for fn in fns:
        fn()
    for _ in range(repeats):
        for i, fn in enumerate(fns):
            start = time.perf_counter()
            fn()
            best[i] = min(best[i], time.perf_counter() - start)
    return best


def time_cuda(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median") / 1e3


def peak_gbps(override: float | None) -> tuple[str, float | None]:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    if override is not None:
        return name, override
    matches = [key for key in PEAK_GBPS if key in name]
    return name, PEAK_GBPS[max(matches, key=len)] if matches else None


def cpu_suite(contexts, batch: int, repeats: int) -> None:
    print(f"indexer, CPU: vectorised torch path vs paged reference; {batch} decode tokens, "
          f"{INDEX_HEADS} heads x {INDEX_DIM} dims, fp8 keys, top-{INDEX_TOPK}; best of {repeats}, "
          f"{torch.get_num_threads()} torch thread(s)")
    print(f"{'context':>9} {'rows':>7} {'fast ms':>9} {'reference ms':>13} {'speedup':>8}")
    gen = torch.Generator().manual_seed(0)
    for context in contexts:
        args = indexer_inputs(context, batch, "cpu", gen)
        fast, reference = time_cpu(partial(indexer_topk_torch, *args), partial(indexer_topk_paged, *args),
                                   repeats=repeats)
        print(f"{context:>9} {context // 4:>7} {fast * 1e3:>9.2f} {reference * 1e3:>13.2f} {reference / fast:>7.1f}x")


def cpu_kernels_suite(repeats: int, smoke: bool) -> None:
    """The C kernels (dsv4/kernels/cpu_*.py) against the torch code the model runs without them, at the
    `small` preset's shapes (16 heads x 512 dims, a 128-row window; 8 experts of 256, top-2, a shared one)."""
    gen = torch.Generator().manual_seed(0)
    print(f"CPU kernels against the torch code they replace; best of {repeats}, {torch.get_num_threads()} torch thread(s)")
    print(f"{'case':>52} {'kernel ms':>10} {'torch ms':>9} {'speedup':>8}")
    if cpu_attention.available():
        blocks, block, heads, band, count, dim = (2 if smoke else 16), 16, 16, 144, 64, 512
        length = blocks * block
        q = torch.randn(1, length, heads, dim, generator=gen).bfloat16()
        rows = torch.randn(1, (blocks - 1) * block + band, dim, generator=gen).bfloat16()
        allowed = torch.rand(1, blocks, block, band, generator=gen) < 0.9
        compressed = torch.randn(1, count, dim, generator=gen).bfloat16()
        compressed_allowed = torch.rand(1, blocks, block, count, generator=gen) < 0.5
        sink, scale = torch.randn(heads, generator=gen), dim**-0.5

        def torch_ops():  # as the model runs it without the kernel: fp32 operands, logits on oneDNN's bf16 products
            raw = rows.float().unfold(1, band, block).transpose(-1, -2)
            return banded_sink_attention(q.float().unflatten(1, (blocks, block)), raw, allowed, sink, compressed.float(),
                                         compressed_allowed, scale=scale, exact_bf16=True).bfloat16()

        kernel, reference = time_cpu(partial(cpu_attention.band_attention, q, rows, allowed, sink, compressed,
                                             compressed_allowed, block=block, scale=scale), torch_ops, repeats=repeats)
        where = "AMX" if cpu_attention.amx_available() else cpu_kernel_isa()
        print(f"{f'bf16 prefill attention, {length}-token chunk ({where})':>52} {kernel * 1e3:>10.2f} "
              f"{reference * 1e3:>9.2f} {reference / kernel:>7.1f}x")
    if cpu_moe.available():
        experts, hidden, inter, top_k = 8, 512, 256, 2
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
        shared = ((torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16(),
                  (torch.randn(hidden, inter, generator=gen) * inter**-0.5).bfloat16())
        gate, bias = torch.randn(experts, hidden, generator=gen) * hidden**-0.5, torch.randn(experts, generator=gen)
        constants = {"first_expert": 0, "local_experts": experts, "top_k": top_k, "scoring_func": "sqrtsoftplus",
                     "norm_topk_prob": True, "routed_scaling_factor": 1.5}
        route = partial(moe.dispatch, **constants)
        grouped = partial(moe.grouped, dispatch=route, combine=partial(moe.combine, swiglu_limit=10.0), swiglu_limit=10.0)
        # (the C kernel, its name, its token counts): each with the same routing and sort as `grouped`, in C
        # in the same call up to cpu_moe.KERNEL_TOKENS tokens (as the model runs it), else eager before it
        tiles = cpu_attention.amx_available()
        kernels = [(cpu_moe.moe_few, "bf16 MoE", (1,) if smoke else (1, 8, 32))]
        if not smoke:
            kernels.append((partial(cpu_moe.moe_blocks, tiles=tiles), f"bf16 MoE on {'AMX' if tiles else cpu_kernel_isa()}",
                            (32, 512) if tiles else (128, 512)))
        for moe_kernel, name, counts in kernels:
            for tokens in counts:
                x, ids = torch.randn(tokens, hidden, generator=gen).bfloat16(), torch.arange(tokens)

                def kernel_moe(x=x, ids=ids, moe_kernel=moe_kernel):
                    if x.shape[0] <= cpu_moe.KERNEL_TOKENS:
                        return cpu_moe.routed(x, ids, gate, bias, w13, w2, *shared,
                                              tiles=moe_kernel is not cpu_moe.moe_few, **constants,
                                              group_rows=moe.GROUP_ROWS, swiglu_limit=10.0)
                    _, places, picked, ends, weights, keep = route(x, ids, gate, bias)
                    return moe_kernel(x, picked, places, ends, weights, keep, w13, w2, *shared, swiglu_limit=10.0)

                kernel, reference = time_cpu(kernel_moe, partial(grouped, x, ids, gate, bias, w13, w2, *shared),
                                             repeats=repeats)
                print(f"{f'{name}, {tokens} token(s), with the routing':>52} {kernel * 1e3:>10.2f} "
                      f"{reference * 1e3:>9.2f} {reference / kernel:>7.1f}x")
        n, mixes = 4, 24  # the mHC mix: 4 streams, against its torch code (eager: the compiled piece's math)
        for tokens in (1,) if smoke else (1, 32, 512):
            streams, output = torch.randn(tokens, n, hidden, generator=gen), torch.randn(tokens, hidden, generator=gen)
            weights = (torch.rand(tokens, n, generator=gen), torch.rand(tokens, n, n, generator=gen),
                       torch.randn(mixes, n * hidden, generator=gen) * 0.02, torch.randn(mixes, generator=gen),
                       torch.rand(mixes, generator=gen), torch.rand(hidden, generator=gen))
            constants = {"n": n, "sinkhorn_iters": 20, "hc_eps": 1e-6, "norm_eps": 1e-6}
            kernel, reference = time_cpu(partial(cpu_mhc.mix, streams, output, *weights, **constants),
                                         partial(mhc.mix, streams, output, *weights, **constants), repeats=repeats)
            print(f"{f'fp32 mHC mix, {tokens} token(s) (torch eager)':>52} {kernel * 1e3:>10.2f} {reference * 1e3:>9.2f} "
                  f"{reference / kernel:>7.1f}x")
        q_rank, dim, heads, rope = 256, 512, 16, 64  # the attention's projections at one token
        width = q_rank + dim + 2624
        w_input = (torch.randn(width, hidden, generator=gen) * hidden**-0.5).bfloat16()
        wq_b = (torch.randn(heads * dim, q_rank, generator=gen) * q_rank**-0.5).bfloat16()
        norms, x = (torch.rand(q_rank, generator=gen) + 0.5, torch.rand(dim, generator=gen) + 0.5), torch.randn(1, hidden)
        angles = torch.rand(1, rope // 2, generator=gen)
        cos2, sin2 = angles.cos().repeat_interleave(2, -1), torch.stack([-angles.sin(), angles.sin()], -1).flatten(-2)
        wide = (w_input.float(), norms[0], wq_b.float(), norms[1])  # (the torch code's fp32 weights)
        kernel, reference = time_cpu(
            partial(cpu_project.project, x, w_input, norms[0], wq_b, norms[1], cos2, sin2, eps=1e-6),
            partial(project_inputs, x, *wide, cos2, sin2, eps=1e-6), repeats=repeats)
        print(f"{'fp32 projections, 1 token (torch eager)':>52} {kernel * 1e3:>10.2f} {reference * 1e3:>9.2f} "
              f"{reference / kernel:>7.1f}x")


def cuda_suite(device: str, contexts, indexer_batch: int, batches, attention_context: int, peak: float | None,
               timer) -> None:
    gen = torch.Generator().manual_seed(0)

    def report(label: str, seconds: float, nbytes: int) -> None:
        gbps = nbytes / seconds / 1e9
        share = f"{100 * gbps / peak:6.1f}% of peak" if peak else "peak unknown"
        print(f"  {label:<28} {seconds * 1e6:>10.1f} us {nbytes / 1e6:>10.2f} MB {gbps:>9.1f} GB/s  {share}")

    print(f"indexer top-{INDEX_TOPK}, batch {indexer_batch}, fp8 keys, {INDEX_HEADS} heads x {INDEX_DIM} dims:")
    for context in contexts:
        args = indexer_inputs(context, indexer_batch, device, gen)
        report(f"context {context}", timer(partial(dispatch.indexer_topk, *args)),
               indexer_bytes(context, indexer_batch))
    print(f"CSA decode attention, {WINDOW} window + {INDEX_TOPK} selected fp8 rows, {HEADS} heads x {HEAD_DIM}:")
    for batch in batches:
        args, kwargs = attention_inputs(batch, attention_context, device, gen)
        report(f"batch {batch}", timer(partial(dispatch.sparse_attention, *args, **kwargs)), attention_bytes(batch))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=("cpu", "cuda"), required=True)
    parser.add_argument("--peak-gbps", type=float, help="the device's peak memory bandwidth (overrides the table)")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls per CPU case (best one reported)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads for the CPU suite")
    parser.add_argument("--smoke", action="store_true", help="each case once, tiny, on CPU (checks the harness)")
    args = parser.parse_args(argv)

    if args.device == "cpu":
        torch.set_num_threads(args.threads)
        if args.smoke:
            cpu_suite(SMOKE_CONTEXTS[:1], 1, repeats=1)
        else:
            cpu_suite(CPU_CONTEXTS, CPU_BATCH, args.repeats)
        cpu_kernels_suite(1 if args.smoke else args.repeats, args.smoke)
        return 0
    if args.smoke:
        cuda_suite("cpu", SMOKE_CONTEXTS, 1, SMOKE_BATCHES, SMOKE_CONTEXTS[-1], args.peak_gbps,
                   lambda fn: time_cpu(fn, repeats=1)[0])
        return 0
    if not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device (use --smoke to check the harness on CPU)")
    name, peak = peak_gbps(args.peak_gbps)
    print(f"device: {name}; peak {peak or 'unknown'} GB/s")
    cuda_suite("cuda", CUDA_CONTEXTS, CUDA_INDEXER_BATCH, CUDA_BATCHES, ATTENTION_CONTEXT, peak, time_cuda)
    return 0


if __name__ == "__main__":
    sys.exit(main())
