"""CPU forwards keep the memory they free (dsv4.engine.host_malloc): blocks up to 32 MiB come from
malloc's heap rather than a mapping of their own, a freed heap top is not trimmed, and a thread's
arena keeps its heaps when they empty, so the next forward reuses pages instead of faulting them in
again."""

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


# In a fresh process, on a thread of its own (the forward thread's case: an arena of 64 MiB heaps):
# three 24 MiB blocks, more than one heap holds, then all freed; the growth of glibc's count of the
# bytes its arenas hold from the system (mallinfo2's `arena`, over all arenas) while they live and
# after the free.
_THREAD_BLOCKS = """
import ctypes, sys, threading
sys.path.insert(0, sys.argv[1])
from host_malloc import retain_freed_memory
class Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype, libc.malloc.restype, libc.free.argtypes = Mallinfo2, ctypes.c_void_p, [ctypes.c_void_p]
assert retain_freed_memory()
def run():
    before = libc.mallinfo2()
    blocks = [libc.malloc(24 << 20) for _ in range(3)]
    for block in blocks:
        ctypes.memset(block, 1, 24 << 20)
    live = libc.mallinfo2()
    for block in reversed(blocks):
        libc.free(block)
    print(live.hblkhd - before.hblkhd, live.arena - before.arena, libc.mallinfo2().arena - before.arena)
thread = threading.Thread(target=run)
thread.start()
thread.join()
"""


def test_a_threads_arena_keeps_its_heaps_when_they_empty():
    module_dir = str(Path(dsv4.engine.host_malloc.__file__).parent)
    out = subprocess.run([sys.executable, "-c", _THREAD_BLOCKS, module_dir], capture_output=True, text=True,
                         timeout=60, check=True)
    mapped, held_live, held_after = map(int, out.stdout.split())
    assert mapped == 0 and held_live >= 24 << 20  # all three from the thread's arena, a heap added for them
    assert held_after == held_live  # no heap unmapped (without the top pad: the second one is)
