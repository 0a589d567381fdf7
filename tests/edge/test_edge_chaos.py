"""Issue 10, edge serving: a paused master or worker, and a 3 MB prompt, do not take the
cluster down for good: /health returns to 200 and greedy answers equal the fault-free ones."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from typing import IO

import pytest

from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from lowband.proc import free_port
from tests.chaos_helpers import wait_for
from tests.conftest import tiny_llama

pytestmark = [pytest.mark.chaos, pytest.mark.slow, pytest.mark.timeout(240)]

RECOVERY_BOUND_S = 60.0  # stated bound: back to 200 within this after SIGCONT (loaded CI box)


def _get(url: str) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")
    except OSError:
        return 0, {}


def _post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                        out.append(int(d))
            except (OSError, IndexError, ValueError):
                pass
    return out


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("edge-chaos")
    m = LlamaForCausalLM(
        tiny_llama(hidden_size=64, intermediate_size=128, max_position_embeddings=256)
    ).eval()
    init_weights(m, std=0.2, seed=11)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    return d


def _edge_run(ckpt, tmp_path, procs) -> tuple[subprocess.Popen, int, IO[str]]:
    """``lowband edge run CKPT --devices 2`` in its own session, output to tmp_path/edge.log
    (the open file, for the test to close), once /health says 200: (process, port, log)."""
    port = free_port()
    log = open(tmp_path / "edge.log", "w")
    args = [sys.executable, "-m", "cli", "edge", "run", str(ckpt), "--devices", "2"]
    p = subprocess.Popen(
        [*args, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )
    procs.append(p)
    health = f"http://127.0.0.1:{port}/health"
    wait_for(lambda: _get(health)[0] == 200, 120, "the cluster to come up")
    return p, port, log


REQ = {"prompt": "The quick brown fox", "max_tokens": 12, "temperature": 0}


@pytest.mark.parametrize("victim", ["master", "worker"])
def test_paused_role_heals_and_answers_stay_equal(ckpt, tmp_path, procs, victim):
    p, port, log = _edge_run(ckpt, tmp_path, procs)
    base = f"http://127.0.0.1:{port}"
    status, ref = _post(base + "/v1/completions", REQ)
    assert status == 200, ref
    # The first event: a ~3 MB prompt is refused quickly and costs the cluster nothing.
    # Before, it was tokenized first (~8 s, the master's heartbeats starved) and refused only
    # then. The event, not the time: it is refused by the character bound, before tokenizing
    # (the tokenizer's refusal counts tokens, not characters), within _post's 60 s deadline.
    status, err = _post(base + "/v1/completions", {"prompt": "word " * 600_000, "max_tokens": 1})
    assert status == 400 and err["error"]["code"] == "context_length_exceeded", err
    assert "(3000000 characters)" in err["error"]["message"], err
    assert _get(base + "/health")[0] == 200
    workers = wait_for(lambda: _children(p.pid), 10, "the worker process")
    pid = p.pid if victim == "master" else workers[0]
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(6.0)  # > the coordinator's deadline (2 × 1 s) and its ZMTP timeout
    finally:
        os.kill(pid, signal.SIGCONT)
    t = time.monotonic()
    wait_for(lambda: _get(base + "/health")[0] == 200, RECOVERY_BOUND_S, "/health 200 again")
    recovery = time.monotonic() - t

    # Right after SIGCONT a paused master still believes it is healthy until it learns it was
    # declared lost; the cluster then re-forms, so answers may take longer than /health.
    last: list = []

    def answered():
        s, out = _post(base + "/v1/completions", REQ)
        last[:] = [s, out]
        return out if s == 200 else None

    try:
        out = wait_for(answered, RECOVERY_BOUND_S, "a completion after the fault", every=0.5)
    except AssertionError as exc:
        tail = (tmp_path / "edge.log").read_text()[-3000:]
        raise AssertionError(f"{exc}; last answer {last}; log tail:\n{tail}") from None
    assert out["choices"][0]["text"] == ref["choices"][0]["text"]
    assert p.poll() is None and all(os.path.exists(f"/proc/{w}") for w in workers)
    print(f"{victim} paused 6 s: /health 200 again {recovery:.1f}s after SIGCONT")
    log.close()
    text = (tmp_path / "edge.log").read_text()
    assert "Traceback" not in text, text[-3000:]


def test_bad_requests_among_16_concurrent_streams(ckpt, tmp_path, procs):
    """Oversize (5 MB), malformed JSON and a bad field, sent among 16 concurrent greedy
    streams: each bad one gets a JSON 4xx, every stream the fault-free text."""
    import threading

    from benchmarks.chaos import stream, wave

    _, port, log = _edge_run(ckpt, tmp_path, procs)
    status, ref = stream(port)
    assert status == "ok" and ref, ref
    counts = dict(ok=0, clear=0, unclear=0, wrong=0, bad_refused=0)
    for _ in range(2):
        wave(port, 16, ref, counts, threading.Lock())
    assert counts == dict(ok=32, clear=0, unclear=0, wrong=0, bad_refused=6)
    assert _get(f"http://127.0.0.1:{port}/health")[0] == 200
    log.close()
    assert "Traceback" not in (tmp_path / "edge.log").read_text()
