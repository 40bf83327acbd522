"""PD decode at any TP size: a transfer's received state lands in the pools of every rank, through the
plan of one tick (docs/PD_ENGINE_HOOKS.md, docs/TENSOR_PARALLEL.md).

Rank 0 queues an install (destination pages and slot with their generations, the CRC-32s of the bytes,
the bytes); the next plan carries up to MAX_INSTALLS_PER_TICK of them. After the plan and before the
forward, every rank receives the bytes of all the plan's installs in one broadcast (`install.bytes`,
issued because the plan has installs, hence by every rank at the same point), writes each install
into its pools and checks the CRC-32s of what landed. Whether an install landed is a rank-local fact:
it travels in the tick's consensus vector (one slot per install, MIN over ranks), and rank 0 adopts
the request in a later plan only once that vector says it landed on every rank. A local failure (a
stale generation, bytes that do not match) fails that install, never the rank.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

import numpy as np
import torch

from dsv4.dist.collectives import TpGroup
from dsv4.memory.pools import StatePools
from dsv4.protocol import StateInstall

log = logging.getLogger(__name__)

# Installs one plan may carry: the consensus vector has one slot for each, so its size stays fixed.
MAX_INSTALLS_PER_TICK = 8


class InstallFailed(RuntimeError):
    """A transfer's state did not land on every rank (or the tick that carried it never completed)."""


@dataclass(frozen=True)
class PendingInstall:
    """Rank 0: an install waiting for its tick, and what its transfer awaits."""

    install: StateInstall
    data: np.ndarray  # uint8: the pages in order, then the slot
    done: asyncio.Future[tuple[list[int], int]]  # the CRC-32s of what landed, once it landed on every rank


def install_nbytes(pools: StatePools, install: StateInstall) -> int:
    return len(install.page_ids) * pools.page_bytes + pools.slot_bytes


def receive_installs(pools: StatePools, installs: tuple[StateInstall, ...], group: TpGroup | None,
                     data: list[np.ndarray] | None) -> list[bool]:
    """Every rank, on its forward thread: writes the plan's `installs` into `pools`; whether each landed
    here. Rank 0 passes each install's bytes (`data`); the other ranks pass None and receive them."""
    if not installs:
        return []
    if data is not None:
        payload = torch.from_numpy(np.concatenate(data))
    else:
        payload = torch.empty(sum(install_nbytes(pools, i) for i in installs), dtype=torch.uint8)
    if group is not None:
        payload = group.broadcast_bytes(payload, "install.bytes")
    landed, offset = [], 0
    for install in installs:
        size = install_nbytes(pools, install)
        landed.append(_write(pools, install, payload[offset:offset + size]))
        offset += size
    return landed


def _write(pools: StatePools, install: StateInstall, data: torch.Tensor) -> bool:
    size = pools.page_bytes
    try:
        for i, (page, generation) in enumerate(zip(install.page_ids, install.page_generations, strict=True)):
            pools.write_page(page, generation, data[i * size:(i + 1) * size])
        pools.write_slot(install.slot, install.slot_generation, data[len(install.page_ids) * size:])
        page_sums = tuple(pools.page_checksum(p) for p in install.page_ids)
        slot_sum = pools.slot_checksum(install.slot)
    except Exception:  # this install's failure, reported through the consensus vector
        log.exception("the state of %s did not land in this rank's pools", install.rid)
        return False
    if page_sums != install.page_checksums or slot_sum != install.slot_checksum:
        log.error("the state of %s landed with other bytes than rank 0 sent", install.rid)
        return False
    return True
