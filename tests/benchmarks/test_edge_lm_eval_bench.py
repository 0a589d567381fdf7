"""benchmarks.edge_lm_eval: the model it trains learns its task, the task folder is what
lm-eval loads, and the script runs lm-eval's local-completions against the server where
lm_eval is installed (it is not one of lowband's extras; elsewhere the script says it skipped,
with exit status 0, and this test checks that instead)."""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from benchmarks import edge_lm_eval as bench


@pytest.fixture
def one_thread():
    """A model this small runs fastest on one thread (and a busy machine's second thread can
    make each step 100x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def test_the_trained_model_learns_the_task_and_the_untrained_does_not(tmp_path, one_thread):
    docs = bench.documents(12, seed=0)
    assert all(d["choices"][d["answer"]] == chr(ord(d["question"][0]) + 1) for d in docs)
    assert all(len(set(d["choices"])) == 4 for d in docs)
    trained = bench.direct_scores(bench.train(60, seed=0), docs)
    assert bench.accuracy(trained, docs) == 1.0
    assert bench.accuracy(bench.direct_scores(bench.train(0, seed=0), docs), docs) < 0.75
    bench.write_task(tmp_path, docs)
    yaml = (tmp_path / f"{bench.TASK}.yaml").read_text()
    assert f"task: {bench.TASK}" in yaml and str(tmp_path / "docs.jsonl") in yaml
    rows = (tmp_path / "docs.jsonl").read_text().splitlines()
    assert [json.loads(r) for r in rows] == docs


def test_the_script_runs_lm_eval_or_says_it_skipped(capsys) -> None:
    threads = torch.get_num_threads()
    rc = bench.main(["--json", "--docs", "8", "--steps", "60", "--concurrent", "2"])
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0, out
    assert torch.get_num_threads() == threads  # main put the process's setting back
    if importlib.util.find_spec("lm_eval") is None:
        assert "lm_eval is not installed" in out["skipped"]
        return
    assert out["acc"] == out["acc_direct"] == 1.0
    assert out["max_abs_loglik_diff"] < 1e-3
    assert out["server"]["requests_total"] == 8 * 4  # one per choice, trained model's run
    assert out["server"]["requests_failed"] == 0
