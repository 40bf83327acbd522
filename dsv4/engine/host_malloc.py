"""glibc malloc settings for CPU forwards: memory a forward frees stays mapped for the next one.

Why: a forward allocates and frees hundreds of MB of activations, and by default glibc hands large
blocks back to the kernel (each block above its mmap threshold is its own mapping, and a free heap
top is trimmed), so the next forward faults every page in again. Measured on the small preset: ~75,000
page faults per 256-token prefill, a third of its time (prefill 743 -> 455 ms, decode step 53 ->
36 ms with no faults). With the mmap threshold at glibc's maximum (32 MiB) and trimming off, blocks up
to 32 MiB are reused in place; the process then keeps the pages of its largest forward, as a caching
allocator would. Larger blocks (long prefill chunks) are still mapped per use.

The forward thread allocates from an arena of its own, made of 64 MiB heaps, and glibc unmaps such a
heap whenever all of it is free, whatever the trim threshold, unless the top pad asks for more than
the rest of the heap could give back: with the pad at a heap's size no heap is unmapped. Without it,
successive 256-token bf16 prefills of `small` faulted 0..21,000 pages each, taking 152..188 ms; with
it 0..1,500, taking 153..169 ms. (The pad only sizes each growth of an arena's address space; pages
are faulted in as they are used.)
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger(__name__)

_M_TRIM_THRESHOLD, _M_TOP_PAD, _M_MMAP_THRESHOLD = -1, -2, -3
_MMAP_THRESHOLD_MAX = 32 * 2**20  # glibc's upper limit for M_MMAP_THRESHOLD on 64-bit
_HEAP_SIZE = 64 * 2**20  # a thread arena's heap on 64-bit (glibc's HEAP_MAX_SIZE)
_NEVER_TRIM = 2**31 - 1  # the largest int mallopt takes: free heap tops are kept


def retain_freed_memory() -> bool:
    """Applies the settings to this process (once is enough; again is harmless). False, and a log
    line, where the C library is not glibc (no mallopt)."""
    mallopt = getattr(ctypes.CDLL(ctypes.util.find_library("c")), "mallopt", None)
    if mallopt is None or not (mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_MAX) and mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
                               and mallopt(_M_TOP_PAD, _HEAP_SIZE)):
        log.info("malloc: not glibc, its defaults stay (CPU forwards may page-fault their activations in)")
        return False
    log.info("malloc: memory freed by forwards stays mapped for the next (mmap threshold 32 MiB, no heap "
             "trimming, top pad 64 MiB): the process keeps the pages of its largest forward")
    return True
