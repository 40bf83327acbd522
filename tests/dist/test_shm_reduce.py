"""The shared-memory all-reduce (dsv4/dist/shm_reduce.py), its ranks as threads of this process, each with
its own mapping of the file: every rank gets the same fold of every rank's tensor, collective after
collective (both buffers reused many times), in every dtype it takes; a rank that never comes is a
TimeoutError at the deadline, a peer process that died is PeerDied within the liveness poll."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dsv4.dist import shm_reduce

pytestmark = pytest.mark.skipif(not shm_reduce.supported(), reason="shared-memory all-reduce: x86-64 Linux only")


@pytest.fixture
def group():
    path = shm_reduce.new_path()
    reducers = [shm_reduce.ShmReducer(path, 0, 3, create=True)]
    reducers += [shm_reduce.ShmReducer(path, rank, 3, create=False) for rank in (1, 2)]
    Path(path).unlink()
    yield reducers
    for reducer in reducers:
        reducer.close()


def _on_every_rank(reducers, work) -> list:
    results, errors = [None] * len(reducers), []

    def run(rank):
        try:
            results[rank] = work(rank, reducers[rank])
        except Exception as e:  # noqa: BLE001 (reported below)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(len(reducers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return results


def _tensors(rank: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    shape = (1 + step % 5, 33)
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=g)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_every_rank_gets_the_fold_of_every_ranks_tensor(group, dtype):
    op = "min" if dtype == torch.int64 else "sum"
    steps = 40

    def work(rank, reducer):
        outs = []
        for step in range(steps):
            tensor = _tensors(rank, step, dtype)
            if step % 3 == 0:  # a strided view is reduced in place too
                wide = torch.zeros(tensor.shape[0], 2 * tensor.shape[1], dtype=dtype)
                view = wide[:, ::2]
                view.copy_(tensor)
                reducer.all_reduce(view, op, time.monotonic() + 30)
                tensor = view.clone()
            else:
                reducer.all_reduce(tensor, op, time.monotonic() + 30)
            outs.append(tensor)
        return outs

    results = _on_every_rank(group, work)
    for step in range(steps):
        inputs = [_tensors(rank, step, dtype) for rank in range(3)]
        if op == "min":
            want = torch.stack(inputs).amin(0)
        else:  # summed in fp32 in rank order, rounded once into the dtype
            want = (inputs[0].float() + inputs[1].float() + inputs[2].float()).to(dtype)
        for rank in range(3):
            assert results[rank][step].dtype == dtype
            assert torch.equal(results[rank][step], want), (rank, step)


def test_a_rank_that_never_comes_times_out_at_the_deadline(group):
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="not every rank reached"):
        group[0].all_reduce(torch.ones(4), "sum", time.monotonic() + 0.3)
    assert 0.3 <= time.monotonic() - started < 5


def test_a_peer_process_that_died_is_noticed_within_the_liveness_poll(group):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    group[0]._pids[2] = gone.pid  # (as rank 2's process would have written it)
    started = time.monotonic()
    with pytest.raises(shm_reduce.PeerDied, match=f"rank 2's process {gone.pid} is gone"):
        group[0].all_reduce(torch.ones(4), "sum", time.monotonic() + 30)
    assert time.monotonic() - started < 2


def test_what_it_does_not_serve():
    assert shm_reduce.ShmReducer.serves(torch.zeros(8))
    assert not shm_reduce.ShmReducer.serves(torch.zeros(shm_reduce.SLOT_BYTES // 4 + 1))  # gloo takes it
    assert not shm_reduce.ShmReducer.serves(torch.zeros(8, dtype=torch.float64))
    assert not shm_reduce.ShmReducer.serves(torch.zeros(8, device="meta"))


def test_a_group_takes_shared_memory_only_where_its_file_fits(monkeypatch):
    free = {"bytes": shm_reduce.file_bytes(2)}
    monkeypatch.setattr(shm_reduce.shutil, "disk_usage", lambda path: type("Usage", (), {"free": free["bytes"]}))
    assert shm_reduce.room_for(2) and not shm_reduce.room_for(3)  # (a full tmpfs would SIGBUS on first touch)
    free["bytes"] -= 1
    assert not shm_reduce.room_for(2)
