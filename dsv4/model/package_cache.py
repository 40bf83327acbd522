"""The compiled packages' cache directory (dsv4/model/compile.py) kept from growing without bound.

Every change to the code the packages depend on, to torch or to the model's shapes gives them a new
key, and the packages of older keys would otherwise stay forever (~25 MB a key for `small`: a
developer's cache reached 1.3 GB over 54 keys). A start that has its packages marks them used and
removes the packages of all but the most recently used keys. A server still running an older build
has loaded its packages into memory already and does not read the files again.
"""

from __future__ import annotations

import logging
import os
import re
from pathlib import Path

log = logging.getLogger(__name__)

# `<piece>-<key>.pt2` as compile.py names a package (its `.partial.pt2` files, being written, never match)
_PACKAGE = re.compile(r"^[a-z0-9_]+-([0-9a-f]{16})\.pt2$")
# The keys whose packages stay: the running build's and others (another model, another dtype, a build
# switched back to) that a next start may want without compiling again. A tensor-parallel server on one
# machine has a key per rank (each runs its own experts), hence room for several servers' worth.
KEEP_KEYS = 16


def mark_used(packages: list[Path]) -> None:
    """Marks a start's packages as just used (their modification time: what `prune` orders keys by)."""
    for package in packages:
        os.utime(package)


def prune(cache: Path, keep: int = KEEP_KEYS) -> list[Path]:
    """Removes the packages of every key but the `keep` most recently used ones (a key's most recent
    package); returns what it removed. Files that are not packages are left alone."""
    by_key: dict[str, list[Path]] = {}
    for path in cache.iterdir():
        match = _PACKAGE.match(path.name)
        if match:
            by_key.setdefault(match.group(1), []).append(path)

    def last_used(key: str) -> float:
        return max(_mtime(path) for path in by_key[key])

    stale = sorted(by_key, key=last_used, reverse=True)[keep:]
    removed = []
    for key in stale:
        for path in by_key[key]:
            try:
                size = path.stat().st_size
                path.unlink()
            except FileNotFoundError:  # (another start pruned it first)
                continue
            removed.append((path, size))
    if removed:
        log.info("removed %d compiled packages of %d older builds from %s (%.0f MB); the %d most recently "
                 "used builds' stay", len(removed), len(stale), cache, sum(size for _, size in removed) / 1e6, keep)
    return [path for path, _ in removed]


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except FileNotFoundError:  # (removed meanwhile by another start's prune)
        return 0.0
