"""The serving benchmark's pieces; `scripts/bench_serving.py` is the entry point."""
