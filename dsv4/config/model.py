"""Model configuration read from a checkpoint's config.json, and cache_dir() (env-var reads live in dsv4.config).

`ModelConfig` accepts DeepSeek's official field names (the config.json shipped with
DeepSeek-V4-Flash: `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, ...),
the names of DeepSeek's inference `ModelArgs` (`dim`, `n_layers`, `window_size`, ...) and HF
transformers' names (`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`, ...).
`expected_weights` lists every tensor a checkpoint of that shape must hold, in official names and
logical (dequantised) shapes, so loaders can fail early naming the tensor that does not fit.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

WINDOW, CSA, HCA = "window", "csa", "hca"
# The compressor with overlap and the lightning indexer exist only at ratio 4 (CSA); ratio 128 is
# the heavily compressed layer (HCA); 0 means sliding-window only. Anything else is not DeepSeek-V4.
LAYER_KIND_BY_RATIO = {0: WINDOW, 4: CSA, 128: HCA}
_HF_LAYER_TYPE_TO_KIND = {
    "sliding_attention": WINDOW,
    "compressed_sparse_attention": CSA,
    "heavily_compressed_attention": HCA,
}
SCORING_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


class ConfigError(ValueError):
    """A config.json that does not describe a DeepSeek-V4 model dsv4 can run."""


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float
    beta_slow: float


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_hash_layers: int
    sliding_window: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    compress_ratios: tuple[int, ...]  # one per decoder layer; the MTP entries are not kept here
    scoring_func: str = "sqrtsoftplus"
    routed_scaling_factor: float = 1.5
    norm_topk_prob: bool = True
    swiglu_limit: float = 10.0
    hc_mult: int = 4
    hc_sinkhorn_iters: int = 20
    hc_eps: float = 1e-6
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    rope_scaling: YarnScaling | None = None  # applies to compressed layers only
    num_nextn_predict_layers: int = 0
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    extra: dict = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.compress_ratios) != self.num_layers:
            raise ConfigError(
                f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_layers} layers"
            )
        for i, ratio in enumerate(self.compress_ratios):
            if ratio not in LAYER_KIND_BY_RATIO:
                raise ConfigError(
                    f"layer {i}: unknown compress ratio {ratio}; expected one of {sorted(LAYER_KIND_BY_RATIO)}"
                )
        if self.scoring_func not in SCORING_FUNCS:
            raise ConfigError(f"unknown scoring_func {self.scoring_func!r}; expected one of {SCORING_FUNCS}")
        if self.num_heads % self.o_groups:
            raise ConfigError(f"num_heads {self.num_heads} is not a multiple of o_groups {self.o_groups}")
        if not 0 < self.rope_head_dim <= self.head_dim or self.rope_head_dim % 2:
            raise ConfigError(f"rope_head_dim {self.rope_head_dim} must be even and within head_dim {self.head_dim}")
        if self.rope_head_dim > self.index_head_dim:
            raise ConfigError(f"rope_head_dim {self.rope_head_dim} exceeds index_head_dim {self.index_head_dim}")
        if not 0 <= self.num_hash_layers <= self.num_layers:
            raise ConfigError(f"num_hash_layers {self.num_hash_layers} outside 0..{self.num_layers}")
        if self.num_experts_per_tok > self.n_routed_experts:
            raise ConfigError("num_experts_per_tok exceeds n_routed_experts")

    # -- per-layer facts --------------------------------------------------------------------------
    @property
    def compressed_ratios(self) -> tuple[int, ...]:
        """The distinct ratios of the compressed layers, ascending: the order in which a plan's parts by ratio
        are kept and a decode step passes them to its layers' calls."""
        return tuple(sorted({r for r in self.compress_ratios if r}))

    def layer_kind(self, layer: int) -> str:
        return LAYER_KIND_BY_RATIO[self.compress_ratios[layer]]

    def is_hash_layer(self, layer: int) -> bool:
        return layer < self.num_hash_layers

    def rope_theta_for(self, layer: int) -> float:
        return self.rope_theta if self.layer_kind(layer) == WINDOW else self.compress_rope_theta

    # -- reading and writing ----------------------------------------------------------------------
    @classmethod
    def from_json(cls, path: str | os.PathLike) -> ModelConfig:
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path}: no config.json") from None
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict) -> ModelConfig:
        r = _FieldReader(raw)
        num_layers = r.int("num_hidden_layers", "n_layers", "num_layers")
        head_dim = r.int("head_dim")
        rope_head_dim = r.opt("qk_rope_head_dim", "rope_head_dim")
        if rope_head_dim is None:
            factor = r.opt("partial_rotary_factor")
            rope_head_dim = int(head_dim * factor) if factor is not None else 64
        return cls(
            vocab_size=r.int("vocab_size"),
            hidden_size=r.int("hidden_size", "dim"),
            num_layers=num_layers,
            num_heads=r.int("num_attention_heads", "n_heads"),
            head_dim=head_dim,
            rope_head_dim=int(rope_head_dim),
            q_lora_rank=r.int("q_lora_rank"),
            o_groups=r.int("o_groups"),
            o_lora_rank=r.int("o_lora_rank"),
            n_routed_experts=r.int("n_routed_experts"),
            n_shared_experts=r.int("n_shared_experts", default=1),
            num_experts_per_tok=r.int("num_experts_per_tok", "n_activated_experts"),
            moe_intermediate_size=r.int("moe_intermediate_size", "moe_inter_dim"),
            num_hash_layers=_hash_layers(raw, num_layers),
            sliding_window=r.int("sliding_window", "window_size"),
            index_n_heads=r.int("index_n_heads"),
            index_head_dim=r.int("index_head_dim"),
            index_topk=r.int("index_topk"),
            compress_ratios=_compress_ratios(raw, num_layers),
            scoring_func=str(r.opt("scoring_func", "score_func", default="sqrtsoftplus")),
            routed_scaling_factor=float(r.opt("routed_scaling_factor", "route_scale", default=1.5)),
            norm_topk_prob=bool(r.opt("norm_topk_prob", default=True)),
            swiglu_limit=float(r.opt("swiglu_limit", default=10.0)),
            hc_mult=r.int("hc_mult", default=4),
            hc_sinkhorn_iters=r.int("hc_sinkhorn_iters", default=20),
            hc_eps=float(r.opt("hc_eps", default=1e-6)),
            rms_norm_eps=float(r.opt("rms_norm_eps", "norm_eps", default=1e-6)),
            rope_theta=float(_rope_value(raw, "main", "rope_theta", 10000.0)),
            compress_rope_theta=float(_rope_value(raw, "compress", "compress_rope_theta", 160000.0)),
            rope_scaling=_yarn(raw),
            num_nextn_predict_layers=r.int("num_nextn_predict_layers", default=0),
            max_position_embeddings=r.int("max_position_embeddings", "max_seq_len", default=1048576),
            bos_token_id=r.int("bos_token_id", default=0),
            eos_token_id=_first_int(r.opt("eos_token_id", default=1)),
        )

    def to_official_dict(self) -> dict:
        """config.json in the field names DeepSeek ships (what `make-tiny` writes)."""
        d = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_head_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "num_hash_layers": self.num_hash_layers,
            "scoring_func": self.scoring_func,
            "routed_scaling_factor": self.routed_scaling_factor,
            "norm_topk_prob": self.norm_topk_prob,
            "topk_method": "noaux_tc",
            "swiglu_limit": self.swiglu_limit,
            "sliding_window": self.sliding_window,
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            # Official files carry one extra ratio per MTP layer (always 0).
            "compress_ratios": list(self.compress_ratios) + [0] * self.num_nextn_predict_layers,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
        }
        if self.rope_scaling is not None:
            d["rope_scaling"] = {"type": "yarn", **asdict(self.rope_scaling)}
        return d


