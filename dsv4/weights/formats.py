"""How DeepSeek-V4 checkpoints store their tensors: FP8/FP4 codecs with e8m0 scales, official and
HF transformers names, and the storage format each tensor takes.

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
"""

from __future__ import annotations

import math
import re

import torch
import torch.nn.functional as F

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
MERGED_EXPERTS = re.compile(r"layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")
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
    layer, kind = MERGED_EXPERTS.fullmatch(name.removeprefix("model.")).groups()
    prefix = f"layers.{layer}.ffn.experts."
    if kind == "down_proj":
        return {f"{prefix}{e}.w2.weight": tensor[e] for e in range(tensor.shape[0])}
    w1, w3 = tensor.chunk(2, dim=1)
    parts = {}
    for e in range(tensor.shape[0]):
        parts[f"{prefix}{e}.w1.weight"] = w1[e]
        parts[f"{prefix}{e}.w3.weight"] = w3[e]
    return parts


def is_merged_experts(name: str) -> bool:
    return MERGED_EXPERTS.fullmatch(name.removeprefix("model.")) is not None


def hf_to_official(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Rename an HF transformers DeepseekV4 state dict to official names, splitting merged experts."""
    out = {}
    for name, tensor in state_dict.items():
        if is_merged_experts(name):
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
        out[name] = decode_stored(stored[name], scale, tensor.shape[-1], torch.float32)
    return out


def decode_stored(stored: torch.Tensor, scale: torch.Tensor | None, in_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """A validated stored tensor -> its logical value (integers stay integers, as int64)."""
    if scale is not None and stored.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(stored, scale).to(dtype)
    if scale is not None:
        return dequantize_fp4(stored, scale, in_dim).to(dtype)
    if stored.is_floating_point():
        return stored.to(dtype)
    return stored.to(torch.int64)
