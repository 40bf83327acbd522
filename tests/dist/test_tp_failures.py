"""A TP=2 server (`python -m dsv4 serve --tp-size 2`, gloo on 127.0.0.1) under failure: a rank
killed during decode, SIGTERM to the launcher, two "nodes" on loopback, and configurations that
must fail at startup with a clear message. Every wait is bounded; every process is stopped."""

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.server.live_server import REPO, SHARED_CORES, LiveServer, free_port, live_servers

STARTUP_FAILURE_TIMEOUT_S = 90.0


def children(pid: int) -> list[int]:
    """Live (not zombie) processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def generate(base: str, prompt: list[int], max_new_tokens: int, timeout: float = 60) -> tuple[int, dict]:
    body = {"input_ids": prompt, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0,
                                                     "ignore_eos": True}}
    request = urllib.request.Request(f"{base}/generate", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def ready_body(base: str) -> tuple[int | None, dict]:
    try:
        with urllib.request.urlopen(f"{base}/health/ready", timeout=2) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None, {}


def tp_server(ckpt, tmp_path, name, *extra):
    return LiveServer(ckpt, tmp_path / f"{name}.log", "--tp-size", "2", "--dist-timeout", "10", *extra)


def test_kill_9_of_a_rank_during_decode_stops_the_group_naming_it(tiny_ckpt, tmp_path):
    server = tp_server(tiny_ckpt, tmp_path, "kill")
    with live_servers(server):
        launcher = server._process.pid
        (rank1,) = children(launcher)
        result = {}
        request = threading.Thread(target=lambda: result.update(out=generate(server.base, [5, 6, 7], 3000)))
        request.start()
        deadline = time.monotonic() + 30
        while json.loads(urllib.request.urlopen(f"{server.base}/debug/requests", timeout=2).read())["tick"] < 20:
            assert time.monotonic() < deadline, "no decode ticks"
            time.sleep(0.05)
        os.kill(rank1, signal.SIGKILL)
        killed = time.monotonic()
        while (status := ready_body(server.base))[0] == 200:
            assert time.monotonic() - killed < 10, "still ready 10 s after a rank was killed"
            time.sleep(0.1)
        if status[0] == 503:  # the server may already be gone; when it answers, the rank comes first
            assert "rank 1 exited, killed by SIGKILL" in status[1]["reasons"][0], status
        request.join(timeout=30)
        assert not request.is_alive()
        code, body = result["out"]
        assert code == 503 and "rank 1 exited, killed by SIGKILL" in json.dumps(body), (code, body)
        assert server.wait_exit(timeout=30) != 0
        assert not alive(rank1) and not children(launcher)


def test_sigterm_to_the_launcher_stops_every_rank(tiny_ckpt, tmp_path):
    server = tp_server(tiny_ckpt, tmp_path, "term")
    with live_servers(server):
        launcher = server._process.pid
        ranks = children(launcher)
        assert len(ranks) == 1
        # (longer than the tiny model's index_topk * 4 tokens: its indexer scores, and sums them across ranks)
        code, body = generate(server.base, list(range(1, 100)), 4)
        assert code == 200 and len(body["output_ids"]) == 4
        debug = json.loads(urllib.request.urlopen(f"{server.base}/debug/requests", timeout=5).read())
        assert debug["tp_size"] == 2 and len(debug["rank_ticks"]) == 2 and debug["slowest_collective"]["seconds"] > 0
        metrics = urllib.request.urlopen(f"{server.base}/metrics", timeout=5).read().decode()
        for op in ("broadcast(plan)", "all_reduce(attn.out)", "all_reduce(indexer.scores)", "all_reduce(ffn.out)",
                   "all_reduce(consensus)"):
            assert f'dsv4_collective_seconds_count{{op="{op}"}}' in metrics, op
        server.send_signal(signal.SIGTERM)
        assert server.wait_exit(timeout=30) == 0
        deadline = time.monotonic() + 10
        while any(alive(pid) for pid in ranks):
            assert time.monotonic() < deadline, "a rank outlived its launcher"
            time.sleep(0.05)


def test_two_nodes_on_loopback_serve_what_one_rank_serves(tiny_ckpt, tmp_path):
    addr = f"127.0.0.1:{free_port()}"
    nodes = ("--nnodes", "2", "--dist-init-addr", addr)
    with open(tmp_path / "node1.log", "wb") as log:
        node1 = subprocess.Popen([sys.executable, "-m", "dsv4", "serve", "--model", str(tiny_ckpt), "--dtype",
                                  "float32", *SHARED_CORES, "--tp-size", "2", "--dist-timeout", "10", *nodes, "--node-rank", "1"],
                                 cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    try:
        node0 = tp_server(tiny_ckpt, tmp_path, "node0", *nodes, "--node-rank", "0")
        alone = LiveServer(tiny_ckpt, tmp_path / "tp1.log")
        with live_servers(node0, alone):
            assert not children(node0._process.pid)  # one rank per node: nothing spawned
            for prompt in ([3], list(range(2, 140)), list(range(7, 400))):
                two, one = generate(node0.base, prompt, 8), generate(alone.base, prompt, 8)
                assert two[0] == one[0] == 200
                assert two[1]["output_ids"] == one[1]["output_ids"], prompt
        assert node1.wait(timeout=30) != 0  # its group ended with node 0
    finally:
        if node1.poll() is None:
            node1.kill()
            node1.wait(timeout=10)


def serve_fails(ckpt, *args) -> str:
    """Runs a serve that must fail at startup; its output."""
    done = subprocess.run([sys.executable, "-m", "dsv4", "serve", "--model", str(ckpt), "--port", str(free_port()),
                           *args], check=False, cwd=REPO, capture_output=True, text=True, timeout=STARTUP_FAILURE_TIMEOUT_S)
    assert done.returncode != 0
    return done.stderr


def test_a_tp_size_that_does_not_divide_the_model_fails_at_startup(tiny_ckpt):
    assert "--tp-size 3 does not divide the model's attention heads (4)" in serve_fails(tiny_ckpt, "--tp-size", "3")


def test_a_node_that_never_joins_is_named_within_the_deadline(tiny_ckpt):
    started = time.monotonic()
    output = serve_fails(tiny_ckpt, "--tp-size", "2", "--nnodes", "2", "--node-rank", "0", "--dist-join-timeout", "3",
                         "--dist-init-addr", f"127.0.0.1:{free_port()}")
    assert "rank 1 (node 1) did not join the group at 127.0.0.1:" in output and "within 3 s" in output, output
    assert time.monotonic() - started < 60


@pytest.fixture(autouse=True)
def no_orphans():
    """No process this test started outlives it."""
    yield
    assert not children(os.getpid()), "a test left a child process behind"
