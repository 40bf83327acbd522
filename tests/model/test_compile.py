"""The compiled pieces (dsv4/model/compile.py) against the eager model they replace, and the bound on
compiling: a compile that cannot finish in time leaves an eager model that serves."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest
import torch

from dsv4.config import ModelConfig, ServerArgs
from dsv4.engine.runner import ModelRunner
from dsv4.kernels import cpu_mhc, cpu_moe, cpu_project
from dsv4.model import compile, ops, package_cache
from dsv4.protocol import ForwardBatch, ForwardChunk
from dsv4.weights import load_state_dict

PAGE = 128


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    cfg = ModelConfig.from_json(tiny_ckpt)
    weights = load_state_dict(tiny_ckpt, cfg, dtype=torch.float32)
    # Every matrix laid out column-major, as views in an in-process state dict may be (dsv4.tiny's
    # tid2eid is a slice of a wider tensor): a package compiled with such an example's strides read
    # the contiguous copies it is served from the wrong places (with these weights, logits off by 4.4).
    return cfg, {name: t.t().contiguous().t() if t.dim() == 2 else t for name, t in weights.items()}


def runner(model, **args) -> ModelRunner:
    cfg, weights = model
    r = ModelRunner(cfg, weights, ServerArgs(dtype="float32", page_size=PAGE, max_running_requests=2,
                                             max_total_tokens=4 * PAGE, index_key_dtype="fp32", **args))
    r.begin_tenancies([(p, 1) for p in range(r.num_pages)], [(s, 1) for s in range(r.num_slots)])
    return r


def logits_of(r: ModelRunner, prompt: list[int], decodes: list[int]) -> torch.Tensor:
    """A prefill chunk, then one request's decode steps, then two requests decoding together."""
    def chunk(slot, start, ids):
        return ForwardChunk(rid=f"r{slot}", slot=slot, slot_generation=1, start_pos=start, token_ids=tuple(ids),
                            page_ids=(2 * slot, 2 * slot + 1), page_generations=(1, 1), sample=True)

    rows = [r.forward(ForwardBatch(tick=1, chunks=(chunk(0, 0, prompt), chunk(1, 0, prompt[:50]))))]
    for i, token in enumerate(decodes):
        rows.append(r.forward(ForwardBatch(tick=2 + i, chunks=(chunk(0, len(prompt) + i, [token]),))))
    both = (chunk(0, len(prompt) + len(decodes), [7]), chunk(1, 50, [9]))
    rows.append(r.forward(ForwardBatch(tick=2 + len(decodes), chunks=both)))
    # a forward of a few tokens (in fp32: the entry's and exit's weight-first packages)
    rows.append(r.forward(ForwardBatch(tick=3 + len(decodes), chunks=(chunk(1, 51, [3, 1, 4, 1, 5, 9]),))))
    return torch.cat(rows)


@pytest.fixture(scope="module")
def compile_cache(tmp_path_factory):
    """Where this module's runners keep their compiled packages (not the user's cache)."""
    return tmp_path_factory.mktemp("compiled")


def without_projection_kernels(monkeypatch) -> None:
    """The model as a CPU without the C kernels of the decode steps' projections and MoE runs it: its
    decode packages serve (with their products and twins, where chosen)."""
    monkeypatch.setattr(cpu_project, "available", lambda: False)
    monkeypatch.setattr(cpu_moe, "available", lambda: False)


def test_compiled_model_equals_eager(model, caplog, compile_cache, monkeypatch):
    """With the decode products and the weights' bf16 twins (the checkpoint is bf16, served in fp32),
    whatever this machine's matmuls measure."""
    cfg, _ = model
    monkeypatch.setenv("DSV4_CACHE_DIR", str(compile_cache))
    without_projection_kernels(monkeypatch)
    monkeypatch.setattr(ops, "one_row_linear_lag", lambda weights, threads: 2 * compile._PRODUCTS_LAG)
    prompt = torch.randint(0, cfg.vocab_size, (200,), generator=torch.Generator().manual_seed(3)).tolist()
    with caplog.at_level(logging.INFO, logger="dsv4.model.compile"):
        compiled = runner(model, disable_compile=False, compile_timeout=600)
    assert compiled.compiled, caplog.text
    assert "compiling (once per machine)" in caplog.text and "compiled pieces ready" in caplog.text
    assert compile.BF16_COPIES_LOGGED in caplog.text
    packages = sorted(path.name.split("-")[0] for path in compile_cache.rglob("*.pt2"))
    mix_kernel = cpu_mhc.serves(torch.float32, torch.device("cpu"), cfg.hc_mult)  # (no package replaces it)
    assert packages == sorted(["attend_decodes", "attend_decodes_compressed", "attention_exit", "attention_exit_many",
                               "compressor_feed", "index_queries", "moe_combine",
                               "moe_dispatch_hash", "moe_dispatch_scored", "moe_few_hash", "moe_few_scored",
                               "project_inputs", "project_inputs_many",
                               *([] if mix_kernel else ["mix"])])  # no partial one
    assert f"({len(packages)} of {len(packages)} packages" in caplog.text  # each compiled package logged as it lands
    # Packages of older builds, the oldest used long ago: a start keeps its own and the most recent others
    folder = next(compile_cache.rglob("*.pt2")).parent
    stale = {f"{i:016x}": folder / f"mix-{i:016x}.pt2" for i in range(package_cache.KEEP_KEYS)}
    for i, path in enumerate(stale.values()):
        path.write_bytes(b"an older build's package")
        os.utime(path, (1_000_000 + i, 1_000_000 + i))
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="dsv4.model"):
        reloaded = runner(model, disable_compile=False, compile_timeout=600)  # a restart: from the cache
    assert reloaded.compiled and "loading the model's pieces" in caplog.text, caplog.text
    assert not stale[f"{0:016x}"].exists() and all(path.exists() for path in list(stale.values())[1:])
    assert "removed 1 compiled packages of 1 older builds" in caplog.text
    eager = runner(model, disable_compile=True)
    assert not eager.compiled
    got, again, want = (logits_of(r, prompt, [5, 6, 7]) for r in (compiled, reloaded, eager))
    # The same math; only the fused code's summation order differs.
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert torch.equal(got, again)


