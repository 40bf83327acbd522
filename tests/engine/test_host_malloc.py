"""CPU forwards keep the memory they free (dsv4.engine.host_malloc): blocks up to 32 MiB come from
malloc's heap rather than a mapping of their own, and a freed heap top is not trimmed, so the next
forward reuses pages instead of faulting them in again."""

import subprocess
import sys
from pathlib import Path

import dsv4.engine.host_malloc

# In a fresh process (the test process's allocator is left as it is): malloc and free a 24 MiB block
# and print glibc's counters (mallinfo2) for it: bytes in mmapped blocks while it lives, and the heap
# size before the free and after.
_BLOCK = """
import ctypes, sys
sys.path.insert(0, sys.argv[2])  # the module alone: no torch import moving glibc's thresholds first
from host_malloc import retain_freed_memory
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Mallinfo2, ctypes.c_void_p, [ctypes.c_void_p]
if sys.argv[1] == "retain":
    assert retain_freed_memory()
before = libc.mallinfo2()
block = libc.malloc(24 << 20)
ctypes.memset(block, 1, 24 << 20)
live = libc.mallinfo2()
libc.free(block)
after = libc.mallinfo2()
print(live.hblkhd - before.hblkhd, live.arena, after.arena)
"""


def _block(mode: str) -> tuple[int, int, int]:
    module_dir = str(Path(dsv4.engine.host_malloc.__file__).parent)
    out = subprocess.run([sys.executable, "-c", _BLOCK, mode, module_dir], capture_output=True, text=True, timeout=60,
                         check=True)
    mapped, heap_live, heap_after = map(int, out.stdout.split())
    return mapped, heap_live, heap_after


def test_a_freed_24_mib_block_stays_in_the_heap():
    mapped, _, _ = _block("default")
    assert mapped >= 24 << 20  # glibc's default: a mapping of its own, unmapped on free
    mapped, heap_live, heap_after = _block("retain")
    assert mapped == 0 and heap_live >= 24 << 20  # from the heap
    assert heap_after == heap_live  # and the heap is not trimmed when it is freed
