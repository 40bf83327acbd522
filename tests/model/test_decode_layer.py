"""Decode steps whose layers run as one C call each (dsv4.model.decode_layer; queued, then run together)
against the same steps through the kernels one at a time (`_Block`): the same logits and the same state,
to the bit.

Two copies of each request run side by side, one fused and one not, from the same prompt. Their decode
steps cross every case the fused path meets: windows of both ratios completing (a layer's call then stores
their rows; with index keys fingerprinted, it runs in two phases around the compressors' storing), the
indexer starting to select (tiny's index_topk is 16 rows, 64 tokens at ratio 4: `_Block` then runs the CSA
layers; until then the first layer's call embeds the tokens and the last one's runs the head), the ring
wrapping."""

from __future__ import annotations

import pytest
import torch

from dsv4.config import ModelConfig, ServerArgs
from dsv4.engine.runner import ModelRunner
from dsv4.kernels import cpu_layer
from dsv4.protocol import ForwardBatch, ForwardChunk
from dsv4.weights import load_state_dict

pytestmark = pytest.mark.skipif(not cpu_layer.available(), reason="the CPU kernels do not run here (no AVX512-BF16 or AVX2, or no C compiler)")

PAGE = 128
PROMPTS = (56, 40, 61)  # the three requests' prompt lengths
STEPS = 80  # positions up to 140: CSA windows every 4, the indexer from 64, HCA's window at 127, the ring's wrap


def make_runner(tiny_ckpt, dtype: str, fingerprints: bool = False) -> ModelRunner:
    """`fingerprints`: the pools fingerprint the index keys (as with --verify-indexer), no tick verified."""
    cfg = ModelConfig.from_json(tiny_ckpt)
    weights = load_state_dict(tiny_ckpt, cfg, dtype={"float32": torch.float32, "bfloat16": torch.bfloat16}[dtype])
    args = ServerArgs(dtype=dtype, page_size=PAGE, max_running_requests=6, max_total_tokens=12 * PAGE,
                      disable_compile=True, verify_indexer="count" if fingerprints else "off",
                      verify_indexer_every=10**9)
    runner = ModelRunner(cfg, weights, args)
    runner.begin_tenancies([(p, 1) for p in range(runner.num_pages)], [(s, 1) for s in range(runner.num_slots)])
    return runner


def chunk(copy: int, request: int, start: int, ids) -> ForwardChunk:
    slot = copy * len(PROMPTS) + request
    return ForwardChunk(rid=f"{copy}.{request}", slot=slot, slot_generation=1, start_pos=start, token_ids=tuple(ids),
                        page_ids=(2 * slot, 2 * slot + 1), page_generations=(1, 1), sample=True)


