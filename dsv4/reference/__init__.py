"""dsv4.reference: the executable spec of DeepSeek-V4 in plain, slow, obviously correct PyTorch.

Every fast path (the production model, CPU fallbacks, Triton kernels, the live indexer check) is
tested against these functions. The HF transformers `DeepseekV4ForCausalLM` is its own oracle.
"""

from .compressor import Compressor, pool_windows
from .indexer import indexer_scores, indexer_topk, visible_rows
from .model import ReferenceModel, check_state_dict, load_reference_model
from .rope import apply_rope, layer_inv_freq, rope_inv_freq

__all__ = [
    "Compressor",
    "ReferenceModel",
    "apply_rope",
    "check_state_dict",
    "indexer_scores",
    "indexer_topk",
    "layer_inv_freq",
    "load_reference_model",
    "pool_windows",
    "rope_inv_freq",
    "visible_rows",
]
