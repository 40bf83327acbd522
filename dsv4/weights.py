"""Checkpoint reading and writing: official and HF names, FP8/FP4 dequantisation, validation.

On-disk formats (DeepSeek-V4-Flash as shipped, confirmed against DeepSeek's inference
`model.py`/`convert.py` and the SGLang/vLLM loaders):
- FP8 e4m3 with one power-of-two (e8m0) scale per 128x128 block, `<name>.scale` of shape
  ceil(out/128) x ceil(in/128): attention wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b and
  the shared experts (and the MTP block's e_proj/h_proj).
- FP4 e2m1 for routed experts, two values per int8 byte (low nibble = even element), with an
  e8m0 scale per 1x32 block, `<name>.scale` of shape out x in/32.
- bf16: embed, head, norms, router weight, compressor wkv/wgate, indexer weights_proj.
- fp32: hc_*, attn_sink, ape, gate.bias. tid2eid: integers (int64 on disk; int32 accepted).
Scales may be float8_e8m0fnu, raw uint8 exponent bytes, or plain floats.

`load_state_dict` reads headers first and validates every tensor against `expected_weights(cfg)`
before reading any data, so a mismatched checkpoint fails in seconds with a `WeightError` that
names the tensor and what was expected. Tensors that belong to no part of the configured model
are an error too (a checkpoint with more layers or experts than config.json says is a config
mistake, not something to ignore); only `mtp.*` (the optional next-token-prediction block) is
skipped without being read.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dsv4.config import ModelConfig, expected_weights

log = logging.getLogger(__name__)

FP8_BLOCK = 128
FP4_BLOCK = 32
E4M3_MAX = 448.0
FP4_MAX = 6.0
# e2m1 code -> value; bit 3 is the sign.
FP4_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0]
)
# Magnitudes halfway between neighbouring e2m1 values: rounding to the nearest code.
_FP4_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
E8M0 = torch.float8_e8m0fnu
E8M0_BIAS = 127
E8M0_NAN = 255

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROGRESS_LOG_BYTES = 1 << 30
MAX_PROBLEMS_SHOWN = 20
DEFAULT_MAX_SHARD_BYTES = 4 << 30


class WeightError(ValueError):
    """A checkpoint that does not hold the tensors its config.json describes."""


# -- FP8 / FP4 / e8m0 ------------------------------------------------------------------------------


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """Block scales as stored (e8m0, uint8 exponent bytes, or floats) -> float32."""
    if scale.dtype in (E8M0, torch.uint8):
        exponent = scale.view(torch.uint8).to(torch.int32)
        values = torch.ldexp(torch.ones(exponent.shape), exponent - E8M0_BIAS)
        return values.masked_fill(exponent == E8M0_NAN, math.nan)
    if scale.is_floating_point():
        return scale.float()
    raise WeightError(f"scale of dtype {scale.dtype} is not e8m0, uint8 or floating point")


def _pow2_exponent(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest e with amax <= qmax * 2**e, clamped to e8m0's range (an all-zero block gets the minimum)."""
    tiny = qmax * 2.0**-E8M0_BIAS
    exponent = torch.ceil(torch.log2(amax.clamp(min=tiny) / qmax)).clamp(-E8M0_BIAS, E8M0_BIAS)
    # log2 of a quotient can land one below the true boundary; one correction step makes it exact.
    exponent = exponent + (amax > qmax * torch.exp2(exponent)).float()
    return exponent.clamp(-E8M0_BIAS, E8M0_BIAS)


def _exponent_to_e8m0(exponent: torch.Tensor) -> torch.Tensor:
    return (exponent.to(torch.int32) + E8M0_BIAS).to(torch.uint8).view(E8M0)


