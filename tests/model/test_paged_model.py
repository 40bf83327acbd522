"""The production model over paged state (ModelRunner) against the reference's full-sequence forward.

The reference is causal, so one full forward over a prompt gives the logits every prefix, chunk end
and teacher-forced decode step must reproduce. One runner per dtype setting serves the whole
module: each request starts its slot with start_pos == 0, so slot reuse is exercised throughout.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dsv4.config import CSA, ModelConfig, ServerArgs
from dsv4.engine.runner import ModelRunner
from dsv4.protocol import BoundaryCapture, ForwardBatch, ForwardChunk
from dsv4.reference import ReferenceModel
from dsv4.weights import load_state_dict

PAGE = 128
PROMPT_LEN = 600
# Deliberately out of order: page-table lookups must not assume contiguous pages.
PAGES = (11, 3, 7, 0, 9, 5, 1, 13)
REL_TOL = 1e-4


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    cfg = ModelConfig.from_json(tiny_ckpt)
    return cfg, load_state_dict(tiny_ckpt, cfg, dtype=torch.float32)


@pytest.fixture(scope="module")
def prompt(model):
    cfg, _ = model
    return torch.randint(0, cfg.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(7)).tolist()


def make_runner(model, dtype="float32", kv_cache_dtype="auto", index_key_dtype="fp32", **more) -> ModelRunner:
    cfg, weights = model
    args = ServerArgs(dtype=dtype, page_size=PAGE, max_running_requests=6, max_total_tokens=16 * PAGE,
                      kv_cache_dtype=kv_cache_dtype, index_key_dtype=index_key_dtype, **more)
    runner = ModelRunner(cfg, weights, args)
    # The chunks below name every page and slot under generation 1, as an allocator's first handouts.
    runner.begin_tenancies([(p, 1) for p in range(runner.num_pages)], [(s, 1) for s in range(runner.num_slots)])
    return runner


def reference_logits(model, ids, dtype=torch.float32, **rounding) -> torch.Tensor:
    cfg, weights = model
    ref = ReferenceModel(cfg, {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()},
                         dtype=dtype, **rounding)
    return ref(torch.tensor([ids]))[0].float()


@pytest.fixture(scope="module")
def fp32_reference(model, prompt):
    return reference_logits(model, prompt)


@pytest.fixture(scope="module")
def fp32_runner(model):
    return make_runner(model)


def chunk(slot, start, ids, pages=PAGES, sample=True, generation=1) -> ForwardChunk:
    return ForwardChunk(rid=f"slot{slot}", slot=slot, slot_generation=generation, start_pos=start,
                        token_ids=tuple(ids), page_ids=tuple(pages), page_generations=(generation,) * len(pages),
                        sample=sample)


def run_chunks(runner, ids, sizes, slot=0, pages=PAGES) -> list[tuple[int, torch.Tensor]]:
    """Feeds `ids` to one request in chunks of `sizes`; (last position, logits) after each chunk."""
    out, start = [], 0
    for size in sizes:
        logits = runner.forward(ForwardBatch(tick=0, chunks=(chunk(slot, start, ids[start : start + size], pages),)))
        start += size
        out.append((start - 1, logits[0]))
    assert start == len(ids)
    return out


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, rel: float = REL_TOL, tie: float = 1e-5) -> None:
    """Logits within `rel` of the largest, and the same argmax, or one whose logit lies within `tie` of it."""
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err <= rel, f"{what}: relative logit error {err:.2e} > {rel:.0e}"
    assert int(got.argmax()) == int(want.argmax()) or (want.max() - want[got.argmax()]) < tie, what


def cycle_sizes(total: int, pattern: tuple[int, ...]) -> list[int]:
    sizes, i = [], 0
    while sum(sizes) < total:
        sizes.append(min(pattern[i % len(pattern)], total - sum(sizes)))
        i += 1
    return sizes


@pytest.mark.parametrize("length", [1, 5, 127, 128, 129, 300, 600])
def test_whole_prompt_prefill(fp32_runner, fp32_reference, prompt, length):
    ((last, logits),) = run_chunks(fp32_runner, prompt[:length], [length])
    assert_close(logits, fp32_reference[last], f"prefill of {length}")


@pytest.mark.parametrize("pattern", [(37, 64, 129), (1, 127, 128, 3, 2, 129)])
def test_chunked_prefill(fp32_runner, fp32_reference, prompt, pattern):
    """Chunk ends fall mid-window, mid-compression group, on and off page and window boundaries."""
    for last, logits in run_chunks(fp32_runner, prompt, cycle_sizes(PROMPT_LEN, pattern), slot=1):
        assert_close(logits, fp32_reference[last], f"chunks {pattern}, position {last}")


def greedy_decode(runner, prompt_ids, steps, slot=2, pages=PAGES) -> list[int]:
    ((_, logits),) = run_chunks(runner, prompt_ids, [len(prompt_ids)], slot=slot, pages=pages)
    tokens = [int(logits.argmax())]
    for step in range(steps - 1):
        batch = ForwardBatch(tick=step, chunks=(chunk(slot, len(prompt_ids) + step, tokens[-1:], pages),))
        tokens.append(int(runner.forward(batch)[0].argmax()))
    return tokens


def test_decode_matches_reference_greedy_generate(model, fp32_runner, prompt):
    """20 decode steps from position 120: the ring wraps and an HCA window completes mid-decode."""
    cfg, weights = model
    ref_tokens, margins = ReferenceModel(cfg, weights).greedy_generate(prompt[:120], 20)
    tokens = greedy_decode(fp32_runner, prompt[:120], 20)
    for step, (got, want) in enumerate(zip(tokens, ref_tokens)):
        if got != want:
            assert margins[step] < 1e-5, f"step {step}: {got} != reference {want} (margin {margins[step]:.2e})"
            break  # a genuine tie: the continuations legitimately part here


def test_decode_across_page_boundary(model, fp32_runner, prompt):
    """Teacher-forced check of 20 decode steps crossing page 2 (position 256): each token must be
    the reference's greedy choice for the same prefix, up to genuine ties."""
    tokens = greedy_decode(fp32_runner, prompt[:250], 20, slot=3)
    logits = reference_logits(model, prompt[:250] + tokens)[249:]
    for step, token in enumerate(tokens):
        top2 = logits[step].topk(2).values
        assert token == int(logits[step].argmax()) or top2[0] - top2[1] < 1e-5, f"decode step {step}"


