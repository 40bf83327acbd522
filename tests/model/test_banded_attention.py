"""The CPU path's banded sink attention (dsv4.model.attention.banded_sink_attention) against the
reference's sink attention over the union of each block's band and the compressed rows, on each way
its logits run: fp32, and with `exact_bf16` on bf16 units (oneDNN's bf16 products), exact for
bf16-valued operands. Decode tokens' attention over their rings (decode_sink_attention) against the
same. (The C kernels that replace it for bf16 models: tests/kernels/test_cpu_attention.py.)"""

import pytest
import torch

from dsv4.model import attention
from dsv4.model.attention import banded_sink_attention, decode_sink_attention
from dsv4.reference.attention import sink_attention

B, N, Q, H, D, K, C = 2, 3, 16, 4, 64, 48, 10


def inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    def bf16_valued(*shape):  # fp32 tensors holding bf16 values, as the CPU path's upcast rows and queries
        return torch.randn(*shape, generator=g).bfloat16().float()
    q, raw, compressed = bf16_valued(B, N, Q, H, D), bf16_valued(B, N, K, D), bf16_valued(B, C, D)
    raw_allowed = torch.rand(B, N, Q, K, generator=g) < 0.6
    compressed_allowed = torch.rand(B, N, Q, C, generator=g) < 0.5
    return q, raw, raw_allowed, torch.randn(H, generator=g), compressed, compressed_allowed


def reference(q, raw, raw_allowed, sink, compressed, compressed_allowed, scale):
    keys = torch.cat([raw, compressed.unsqueeze(1).expand(-1, N, -1, -1)], 2).flatten(0, 1).double()
    allowed = torch.cat([raw_allowed, compressed_allowed], -1).flatten(0, 1)
    out = sink_attention(q.flatten(0, 1).transpose(1, 2).double(), keys, allowed, sink.double(), scale)
    return out.transpose(1, 2).unflatten(0, (B, N))  # [B, N, Q, H, D]


@pytest.fixture(params=[None, "onednn"])
def logits_path(request, monkeypatch):
    """How the logits run (None: fp32), whatever this CPU would choose."""
    monkeypatch.setattr(attention, "bf16_logits", lambda: request.param)
    return request.param


def test_banded_attention_equals_the_reference_over_band_and_compressed_rows(logits_path):
    exact_bf16 = logits_path is not None
    scale = D**-0.5
    setting = torch.backends.mkldnn.matmul.fp32_precision
    for seed in range(3):
        args = inputs(seed)
        want = reference(*args, scale)
        got = banded_sink_attention(*args, scale=scale, exact_bf16=exact_bf16)
        # fp32 sums in another order: far below a bf16 rounding of the weights (~4e-3 relative)
        assert ((got.double() - want).abs().max() / want.abs().max()).item() < 2e-6, seed
        alone = banded_sink_attention(*args[:4], scale=scale, exact_bf16=exact_bf16)
        want_alone = reference(*args[:4], args[4][:, :0], args[5][..., :0], scale)
        assert ((alone.double() - want_alone).abs().max() / want_alone.abs().max()).item() < 2e-6, seed
    assert torch.backends.mkldnn.matmul.fp32_precision == setting  # scoped to the logits


def test_the_bf16_setting_is_restored_when_the_attention_fails(monkeypatch):
    monkeypatch.setattr(attention, "bf16_logits", lambda: "onednn")
    setting = torch.backends.mkldnn.matmul.fp32_precision
    q, raw, raw_allowed, sink, *_ = inputs(0)
    with pytest.raises(RuntimeError):
        banded_sink_attention(q, raw[..., :-1], raw_allowed, sink, scale=1.0, exact_bf16=True)
    assert torch.backends.mkldnn.matmul.fp32_precision == setting


@pytest.mark.parametrize("compressed", [False, True])
def test_decode_attention_equals_the_reference_and_ignores_what_missing_rows_hold(compressed):
    """decode_sink_attention: each token over its whole ring, rows r <= its position (a young request's
    ring rows past it were never written: here NaN), plus the compressed rows that exist and that it
    attends to (padding rows: NaN too)."""
    g = torch.Generator().manual_seed(7)
    scale, window = D**-0.5, K
    q, sink = torch.randn(B, H, D, generator=g).bfloat16(), torch.randn(H, generator=g)
    ring = torch.randn(B, window, D, generator=g).bfloat16()
    at = torch.tensor([5, window + 3])  # one ring still filling, one full
    ring[0, 6:] = float("nan")
    rows = torch.randn(B, C, D, generator=g).bfloat16()
    exists = torch.arange(C) < torch.tensor([[4], [C]])
    rows[~exists] = float("nan")
    allowed = exists & (torch.rand(B, C, generator=g) < 0.7)
    got = decode_sink_attention(q, ring, at, sink, *((rows, exists, allowed) if compressed else ()), scale=scale)
    assert got.dtype == q.dtype and got.shape == q.shape and torch.isfinite(got).all()
    keys, key_allowed = ring, torch.arange(window) <= at.unsqueeze(-1)
    if compressed:
        keys, key_allowed = torch.cat([ring, rows], 1), torch.cat([key_allowed, allowed], 1)
    keys = torch.where(key_allowed.unsqueeze(-1), keys.double(), 0)  # (the reference's keys: no garbage)
    want = sink_attention(q.double().unsqueeze(2), keys, key_allowed.unsqueeze(1), sink.double(), scale)[:, :, 0]
    assert ((got.double() - want).abs().max() / want.abs().max()).item() < 1e-2  # one bf16 rounding