class _FieldReader:
    """Looks a field up under any of its aliases, with errors that name the field."""

    def __init__(self, raw: dict):
        if not isinstance(raw, dict):
            raise ConfigError("config.json must hold a JSON object")
        self.raw = raw

    def opt(self, *names: str, default=None):
        for name in names:
            if self.raw.get(name) is not None:
                return self.raw[name]
        return default

    def int(self, *names: str, default=None) -> int:
        value = self.opt(*names, default=default)
        if value is None:
            raise ConfigError(f"config.json lacks {names[0]!r}")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
            raise ConfigError(f"config.json field {names[0]!r} must be an integer, got {value!r}")
        return int(value)


def _first_int(value) -> int:
    return int(value[0]) if isinstance(value, list) else int(value)


def _compress_ratios(raw: dict, num_layers: int) -> tuple[int, ...]:
    if raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        if len(ratios) < num_layers:
            raise ConfigError(f"compress_ratios has {len(ratios)} entries for {num_layers} layers")
        return tuple(int(r) for r in ratios[:num_layers])
    layer_types = raw.get("layer_types")
    if layer_types is None:
        raise ConfigError("config.json lacks 'compress_ratios' (or HF 'layer_types')")
    rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    rates.update(raw.get("compress_rates") or {})
    ratios = []
    for i, layer_type in enumerate(layer_types[:num_layers]):
        if layer_type not in _HF_LAYER_TYPE_TO_KIND:
            raise ConfigError(f"layer {i}: unknown layer type {layer_type!r}")
        ratios.append(0 if layer_type == "sliding_attention" else int(rates[layer_type]))
    return tuple(ratios)