def test_mixed_batch_equals_each_request_alone(model, prompt):
    """Prefill chunks and decodes of four requests at different positions share ticks."""
    ids = {r: prompt[100 * r : 100 * r + 320] for r in range(4)}
    pages = {0: (0, 1, 2), 1: (5, 3, 4), 2: (8, 6, 7), 3: (9, 11, 10)}
    # Per tick: request -> (start, length). Lengths 1 at start 0 (a one-token prompt) and 1 later
    # (decodes) land in one decode group with chunks of other lengths alongside.
    schedule = [
        {0: (0, 130), 1: (0, 7)},
        {0: (130, 1), 1: (7, 133), 2: (0, 64)},
        {0: (131, 1), 1: (140, 1), 2: (64, 236), 3: (0, 1)},
        {0: (132, 1), 1: (141, 1), 2: (300, 1), 3: (1, 1)},
        {0: (133, 1), 1: (142, 1), 2: (301, 1), 3: (2, 129)},
    ]
    batched, alone = make_runner(model), make_runner(model)
    for tick, plan in enumerate(schedule):
        # Shuffled slots and chunk order: nothing may depend on a chunk's place in the batch.
        chunks = [chunk(3 - r, s, ids[r][s : s + n], pages[r]) for r, (s, n) in sorted(plan.items(), reverse=True)]
        together = batched.forward(ForwardBatch(tick=tick, chunks=tuple(chunks)))
        for i, c in enumerate(chunks):
            by_itself = alone.forward(ForwardBatch(tick=tick, chunks=(c,)))[0]
            assert_close(together[i], by_itself, f"tick {tick}, {c.rid}", rel=1e-5)