def test_a_compile_past_its_timeout_serves_eagerly(tiny_ckpt, compile_cache):
    """In a fresh process, with the package in the cache: even loading it takes longer than 1 ms."""
    script = f"""
import logging, sys, torch
logging.basicConfig(level=logging.INFO, stream=sys.stdout)
from dsv4.config import ModelConfig, ServerArgs
from dsv4.engine.runner import ModelRunner
from dsv4.kernels import cpu_mhc, cpu_moe, cpu_project
from dsv4.protocol import ForwardBatch, ForwardChunk
from dsv4.weights import load_state_dict
cfg = ModelConfig.from_json({str(tiny_ckpt)!r})
args = ServerArgs(dtype="float32", max_running_requests=1, max_total_tokens=256, disable_compile=False,
                  compile_timeout=0.001)
r = ModelRunner(cfg, load_state_dict({str(tiny_ckpt)!r}, cfg, dtype=torch.float32), args)
r.begin_tenancies([(0, 1)], [(0, 1)])
chunk = ForwardChunk(rid="r", slot=0, slot_generation=1, start_pos=0, token_ids=(1, 2, 3), page_ids=(0,),
                     page_generations=(1,), sample=True)
with torch.inference_mode():
    assert torch.isfinite(r.forward(ForwardBatch(tick=1, chunks=(chunk,)))).all()
print("compiled:", r.compiled)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, check=False,
                          env={**os.environ, "DSV4_DISABLE_COMPILE": "0", "DSV4_CACHE_DIR": str(compile_cache)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert "compiled: False" in done.stdout and "did not finish within" in done.stdout, done.stdout


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_decode_packages_equal_eager(model, compile_cache, dtype):
    """The decode packages as they are compiled where one-row matmuls lag (`ops.decode_linear`'s
    products summed over the output features, where the eager pieces call F.linear; in fp32, over the
    weights' bf16 twins, which hold the same values): at one token and at the most each serves they give
    the eager pieces' results, over the fp32 weights, within one rounding of the dtype. So does the
    decode attention over the dtype's rows."""
    cfg, weights = model
    m = ModelRunner(cfg, weights, ServerArgs(dtype=dtype, page_size=PAGE, max_running_requests=2,
                                             max_total_tokens=4 * PAGE, disable_compile=True)).model
    twins = compile._bf16_twins(m)
    assert bool(twins) is (dtype == "float32")  # the checkpoint is bf16: its fp32 weights hold bf16 values
    examples, modules = compile._examples(m, twins), compile._modules(cfg, m.blocks[0].ffn.experts, decode_products=True)
    served = compile._examples(m, {})  # what the model calls the pieces with
    rel = 2e-2 if dtype == "bfloat16" else 1e-5
    g = torch.Generator().manual_seed(5)
    for name in ("project_inputs", "attention_exit", "attend_decodes_compressed", "moe_few_scored", "moe_few_hash"):
        if dtype == "float32" and name != "attend_decodes_compressed":
            assert any(t.dtype == torch.bfloat16 for t in examples[name]), name  # compiled for the twins
        piece = compile._load_or_compile(compile_cache / f"{name}-{dtype}.pt2", name, examples[name], modules[name])
        eager = modules[name].function
        constants = {k: v for k, v in modules[name].constants.items() if k != "product"}
        assert modules[name].constants.get("product", ops.decode_linear) is ops.decode_linear
        for tokens in (1, compile._token_limit(name) or 3):
            # every per-token input random at this many tokens; the weights are the layer's
            rows = {i: _random_like(served[name][i], tokens, g) for i in _TOKEN_ARGS[name]}
            got = piece(*(rows.get(i, t).clone() for i, t in enumerate(examples[name])))
            want = eager(*(rows.get(i, t).clone() for i, t in enumerate(served[name])), **constants)
            for got_part, want_part in zip(got if isinstance(got, tuple) else (got,),
                                           want if isinstance(want, tuple) else (want,), strict=True):
                assert got_part.dtype == want_part.dtype and got_part.shape == want_part.shape
                scale = want_part.float().abs().max()
                assert (got_part.float() - want_part.float()).abs().max() <= rel * scale, name


def test_bf16_twins_only_where_every_weight_holds_bf16_values(model):
    """An fp32 model gets bf16 twins of the weights its decode packages read whole only when no weight
    would round; each twin holds its weight's values."""
    cfg, weights = model
    args = {"page_size": PAGE, "max_running_requests": 2, "max_total_tokens": 4 * PAGE, "disable_compile": True}
    m = ModelRunner(cfg, weights, ServerArgs(dtype="float32", **args)).model
    twins = compile._bf16_twins(m)
    assert {id(w) for w in (m.blocks[0].attn.wq_b, m.blocks[-1].ffn.w13, m.blocks[0].attn.input_weights[0])} <= set(twins)
    for weight, twin in twins.values():
        assert twin.dtype == torch.bfloat16 and twin.is_contiguous() and torch.equal(twin.float(), weight)
    rounding = dict(weights)
    name = next(n for n in weights if n.endswith("attn.wo_b.weight"))
    rounding[name] = weights[name] + 1e-4  # one weight past bf16
    m = ModelRunner(cfg, rounding, ServerArgs(dtype="float32", **args)).model
    assert compile._bf16_twins(m) == {}


def test_decode_products_follow_the_measured_lag_and_key_the_packages(model, monkeypatch):
    """The decode packages multiply as `ops.decode_linear` exactly where one-row `ops.linear` lags a sum by
    `_PRODUCTS_LAG` or more, and the choice is part of the packages' key: a package compiled with one
    choice is never loaded for the other; where the C kernels take every decode step, the packages are
    `ops.linear`'s, unmeasured (a noisy measurement must not key packages that serve nothing)."""
    cfg, weights = model
    args = ServerArgs(dtype="float32", page_size=PAGE, max_running_requests=2, max_total_tokens=4 * PAGE,
                      disable_compile=True)
    if cpu_project.available() and cpu_moe.available():
        monkeypatch.setattr(ops, "one_row_linear_lag", lambda weights, threads: 2 * compile._PRODUCTS_LAG)
        assert compile._decode_products(ModelRunner(cfg, weights, args).model, 1) is False
        monkeypatch.undo()
    without_projection_kernels(monkeypatch)
    m = ModelRunner(cfg, weights, args).model
    lag = ops.one_row_linear_lag([block.attn.wq_b for block in m.blocks], 1)
    assert 0 < lag < float("inf")
    for measured, products in ((compile._PRODUCTS_LAG, True), (compile._PRODUCTS_LAG * 0.99, False)):
        monkeypatch.setattr(ops, "one_row_linear_lag", lambda weights, threads, measured=measured: measured)
        assert compile._decode_products(m, 1) is products
    experts, examples = m.blocks[0].ffn.experts, compile._examples(m, {})
    for products, product in ((True, ops.decode_linear), (False, ops.linear)):
        modules = compile._modules(cfg, experts, products)
        assert modules["project_inputs"].constants["product"] is product
        assert modules["attention_exit"].constants["product"] is product
        assert "product" not in modules["project_inputs_many"].constants
    assert compile._key(cfg, experts, examples, True) != compile._key(cfg, experts, examples, False)


# The arguments that have a row per token: the projections' input and RoPE tables (the last 2); the
# exit's attention output and tables; the decode attention's all but the sink; the MoE's input and
# token ids
_TOKEN_ARGS = {"project_inputs": (0, 5, 6), "attention_exit": (0, 1, 2),
               "attend_decodes_compressed": (0, 1, 2, 4, 5, 6), "moe_few_scored": (0, 1), "moe_few_hash": (0, 1)}


def _random_like(example: torch.Tensor, rows: int, g: torch.Generator) -> torch.Tensor:
    """`rows` random rows shaped as the example's: positions (long) below 300, masks (bool) two-thirds
    true, values normal."""
    shape = (rows, *example.shape[1:])
    if example.dtype == torch.long:
        return torch.randint(0, 300, shape, generator=g)
    if example.dtype == torch.bool:
        return torch.rand(shape, generator=g) < 0.67
    return torch.randn(shape, generator=g).to(example.dtype)
