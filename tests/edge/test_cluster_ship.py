"""A TP cluster whose worker has no model copy: the master ships it (edge.cluster.ship) at
assignment, the worker loads it from its cache and the texts are one device's; a worker
without a cache directory is refused with a reason, and nobody waits on the other."""

from __future__ import annotations

import pytest

from edge.cluster.master import ClusterConfig, MasterRunner
from edge.cluster.worker import WorkerConfig, run_worker
from edge.engine import Engine
from edge.sampling import SamplingParams
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from tests.edge.test_edge_cluster import CFG, _local_engine, _Thread
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, std=0.2, seed=5)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    return d


def _cluster(ckpt, worker: WorkerConfig):
    master, wcomm = LoopbackGroup(2, timeout=20).comms()
    w = _Thread(lambda: run_worker(wcomm, worker))
    w.start()
    cfg = ClusterConfig(devices=2, op_timeout=5.0, join_timeout=20, heartbeat_s=0.3, ship=True)
    return w, lambda: MasterRunner(master, ckpt, cfg)


def test_a_worker_without_the_model_gets_it_shipped(ckpt, tmp_path) -> None:
    params = SamplingParams(max_tokens=12)
    local = _local_engine(ckpt)
    want = local.complete("Once upon", params)[0]
    local.close()
    # the worker's own path does not exist: only the shipment can serve it
    cache = tmp_path / "cache"
    cfg = WorkerConfig(model_dir=str(tmp_path / "nothing"), cache_dir=str(cache), join_timeout=20)
    w, start = _cluster(ckpt, cfg)
    runner = start()
    try:
        assert (
            Engine(runner, ByteTokenizer(), model_name="m").complete("Once upon", params)[0] == want
        )
    finally:
        runner.close()
        w.join(10)
    assert w.error is None
    shipped = {p.relative_to(next(cache.iterdir())) for p in cache.rglob("*") if p.is_file()}
    assert shipped == {p.relative_to(ckpt) for p in ckpt.rglob("*") if p.is_file()}


def test_a_worker_without_a_cache_directory_is_refused_with_the_reason(ckpt, tmp_path) -> None:
    # the refused worker then waits join_timeout for a master that has given up on it: the
    # shortest that still lets it join on a loaded machine (the test waits for it to end)
    w, start = _cluster(ckpt, WorkerConfig(model_dir=str(ckpt), join_timeout=8))
    with pytest.raises(ConfigError, match="--cache-dir"):
        start()
    w.join(30)


def _pipeline(ckpt, worker: WorkerConfig):
    from edge.cluster.pipeline import PipelineRunner

    master, wcomm = LoopbackGroup(2, timeout=20).comms()
    w = _Thread(lambda: run_worker(wcomm, worker))
    w.start()
    cfg = ClusterConfig(
        devices=2, op_timeout=5.0, join_timeout=20, heartbeat_s=0.3, ship=True, layout="pipeline"
    )
    return w, wcomm, lambda: PipelineRunner(master, str(ckpt), cfg)


def test_a_pipeline_stage_without_the_model_gets_it_shipped_once(
    ckpt, tmp_path, monkeypatch
) -> None:
    """The stage worker has no model path, only a cache directory: the first start ships the
    checkpoint, the second finds it there (no chunk asked for), and both give one device's
    greedy text."""
    import edge.cluster.pipeline as pipeline

    served: list[int] = []

    def counted(*a, **kw):
        served.append(offer(*a, **kw))
        return served[-1]

    offer = pipeline.offer
    monkeypatch.setattr(pipeline, "offer", counted)
    params = SamplingParams(max_tokens=12)
    local = _local_engine(ckpt)
    want = local.complete("Once upon", params)[0]
    local.close()
    cache = tmp_path / "cache"
    for _ in range(2):
        w, _, start = _pipeline(ckpt, WorkerConfig(cache_dir=str(cache), join_timeout=20))
        runner = start()
        try:
            eng = Engine(runner, ByteTokenizer(), model_name="m")
            assert eng.complete("Once upon", params)[0] == want
        finally:
            runner.close()
            w.join(10)
        assert w.error is None
    assert served[0] > 0 and served[1] == 0  # the second start: a cache hit
    shipped = {p.relative_to(next(cache.iterdir())) for p in cache.rglob("*") if p.is_file()}
    assert shipped == {p.relative_to(ckpt) for p in ckpt.rglob("*") if p.is_file()}


def test_a_pipeline_stage_without_a_cache_directory_is_refused(ckpt) -> None:
    w, wcomm, start = _pipeline(ckpt, WorkerConfig(model_dir=str(ckpt), join_timeout=20))
    with pytest.raises(ConfigError, match="--cache-dir"):
        start()
    wcomm.close()  # (the refused worker would wait join_timeout for its next assignment)
    w.join(10)
    assert not w.is_alive()