@pytest.mark.parametrize("dtype,fingerprints", [("float32", False), ("bfloat16", False), ("float32", True)])
def test_fused_decode_layers_equal_the_kernels_one_by_one(tiny_ckpt, dtype, fingerprints, monkeypatch):
    runner = make_runner(tiny_ckpt, dtype, fingerprints)
    model, cfg = runner.model, runner.cfg
    fused = model.fused
    assert all(layer is not None for layer in fused)
    calls, stores, ends = [], [], []
    run, store_at = cpu_layer.decode_layer, cpu_layer.POINTERS.index("store_norm_0")
    embed_at, logits_at = cpu_layer.POINTERS.index("embed"), cpu_layer.POINTERS.index("logits")

    def record(pointers, phases):  # (a queued call's pointers stay as they are until it runs)
        calls.append(phases)
        stores.append(pointers[store_at] is not None)
        ends.append((pointers[embed_at] is not None and phases & cpu_layer.FRONT,
                     pointers[logits_at] is not None and phases & cpu_layer.BACK))

    def decode_layer(pointers, *args, phases=cpu_layer.WHOLE):
        record(pointers, phases)
        return run(pointers, *args, phases=phases)

    def add(self, pointers, *args):
        record(pointers, cpu_layer.WHOLE)
        return queue(self, pointers, *args)

    queue = cpu_layer.Calls.add
    monkeypatch.setattr(cpu_layer, "decode_layer", decode_layer)
    monkeypatch.setattr(cpu_layer.Calls, "add", add)

    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=generator).tolist() for n in PROMPTS]
    tick = 0
    for copy in (0, 1):
        tick += 1
        runner.forward(ForwardBatch(tick=tick, chunks=tuple(chunk(copy, r, 0, ids) for r, ids in enumerate(prompts))))
    last = [ids[-1] for ids in prompts]
    fused_steps = 0
    for step in range(STEPS):
        logits = []
        for copy in (0, 1):
            model.fused = fused if copy == 0 else [None] * len(fused)
            before, tick = len(calls), tick + 1
            batch = ForwardBatch(tick=tick, chunks=tuple(chunk(copy, r, n + step, [last[r]])
                                                         for r, n in enumerate(PROMPTS)))
            logits.append(runner.forward(batch))
            fused_steps += copy == 0 and len(calls) > before
        assert torch.equal(logits[0], logits[1]), f"decode step {step}"
        last = logits[0].argmax(-1).tolist()
    model.fused = fused
    # Every step ran some layer fused, some storing new rows (in the call, or in two phases around the
    # compressors' storing where index keys are fingerprinted); not every layer ran fused in every step
    assert fused_steps == STEPS
    two_phase = calls.count(cpu_layer.FRONT)
    assert two_phase == calls.count(cpu_layer.BACK) and (two_phase > 0) == fingerprints
    assert (sum(stores) > 0) != fingerprints
    assert 0 < calls.count(cpu_layer.WHOLE) + two_phase < STEPS * cfg.num_layers
    # Steps whose every layer ran fused embedded their tokens in the first call and ran the head in the last
    embeds, heads = sum(bool(e) for e, _ in ends), sum(bool(h) for _, h in ends)
    assert 0 < embeds == heads < STEPS

    pools = runner.pools
    for layer, kind in enumerate(cfg.compress_ratios):
        for r in range(len(PROMPTS)):
            a, b = r, len(PROMPTS) + r
            assert torch.equal(pools.window(layer)[a], pools.window(layer)[b])
            if kind:
                assert torch.equal(pools.compressor_state(layer)[a], pools.compressor_state(layer)[b])
                assert torch.equal(pools.compressed_rows(layer)[2 * a : 2 * a + 2],
                                   pools.compressed_rows(layer)[2 * b : 2 * b + 2])


def test_only_batches_of_decode_tokens_alone_run_fused(tiny_ckpt, monkeypatch):
    runner = make_runner(tiny_ckpt, "float32")
    calls = []
    queue = cpu_layer.Calls.add
    monkeypatch.setattr(cpu_layer.Calls, "add", lambda *args: (calls.append(1), queue(*args)))
    prompt = list(range(3, 40))
    runner.forward(ForwardBatch(tick=1, chunks=(chunk(0, 0, 0, prompt),)))  # a prefill
    assert not calls
    # a decode token beside another request's prefill chunk
    runner.forward(ForwardBatch(tick=2, chunks=(chunk(0, 0, len(prompt), [5]), chunk(0, 1, 0, prompt))))
    assert not calls
    runner.forward(ForwardBatch(tick=3, chunks=(chunk(0, 0, len(prompt) + 1, [5]),)))
    assert len(calls) == runner.cfg.num_layers  # (position 38: no window completes, the indexer does not select)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_head_kernel_equals_the_torch_head(tiny_ckpt, dtype):
    """The head of a few rows through the mix kernel and cpu_project.logits (PagedModel.head_kernel) against
    hc_head, the norm and the product in torch: the same logits within the dtype's rounding."""
    runner = make_runner(tiny_ckpt, dtype)
    model, cfg = runner.model, runner.cfg
    kernel = model.head_kernel
    assert kernel is not None
    generator = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), generator=generator).tolist() for n in PROMPTS]
    logits = []
    for copy, head in enumerate((kernel, None)):
        model.head_kernel = head
        prefill = runner.forward(ForwardBatch(tick=1, chunks=tuple(chunk(copy, r, 0, ids) for r, ids in enumerate(prompts))))
        step = runner.forward(ForwardBatch(tick=2, chunks=tuple(chunk(copy, r, n, [7]) for r, n in enumerate(PROMPTS))))
        logits.append(torch.cat([prefill, step]))
    model.head_kernel = kernel
    tolerance = {"float32": 1e-5, "bfloat16": 2e-2}[dtype]
    assert (logits[0] - logits[1]).abs().max() <= tolerance * logits[1].abs().max()
    assert (logits[0].argmax(-1) == logits[1].argmax(-1)).all()
