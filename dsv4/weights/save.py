"""Writing a checkpoint in official names, bf16 or as DeepSeek ships it (FP8 and FP4)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from dsv4.config import ModelConfig
from dsv4.weights.formats import FP8_BLOCK, encode_tensor
from dsv4.weights.load import INDEX_FILE, SINGLE_FILE

DEFAULT_MAX_SHARD_BYTES = 4 << 30


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