def test_only_sampling_chunks_return_logits(fp32_runner, prompt):
    chunks = (chunk(4, 0, prompt[:10], sample=False), chunk(5, 0, prompt[:3], pages=(12,)))
    logits = fp32_runner.forward(ForwardBatch(tick=0, chunks=chunks))
    assert logits.shape == (1, fp32_runner.cfg.vocab_size) and logits.dtype == torch.float32


@pytest.mark.parametrize("index_key_dtype", ["bf16", "fp8"])
def test_rounded_index_keys(model, prompt, index_key_dtype):
    ids = prompt[:300]
    want = reference_logits(model, ids, index_key_dtype=index_key_dtype)
    runner = make_runner(model, index_key_dtype=index_key_dtype)
    for last, logits in run_chunks(runner, ids, cycle_sizes(300, (129, 37, 1, 64))):
        assert_close(logits, want[last], f"{index_key_dtype} index keys, position {last}")


def test_fp8_main_rows(model, prompt):
    """fp8 main rows (584 B) and fp8 index keys, in float64 so that no fp8 rounding boundary is
    crossed differently by the two forwards' last-bit differences."""
    ids = prompt[:300]
    want = reference_logits(model, ids, dtype=torch.float64, index_key_dtype="fp8", kv_cache_dtype="fp8_e4m3")
    runner = make_runner(model, dtype="float64", kv_cache_dtype="fp8_e4m3", index_key_dtype="fp8")
    for last, logits in run_chunks(runner, ids, cycle_sizes(300, (129, 37, 1, 64))):
        assert_close(logits, want[last], f"fp8 rows, position {last}", rel=1e-6)


def test_bfloat16_runs_close_to_reference(model, prompt):
    """bf16 compute: different but equally valid rounding orders keep logits within a few percent, and
    the argmax where no other logit lies within a few bf16 roundings of it (a Zen 5 gave 155 for 130 at
    2.969 against 2.984, one bf16 step apart). (On a CPU with the C kernels: chunks of 150 tokens
    through the grouped MoE, of 1, 20 and 29 through the MoE kernel.)"""
    ids = prompt[:200]
    want = reference_logits(model, ids, dtype=torch.bfloat16, index_key_dtype="fp8")
    runner = make_runner(model, dtype="bfloat16", index_key_dtype="fp8")
    for last, logits in run_chunks(runner, ids, [150, 1, 20, 29]):
        assert_close(logits, want[last], f"bf16, position {last}", rel=5e-2, tie=2**-6 * want[last].abs().max().item())


def test_unwritten_rows_are_never_read(model, prompt):
    """Pools full of NaN bytes (0xFF) give the same logits as zeroed ones: masked-off rows (ring rows
    before position 0, compressed rows past a shorter request's end, stale partial state) never
    reach a matmul."""
    clean, dirty = make_runner(model, index_key_dtype="fp8"), make_runner(model, index_key_dtype="fp8")
    for page in range(dirty.num_pages):
        dirty.pools.write_page(page, 1, b"\xff" * dirty.pools.page_bytes)
    for slot in range(dirty.num_slots):
        dirty.pools.write_slot(slot, 1, b"\xff" * dirty.pools.slot_bytes)
    long, short = prompt[:300], prompt[300:320]
    ticks = [
        (chunk(0, 0, long, PAGES[:3]), chunk(1, 0, short[:19], PAGES[3:4])),
        (chunk(0, 300, [5], PAGES[:3]), chunk(1, 19, short[19:], PAGES[3:4])),
    ]
    for tick, chunks in enumerate(ticks):
        want = clean.forward(ForwardBatch(tick=tick, chunks=chunks))
        got = dirty.forward(ForwardBatch(tick=tick, chunks=chunks))
        assert torch.isfinite(got).all() and torch.equal(got, want), f"tick {tick}"


