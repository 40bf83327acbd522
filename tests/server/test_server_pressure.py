"""Memory pressure through the real HTTP server (ARCHITECTURE.md invariant 5): more requests than a
2,048-token pool holds at their full length all answer 200, unchanged, some of them after a
retraction; a request that can never fit is refused with a 400 that names the numbers."""

from __future__ import annotations

import json
import random
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest
from live_server import LiveServer, http_status, live_servers

pytestmark = pytest.mark.timeout(300)

# 100 + 100 tokens take two pages of 128; admission bets on nine at once in sixteen pages, and
# loses when they cross into their second page.
REQUESTS, PROMPT, NEW = 12, 100, 100


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory) -> str:
    log = tmp_path_factory.mktemp("pressure") / "server.log"
    with live_servers(LiveServer(tiny_ckpt, log, "--max-total-tokens", "2048")) as (s,):
        yield s.base


def post(base: str, path: str, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(f"{base}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(base: str, path: str) -> str:
    with urllib.request.urlopen(f"{base}{path}", timeout=10) as response:
        return response.read().decode()


def body(i: int, prompt: list[int], max_new_tokens: int = NEW) -> dict:
    sampling = {"max_new_tokens": max_new_tokens, "ignore_eos": True, "temperature": 0.0}
    if i % 2:
        sampling.update(temperature=0.8, seed=100 + i)
    return {"input_ids": prompt, "sampling_params": sampling}


def test_pressure_serves_every_request_unchanged_and_refuses_one_that_never_fits(server):
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 500) for _ in range(PROMPT)] for _ in range(REQUESTS)]
    with ThreadPoolExecutor(REQUESTS) as pool:
        answers = list(pool.map(lambda i: post(server, "/generate", body(i, prompts[i])), range(REQUESTS)))
    for status, answer in answers:
        assert status == 200, answer
        assert answer["meta_info"]["finish_reason"] == "length" and len(answer["output_ids"]) == NEW
    metrics = get(server, "/metrics")
    preemptions = next(float(line.split()[1]) for line in metrics.splitlines()
                       if line.startswith("dsv4_preemptions_total "))
    assert preemptions > 0
    debug = json.loads(get(server, "/debug/requests"))
    assert not debug["requests"]
    assert debug["free_pages"] == debug["total_pages"] == 16 and debug["free_slots"] == debug["total_slots"]

    for i in (REQUESTS - 2, REQUESTS - 1):  # greedy and seeded, served again without pressure
        status, alone = post(server, "/generate", body(i, prompts[i]))
        assert status == 200 and alone["output_ids"] == answers[i][1]["output_ids"], f"request {i}"

    status, refusal = post(server, "/generate", body(0, prompts[0], max_new_tokens=2000))
    assert status == 400
    message = refusal["error"]["message"]
    assert all(n in message for n in ("2000", "100", "2048")), message
    assert http_status(f"{server}/health/ready") == 200
