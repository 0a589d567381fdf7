"""How libgomp's idle workers wait, on the server path: ``lowband edge serve`` single-stream
decode with the command line's default (``OMP_WAIT_POLICY=ACTIVE GOMP_SPINCOUNT=2000000``, set
by ``cli.openmp_wait``) against libgomp's own (``GOMP_SPINCOUNT=300000``, its documented default
spin count, which also tells the command line to leave both variables alone).

A server runs its steps on the engine's thread and loaded the model on the main one; each thread
that enters a parallel region gets an OpenMP team of its own. Arms alternate, a fresh server per
arm and round, one warm-up request, then ``--requests`` timed requests of ``--tokens`` tokens
(``ignore_eos``): tokens/s = completion tokens / request wall time. Prints one JSON line last.

    python -m benchmarks.edge_omp_wait --json                 # the real Gemma 3 270M Q4_K_M
    python -m benchmarks.edge_omp_wait --model DIR --tokens 8 --rounds 1 --requests 1 --json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from benchmarks.stats import spread
from lowband.proc import free_port

ARMS = {"cli_default": {}, "libgomp_default": {"GOMP_SPINCOUNT": "300000"}}
PROMPT = "The history of the printing press begins"


def _post(port: int, body: dict, timeout: float) -> dict:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"lowband edge serve exited with {proc.returncode}")
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
            return
        except OSError:
            time.sleep(0.3)
    raise RuntimeError(f"lowband edge serve not ready within {timeout:.0f} s")


def run_arm(model: str, env_extra: dict, a: argparse.Namespace) -> list[float]:
    """One fresh server with ``env_extra``: tokens/s of each timed request."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(env_extra)
    cmd = [sys.executable, "-m", "cli", "edge", "serve", model, "--port", str(port)]
    cmd += ["--threads", str(a.threads)]
    proc = subprocess.Popen(
        cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True
    )
    try:
        _wait_ready(port, proc, a.start_timeout)
        body = {"prompt": PROMPT, "max_tokens": a.tokens, "temperature": 0, "ignore_eos": True}
        _post(port, body, a.request_timeout)  # warm-up: kernels, caches, the first team
        out = []
        for _ in range(a.requests):
            t = time.perf_counter()
            r = _post(port, body, a.request_timeout)
            out.append(r["usage"]["completion_tokens"] / (time.perf_counter() - t))
        return out
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="GGUF file or model dir (default: the real Gemma 3 270M)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3, help="fresh servers per arm, alternating")
    p.add_argument("--requests", type=int, default=3, help="timed requests per server")
    p.add_argument("--start-timeout", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    model = a.model
    if model is None:
        from benchmarks.real_models import gemma3_270m

        model = str(gemma3_270m())
    runs: dict[str, list[float]] = {name: [] for name in ARMS}
    t0 = time.time()
    for _ in range(a.rounds):
        for name, env in ARMS.items():
            runs[name] += run_arm(model, env, a)
    result = {
        "model": Path(model).name,
        "threads": a.threads,
        "tokens": a.tokens,
        "rounds": a.rounds,
        "requests": a.requests,
        "env": ARMS,
        "tok_s": {name: spread(xs) for name, xs in runs.items()},
        "runs": {name: [round(x, 2) for x in xs] for name, xs in runs.items()},
        "cli_over_libgomp": round(
            statistics.median(runs["cli_default"]) / statistics.median(runs["libgomp_default"]), 3
        ),
        "seconds": round(time.time() - t0, 1),
    }
    rec = {"benchmark": "edge_omp_wait", "result": result}
    if not a.json:
        for name, s in result["tok_s"].items():
            print(f"{name}: {s['median']} tok/s ({s['min']}-{s['max']})")
    print(json.dumps(rec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
