"""dsv4.engine.launch.settle_heap: a serving process's startup garbage is collected, and what remains is frozen
out of the cyclic collector's full collections. In a child process: freezing is for the whole process."""

import subprocess
import sys

CHILD = """
import gc, weakref
gc.disable()  # (nothing collects before settle_heap does)
from dsv4.engine.launch import settle_heap

class Node:
    pass

garbage = Node()
garbage.self = garbage  # a cycle: only the cyclic collector frees it
dead = weakref.ref(garbage)
del garbage
kept = [Node() for _ in range(1000)]
settle_heap()
assert dead() is None, "the startup garbage was frozen instead of collected"
assert gc.get_freeze_count() >= len(kept), gc.get_freeze_count()
assert len(gc.get_objects()) < len(kept), "a full collection still walks the startup objects"
print("ok")
"""


def test_settle_heap_collects_then_freezes():
    done = subprocess.run([sys.executable, "-c", CHILD], check=False, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-2000:]
