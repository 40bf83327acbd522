"""What dsv4 is measured against in the same run: HF transformers' batched `generate` on the same
checkpoint and prompts, the machine's memory bandwidth, the weight bytes a decode step reads, and the
arithmetic of a token's weight products with this CPU's pace for them.
"""

from __future__ import annotations

import collections
import itertools
import json
import math
import re
import time
from pathlib import Path

import torch
from transformers import DeepseekV4ForCausalLM
from transformers.generation.streamers import BaseStreamer
from transformers.utils import logging as hf_logging

from bench.metrics import RequestResult
from dsv4.config import ModelConfig, expected_weights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_ROUTED_EXPERT = re.compile(r"\.experts\.(\d+)\.")
# The weights an fp32 server's decode steps read as bf16 copies when every one holds bf16 values, by
# kind: the attention's input and output projections (dsv4/model/compile.py `_bf16_twins`) and the
# experts' (the same, or the MoE's C kernel's copies: dsv4.model.moe._kernel_weights), and the head (the head's kernel's)
_BF16_COPIES = {
    "projections": re.compile(r"\.attn\.(wq_a|wq_b|wkv|wo_a|wo_b|compressor\.(wkv|wgate)|"
                              r"indexer\.(weights_proj|compressor\.(wkv|wgate)))\.weight$"),
    "experts": re.compile(r"\.(experts\.\d+|shared_experts)\.w[123]\.weight$"),
    "head": re.compile(r"^head\.weight$")}


