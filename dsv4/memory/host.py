"""The prefix cache's host pool: one unit per cached node, mirroring the device pools' layout.

A host unit is a device page (every CSA/HCA layer's compressed main rows and every CSA layer's
index-key rows, in the pools' own formats: the bytes are copied, never re-encoded) followed by a
slot-sized boundary snapshot (window rings and compressor partial state incl. CSA's overlap half).
So a node's whole state is one contiguous unit: it moves with one copy job, one completion and one
checksum. `layout()` names every region at its offset in the unit.

On CUDA the buffer is pinned, so copies to and from the device run asynchronously on a copy stream;
on CPU it is a separate buffer. Generations work as in the device pools: every reader or writer
names (unit, generation) and a stale one raises `StaleReference`.
"""

from __future__ import annotations

import zlib
from dataclasses import replace

import numpy as np
import torch

from dsv4.memory.pools import Region, StaleReference, StatePools


class HostPool:
    def __init__(self, pools: StatePools, num_units: int, *, pin: bool):
        if num_units <= 0:
            raise ValueError(f"the host pool needs at least one unit, got {num_units}")
        self.num_units = num_units
        self.page_bytes = pools.page_bytes
        self.slot_bytes = pools.slot_bytes
        self.unit_bytes = self.page_bytes + self.slot_bytes
        self._layout = (*pools.page_layout(),
                        *(replace(r, name=f"snapshot.{r.name}", offset=self.page_bytes + r.offset)
                          for r in pools.slot_layout()))
        # Zeroed by calloc on the CPU rather than by a parallel fill: the caller's thread would get
        # OpenMP workers of its own, and libgomp throttles every thread's workers once it manages more
        # threads than cores (dsv4.engine.launch.load_model).
        self.data = (torch.zeros((num_units, self.unit_bytes), dtype=torch.uint8, pin_memory=True) if pin
                     else torch.from_numpy(np.zeros((num_units, self.unit_bytes), dtype=np.uint8)))
        self._generations = np.full(num_units, -1, dtype=np.int64)

    def layout(self) -> tuple[Region, ...]:
        return self._layout

    def unit(self, unit: int, generation: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page part, snapshot part) of the unit, aliasing the buffer."""
        if not 0 <= unit < self.num_units:
            raise IndexError(f"host unit {unit} outside 0..{self.num_units - 1}")
        if generation < self._generations[unit]:
            raise StaleReference(f"host unit {unit}: generation {generation} is stale "
                                 f"(now at generation {self._generations[unit]})")
        self._generations[unit] = generation
        row = self.data[unit]
        return row[: self.page_bytes], row[self.page_bytes :]

    def checksum(self, unit: int) -> int:
        return zlib.crc32(self.data[unit].numpy())


def checksum_of(parts: tuple[torch.Tensor, ...]) -> int:
    """CRC-32 of the parts' bytes in order (device tensors are read back to the host)."""
    crc = 0
    for part in parts:
        crc = zlib.crc32(np.ascontiguousarray(part.cpu().numpy()), crc)
    return crc
