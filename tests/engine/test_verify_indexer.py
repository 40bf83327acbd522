"""--verify-indexer: the reference indexer re-checks the served batches' selections.

Clean serving reports zero mismatches and counts every selection; bytes flipped in one request's
cached index-key rows between ticks, which the fast and the reference indexer would read alike, are
caught by the rows' fingerprints: counted by layer, shown in /debug/requests and, with `fail`, fail
that request alone while the others complete.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random

import pytest

from dsv4.config import CSA, ConfigError, ServerArgs
from dsv4.engine.engine import Engine
from dsv4.engine.launch import load_model
from dsv4.protocol import GenerationRequest, SamplingParams
from dsv4.tiny import make_tiny

TINY_CSA_LAYERS = (1, 3)  # tiny: window, CSA, HCA, CSA; index_topk 16
# Below and across the window / page edge (128) and well past 4 * topk, so the indexer selects.
LENGTHS = [3, 17, 60, 100, 127, 128, 129, 150, 190, 200, 230, 257, 280, 300, 333, 400]


def parse(*argv) -> ServerArgs:
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli(parser.parse_args(argv))


def test_flags():
    assert (parse().verify_indexer, parse().verify_indexer_every, parse().device) == ("off", 1, None)
    assert parse("--verify-indexer").verify_indexer == "count"
    assert parse("--verify-indexer", "--port", "8000").verify_indexer == "count"
    assert parse("--verify-indexer=fail", "--verify-indexer-every", "4").verify_indexer_every == 4
    assert parse("--verify-indexer", "fail").verify_indexer == "fail"
    assert parse("--device", "cpu").device == "cpu"
    for bad in ({"verify_indexer": "always"}, {"verify_indexer_every": 0}, {"device": "tpu"}):
        with pytest.raises(ConfigError, match=next(iter(bad)).replace("_", "-")):
            ServerArgs(**bad)


def make_prompts(lengths, vocab, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def selections(lengths, new_tokens, csa_layers) -> int:
    """Selections a fully verified run checks: one per CSA layer per fed position p >= 3 (the first
    that sees an index-key row); a request feeds positions 0 .. prompt + new_tokens - 2."""
    return len(csa_layers) * sum(max(0, n + new_tokens - 1 - 3) for n in lengths)


@contextlib.asynccontextmanager
async def serving(checkpoint, **overrides):
    args = ServerArgs(**{"model": str(checkpoint), "verify_indexer": "count", "max_running_requests": 16,
                         "max_total_tokens": 128 * 48, **overrides})
    model = load_model(args)
    engine = Engine(args, model.config, model.tokenizer, model.runner, model_name=model.name)
    await engine.start()
    try:
        yield engine
    finally:
        await engine.stop()


async def generate(engine, rid, prompt, new_tokens, on_output=lambda out: None):
    request = GenerationRequest(rid=rid, input_ids=tuple(prompt),
                                sampling=SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True))
    outputs = []
    async for out in engine.submit(request):
        outputs.append(out)
        on_output(out)
    return outputs


def mismatches(engine, layer) -> float:
    return engine.metrics.registry.get_sample_value("dsv4_indexer_mismatch_total", {"layer": str(layer)})


def verified(engine) -> float:
    return engine.metrics.registry.get_sample_value("dsv4_indexer_verified_total")


async def serve_all(engine, prompts, new_tokens):
    async with asyncio.timeout(120):
        results = await asyncio.gather(*(generate(engine, f"r{i}", p, new_tokens) for i, p in enumerate(prompts)))
    for outputs in results:
        assert outputs[-1].finish_reason == "length", outputs[-1]


async def test_concurrent_serving_reports_zero_mismatches(tiny_ckpt):
    new_tokens = 6
    async with serving(tiny_ckpt, chunked_prefill_size=256) as engine:  # prompts split across ticks
        await serve_all(engine, make_prompts(LENGTHS, engine.model_config.vocab_size), new_tokens)
        assert [mismatches(engine, layer) for layer in TINY_CSA_LAYERS] == [0.0, 0.0]
        assert verified(engine) == selections(LENGTHS, new_tokens, TINY_CSA_LAYERS)


async def test_verify_every_n_ticks_checks_a_share(tiny_ckpt):
    lengths, new_tokens = [150, 40, 260], 8
    async with serving(tiny_ckpt, verify_indexer_every=3) as engine:
        await serve_all(engine, make_prompts(lengths, engine.model_config.vocab_size), new_tokens)
        assert 0 < verified(engine) < selections(lengths, new_tokens, TINY_CSA_LAYERS)
        assert [mismatches(engine, layer) for layer in TINY_CSA_LAYERS] == [0.0, 0.0]


VICTIM_LAYER, VICTIM_PROMPT, VICTIM_ROW = 1, 180, 5


def corrupt_victim_once(runner):
    """Wraps runner.forward: before the victim's second decode step, flips bits in three bytes of
    its index-key row 5 (first page, layer 1), which every later query of it sees."""
    forward, corrupted = runner.forward, []

    def run(batch):
        victim = next((c for c in batch.chunks if c.rid == "victim"), None)
        if victim is not None and victim.start_pos > VICTIM_PROMPT and not corrupted:
            runner.pools.index_keys(VICTIM_LAYER)[victim.page_ids[0], VICTIM_ROW, :3] ^= 0x08
            corrupted.append(victim.start_pos)
        return forward(batch)

    runner.forward = run
    return corrupted


@pytest.mark.parametrize("mode", ["count", "fail"])
@pytest.mark.parametrize("index_key_dtype", ["fp8", "bf16"])
async def test_flipped_index_key_bytes_are_caught(tiny_ckpt, index_key_dtype, mode, caplog):
    new_tokens = 10
    async with serving(tiny_ckpt, index_key_dtype=index_key_dtype, verify_indexer=mode) as engine:
        corrupted = corrupt_victim_once(engine.runner)
        vocab = engine.model_config.vocab_size
        victim_prompt, *others = make_prompts([VICTIM_PROMPT, 150, 200, 60], vocab)
        seen = []  # the victim's /debug/requests entry after each of its outputs

        def look(out):
            seen.extend(e for e in engine.debug_requests()["requests"] if e["rid"] == "victim")

        async with asyncio.timeout(120):
            victim, *rest = await asyncio.gather(generate(engine, "victim", victim_prompt, new_tokens, look),
                                                 *(generate(engine, f"r{i}", p, new_tokens) for i, p in enumerate(others)))
        assert corrupted, "the victim never reached its second decode step"
        for outputs in rest:  # the others are served in full
            assert outputs[-1].finish_reason == "length" and outputs[-1].completion_tokens == new_tokens
        assert mismatches(engine, VICTIM_LAYER) >= 1 and mismatches(engine, 3) == 0
        where = f"layer {VICTIM_LAYER} position {corrupted[0]}"
        assert any(r.levelname == "WARNING" and f"request victim: indexer cross-check failed at {where}" in r.getMessage()
                   for r in caplog.records)
        last = victim[-1]
        if mode == "fail":
            assert last.finish_reason == "error" and last.completion_tokens < new_tokens
            assert last.error.startswith(f"indexer cross-check failed at {where}: ")
            assert f"rows [{VICTIM_ROW}] changed after they were written" in last.error
        else:
            assert last.finish_reason == "length" and last.completion_tokens == new_tokens
            # Every later step of the victim sees the changed row: each one fails its check.
            assert mismatches(engine, VICTIM_LAYER) == VICTIM_PROMPT + new_tokens - 1 - corrupted[0]
            flagged = [e for e in seen if e["indexer_mismatches"]]
            assert flagged and flagged[0]["last_indexer_mismatch"].startswith(f"layer {VICTIM_LAYER} position ")


@pytest.fixture(scope="module")
def small_ckpt(tmp_path_factory):
    return make_tiny(tmp_path_factory.mktemp("small"), preset="small")


async def test_small_checkpoint_reports_zero_mismatches(small_ckpt):
    lengths, new_tokens = [40, 140, 260], 3
    async with serving(small_ckpt, dtype="float32") as engine:
        csa_layers = [i for i in range(engine.model_config.num_layers) if engine.model_config.layer_kind(i) == CSA]
        await serve_all(engine, make_prompts(lengths, engine.model_config.vocab_size), new_tokens)
        assert [mismatches(engine, layer) for layer in csa_layers] == [0.0] * len(csa_layers)
        assert verified(engine) == selections(lengths, new_tokens, csa_layers)