def quantize_fp8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (float8_e4m3fn [out, in], e8m0 scales [ceil(out/128), ceil(in/128)])."""
    out_dim, in_dim = weight.shape
    padded = F.pad(weight.float(), (0, -in_dim % FP8_BLOCK, 0, -out_dim % FP8_BLOCK))
    bo, bi = padded.shape[0] // FP8_BLOCK, padded.shape[1] // FP8_BLOCK
    blocks = padded.view(bo, FP8_BLOCK, bi, FP8_BLOCK)
    exponent = _pow2_exponent(blocks.abs().amax(dim=(1, 3)), E4M3_MAX)
    scaled = blocks / torch.exp2(exponent)[:, None, :, None]
    quantized = scaled.reshape(padded.shape)[:out_dim, :in_dim].to(torch.float8_e4m3fn)
    return quantized, _exponent_to_e8m0(exponent)


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn [out, in] with 128x128 block scales -> float32 [out, in]."""
    out_dim, in_dim = weight.shape
    factors = scale_to_float(scale).repeat_interleave(FP8_BLOCK, 0)[:out_dim]
    factors = factors.repeat_interleave(FP8_BLOCK, 1)[:, :in_dim]
    return weight.float() * factors


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] -> (int8 [out, ceil(in/2)] two e2m1 codes per byte, e8m0 scales [out, ceil(in/32)])."""
    out_dim, in_dim = weight.shape
    blocks = F.pad(weight.float(), (0, -in_dim % FP4_BLOCK)).view(out_dim, -1, FP4_BLOCK)
    exponent = _pow2_exponent(blocks.abs().amax(dim=-1), FP4_MAX)
    scaled = (blocks * torch.exp2(-exponent)[..., None]).flatten(1)[:, :in_dim]  # exact: a power of two
    codes = torch.bucketize(scaled.abs(), _FP4_MIDPOINTS, out_int32=True).to(torch.uint8)
    codes |= (scaled < 0).to(torch.uint8) << 3
    return pack_fp4(codes), _exponent_to_e8m0(exponent)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes [out, in] -> int8 [out, ceil(in/2)], the even element in the low nibble."""
    codes = F.pad(codes, (0, codes.shape[-1] % 2))
    return (codes[..., 0::2] | (codes[..., 1::2] << 4)).view(torch.int8)


def unpack_fp4(packed: torch.Tensor, in_dim: int) -> torch.Tensor:
    """int8/uint8/float4_e2m1fn_x2 [out, ceil(in/2)] -> float32 e2m1 values [out, in]."""
    raw = packed.view(torch.uint8)
    codes = torch.stack((raw & 0xF, raw >> 4), dim=-1).flatten(-2)[..., :in_dim]
    return FP4_VALUES[codes.long()]


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, in_dim: int) -> torch.Tensor:
    """Packed e2m1 with 1x32 block scales -> float32 [out, in]."""
    factors = scale_to_float(scale).repeat_interleave(FP4_BLOCK, 1)[:, :in_dim]
    return unpack_fp4(packed, in_dim) * factors


# -- names: official <-> HF transformers -----------------------------------------------------------

