"""The serving benchmark's metric math on fixed numbers (scripts/bench/metrics.py)."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))

from bench.client import Stream
from bench.metrics import RequestResult, metric_keys, percentile, ratio, summarize


def test_percentiles_interpolate_between_ranks_like_numpy():
    values = [float(v) for v in range(10, 0, -1)]  # 10..1, unsorted on purpose
    assert percentile(values, 50) == pytest.approx(5.5)
    assert percentile(values, 90) == pytest.approx(9.1)
    assert percentile(values, 99) == pytest.approx(9.91)
    assert percentile(values, 0) == 1 and percentile(values, 100) == 10
    assert percentile([7.0], 99) == 7.0
    assert math.isnan(percentile([], 50))


def test_tpot_excludes_the_first_token_and_itl_splits_a_multi_token_event():
    stream = Stream([5] * 4)
    stream.sent = 100.0
    stream.events = [(100.5, 1), (100.7, 1), (101.3, 2)]  # TTFT 0.5 s; then 0.2 s, then 0.6 s for two tokens
    stream.finish_reason = "length"
    r = stream.result()
    assert r.ok and r.output_tokens == 4 and r.prompt_tokens == 4
    assert r.ttft == pytest.approx(0.5) and r.e2e == pytest.approx(1.3)
    assert r.tpot == pytest.approx((1.3 - 0.5) / 3)
    assert r.itls == pytest.approx([0.2, 0.3, 0.3])


def test_a_stream_that_ended_without_length_or_stop_is_a_failure():
    stream = Stream([5])
    stream.events = [(1.0, 1)]
    stream.finish_reason = "abort"
    assert not stream.result().ok and "abort" in stream.result().error


def test_summary_counts_only_completed_requests_and_divides_by_wall_time():
    results = [
        RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft=0.1, e2e=0.5, itls=[0.1] * 4),
        RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft=0.3, e2e=0.7, itls=[0.2] * 2),
        RequestResult(ok=False, prompt_tokens=10, error="HTTP 500"),
    ]
    s = summarize(results, duration=2.0)
    assert set(metric_keys()) <= set(s)
    assert (s["completed"], s["failed"], s["errors"]) == (2, 1, ["HTTP 500"])
    assert s["total_input_tokens"] == 20 and s["total_output_tokens"] == 8
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["output_throughput"] == pytest.approx(4.0)
    assert s["total_token_throughput"] == pytest.approx(14.0)
    assert s["mean_ttft_ms"] == pytest.approx(200.0) and s["median_ttft_ms"] == pytest.approx(200.0)
    assert s["p90_ttft_ms"] == pytest.approx(280.0)
    assert s["mean_tpot_ms"] == pytest.approx(150.0)  # (0.4/4 + 0.4/2) / 2
    assert s["mean_itl_ms"] == pytest.approx(800 / 6)  # over all six gaps, not per request
    assert s["median_itl_ms"] == pytest.approx(100.0)
    assert s["p99_e2e_ms"] == pytest.approx(698.0)


def test_ratio_is_nan_where_a_side_is_missing():
    assert ratio(6.0, 2.0) == 3.0
    assert math.isnan(ratio(1.0, 0.0)) and math.isnan(ratio(math.nan, 1.0)) and math.isnan(ratio(1.0, math.nan))


def test_the_floor_counts_as_bf16_exactly_the_weights_the_server_reads_as_bf16_copies(tiny_ckpt):
    """scripts/bench/baseline.py's `_BF16_COPIES` names the checkpoint tensors that
    dsv4/model/compile.py `_bf16_twins` copies (projections and experts) and those the MoE's C kernel
    reads as copies (experts): every element of each, and no other."""
    import torch
    from bench.baseline import _BF16_COPIES, decode_weight_bytes

    from dsv4.config import ModelConfig, ServerArgs, expected_weights
    from dsv4.engine.runner import ModelRunner
    from dsv4.kernels import cpu_moe
    from dsv4.model import compile
    from dsv4.weights import load_state_dict

    cfg = ModelConfig.from_json(tiny_ckpt)
    runner = ModelRunner(cfg, load_state_dict(tiny_ckpt, cfg, dtype=torch.float32),
                         ServerArgs(dtype="float32", max_running_requests=1, max_total_tokens=256, disable_compile=True))

    def named(*kinds: str) -> int:
        return sum(math.prod(shape) for name, shape in expected_weights(cfg).items()
                   if any(_BF16_COPIES[kind].search(name) for kind in kinds))

    twins = compile._bf16_twins(runner.model)
    assert named("projections", "experts") == sum(twin.numel() for _, twin in twins.values()) > 0
    if cpu_moe.available():
        copies = [w for block in runner.model.blocks for w in block.ffn.kernel_weights if w is not None]
        assert all(w.dtype == torch.bfloat16 for w in copies)
        assert named("experts") == sum(w.numel() for w in copies) > 0
    in_fp32, experts, as_read = (decode_weight_bytes(tiny_ckpt, "float32", 64, bf16_copies=copies)
                                 for copies in ((), ("experts",), ("projections", "experts")))
    in_bf16 = decode_weight_bytes(tiny_ckpt, "bfloat16", 64)
    assert in_bf16 < as_read < experts < in_fp32  # the norms, mixes, gate, embedding row and head stay fp32


def test_the_compute_floor_multiplies_every_matrix_a_token_reads_and_nothing_else(tiny_ckpt):
    """`product_flops` counts 2 FLOPs per element of each matrix the decode floor counts as read whole,
    and the LM head apart: with the elements read but not multiplied (norms and other vectors, the
    embedding's and each `ape`'s one row, each `tid2eid` row as 8 bytes) it adds up to the fp32 floor's
    bytes / 4."""
    from bench.baseline import _weights_read, decode_weight_bytes, product_flops

    from dsv4.config import ModelConfig

    cfg = ModelConfig.from_json(tiny_ckpt)
    for context in (64, cfg.index_topk * 4 + 4):  # without and with the indexer's queries
        layers, head = product_flops(tiny_ckpt, context)
        assert head == 2 * cfg.vocab_size * cfg.hidden_size and layers > 0
        read_not_multiplied = sum(
            math.prod(shape) if len(shape) == 1 else 2 * shape[-1] if name.endswith("tid2eid") else shape[-1]
            for name, shape in _weights_read(tiny_ckpt, context)
            if len(shape) == 1 or name == "embed.weight" or name.endswith((".ape", "tid2eid")))
        assert (layers + head) // 2 + read_not_multiplied == decode_weight_bytes(tiny_ckpt, "float32", context) // 4
    assert product_flops(tiny_ckpt, cfg.index_topk * 4 + 4)[0] > product_flops(tiny_ckpt, 64)[0]