@pytest.mark.parametrize(("more", "threads"), [({}, 2), ({"cpu_threads": 1}, 1), ({"tp_size": 2}, 1),
                                               ({"tp_size": 2, "nnodes": 2, "dist_init_addr": "127.0.0.1:1"}, 2)])
def test_every_forward_runs_on_the_processs_share_of_the_cores(model, prompt, monkeypatch, torch_threads, more,
                                                                threads):
    # By default a share of torch's thread count where the runner is built (2 here, standing for every
    # core; the test session itself runs on one, tests/conftest.py) for each of this node's ranks, or
    # --cpu-threads; every forward, prefill chunk or decode step, sets it on its own thread.
    with torch_threads(2):
        runner = make_runner(model, **more)
    chosen = []
    monkeypatch.setattr(torch, "set_num_threads", chosen.append)
    run_chunks(runner, prompt[:9], [8, 1])
    assert chosen == [threads, threads]


def test_boundaries_captured_inside_a_chunk_equal_the_slot_at_those_boundaries(model, prompt):
    """A chunk [0, 300) captures its state at 128 and 256 into snapshot units (prefix cache); each
    equals the slot of the same prompt prefilled up to that boundary: the whole window ring and the
    partial state a boundary holds (CSA: the previous window's rows; HCA: none)."""
    cfg, _ = model
    runner = make_runner(model)
    units = (runner.num_slots, runner.num_slots + 1)
    runner.begin_tenancies([], [(unit, 1) for unit in units])
    ids = prompt[:300]
    captures = tuple(BoundaryCapture(0, boundary, unit, 1) for boundary, unit in zip((128, 256), units, strict=True))
    runner.forward(ForwardBatch(tick=0, chunks=(chunk(0, 0, ids, PAGES[:3]),), captures=captures))
    pools = runner.pools
    for boundary, unit in zip((128, 256), units, strict=True):
        run_chunks(runner, ids[:boundary], [boundary], slot=1, pages=PAGES[3:6])
        for layer, ratio in enumerate(cfg.compress_ratios):
            where = f"layer {layer}, boundary {boundary}"
            ring = pools.window(layer)
            torch.testing.assert_close(ring[unit].view(torch.float32), ring[1].view(torch.float32),
                                       rtol=1e-4, atol=1e-5, msg=f"window ring, {where}")
            if cfg.layer_kind(layer) == CSA:
                for state in (pools.compressor_state(layer), pools.indexer_state(layer)):
                    torch.testing.assert_close(state[unit, :ratio], state[1, :ratio], rtol=1e-4, atol=1e-5,
                                               msg=f"partial state, {where}")
    assert not torch.equal(pools.window(0)[units[0]], pools.window(0)[units[1]])


def test_indexer_skipped_while_no_query_sees_more_rows_than_it_keeps(model, prompt):
    """While every query sees at most index_topk compressed rows, the top-k is all of them: no index
    query or score is computed, and the logits equal those of a runner whose indexer runs (with
    --verify-indexer it always does). Past that length the indexer runs again."""
    cfg, _ = model
    ratio = next(cfg.compress_ratios[i] for i in range(cfg.num_layers) if cfg.layer_kind(i) == CSA)
    limit = cfg.index_topk * ratio + ratio - 1  # the longest prompt whose queries see at most index_topk rows
    plain, indexed = make_runner(model), make_runner(model, verify_indexer="count")
    calls = []
    index_queries = plain.model.pieces.index_queries
    plain.model.pieces = dataclasses.replace(plain.model.pieces,
                                             index_queries=lambda *a: calls.append(1) or index_queries(*a))
    counts, start = [], 0
    for size in (limit - 2, 2, 40):
        ids = prompt[start : start + size]
        got, want = (runner.forward(ForwardBatch(tick=0, chunks=(chunk(0, start, ids),)))[0]
                     for runner in (plain, indexed))
        assert torch.equal(got, want), start
        counts.append(len(calls))
        start += size
    assert counts[0] == counts[1] == 0 < counts[2]
