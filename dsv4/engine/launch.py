"""From ServerArgs to a loaded model: checkpoint directory, config, weights, tokenizer, runner."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import dsv4.tiny
import dsv4.weights
from dsv4.config import ModelConfig, ServerArgs, cache_dir
from dsv4.engine.runner import TORCH_DTYPES, ModelRunner
from dsv4.tokenizer import Tokenizer

log = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "dsv4-tiny"


@dataclass(frozen=True)
class LoadedModel:
    name: str
    config: ModelConfig
    tokenizer: Tokenizer
    runner: ModelRunner


def load_model(args: ServerArgs) -> LoadedModel:
    path = Path(args.model) if args.model else builtin_tiny_checkpoint()
    config = ModelConfig.from_json(path)
    weights = dsv4.weights.load_state_dict(path, config, TORCH_DTYPES[args.dtype])
    tokenizer = Tokenizer.from_dir(path)
    runner = ModelRunner(config, weights, args)
    name = BUILTIN_MODEL_NAME if args.model is None else path.name
    log.info("loaded %s from %s (%s on %s, %d pages of %d tokens, %d slots)",
             name, path, args.dtype, runner.device, runner.num_pages, args.page_size, runner.num_slots)
    return LoadedModel(name, config, tokenizer, runner)


def builtin_tiny_checkpoint() -> Path:
    """The built-in tiny checkpoint, built once per version of the code that writes it."""
    path = cache_dir() / f"tiny-{_tiny_version()}"
    if not (path / "config.json").exists():
        log.info("no --model given: building the built-in tiny checkpoint in %s", path)
        # Build aside and rename, so a concurrent or interrupted build never leaves half a checkpoint.
        partial = path.with_name(f"{path.name}.partial-{os.getpid()}")
        dsv4.tiny.make_tiny(partial)
        try:
            partial.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(partial, ignore_errors=True)
    log.info("no --model given: serving the built-in tiny checkpoint %s", path)
    return path


def _tiny_version() -> str:
    digest = hashlib.sha256()
    for module in (dsv4.tiny, dsv4.weights):
        digest.update(Path(module.__file__).read_bytes())
    return digest.hexdigest()[:12]