class _StepClock(BaseStreamer):
    """`generate` hands the streamer the prompt first, then each step's new tokens (the whole
    batch's): the times of those calls are the batch's token arrivals."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


class HFBaseline:
    """`DeepseekV4ForCausalLM` loaded from a dsv4 checkpoint directory (HF reads its config and
    official tensor names), run greedily in batches of equal-length prompts: no padding."""

    def __init__(self, model_dir: Path, dtype: str, warmup: list[int]):
        hf_logging.disable_progress_bar()
        self.model = DeepseekV4ForCausalLM.from_pretrained(str(model_dir), dtype=DTYPES[dtype]).eval()
        self.threads = torch.get_num_threads()  # torch's default, as the server's: every core
        self.eos = json.loads((model_dir / "config.json").read_text()).get("eos_token_id", 1)
        self.generate([warmup], 2)  # first-call costs (allocator, lazy inits) stay out of the figures

    @torch.inference_mode()
    def generate(self, batch: list[list[int]], output_len: int) -> list[RequestResult]:
        """One `generate` over `batch`; each request's TTFT is the batch's prefill, its ITLs the steps."""
        ids = torch.tensor(batch)
        clock = _StepClock()
        start = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=output_len,
                                  min_new_tokens=output_len, do_sample=False, streamer=clock, pad_token_id=self.eos)
        new = out.shape[1] - ids.shape[1]
        tokens = clock.times[1:]  # [0] is the prompt
        if new != output_len or len(tokens) != new:
            return [RequestResult(ok=False, prompt_tokens=len(p), error=f"HF generated {new} tokens") for p in batch]
        itls = [b - a for a, b in itertools.pairwise(tokens)]
        return [RequestResult(ok=True, prompt_tokens=len(p), output_tokens=new, ttft=tokens[0] - start,
                              e2e=tokens[-1] - start, itls=list(itls)) for p in batch]

    def run(self, prompts: list[list[int]], batch_size: int, output_len: int) -> tuple[list[RequestResult], float]:
        """The prompts in batches of `batch_size`, one after another (HF serves one batch at a time)."""
        results, start = [], time.perf_counter()
        for i in range(0, len(prompts), batch_size):
            results += self.generate(prompts[i:i + batch_size], output_len)
        return results, time.perf_counter() - start


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> dict[str, float]:
    """GB/s of a sum over `gib` GiB of float32 (reads only, as a decode step's weight reads are) and
    of a copy of it (a read and a write per byte), best of `repeats`: the least disturbed run."""
    src = torch.ones(int(gib * 2**30) // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    nbytes = src.numel() * 4

    def best(fn) -> float:
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    read = nbytes / best(src.sum) / 1e9
    copy = 2 * nbytes / best(lambda: dst.copy_(src)) / 1e9
    return {"read_gbps": read, "copy_gbps": copy, "bytes": nbytes}


def decode_weight_bytes(model_dir: Path, dtype: str, context: int, bf16_copies: tuple[str, ...] = ()) -> int:
    """Parameter bytes one decode step of one token reads at contexts of up to `context` tokens, in the
    model's dtype (those of the kinds in `bf16_copies`, which an fp32 server reads as bf16 copies, at 2
    bytes each).

    Every tensor is read whole except: the embedding (one row, the token's), the hash layers'
    token-to-expert table (one row), the compressors' absolute position embeddings `ape` (one row,
    the position's phase in the ratio), and the routed experts (only the `num_experts_per_tok`
    chosen ones: top-k by the gate, or by the table in hash layers). The shared experts, the gate,
    the attention, indexer and compressor projections, norms, hyper-connections and the LM head are
    read whole. So, with E = num_experts_per_tok and w(t) = numel(t) * itemsize:
        bytes = sum of w(t) over dense tensors + d * itemsize (embedding row)
              + sum over layers of E * w(one routed expert's w1, w2, w3)
    except the indexer's query projection `indexer.wq_b` where no query sees more compressed rows
    than the indexer keeps (contexts of at most index_topk * ratio + ratio - 1 tokens): dsv4 then
    skips the indexer (dsv4.model.attention.PagedAttention._selection_needed), and the floor is what
    it reads. (Where the indexer runs, an fp32 server whose projection kernels read bf16 copies reads
    `indexer.wq_b` from its copy too, which this counts in fp32: no suite context is that long.) The KV cache the step reads (window, compressed rows, index keys) is state, not weights,
    and is left out: at a 256-token context it is small next to the weights.
    """
    total = 0
    for name, shape in _weights_read(model_dir, context):
        copied = any(_BF16_COPIES[kind].search(name) for kind in bf16_copies)
        itemsize = 2 if copied else DTYPES[dtype].itemsize
        if name.endswith("tid2eid"):
            total += shape[-1] * 8  # one int64 row
        elif name == "embed.weight" or name.endswith(".ape"):
            total += shape[-1] * itemsize  # one row
        else:
            total += math.prod(shape) * itemsize
    return total


def _weights_read(model_dir: Path, context: int):
    """(name, shape) of each weight one token's forward reads at contexts of up to `context` tokens, as
    `decode_weight_bytes` says (the routed experts: the first `num_experts_per_tok` stand for the chosen)."""
    cfg = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    for name, shape in expected_weights(cfg).items():
        routed = _ROUTED_EXPERT.search(name)
        if routed and int(routed.group(1)) >= cfg.num_experts_per_tok:
            continue  # a routed expert the token does not choose (any E of them weigh the same)
        layer = re.match(r"layers\.(\d+)\.attn\.indexer\.wq_b\.", name)
        if layer and context <= cfg.index_topk * (ratio := cfg.compress_ratios[int(layer.group(1))]) + ratio - 1:
            continue  # the indexer does not run at this context
        yield name, shape


def _products(model_dir: Path, context: int) -> tuple[collections.Counter, tuple[int, int]]:
    """The weight shapes one token's products multiply by, with how many of each, through the layers (every
    matrix `_weights_read` names but the embedding, a row looked up, and the compressors' `ape`, added),
    and the LM head's (a sampled token's)."""
    layers: collections.Counter = collections.Counter()
    head = (0, 0)
    for name, shape in _weights_read(model_dir, context):
        if len(shape) != 2 or name == "embed.weight" or name.endswith((".ape", "tid2eid")):
            continue
        if name == "head.weight":
            head = tuple(shape)
        else:
            layers[tuple(shape)] += 1
    return layers, head


def product_flops(model_dir: Path, context: int) -> tuple[int, int]:
    """FLOPs of the weight products (2 per weight element multiplied) of one token through the layers, and
    of the LM head's for one sampled token, at contexts of up to `context` tokens. A lower bound on a
    forward's arithmetic: the attention's own products are left out."""
    layers, head = _products(model_dir, context)
    return sum(2 * math.prod(shape) * n for shape, n in layers.items()), 2 * math.prod(head)


def product_seconds(model_dir: Path, rows: int, context: int, repeats: int = 5) -> tuple[float, float]:
    """Seconds a token's weight products take through the layers, and the head's for a sampled token, at
    this CPU's pace for them: each shape's product with `rows` rows, in fp32 as dsv4 multiplies
    (`dsv4.model.ops.linear`: oneDNN's where torch has it) on every thread, best of `repeats`, over `rows`."""
    from dsv4.model.ops import linear

    def seconds(shape: tuple[int, int]) -> float:
        x, weight = torch.randn(rows, shape[1]), torch.randn(*shape)
        linear(x, weight)  # (its first call sets up)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            linear(x, weight)
            times.append(time.perf_counter() - started)
        return min(times) / rows

    layers, head = _products(model_dir, context)
    return sum(seconds(shape) * n for shape, n in layers.items()), seconds(head)
