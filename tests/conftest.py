"""Shared fixtures. Multi-process tests use ``spawn``, so every child dies with the test."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Callable, Iterator

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen]]:
    """Start children in their own process group; kill every group at teardown."""
    procs: list[subprocess.Popen] = []

    def start(args: list[str], **kw) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", **kw.pop("env", {}))
        p = subprocess.Popen(args, start_new_session=True, env=env, cwd=kw.pop("cwd", REPO), **kw)
        procs.append(p)
        return p

    yield start
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def tp_head(model, plan, rank: int, h, reduce):
    """Logits of every position of ``h`` (1, T, H) under tensor parallelism: each rank applies
    its rows of the (vocabulary-parallel) LM head and rank 0 gathers them exactly
    (``edge.tp.gather_logits`` with top=0). Rank 0 gets (1, T, V), the others None."""
    import torch

    from edge.tp import exact_reduce, gather_logits

    V = model.config.vocab_size
    a, b = plan.vocab_rows(rank, V)
    if not plan.vocab_split:
        return model.head(h) if rank == 0 else None
    local = model.head(h)[0] if b > a else None
    rows = [
        gather_logits(None if local is None else local[t], plan, rank, V, 0, exact_reduce(reduce))
        for t in range(h.shape[1])
    ]
    return torch.stack(rows).unsqueeze(0) if rank == 0 else None


def run_ranks(fns: list[Callable[[], object]], timeout: float = 60.0) -> list[object]:
    """Run one callable per rank in threads; return results by rank, re-raising the first error."""
    results: list[object] = [None] * len(fns)
    errors: list[BaseException | None] = [None] * len(fns)

    def body(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001 - reported to the test below
            errors[i] = e

    threads = [threading.Thread(target=body, args=(i,), daemon=True) for i in range(len(fns))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
        if t.is_alive():
            raise TimeoutError(f"rank thread still running after {timeout}s")
    for e in errors:
        if e is not None:
            raise e
    return results


PY = sys.executable


# ---- skips are recorded, so CI can refuse an unexpected one -------------------------------------
# A broken install must fail, not turn tests into skips: required modules are imported plainly, and
# the few skips left (root, iproute2, Linux-only) are listed in .ci/allowed-skips. With
# LOWBAND_SKIPS_FILE set, every skipped test's id and reason are written there as JSON lines at
# the end of the session; .ci/check_skips.py compares them with the allow-list.
_SKIPS: list[dict[str, str]] = []


def _record_skip(report: pytest.TestReport | pytest.CollectReport) -> None:
    if report.skipped and not hasattr(report, "wasxfail"):
        reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
        _SKIPS.append({"nodeid": report.nodeid, "reason": reason})


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _record_skip(report)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    _record_skip(report)  # a whole module skipped at import (module-level skip / importorskip)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    path = os.environ.get("LOWBAND_SKIPS_FILE")
    if path:
        import json

        Path(path).write_text("".join(json.dumps(s) + "\n" for s in _SKIPS))