def _hash_layers(raw: dict, num_layers: int) -> int:
    mlp_types = raw.get("mlp_layer_types")
    if mlp_types is not None:
        n_hash = sum(1 for t in mlp_types[:num_layers] if t == "hash_moe")
        if list(mlp_types[:n_hash]) != ["hash_moe"] * n_hash:
            raise ConfigError("mlp_layer_types: hash_moe layers must come first")
        return n_hash
    return int(raw.get("num_hash_layers", raw.get("n_hash_layers", 3)))


def _rope_value(raw: dict, label: str, flat_name: str, default: float) -> float:
    nested = (raw.get("rope_parameters") or {}).get(label)
    if isinstance(nested, dict) and nested.get("rope_theta") is not None:
        return nested["rope_theta"]
    return raw.get(flat_name) if raw.get(flat_name) is not None else default


def _yarn(raw: dict) -> YarnScaling | None:
    params = raw.get("rope_scaling")
    nested = (raw.get("rope_parameters") or {}).get("compress")
    if isinstance(nested, dict):
        params = nested
    if not params:
        return None
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return None
    if kind != "yarn":
        raise ConfigError(f"unsupported rope scaling {kind!r}; DeepSeek-V4 uses yarn")
    return YarnScaling(
        factor=float(params["factor"]),
        original_max_position_embeddings=int(params["original_max_position_embeddings"]),
        beta_fast=float(params.get("beta_fast", 32)),
        beta_slow=float(params.get("beta_slow", 1)),
    )


# -- the tensors a checkpoint must hold ------------------------------------------------------------


