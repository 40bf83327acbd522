"""Model configuration read from a checkpoint's config.json, and the only place that reads env vars.

`ModelConfig` accepts DeepSeek's official field names (the config.json shipped with
DeepSeek-V4-Flash: `compress_ratios`, `num_hash_layers`, `qk_rope_head_dim`, `rope_scaling`, ...),
the names of DeepSeek's inference `ModelArgs` (`dim`, `n_layers`, `window_size`, ...) and HF
transformers' names (`layer_types`, `compress_rates`, `mlp_layer_types`, `rope_parameters`, ...).
`expected_weights` lists every tensor a checkpoint of that shape must hold, in official names and
logical (dequantised) shapes, so loaders can fail early naming the tensor that does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict, dataclass, field, fields
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
    """Where dsv4 keeps what it builds once per user (the built-in tiny checkpoint)."""
    explicit = os.environ.get("DSV4_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "dsv4"


# -- server arguments ------------------------------------------------------------------------------

DTYPES = ("bfloat16", "float32", "float64")  # float64 exists for oracle tests
KV_CACHE_DTYPES = ("auto", "fp8_e4m3")
INDEX_KEY_DTYPES = ("fp8", "bf16", "fp32")
LOG_LEVELS = ("debug", "info", "warning", "error")
DEVICES = ("cpu", "cuda")
VERIFY_INDEXER_MODES = ("off", "count", "fail")


# -- disaggregation: modes and transfer faults (owner: dsv4/disagg) -------------------------------

DISAGGREGATION_MODES = ("null", "prefill", "decode")
FRAME_KINDS = (
    "hello", "hello_ack", "prefill", "payload", "commit", "abort", "abort_ack", "drain", "drain_ack", "heartbeat",
)
_FRAME_FAULT_ACTIONS = ("drop", "delay", "duplicate", "corrupt")
_TRANSFER_FAULT_FORMS = (
    "drop|duplicate|corrupt:KIND:P, delay:KIND:P:DURATION, stall:prefill:DURATION, kill:transfer_task "
    "(KIND: a frame kind or *)"
)


@dataclass(frozen=True)
class FrameFault:
    """Sender-side fault on frames of one kind (`*`: every kind), each hit with `probability`:
    drop (a payload's header and body together), delay (keeping the sender's order), duplicate,
    corrupt (one byte flipped after the checksum was taken)."""

    action: str
    kind: str
    probability: float
    delay_seconds: float = 0.0


def parse_duration(text: str) -> float:
    """"200ms" or "2s" -> seconds."""
    number = text[:-2] if text.endswith("ms") else text[:-1] if text.endswith("s") else None
    try:
        seconds = float(number) / (1000.0 if text.endswith("ms") else 1.0)
    except (TypeError, ValueError):
        raise ValueError(f"duration {text!r}: expected e.g. 200ms or 2s") from None
    if seconds < 0:
        raise ValueError(f"duration {text!r} is negative")
    return seconds


def parse_transfer_fault(item: str, fields: dict) -> None:
    """One `ACTION:...` item of --fault-inject into FaultInjection fields."""
    action, *rest = item.split(":")
    try:
        if action in _FRAME_FAULT_ACTIONS:
            if len(rest) != (3 if action == "delay" else 2):
                raise ValueError("wrong number of fields")
            kind, probability = rest[0], float(rest[1])
            if kind != "*" and kind not in FRAME_KINDS:
                raise ValueError(f"unknown frame kind {kind!r}")
            if not 0.0 <= probability <= 1.0:
                raise ValueError(f"probability {probability} outside 0..1")
            delay = parse_duration(rest[2]) if action == "delay" else 0.0
            fields["frame_faults"] = (*fields.get("frame_faults", ()), FrameFault(action, kind, probability, delay))
        elif action == "stall" and len(rest) == 2 and rest[0] == "prefill":
            fields["stall_prefill_seconds"] = parse_duration(rest[1])
        elif action == "kill" and rest == ["transfer_task"]:
            fields["kill_transfer_task"] = True
        else:
            raise ValueError("unknown fault")
    except ValueError as e:
        raise ConfigError(f"--fault-inject {item!r}: {e}; expected {_TRANSFER_FAULT_FORMS}") from None


@dataclass(frozen=True)
class FaultInjection:
    """Test-only faults, parsed from `--fault-inject`: comma-separated `stall_tick=SECONDS@TICK`
    (the forward of tick TICK sleeps SECONDS first, as a wedged collective would) and
    `crash_tick=TICK` (tick TICK raises, killing the tick loop)."""

    stall_seconds: float = 0.0
    stall_at_tick: int | None = None
    crash_at_tick: int | None = None
    # Transfer faults (`ACTION:...` items; see parse_transfer_fault below).
    frame_faults: tuple[FrameFault, ...] = ()
    stall_prefill_seconds: float = 0.0
    kill_transfer_task: bool = False

    @classmethod
    def parse(cls, spec: str | None) -> FaultInjection:
        fields: dict = {}
        for item in filter(None, (part.strip() for part in (spec or "").split(","))):
            if ":" in item:
                parse_transfer_fault(item, fields)
                continue
            name, _, value = item.partition("=")
            try:
                if name == "stall_tick":
                    seconds, _, tick = value.partition("@")
                    fields.update(stall_seconds=float(seconds), stall_at_tick=int(tick))
                elif name == "crash_tick":
                    fields["crash_at_tick"] = int(value)
                else:
                    raise ValueError(f"unknown fault {name!r}")
            except ValueError as e:
                raise ConfigError(
                    f"--fault-inject {item!r}: {e}; expected stall_tick=SECONDS@TICK or crash_tick=TICK"
                ) from None
        return cls(**fields)


@dataclass(frozen=True)
class ServerArgs:
    """Everything `python -m dsv4 serve` is told; flag names follow SGLang's where one exists."""

    model: str | None = None  # None: the built-in tiny checkpoint, built once under cache_dir()
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    served_model_name: str | None = None
    dtype: str = "bfloat16"
    page_size: int = 128
    max_running_requests: int = 32
    max_total_tokens: int = 65536  # KV pool size in tokens
    chunked_prefill_size: int = 512  # tokens per tick, shared by decodes (one each) and prefill chunks
    context_length: int | None = None  # None: the model's max_position_embeddings
    kv_cache_dtype: str = "auto"
    index_key_dtype: str = "fp8"
    max_request_bytes: int = 8 << 20
    request_timeout: float = 600.0  # default deadline of a request, seconds
    tick_stall_timeout: float = 5.0  # not ready when ticks stop advancing with work pending this long
    max_queue_wait: float = 60.0  # not ready when the oldest waiting request is older than this
    log_level: str = "info"
    fault_inject: str | None = None
    # -- device and live cross-checks (owner: dsv4/model, dsv4/kernels) --
    device: str | None = None  # where pools and weights live; None: cuda when available, else cpu
    verify_indexer: str = "off"  # count: count and log indexer disagreements; fail: also fail the request
    verify_indexer_every: int = 1  # verify the indexer's selections every N ticks
    # -- disaggregation (owner: dsv4/disagg; checked in _check_disaggregation) --
    disaggregation_mode: str = "null"  # null: colocated; prefill or decode: one side of a PD pair
    disaggregation_bootstrap_port: int = 8998  # prefill: the UCX port decode instances connect to
    prefill_addr: tuple[str, ...] = ()  # decode: HOST:PORT of each prefill instance's bootstrap port
    verify_transfers: bool = False  # decode: per-page checksums checked before a transfer is used

    def __post_init__(self) -> None:
        for name, value, allowed in (
            ("dtype", self.dtype, DTYPES),
            ("kv_cache_dtype", self.kv_cache_dtype, KV_CACHE_DTYPES),
            ("index_key_dtype", self.index_key_dtype, INDEX_KEY_DTYPES),
            ("log_level", self.log_level, LOG_LEVELS),
        ):
            if value not in allowed:
                raise ConfigError(f"--{name.replace('_', '-')} {value!r}: expected one of {allowed}")
        if self.page_size <= 0 or self.page_size % 128:
            # Compressed rows (ratio 4 and 128) must align with page boundaries.
            raise ConfigError(f"--page-size {self.page_size} must be a positive multiple of 128")
        for name in ("max_running_requests", "max_total_tokens", "chunked_prefill_size", "max_request_bytes"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        if self.max_total_tokens < self.page_size:
            raise ConfigError(f"--max-total-tokens {self.max_total_tokens} is less than one page ({self.page_size})")
        if self.chunked_prefill_size < self.max_running_requests:
            # Every running decode takes one token of the tick's budget; a smaller budget could
            # leave some decodes out of every tick.
            raise ConfigError(
                f"--chunked-prefill-size {self.chunked_prefill_size} must be at least "
                f"--max-running-requests {self.max_running_requests}"
            )
        if self.context_length is not None and self.context_length <= 0:
            raise ConfigError("--context-length must be positive")
        for name in ("request_timeout", "tick_stall_timeout", "max_queue_wait"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be positive")
        FaultInjection.parse(self.fault_inject)
        self._check_verification()
        self._check_disaggregation()

    def _check_verification(self) -> None:
        if self.device is not None and self.device not in DEVICES:
            raise ConfigError(f"--device {self.device!r}: expected one of {DEVICES}")
        if self.verify_indexer not in VERIFY_INDEXER_MODES:
            raise ConfigError(f"--verify-indexer {self.verify_indexer!r}: expected one of {VERIFY_INDEXER_MODES}")
        if self.verify_indexer_every <= 0:
            raise ConfigError(f"--verify-indexer-every {self.verify_indexer_every} must be positive")

    def _check_disaggregation(self) -> None:
        object.__setattr__(self, "prefill_addr", tuple(self.prefill_addr or ()))
        if self.disaggregation_mode not in DISAGGREGATION_MODES:
            raise ConfigError(
                f"--disaggregation-mode {self.disaggregation_mode!r}: expected one of {DISAGGREGATION_MODES}"
            )
        if self.disaggregation_mode == "decode" and not self.prefill_addr:
            raise ConfigError("--disaggregation-mode decode needs at least one --prefill-addr HOST:PORT")
        if self.prefill_addr and self.disaggregation_mode != "decode":
            raise ConfigError("--prefill-addr is only meaningful with --disaggregation-mode decode")
        for addr in self.prefill_addr:
            host, _, port = addr.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"--prefill-addr {addr!r}: expected HOST:PORT")
        if not 0 <= self.disaggregation_bootstrap_port < 65536:
            raise ConfigError(f"--disaggregation-bootstrap-port {self.disaggregation_bootstrap_port} is not a port")

    @property
    def faults(self) -> FaultInjection:
        return FaultInjection.parse(self.fault_inject)

    @staticmethod
    def add_cli_args(parser) -> None:
        d = ServerArgs
        add = parser.add_argument
        add("--model", "--model-path", dest="model", default=d.model,
            help="checkpoint directory; default: a built-in tiny DeepSeek-V4-architecture checkpoint")
        add("--host", default=d.host)
        add("--port", type=int, default=d.port)
        add("--api-key", default=d.api_key, help="require this bearer token on API routes")
        add("--served-model-name", default=d.served_model_name)
        add("--dtype", choices=DTYPES, default=d.dtype)
        add("--page-size", type=int, default=d.page_size, help="tokens per KV page (a multiple of 128)")
        add("--max-running-requests", type=int, default=d.max_running_requests)
        add("--max-total-tokens", type=int, default=d.max_total_tokens, help="KV pool size in tokens")
        add("--chunked-prefill-size", type=int, default=d.chunked_prefill_size, help="token budget per tick")
        add("--context-length", type=int, default=d.context_length)
        add("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=d.kv_cache_dtype)
        add("--index-key-dtype", choices=INDEX_KEY_DTYPES, default=d.index_key_dtype)
        add("--max-request-bytes", type=int, default=d.max_request_bytes)
        add("--request-timeout", type=float, default=d.request_timeout, help="default request deadline, seconds")
        add("--tick-stall-timeout", type=float, default=d.tick_stall_timeout,
            help="not ready when ticks stop advancing with work pending this long, seconds")
        add("--max-queue-wait", type=float, default=d.max_queue_wait,
            help="not ready when the oldest waiting request is older than this, seconds")
        add("--log-level", choices=LOG_LEVELS, default=d.log_level)
        add("--fault-inject", default=d.fault_inject, help=argparse.SUPPRESS)  # test-only: out of --help
        # -- device and live cross-checks --
        add("--device", choices=DEVICES, default=d.device,
            help="where the model's weights and state live (default: cuda when available, else cpu)")
        add("--verify-indexer", nargs="?", const="count", choices=VERIFY_INDEXER_MODES, default=d.verify_indexer,
            help="re-run the reference indexer on the cached state and compare its top-k with the fast path's; "
                 "count (the default when given without a value): count and log disagreements; fail: also fail "
                 "the affected request")
        add("--verify-indexer-every", type=int, default=d.verify_indexer_every, metavar="N",
            help="with --verify-indexer: verify every N ticks")
        # -- disaggregation --
        add("--disaggregation-mode", choices=DISAGGREGATION_MODES, default=d.disaggregation_mode,
            help="null: serve alone; prefill: compute prompts for decode instances; decode: serve users, "
                 "prefill remotely")
        add("--disaggregation-bootstrap-port", type=int, default=d.disaggregation_bootstrap_port,
            help="prefill mode: UCX port that decode instances connect to")
        add("--prefill-addr", action="append", default=None, metavar="HOST:PORT",
            help="decode mode: a prefill instance's bootstrap address (repeatable)")
        add("--verify-transfers", action="store_true",
            help="decode mode: check per-page checksums of every transfer before using it")

    @classmethod
    def from_cli(cls, namespace) -> ServerArgs:
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in vars(namespace).items() if k in names})