# HF module names (transformers' deepseek_v4 conversion mapping, inverted), per decoder layer.
_HF_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "attn_hc.fn": "hc_attn_fn",
    "attn_hc.base": "hc_attn_base",
    "attn_hc.scale": "hc_attn_scale",
    "ffn_hc.fn": "hc_ffn_fn",
    "ffn_hc.base": "hc_ffn_base",
    "ffn_hc.scale": "hc_ffn_scale",
    "self_attn.sinks": "attn.attn_sink",
    "self_attn.q_a_proj.weight": "attn.wq_a.weight",
    "self_attn.q_a_norm.weight": "attn.q_norm.weight",
    "self_attn.q_b_proj.weight": "attn.wq_b.weight",
    "self_attn.kv_proj.weight": "attn.wkv.weight",
    "self_attn.kv_norm.weight": "attn.kv_norm.weight",
    "self_attn.o_a_proj.weight": "attn.wo_a.weight",
    "self_attn.o_b_proj.weight": "attn.wo_b.weight",
    "self_attn.compressor.position_bias": "attn.compressor.ape",
    "self_attn.compressor.kv_proj.weight": "attn.compressor.wkv.weight",
    "self_attn.compressor.gate_proj.weight": "attn.compressor.wgate.weight",
    "self_attn.compressor.kv_norm.weight": "attn.compressor.norm.weight",
    "self_attn.compressor.indexer.position_bias": "attn.indexer.compressor.ape",
    "self_attn.compressor.indexer.kv_proj.weight": "attn.indexer.compressor.wkv.weight",
    "self_attn.compressor.indexer.gate_proj.weight": "attn.indexer.compressor.wgate.weight",
    "self_attn.compressor.indexer.kv_norm.weight": "attn.indexer.compressor.norm.weight",
    "self_attn.compressor.indexer.q_b_proj.weight": "attn.indexer.wq_b.weight",
    "self_attn.compressor.indexer.scorer.weights_proj.weight": "attn.indexer.weights_proj.weight",
    "mlp.gate.weight": "ffn.gate.weight",
    "mlp.gate.e_score_correction_bias": "ffn.gate.bias",
    "mlp.gate.tid2eid": "ffn.gate.tid2eid",
    "mlp.shared_experts.gate_proj.weight": "ffn.shared_experts.w1.weight",
    "mlp.shared_experts.up_proj.weight": "ffn.shared_experts.w3.weight",
    "mlp.shared_experts.down_proj.weight": "ffn.shared_experts.w2.weight",
}
_HF_TOP_NAMES = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}
_HF_EXPERT_PROJ = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2"}
_LAYER_NAME = re.compile(r"layers\.(\d+)\.(.+)")
_HF_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
# HF keeps routed experts merged: gate_up_proj [E, 2*inter, hidden] (w1 rows, then w3), down_proj [E, hidden, inter].
_MERGED_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
_SCALE_SUFFIXES = (".weight_scale_inv", ".scale")


def official_name(name: str) -> str:
    """One tensor's official name, given its official or HF name (merged HF experts excepted)."""
    name = name.removeprefix("model.")
    renamed = _rename_hf(name)
    if renamed is not None:
        return renamed
    for suffix in _SCALE_SUFFIXES:
        if name.endswith(suffix):
            weight = name.removesuffix(suffix) + ".weight"
            return (_rename_hf(weight) or weight).removesuffix(".weight") + ".scale"
    return name


def _rename_hf(name: str) -> str | None:
    """The official name of an HF module name; None when `name` is not one."""
    if name in _HF_TOP_NAMES:
        return _HF_TOP_NAMES[name]
    match = _LAYER_NAME.fullmatch(name)
    if match is None:
        return None
    layer, rest = match.groups()
    if rest in _HF_LAYER_NAMES:
        return f"layers.{layer}.{_HF_LAYER_NAMES[rest]}"
    expert = _HF_EXPERT.fullmatch(rest)
    if expert:
        return f"layers.{layer}.ffn.experts.{expert[1]}.{_HF_EXPERT_PROJ[expert[2]]}.weight"
    return None