def expected_weights(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Official tensor name -> logical shape (after dequantisation), for every decoder tensor.

    MTP tensors (`mtp.*`) are optional and not listed. FP8/FP4 `.scale` tensors are implied by
    the storage format and are checked by the loader, not listed here.
    """
    d, hc = cfg.hidden_size, cfg.hc_mult
    n_mix = (2 + hc) * hc
    heads_dim = cfg.num_heads * cfg.head_dim
    shapes: dict[str, tuple[int, ...]] = {
        "embed.weight": (cfg.vocab_size, d),
        "head.weight": (cfg.vocab_size, d),
        "norm.weight": (d,),
        "hc_head_fn": (hc, hc * d),
        "hc_head_base": (hc,),
        "hc_head_scale": (1,),
    }
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        shapes.update(
            {
                p + "attn_norm.weight": (d,),
                p + "ffn_norm.weight": (d,),
                p + "hc_attn_fn": (n_mix, hc * d),
                p + "hc_attn_base": (n_mix,),
                p + "hc_attn_scale": (3,),
                p + "hc_ffn_fn": (n_mix, hc * d),
                p + "hc_ffn_base": (n_mix,),
                p + "hc_ffn_scale": (3,),
                p + "attn.wq_a.weight": (cfg.q_lora_rank, d),
                p + "attn.q_norm.weight": (cfg.q_lora_rank,),
                p + "attn.wq_b.weight": (heads_dim, cfg.q_lora_rank),
                p + "attn.wkv.weight": (cfg.head_dim, d),
                p + "attn.kv_norm.weight": (cfg.head_dim,),
                p + "attn.wo_a.weight": (cfg.o_groups * cfg.o_lora_rank, heads_dim // cfg.o_groups),
                p + "attn.wo_b.weight": (d, cfg.o_groups * cfg.o_lora_rank),
                p + "attn.attn_sink": (cfg.num_heads,),
                p + "ffn.gate.weight": (cfg.n_routed_experts, d),
            }
        )
        kind = cfg.layer_kind(i)
        if kind != WINDOW:
            ratio = cfg.compress_ratios[i]
            coff = 2 if kind == CSA else 1
            c = p + "attn.compressor."
            shapes.update(
                {
                    c + "wkv.weight": (coff * cfg.head_dim, d),
                    c + "wgate.weight": (coff * cfg.head_dim, d),
                    c + "ape": (ratio, coff * cfg.head_dim),
                    c + "norm.weight": (cfg.head_dim,),
                }
            )
        if kind == CSA:
            x = p + "attn.indexer."
            ic = x + "compressor."
            shapes.update(
                {
                    x + "wq_b.weight": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank),
                    x + "weights_proj.weight": (cfg.index_n_heads, d),
                    ic + "wkv.weight": (2 * cfg.index_head_dim, d),
                    ic + "wgate.weight": (2 * cfg.index_head_dim, d),
                    ic + "ape": (cfg.compress_ratios[i], 2 * cfg.index_head_dim),
                    ic + "norm.weight": (cfg.index_head_dim,),
                }
            )
        if cfg.is_hash_layer(i):
            shapes[p + "ffn.gate.tid2eid"] = (cfg.vocab_size, cfg.num_experts_per_tok)
        else:
            shapes[p + "ffn.gate.bias"] = (cfg.n_routed_experts,)
        inter = cfg.moe_intermediate_size
        for e in range(cfg.n_routed_experts):
            q = f"{p}ffn.experts.{e}."
            shapes.update({q + "w1.weight": (inter, d), q + "w2.weight": (d, inter), q + "w3.weight": (inter, d)})
        shared = inter * cfg.n_shared_experts
        if shared:
            q = p + "ffn.shared_experts."
            shapes.update({q + "w1.weight": (shared, d), q + "w2.weight": (d, shared), q + "w3.weight": (shared, d)})
    return shapes


# -- environment (the only env-var reads in dsv4) --------------------------------------------------


def cache_dir() -> Path:
    """Where dsv4 keeps what it builds once per user (the benchmark checkpoints)."""
    explicit = os.environ.get("DSV4_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4"


def compile_disabled_by_env() -> bool:
    """`DSV4_DISABLE_COMPILE=1`: the default of `--disable-compile` (the test suite sets it, so only the
    tests that are about the compiled path pay for compiling)."""
    return os.environ.get("DSV4_DISABLE_COMPILE", "") not in ("", "0")
