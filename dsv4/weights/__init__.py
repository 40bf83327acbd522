"""Checkpoint reading and writing: official and HF names, FP8/FP4 dequantisation, validation.

- `formats.py`: how tensors are stored (FP8/FP4 codecs, e8m0 scales, names, storage formats).
- `load.py`: `load_state_dict`, which validates every header before reading any data.
- `save.py`: `save_checkpoint`, in official names, bf16 or as DeepSeek ships it.
"""

from dsv4.weights.formats import (
    E8M0,
    FP4_VALUES,
    WeightError,
    dequantize_fp4,
    dequantize_fp8,
    encode_tensor,
    hf_to_official,
    official_name,
    official_storage,
    pack_fp4,
    quantize_fp4,
    quantize_fp8,
    scale_to_float,
    split_merged_experts,
    storage_roundtrip,
    unpack_fp4,
)
from dsv4.weights.load import INDEX_FILE, SINGLE_FILE, load_state_dict
from dsv4.weights.save import save_checkpoint

__all__ = [
    "E8M0", "FP4_VALUES", "INDEX_FILE", "SINGLE_FILE", "WeightError", "dequantize_fp4", "dequantize_fp8",
    "encode_tensor", "hf_to_official", "load_state_dict", "official_name", "official_storage", "pack_fp4",
    "quantize_fp4", "quantize_fp8", "save_checkpoint", "scale_to_float", "split_merged_experts", "storage_roundtrip",
    "unpack_fp4",
]
