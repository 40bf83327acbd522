"""Reading a checkpoint.

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
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from dsv4.config import ModelConfig, expected_weights
from dsv4.weights.formats import (
    FP4_BLOCK,
    FP8_BLOCK,
    MERGED_EXPERTS,
    WeightError,
    decode_stored,
    is_merged_experts,
    official_name,
)

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
PROGRESS_LOG_BYTES = 1 << 30
MAX_PROBLEMS_SHOWN = 20


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
        if is_merged_experts(s.name):
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
    layer, kind = MERGED_EXPERTS.fullmatch(s.name.removeprefix("model.")).groups()
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
    tensor = decode_stored(stored, scale, entry.shape[-1], dtype).contiguous()
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