def split_merged_experts(name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    """HF's merged `mlp.experts.gate_up_proj` / `down_proj` -> per-expert official w1/w3 or w2."""
    layer, kind = _MERGED_EXPERTS.fullmatch(name.removeprefix("model.")).groups()
    prefix = f"layers.{layer}.ffn.experts."
    if kind == "down_proj":
        return {f"{prefix}{e}.w2.weight": tensor[e] for e in range(tensor.shape[0])}
    w1, w3 = tensor.chunk(2, dim=1)
    parts = {}
    for e in range(tensor.shape[0]):
        parts[f"{prefix}{e}.w1.weight"] = w1[e]
        parts[f"{prefix}{e}.w3.weight"] = w3[e]
    return parts


def _is_merged_experts(name: str) -> bool:
    return _MERGED_EXPERTS.fullmatch(name.removeprefix("model.")) is not None


def hf_to_official(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an HF transformers DeepseekV4 state dict to official names, splitting merged experts."""
    out = {}
    for name, tensor in state_dict.items():
        if _is_merged_experts(name):
            out.update(split_merged_experts(name, tensor))
        else:
            out[official_name(name)] = tensor
    return out


# -- storage formats -------------------------------------------------------------------------------

_FP8_STORED = re.compile(
    r"(layers|mtp)\.\d+\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)|ffn\.shared_experts\.w[123]|e_proj|h_proj)\.weight"
)
_FP4_STORED = re.compile(r"(layers|mtp)\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_FP32_STORED = re.compile(r"(.*\.)?(hc_\w+|attn_sink|ape|gate\.bias)")


def official_storage(name: str, fmt: str) -> str:
    """How DeepSeek's own checkpoint stores a tensor: 'fp8', 'fp4', 'bf16', 'fp32' or 'int64'.

    fmt='bf16' is the same layout with every FP8/FP4 tensor in bf16 instead.
    """
    if fmt not in ("bf16", "fp8"):
        raise ValueError(f"unknown checkpoint format {fmt!r}; expected 'bf16' or 'fp8'")
    if name.endswith(".tid2eid"):
        return "int64"
    if _FP32_STORED.fullmatch(name):
        return "fp32"
    if fmt == "fp8" and _FP4_STORED.fullmatch(name):
        return "fp4"
    if fmt == "fp8" and _FP8_STORED.fullmatch(name):
        return "fp8"
    return "bf16"


def encode_tensor(name: str, tensor: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """One official tensor -> the tensors that store it (the weight, plus `.scale` when quantised)."""
    storage = official_storage(name, fmt)
    scale_name = name.removesuffix(".weight") + ".scale"
    if storage == "fp8":
        weight, scale = quantize_fp8(tensor)
        return {name: weight, scale_name: scale}
    if storage == "fp4":
        weight, scale = quantize_fp4(tensor)
        return {name: weight, scale_name: scale}
    dtype = {"bf16": torch.bfloat16, "fp32": torch.float32, "int64": torch.int64}[storage]
    # A copy, so that views of one tensor (HF's merged experts) never share storage in the file.
    return {name: tensor.to(dtype=dtype, copy=True).contiguous()}


def storage_roundtrip(state_dict: dict[str, torch.Tensor], fmt: str) -> dict[str, torch.Tensor]:
    """What a checkpoint written with `save_checkpoint(fmt=...)` decodes to, computed in memory (fp32)."""
    out = {}
    for name, tensor in state_dict.items():
        stored = encode_tensor(name, tensor, fmt)
        scale = stored.get(name.removesuffix(".weight") + ".scale")
        out[name] = _decode(stored[name], scale, tensor.shape[-1], torch.float32)
    return out


def _decode(stored: torch.Tensor, scale: torch.Tensor | None, in_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A validated stored tensor -> its logical value (integers stay integers, as int64)."""
    if scale is not None and stored.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(stored, scale).to(dtype)
    if scale is not None:
        return dequantize_fp4(stored, scale, in_dim).to(dtype)
    if stored.is_floating_point():
        return stored.to(dtype)
    return stored.to(torch.int64)


# -- reading a checkpoint --------------------------------------------------------------------------

_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_INT_DTYPES = {"I64", "I32", "I16", "U32", "U16"}
_FP8_DTYPES = {"F8_E4M3"}
# int8/uint8 hold two e2m1 codes per byte; safetensors' F4 counts elements, so its shape is the logical one.
_FP4_DTYPES = {"I8", "U8", "F4"}
_SCALE_DTYPES = {"F8_E8M0", "U8", "F32", "BF16", "F16"}
_ITEM_BITS = {"F64": 64, "F32": 32, "F16": 16, "BF16": 16, "I64": 64, "I32": 32, "I16": 16, "U32": 32,
              "U16": 16, "I8": 8, "U8": 8, "F8_E4M3": 8, "F8_E5M2": 8, "F8_E8M0": 8, "F4": 4, "BOOL": 8}


@dataclass(frozen=True)
class _Stored:
    """One tensor as it lies in a file (from the header alone)."""

    name: str
    file: Path
    dtype: str  # safetensors dtype string: BF16, F8_E4M3, I8, ...
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEM_BITS.get(self.dtype, 8) // 8

    def describe(self, official: str) -> str:
        renamed = "" if self.name == official else f" (stored as {self.name!r})"
        return f"{official!r}{renamed}"


@dataclass
class _Entry:
    """How to produce one official tensor: from a stored weight (maybe one slice of a merged one) and its scale."""

    official: str
    shape: tuple[int, ...]
    weight: _Stored
    scale: _Stored | None = None
    merged_part: tuple[int, int, int] | None = None  # (expert, row start, row end) within a merged HF tensor


def load_state_dict(
    path: str | Path,
    cfg: ModelConfig,
    dtype: torch.dtype = torch.float32,
    progress: Callable[[int, int], None] | None = None,
    select: Callable[[str], tuple[slice, ...] | None] | None = None,
) -> dict[str, torch.Tensor]:
    """Official name -> tensor in `dtype` (tid2eid: int64) for every tensor of `expected_weights(cfg)`.

    `path` is a checkpoint directory (or one .safetensors file). Everything is validated from the
    headers before any data is read; each shard is opened once and read tensor by tensor.
    `progress(done_bytes, total_bytes)` is called after each shard; without it, checkpoints over
    1 GiB log one line per shard. `select(name)` (a tensor-parallel rank's share,
    `dsv4.model.sharding.ShardPlan.select`) says which part of each tensor to keep: () all of it,
    an index to slice it by once decoded, None none (the tensor is not read at all).
    """
    files = _checkpoint_files(Path(path))
    stored = _read_headers(files)
    entries = _plan(stored, cfg, Path(path))
    parts = {entry.official: select(entry.official) if select else () for entry in entries}
    entries = [entry for entry in entries if parts[entry.official] is not None]
    return _read_entries(entries, files, cfg, dtype, progress, parts)


def _checkpoint_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise WeightError(f"{path}: no such checkpoint directory")
    index = path / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise WeightError(f"{index}: not a safetensors index ({e!r})") from None
        files = sorted({path / name for name in weight_map.values()})
        for file in files:
            if not file.exists():
                raise WeightError(f"{index} names {file.name}, which does not exist")
        return files
    if (path / SINGLE_FILE).exists():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise WeightError(f"{path}: no {SINGLE_FILE}, {INDEX_FILE} or *.safetensors files")
    return files


def _read_headers(files: list[Path]) -> dict[str, _Stored]:
    stored: dict[str, _Stored] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 -- safe_open is not iterable
                    part = f.get_slice(name)
                    if name in stored:
                        raise WeightError(f"tensor {name!r} is stored twice: in {stored[name].file.name} and {file.name}")
                    stored[name] = _Stored(name, file, part.get_dtype(), tuple(part.get_shape()))
        except SafetensorError as e:
            raise WeightError(f"{file}: not a readable safetensors file ({e})") from None
    return stored


def _plan(stored: dict[str, _Stored], cfg: ModelConfig, where: Path) -> list[_Entry]:
    """Match stored tensors to expected ones; raise one WeightError listing every mismatch."""
    expected = expected_weights(cfg)
    problems: list[str] = []
    weights: dict[str, _Stored] = {}
    scales: dict[str, _Stored] = {}
    entries: dict[str, _Entry] = {}
    owner: dict[str, _Stored] = {}  # official name -> where it came from, to catch double definitions

    def claim(official: str, source: _Stored) -> bool:
        if official in owner:
            problems.append(f"{source.describe(official)} is defined twice (also by {owner[official].name!r})")
            return False
        owner[official] = source
        return True

    for s in stored.values():
        if s.name.removeprefix("model.").startswith("mtp."):
            continue
        if _is_merged_experts(s.name):
            for entry in _merged_entries(s, cfg, problems):
                if claim(entry.official, s):
                    entries[entry.official] = entry
            continue
        official = official_name(s.name)
        weight_name = official.removesuffix(".scale") + ".weight"
        if official.endswith(".scale") and weight_name in expected:
            if claim(official, s):
                scales[weight_name] = s
        elif official in expected:
            if claim(official, s):
                weights[official] = s
        else:
            problems.append(f"unexpected tensor {s.describe(official)}: not part of {_describe_model(cfg)}")

    for name, shape in expected.items():
        scale = scales.get(name)
        if name in weights:
            entry = _Entry(name, shape, weights[name], scale)
            problems.extend(_check_stored(entry))
            entries[name] = entry
        elif name not in entries:
            problems.append(f"missing tensor {name!r} (expected shape {shape})")
        elif scale is not None:
            problems.append(f"{scale.name!r}: a scale for {name!r}, which comes from an unquantised merged HF tensor")
    if problems:
        shown = "\n  ".join(problems[:MAX_PROBLEMS_SHOWN])
        more = len(problems) - MAX_PROBLEMS_SHOWN
        more = f"\n  ... and {more} more" if more > 0 else ""
        raise WeightError(f"{where} does not match its config ({len(problems)} problems):\n  {shown}{more}")
    return [entries[name] for name in expected]


def _describe_model(cfg: ModelConfig) -> str:
    return (
        f"the configured model ({cfg.num_layers} layers, {cfg.n_routed_experts} routed experts, "
        f"compress_ratios {list(cfg.compress_ratios)}, {cfg.num_hash_layers} hash layers)"
    )


def _merged_entries(s: _Stored, cfg: ModelConfig, problems: list[str]) -> list[_Entry]:
    layer, kind = _MERGED_EXPERTS.fullmatch(s.name.removeprefix("model.")).groups()
    layer = int(layer)
    d, inter, n_exp = cfg.hidden_size, cfg.moe_intermediate_size, cfg.n_routed_experts
    want = (n_exp, 2 * inter, d) if kind == "gate_up_proj" else (n_exp, d, inter)
    if layer >= cfg.num_layers:
        problems.append(f"unexpected tensor {s.name!r}: not part of {_describe_model(cfg)}")
        return []
    if s.dtype not in _FLOAT_DTYPES:
        problems.append(f"{s.name!r}: stored as {s.dtype}, expected a floating-point dtype (merged experts are not quantised)")
        return []
    if s.shape != want:
        problems.append(f"{s.name!r}: stored shape {s.shape}, expected {want}")
        return []
    prefix = f"layers.{layer}.ffn.experts."
    if kind == "down_proj":
        return [_Entry(f"{prefix}{e}.w2.weight", (d, inter), s, merged_part=(e, 0, d)) for e in range(n_exp)]
    entries = []
    for e in range(n_exp):
        entries.append(_Entry(f"{prefix}{e}.w1.weight", (inter, d), s, merged_part=(e, 0, inter)))
        entries.append(_Entry(f"{prefix}{e}.w3.weight", (inter, d), s, merged_part=(e, inter, 2 * inter)))
    return entries


def _check_stored(entry: _Entry) -> list[str]:
    """Dtype and shape of one stored tensor (and its scale) against the logical shape it must decode to."""
    w, shape, name = entry.weight, entry.shape, entry.weight.describe(entry.official)
    if entry.official.endswith(".tid2eid"):
        if w.dtype not in _INT_DTYPES:
            return [f"{name}: stored as {w.dtype}, expected an integer dtype (I64 or I32)"]
        return [] if w.shape == shape else [f"{name}: stored shape {w.shape}, expected {shape}"]
    quantised = w.dtype in _FP8_DTYPES or w.dtype in _FP4_DTYPES
    if w.dtype not in _FLOAT_DTYPES and not quantised:
        return [f"{name}: stored as {w.dtype}, expected a floating-point dtype (BF16/F32)"]
    if quantised and (len(shape) != 2 or not entry.official.endswith(".weight")):
        return [f"{name}: stored as {w.dtype}, expected a floating-point dtype (BF16/F32); only 2-D linear weights may be FP8/FP4"]
    if not quantised:
        if entry.scale is not None:
            return [f"{name}: stored as {w.dtype} but has a scale tensor {entry.scale.name!r}; only FP8/FP4 weights have scales"]
        return [] if w.shape == shape else [f"{name}: stored shape {w.shape}, expected {shape}"]
    return _check_quantised(entry, name)


def _check_quantised(entry: _Entry, name: str) -> list[str]:
    w, logical = entry.weight, entry.shape
    out_dim, in_dim = logical
    scale_name = entry.official.removesuffix(".weight") + ".scale"
    if w.dtype in _FP8_DTYPES:
        label, block = "FP8", f"{FP8_BLOCK}x{FP8_BLOCK}"
        want_stored, decoded = logical, w.shape
        want_scale = (math.ceil(out_dim / FP8_BLOCK), math.ceil(in_dim / FP8_BLOCK))
    else:
        label, block = f"FP4 ({w.dtype})", f"1x{FP4_BLOCK}"
        want_scale = (out_dim, math.ceil(in_dim / FP4_BLOCK))
        if w.dtype == "F4":  # safetensors counts F4 elements: its shape is the logical one
            want_stored, decoded = logical, w.shape
        else:  # two e2m1 values per byte
            want_stored = (out_dim, math.ceil(in_dim / 2))
            decoded = (w.shape[0], 2 * w.shape[1]) if len(w.shape) == 2 else w.shape
    if w.shape != want_stored:
        problem = f"{name}: {label} weight stored as {w.shape} decodes to {decoded}, expected {logical}"
        return [f"{problem} (stored as {want_stored})"]
    s = entry.scale
    if s is None:
        return [f"{name}: {label} weight without its scale tensor {scale_name!r}"]
    if s.dtype not in _SCALE_DTYPES:
        return [f"{s.describe(scale_name)}: stored as {s.dtype}, expected an e8m0 scale (F8_E8M0, U8 or F32)"]
    if s.shape != want_scale:
        return [f"{s.describe(scale_name)}: shape {s.shape}, expected {want_scale} (one scale per {block} block)"]
    return []


def _read_entries(
    entries: list[_Entry],
    files: list[Path],
    cfg: ModelConfig,
    dtype: torch.dtype,
    progress: Callable[[int, int], None] | None,
    keep: dict[str, tuple[slice, ...]],
) -> dict[str, torch.Tensor]:
    """Read each shard once, in order; decode an entry as soon as every part of it has been read, and
    keep `keep[name]` of it."""
    file_order = {file: i for i, file in enumerate(files)}
    needed: dict[Path, dict[str, _Stored]] = defaultdict(dict)
    ready_after: dict[int, list[_Entry]] = defaultdict(list)
    users: dict[str, int] = defaultdict(int)
    for entry in entries:
        parts = [entry.weight] + ([entry.scale] if entry.scale else [])
        for part in parts:
            needed[part.file][part.name] = part
            users[part.name] += 1
        ready_after[max(file_order[p.file] for p in parts)].append(entry)
    total = sum(s.nbytes for by_name in needed.values() for s in by_name.values())
    done = 0
    raw: dict[str, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for i, file in enumerate(files):
        start, shard_bytes = time.monotonic(), 0
        try:
            with safe_open(file, framework="pt") as f:
                for name, s in needed[file].items():
                    raw[name] = f.get_tensor(name)
                    shard_bytes += s.nbytes
        except SafetensorError as e:
            raise WeightError(f"{file}: could not read tensor data ({e})") from None
        for entry in ready_after[i]:
            tensor = _materialise(entry, raw, cfg, dtype)
            part = keep[entry.official]
            out[entry.official] = tensor[part].clone() if part else tensor  # a copy: the rest is freed
            for part in (entry.weight, entry.scale):
                if part is not None:
                    users[part.name] -= 1
                    if users[part.name] == 0:
                        del raw[part.name]
        done += shard_bytes
        _report(progress, done, total, i, files, shard_bytes, time.monotonic() - start)
    return {entry.official: out[entry.official] for entry in entries}


def _materialise(entry: _Entry, raw: dict[str, torch.Tensor], cfg: ModelConfig, dtype: torch.dtype) -> torch.Tensor:
    stored = raw[entry.weight.name]
    if entry.merged_part is not None:
        expert, lo, hi = entry.merged_part
        stored = stored[expert, lo:hi]
    scale = raw[entry.scale.name] if entry.scale is not None else None
    tensor = _decode(stored, scale, entry.shape[-1], dtype).contiguous()
    where = entry.weight.describe(entry.official)
    if entry.official.endswith(".tid2eid"):
        bad = (tensor < 0) | (tensor >= cfg.n_routed_experts)
        if bad.any():
            token, slot = bad.nonzero()[0].tolist()
            raise WeightError(
                f"{where}: expert id {tensor[token, slot].item()} for token {token} is outside "
                f"0..{cfg.n_routed_experts - 1} (n_routed_experts={cfg.n_routed_experts})"
            )
    elif tensor.numel() and not all(torch.isfinite(x) for x in torch.aminmax(tensor)):  # NaN propagates into min/max
        scale_note = " (check its scale: e8m0 byte 255 is NaN)" if scale is not None else ""
        raise WeightError(f"{where}: holds NaN or infinite values after decoding{scale_note}")
    return tensor


def _report(progress, done: int, total: int, index: int, files: list[Path], shard_bytes: int, seconds: float) -> None:
    if progress is not None:
        progress(done, total)
    elif total > PROGRESS_LOG_BYTES:
        rate = shard_bytes / max(seconds, 1e-9) / 1e9
        log.info(
            "loaded shard %d/%d %s: %.2f GB in %.1f s (%.2f GB/s); %.0f%% of %.1f GB",
            index + 1, len(files), files[index].name, shard_bytes / 1e9, seconds, rate, 100 * done / total, total / 1e9,
        )


# -- writing a checkpoint --------------------------------------------------------------------------


def save_checkpoint(
    out_dir: str | Path,
    cfg: ModelConfig,
    state_dict: dict[str, torch.Tensor],
    fmt: str = "bf16",
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
) -> list[Path]:
    """Write config.json and safetensors in official names and storage formats; returns the shard paths.

    fmt='fp8' stores what DeepSeek stores in FP8/FP4 that way (see `official_storage`); fmt='bf16'
    stores those in bf16. A weight and its scale always share a shard. Over `max_shard_bytes` the
    tensors are split into model-0000i-of-0000N.safetensors with model.safetensors.index.json.
    """
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    config = cfg.to_official_dict()
    if fmt == "fp8":
        # DeepSeek's config.json announces the block-FP8 layout and FP4 experts like this.
        config["quantization_config"] = {
            "activation_scheme": "dynamic",
            "fmt": "e4m3",
            "quant_method": "fp8",
            "scale_fmt": "ue8m0",
            "weight_block_size": [FP8_BLOCK, FP8_BLOCK],
        }
        config["expert_dtype"] = "fp4"
    (out_dir / "config.json").write_text(json.dumps(config, indent=2) + "\n")

    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name, tensor in state_dict.items():
        stored = encode_tensor(name, tensor, fmt)
        size = sum(t.numel() * t.element_size() for t in stored.values())
        if shard_bytes and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1].update(stored)
        shard_bytes += size
    for stale in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    if len(shards) == 1:
        path = out_dir / SINGLE_FILE
        save_file(shards[0], path, metadata={"format": "pt"})
        return [path]
    paths, weight_map, total = [], {}, 0
    for i, shard in enumerate(shards):
        path = out_dir / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, path, metadata={"format": "pt"})
        paths.append(path)
        for name, tensor in shard.items():
            weight_map[name] = path.name
            total += tensor.numel() * tensor.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return paths
