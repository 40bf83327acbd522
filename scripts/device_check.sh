#!/usr/bin/env bash
# Kernel checks for a session that holds the GPU machine (an H200): the kernel tests compiled for
# real on CUDA (tests/kernels/conftest.py enables Triton's interpreter only without a GPU), the
# model's kernel path on CUDA against the reference (the runner's --device defaults to cuda when
# there is one, so these tests run there) with --verify-indexer checking every selection, then the
# bandwidth benchmarks. Installs nothing; every step is bounded by `timeout`.
#
#   scripts/device_check.sh [--dry-run] [bench_kernels.py arguments, e.g. --peak-gbps 4800]
#
# --dry-run checks every step on a machine without a GPU (this script's syntax, the test
# collection, the bench's argument parsing and a tiny CPU run of each benchmark case), exits 0.

# The model and engine on CUDA: paged model and kernel path against the reference, and
# --verify-indexer under load (zero mismatches; flipped index-key bytes caught) and its full mode.
ENGINE_TESTS=(tests/model tests/engine/test_verify_indexer.py tests/engine/test_indexer_check.py
              tests/engine/test_verify_indexer_full.py)
set -euo pipefail
cd "$(dirname "$0")/.."

PY=.venv/bin/python
[ -x "$PY" ] || PY=python3

dry_run=0
bench_args=()
for arg in "$@"; do
  if [ "$arg" = "--dry-run" ]; then dry_run=1; else bench_args+=("$arg"); fi
done

step() { printf '\n== %s\n' "$*"; }

if [ "$dry_run" = 1 ]; then
  step "script syntax"
  bash -n "$0" && echo ok
  step "kernel test collection"
  timeout 120 "$PY" -m pytest --collect-only -q -p no:cacheprovider tests/kernels 2>/dev/null \
    | awk -F': ' 'NF == 2 { print; total += $2 } END { print total " tests collected"; exit total == 0 }'
  step "model and engine test collection"
  timeout 120 "$PY" -m pytest --collect-only -q -p no:cacheprovider "${ENGINE_TESTS[@]}" 2>/dev/null \
    | awk -F': ' 'NF == 2 { print; total += $2 } END { print total " tests collected"; exit total == 0 }'
  step "bench arguments"
  timeout 60 "$PY" scripts/bench_kernels.py --help >/dev/null
  if timeout 60 "$PY" scripts/bench_kernels.py --device tpu >/dev/null 2>&1; then
    echo "bench_kernels.py accepted --device tpu" >&2
    exit 1
  fi
  echo ok
  step "each benchmark case, tiny, on CPU"
  timeout 180 "$PY" scripts/bench_kernels.py --device cuda --smoke "${bench_args[@]}"
  timeout 120 "$PY" scripts/bench_kernels.py --device cpu --smoke
  step "dry run passed"
  exit 0
fi

step "GPU"
timeout 30 nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv
timeout 60 "$PY" -c 'import torch, triton; assert torch.cuda.is_available(), "torch sees no CUDA device"; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.get_device_name())'

step "kernel tests, compiled for CUDA"
timeout 420 "$PY" -m pytest -q -p no:cacheprovider tests/kernels

step "model and engine on CUDA against the reference, with --verify-indexer"
timeout 300 "$PY" -m pytest -q -p no:cacheprovider "${ENGINE_TESTS[@]}"

step "bandwidth"
timeout 240 "$PY" scripts/bench_kernels.py --device cuda "${bench_args[@]}"
