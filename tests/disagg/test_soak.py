"""`scripts/soak.py` for 60 seconds: a prefill/decode pair of server processes under memory
pressure (the decode pool at a quarter of demand), 30% client aborts and 5% frame faults."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from pd_processes import REPO


@pytest.mark.timeout(480)
def test_a_60_second_soak_fails_nothing_for_pressure_hangs_nothing_and_leaks_nothing(tiny_ckpt):
    cmd = [sys.executable, str(REPO / "scripts" / "soak.py"), "--model", str(tiny_ckpt), "--duration", "60", "--json"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=450, check=False)
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert summary["hung"] == 0 and summary["client_errors"] == 0, summary
    assert summary["failed_pressure"] == 0, summary["examples"]
    assert summary["unclear_failures"] == 0, summary["examples"]  # fault failures must say why
    assert not summary["leaked"] and not summary["not_ready"], summary
    assert summary["completed"] > 0 and summary["checked"] > 0 and summary["wrong"] == 0, summary
    assert summary["aborted"] > 0, "the soak was meant to abort requests"
    assert summary["passed"] and done.returncode == 0, summary
