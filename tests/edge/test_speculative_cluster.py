"""Speculative decoding across devices (loopback, no root): a verification pass carries the next
token and its k draft tokens through the pipeline's stages (or the TP split) as one row group,
one traversal per pass; greedy texts equal one device's without speculation, rejected rows are
rolled back on every stage; with lanes, a draft's cost is weighed against the whole cycle."""

from __future__ import annotations

import pytest
import torch

from edge.cluster.master import MasterRunner
from edge.draft import DraftModel
from edge.engine import Engine, LocalRunner
from edge.lookup import LookupDrafter
from edge.sampling import SamplingParams
from edge.shardio import load_shard
from edge.speculative import DraftLength, SpecConfig, Speculation
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from tests.edge.test_edge_cluster import _start_cluster
from tests.edge.test_engine_lanes import Lanes
from tests.edge.test_pipeline import _start, _stop
from tests.edge.test_speculative import PROMPTS, _model
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(300)


def _ckpt(d):
    """The tiny Llama whose greedy texts loop (drafts both kept and rejected), two layers:
    one per stage."""
    save_pretrained(_model(), d)
    ByteTokenizer().save(d)
    return d


def _lookup() -> Speculation:
    return Speculation(SpecConfig(draft_max=6, adaptive=False), LookupDrafter)


def _draft_model() -> Speculation:
    """A draft model on the master (``--draft``): the target's weights with its head moved
    by noise, so its drafts are partly kept and partly rejected."""
    draft = _model()
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        w = draft.lm_head.weight
        w.add_(torch.randn(w.shape, generator=g) * 0.3)
    dm = DraftModel(draft, ByteTokenizer())
    return Speculation(SpecConfig(draft_max=6, adaptive=False), dm.drafter)


def _texts(engine: Engine, params: SamplingParams) -> list[str]:
    return [engine.complete(p, params)[0] for p in PROMPTS]


@pytest.mark.parametrize("drafter", ["lookup", "draft-model"])
@pytest.mark.parametrize("layout", ["pipeline", "tp"])
def test_greedy_speculation_across_devices_equals_one_device(tmp_path, layout, drafter) -> None:
    d = _ckpt(tmp_path)
    params = SamplingParams(max_tokens=48, ignore_eos=True)
    local = Engine(LocalRunner(load_shard(d).model), ByteTokenizer(), model_name="m")
    want = _texts(local, params)
    local.close()
    if layout == "pipeline":
        runner, workers = _start(d, 2, micro_batches=2)
    else:
        runner, workers = _start_cluster(str(d), 2, LoopbackGroup(2, timeout=20))
        assert isinstance(runner, MasterRunner)
    spec = _lookup() if drafter == "lookup" else _draft_model()
    eng = Engine(runner, ByteTokenizer(), model_name="m", speculation=spec)
    try:
        steps0 = runner.times.steps if layout == "pipeline" else 0
        assert _texts(eng, params) == want
        m = eng.metrics.snapshot()
        # drafts were kept and rejected (the stages rolled back and wrote over them)
        assert 0 < m["spec_accepted_tokens_total"] < m["spec_draft_tokens_total"]
        if layout == "pipeline":  # one traversal per pass: each kept draft token saves one
            # (a prompt's one prefill step gives its first token, every other step one pass)
            passes = runner.times.steps - steps0
            assert passes == m["completion_tokens_total"] - m["spec_accepted_tokens_total"]
    finally:
        eng.close()
        if layout == "pipeline":
            _stop(runner, workers)
        else:
            runner.close()
            for w in workers:
                w.join(10)


def test_lanes_weigh_a_draft_against_the_whole_cycle(monkeypatch) -> None:
    """Four streams in two lanes: each step holds two of them while the other lane's step is
    in flight; the draft length is chosen for the four sequences sharing the devices' cycle,
    and a landed step's time is counted as the cost of every row in that cycle."""
    seen: list[int] = []
    choose = DraftLength.choose

    def spy(self, cost, batch: int = 1, added: int = 0) -> int:
        seen.append(batch)
        return choose(self, cost, batch, added)

    monkeypatch.setattr(DraftLength, "choose", spy)
    model = _model()
    params = SamplingParams(max_tokens=24)
    alone = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    want = _texts(alone, params)
    alone.close()
    runner = Lanes(model, lanes=2)
    eng = Engine(
        runner,
        ByteTokenizer(),
        model_name="m",
        parallel=4,
        speculation=Speculation(SpecConfig(draft_max=4), LookupDrafter),
    )
    rows: list[int] = []
    observe = eng.pass_cost.observe
    monkeypatch.setattr(eng.pass_cost, "observe", lambda r, s: (rows.append(r), observe(r, s)))
    try:
        from tests.edge.test_engine_batch import _concurrently

        got = _concurrently(eng, [*PROMPTS, PROMPTS[0]], params)
        assert got[:3] == want and got[3] == want[0]
        assert runner.most == 2
        # a lane holds two sequences; with the other lane in flight, four share the cycle
        assert max(seen) >= 4
        assert max(rows) >= 4
    finally:
        eng.close()
