"""Smoke run of the liveness soak (``benchmarks.chaos --tiny``): it injects faults, heals, and
prints its JSON line; no completed stream may carry a wrong text."""

from __future__ import annotations

import json
import subprocess

import pytest

from tests.conftest import PY, REPO

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_chaos_soak_tiny_prints_its_json():
    out = subprocess.run(
        # --tiny's 0.3 min of faults cut to 0.1: still at least one fault (the first comes 2-4 s
        # in) under the load waves; test_edge_chaos and test_train_chaos cover each kind
        [PY, "-m", "benchmarks.chaos", "--tiny", "--minutes", "0.1", "--json"],
        capture_output=True,
        text=True,
        timeout=230,
        cwd=REPO,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    for key in (
        "faults_injected",
        "recovered",
        "max_recovery_s",
        "requests_ok",
        "requests_failed_with_clear_error",
        "requests_wrong",
        "lost_progress_steps",
    ):
        assert key in r
    assert r["faults_injected"] >= 1
    assert r["requests_ok"] > 0 and r["requests_wrong"] == 0
    assert r["bad_requests_refused"] > 0
