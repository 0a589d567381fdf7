"""RunSummary: one meaning of ``consistent`` for every run report (train, demo, Flower, compose)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from diloco.metrics import RunSummary

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


def final(h: int, steps: int = 10) -> dict:
    return {"event": "final", "state_hash": h, "steps": steps}


def test_equal_hashes_of_every_expected_worker_are_consistent() -> None:
    run = RunSummary.from_finals(["w0", "w1"], {"w0": final(7), "w1": final(7)}, steps=10)
    assert run.consistent and run.reason is None
    assert run.finished == ("w0", "w1") and run.differ == () and dict(run.missing) == {}
    assert run.to_dict() == {"consistent": True, "missing": {}, "differ": [], "inconsistency": None}


def test_a_missing_worker_is_not_consistent() -> None:
    # The hashes that exist agree: demo and compose used to call this run consistent.
    run = RunSummary.from_finals(["w0", "w1", "w2"], {"w0": final(7), "w1": final(7)})
    assert not run.consistent
    assert dict(run.missing) == {"w2": "no final record"} and run.differ == ()
    assert run.reason == "w2 missing (no final record)"


def test_died_or_left_early_workers_are_missing_with_the_reason() -> None:
    run = RunSummary.from_finals(
        ["w0", "w1", "w2", "w3"],
        {"w0": final(7), "w1": final(7), "w2": final(5, steps=6), "w3": final(7)},
        steps=10,
        exit_codes={"w1": 0, "w3": -9},
    )
    assert not run.consistent and run.finished == ("w0", "w1")
    assert dict(run.missing) == {"w2": "stopped at step 6 of 10", "w3": "exited with code -9"}
    no_record = RunSummary.from_finals(["w0"], {}, exit_codes={"w0": 1})
    assert dict(no_record.missing) == {"w0": "no final record (exit code 1)"}
    assert RunSummary.from_finals(["w0"], {"w0": {"steps": 10}}).missing == {
        "w0": "its final record has no state_hash"
    }


def test_differing_hashes_name_the_odd_workers() -> None:
    run = RunSummary.from_finals(["a", "b", "c"], {"a": final(1), "b": final(2), "c": final(2)})
    assert not run.consistent and run.differ == ("a",) and dict(run.missing) == {}
    assert run.reason == "final state differs: a"
    tie = RunSummary.from_finals(["a", "b"], {"a": final(1), "b": final(2)})
    assert tie.differ == ("b",)  # a tie keeps the first worker's hash as the reference


def test_no_worker_at_all_is_not_consistent() -> None:
    assert not RunSummary.from_finals([], {}).consistent
    assert RunSummary.from_finals([], {}).reason == "no worker reported a final state"


def _metrics(directory: Path, worker: str, *records: dict) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    rows = [{"event": "step", "step": 1}, *records]
    (directory / f"metrics-{worker}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_compose_compare_reports_a_worker_that_started_and_never_finished(tmp_path) -> None:
    sys.path.insert(0, str(REPO / "docker"))
    try:
        import compare
    finally:
        sys.path.remove(str(REPO / "docker"))
    done = dict(final(7), final_eval=2.0, bytes_sent=10, wall_s=1.0, tokens=100)
    _metrics(tmp_path, "site-1", done)
    _metrics(tmp_path, "site-2", done)
    _metrics(tmp_path, "site-3")  # started (wrote steps), no final record
    run = compare.load_run(tmp_path)
    assert run["workers"] == 2 and run["consistent"] is False
    assert run["missing"] == {"site-3": "no final record"}
