"""The full-sequence DeepSeek-V4 forward: embedding -> mHC blocks -> hc head -> norm -> head.

No cache, no batching tricks: every call recomputes everything from the token ids, which is what
makes it the oracle the engine, the kernels and the transfers are checked against.
"""

from __future__ import annotations

import os

import torch

from dsv4.config import ModelConfig, expected_weights
from dsv4.kernels import rows as row_formats

from .attention import Attention
from .mhc import HyperConnection, hc_head, layer_hyper_connections
from .moe import MoE
from .ops import accumulation_dtype, linear, rms_norm
from .rope import layer_inv_freq

COMPUTE_DTYPES = (torch.float32, torch.float64, torch.bfloat16)
INDEX_KEY_DTYPES = (None, "fp32", "bf16", "fp8")
KV_CACHE_DTYPES = (None, "auto", "bf16", "fp8_e4m3")


class ReferenceModel:
    """The executable spec, built from an official-named, dequantised state dict.

    `model(input_ids [B, S] int64)` -> logits [B, S, vocab], float32 (float64 when dtype is float64).
    dtype is the compute dtype of embeddings, projections and experts; norms, RoPE, softmaxes, mHC
    and routing run in at least fp32.
    `index_key_dtype` ("bf16" | "fp8") and `kv_cache_dtype` ("fp8_e4m3" | "bf16") round every row an
    engine would cache through that cache's row format (dsv4.kernels.rows) before it is used:
    the indexer's compressed keys, and every main KV row (window rows and compressed rows, the
    current token's own row included). Queries are never rounded. None / "fp32" / "auto" keep rows
    in full precision.
    """

    def __init__(self, cfg: ModelConfig, state_dict: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32,
                 index_key_dtype: str | None = None, kv_cache_dtype: str | None = None):
        if dtype not in COMPUTE_DTYPES:
            raise ValueError(f"dtype must be one of {COMPUTE_DTYPES}, got {dtype}")
        if index_key_dtype not in INDEX_KEY_DTYPES:
            raise ValueError(f"index_key_dtype must be one of {INDEX_KEY_DTYPES}, got {index_key_dtype!r}")
        if kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {kv_cache_dtype!r}")
        check_state_dict(cfg, state_dict)
        self.cfg, self.dtype = cfg, dtype
        self.acc = accumulation_dtype(dtype)
        w = _WeightReader(state_dict, dtype, self.acc)
        round_kv = _main_row_rounding(kv_cache_dtype, cfg)
        round_index_keys = _index_row_rounding(index_key_dtype)

        self.embed, self.head, self.norm = w("embed.weight"), w("head.weight"), w("norm.weight")
        self.hc_head_weights = (w("hc_head_fn"), w("hc_head_base"), w("hc_head_scale"))
        self.blocks = [_Block(cfg, i, w, round_kv, round_index_keys) for i in range(cfg.num_layers)]

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.logits(input_ids)

    forward = __call__

    def logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The forward outside inference mode, so autograd can train the state dict's tensors
        (scripts/train_demo.py); the top-k picks of the indexer carry no gradient."""
        if input_ids.dim() != 2 or input_ids.dtype != torch.int64:
            raise ValueError(f"input_ids must be int64 [batch, seq], got {input_ids.dtype} {list(input_ids.shape)}")
        cfg = self.cfg
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed[input_ids]
        streams = x.unsqueeze(2).expand(-1, -1, cfg.hc_mult, -1)  # every stream starts as the embedding
        for block in self.blocks:
            streams = block(streams, input_ids, positions)
        x = hc_head(streams, *self.hc_head_weights, hc_eps=cfg.hc_eps, norm_eps=cfg.rms_norm_eps)
        return linear(rms_norm(x, self.norm, cfg.rms_norm_eps), self.head).to(self.acc)

    def greedy_generate(self, prompt_ids: list[int], max_new_tokens: int,
                        stop_token_ids: tuple[int, ...] = ()) -> tuple[list[int], list[float]]:
        """Greedy decoding by re-running the full forward for every new token.

        Returns (new tokens, margins): margins[i] is the gap between the best and second-best logit
        at step i, so a caller can tell a genuine tie (tiny margin) from a real disagreement.
        Stops early after emitting a token in `stop_token_ids`.
        """
        ids, tokens, margins = list(prompt_ids), [], []
        for _ in range(max_new_tokens):
            logits = self(torch.tensor([ids], dtype=torch.int64, device=self.embed.device))[0, -1]
            best = logits.topk(2)
            token = int(best.indices[0])
            tokens.append(token)
            margins.append(float(best.values[0] - best.values[1]))
            ids.append(token)
            if token in stop_token_ids:
                break
        return tokens, margins


class _Block:
    """One decoder layer: mHC around attention, then mHC around the MoE."""

    def __init__(self, cfg: ModelConfig, layer: int, w, round_kv, round_index_keys):
        self.eps = cfg.rms_norm_eps
        self.attn_hc, self.ffn_hc = layer_hyper_connections(cfg, w, layer)
        self.attn_norm, self.ffn_norm = w(f"layers.{layer}.attn_norm.weight"), w(f"layers.{layer}.ffn_norm.weight")
        self.attn = Attention(cfg, layer, w.under(f"layers.{layer}.attn."), layer_inv_freq(cfg, layer),
                              round_kv, round_index_keys)
        self.ffn = MoE(cfg, layer, w.under(f"layers.{layer}.ffn."))

    def __call__(self, streams: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x, post, comb = self.attn_hc.collapse(streams)
        streams = HyperConnection.expand(streams, self.attn(rms_norm(x, self.attn_norm, self.eps), positions),
                                         post, comb)
        x, post, comb = self.ffn_hc.collapse(streams)
        return HyperConnection.expand(streams, self.ffn(rms_norm(x, self.ffn_norm, self.eps), input_ids),
                                      post, comb)


# Tensors kept in at least fp32 whatever the compute dtype: they feed the fp32 math (mHC, norms,
# sinks, compressor scores, routing), and several ship in fp32 in the official checkpoint.
_FULL_PRECISION_SUFFIXES = ("_fn", "_base", "_scale", "norm.weight", "attn_sink", ".ape", "ffn.gate.weight", "ffn.gate.bias")


class _WeightReader:
    """Fetches tensors by official name, cast to the dtype their math runs in."""

    def __init__(self, state_dict: dict[str, torch.Tensor], dtype: torch.dtype, acc: torch.dtype, prefix: str = ""):
        self.state_dict, self.dtype, self.acc, self.prefix = state_dict, dtype, acc, prefix

    def __call__(self, name: str) -> torch.Tensor:
        name = self.prefix + name
        tensor = self.state_dict[name]
        if name.endswith("tid2eid"):
            return tensor.long()
        return tensor.to(self.acc if name.endswith(_FULL_PRECISION_SUFFIXES) else self.dtype)

    def under(self, prefix: str) -> _WeightReader:
        return _WeightReader(self.state_dict, self.dtype, self.acc, self.prefix + prefix)


def check_state_dict(cfg: ModelConfig, state_dict: dict[str, torch.Tensor]) -> None:
    """Raise ValueError naming the first tensor that is missing, unexpected or misshapen.

    `mtp.*` tensors are ignored (the reference has no MTP head)."""
    expected = expected_weights(cfg)
    for name, shape in expected.items():
        if name not in state_dict:
            raise ValueError(f"state dict lacks tensor {name!r}")
        if tuple(state_dict[name].shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {list(state_dict[name].shape)}, expected {list(shape)}")
    unexpected = sorted(n for n in state_dict if n not in expected and not n.startswith("mtp."))
    if unexpected:
        raise ValueError(f"unexpected tensor {unexpected[0]!r} ({len(unexpected)} unexpected in all)")
    for name in expected:
        if name.endswith("tid2eid"):
            table = state_dict[name]
            if table.min() < 0 or table.max() >= cfg.n_routed_experts:
                raise ValueError(f"tensor {name!r} holds expert ids outside 0..{cfg.n_routed_experts - 1}")


def _main_row_rounding(kv_cache_dtype: str | None, cfg: ModelConfig):
    if kv_cache_dtype in (None, "auto"):
        return _unchanged

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        packed = row_formats.pack_main_rows(flat, kv_cache_dtype, cfg.rope_head_dim)
        unpacked = row_formats.unpack_main_rows(packed, kv_cache_dtype, cfg.head_dim, cfg.rope_head_dim)
        return unpacked.view_as(x).to(x.dtype)

    return round_trip


def _index_row_rounding(index_key_dtype: str | None):
    if index_key_dtype in (None, "fp32"):
        return _unchanged

    def round_trip(x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        unpacked = row_formats.unpack_index_rows(row_formats.pack_index_rows(flat, index_key_dtype),
                                                 index_key_dtype, flat.shape[-1])
        return unpacked.view_as(x).to(x.dtype)

    return round_trip


def _unchanged(x: torch.Tensor) -> torch.Tensor:
    return x


def load_reference_model(path: str | os.PathLike, dtype: torch.dtype = torch.float32,
                         index_key_dtype: str | None = None, kv_cache_dtype: str | None = None) -> ReferenceModel:
    """Read a checkpoint directory (config.json + safetensors, official or HF names) into a ReferenceModel."""
    from dsv4.weights import load_state_dict  # imported here: the reference itself needs only a state dict

    cfg = ModelConfig.from_json(path)
    return ReferenceModel(cfg, load_state_dict(path, cfg, dtype=dtype), dtype=dtype,
                          index_key_dtype=index_key_dtype, kv_cache_dtype=kv_cache_dtype)
