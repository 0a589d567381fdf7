"""The pipeline layout (edge.cluster.stage / pipeline / layout): pure schedules, logits bit for
bit those of one device (each layer computed whole by the same kernels), micro-batches in
flight, engine texts equal to one device's, and a lost stage failing the request clearly."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from edge import fastpath
from edge.cluster import ClusterConfig, WorkerConfig, run_worker
from edge.cluster.layout import micro_batches, stage_ranges
from edge.cluster.pipeline import PipelineRunner
from edge.cluster.stage import LayerRange
from edge.engine import ClusterUnavailable, Engine, LocalRunner, Work
from edge.sampling import SamplingParams
from edge.shardio import load_shard
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, Span, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from tests.edge.test_edge_cluster import CFG, _Thread
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)


def write_ckpt(d, layers: int, seed: int):
    """A random checkpoint of ``CFG`` with ``layers`` layers and a byte tokenizer in ``d``."""
    m = LlamaForCausalLM(ModelConfig(**dict(CFG, num_hidden_layers=layers))).eval()
    init_weights(m, std=0.2, seed=seed)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    return d


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_ckpt(tmp_path_factory.mktemp("pipe"), 5, 5)


def test_stage_ranges_split_by_speed_and_memory() -> None:
    assert [(r.lo, r.hi) for r in stage_ranges(18, [1.0, 1.0])] == [(0, 9), (9, 18)]
    assert [(r.lo, r.hi) for r in stage_ranges(18, [2.0, 1.0])] == [(0, 12), (12, 18)]
    # a device whose memory holds 4 layers gets 4, the rest goes to the others
    assert [(r.lo, r.hi) for r in stage_ranges(18, [1.0, 1.0, 1.0], [4, 18, 18])][0] == (0, 4)
    assert sum(r.hi - r.lo for r in stage_ranges(7, [5.0, 0.1, 0.1])) == 7
    assert all(r.hi > r.lo for r in stage_ranges(7, [5.0, 0.1, 0.1]))
    with pytest.raises(ConfigError):
        stage_ranges(4, [1.0, 1.0], [1, 2])  # the devices hold 3 of 4 layers
    with pytest.raises(ConfigError):
        stage_ranges(2, [1.0, 1.0, 1.0])


def test_micro_batches_are_contiguous_and_balanced() -> None:
    items = list("abcdefgh")
    groups = micro_batches(items, [1] * 8, 2)
    assert groups == [list("abcd"), list("efgh")]
    assert micro_batches(items, [1] * 8, 1) == [items]
    assert micro_batches(["a", "b"], [1, 1], 5) == [["a"], ["b"]]
    # a prompt chunk stays whole in its group; every group non-empty, order kept
    g = micro_batches(list("abc"), [30, 1, 1], 3)
    assert [x for grp in g for x in grp] == list("abc") and all(g)


def _start(path, world, group=None, **kw):
    """A pipeline master over ``world`` devices on ``group`` (a new LoopbackGroup by default),
    its workers on threads."""
    group = LoopbackGroup(world, timeout=20) if group is None else group
    comms = group.comms()
    workers = [_Thread(lambda c=c: run_worker(c, WorkerConfig(join_timeout=20))) for c in comms[1:]]
    for w in workers:
        w.start()
    cfg = ClusterConfig(
        devices=world, op_timeout=5.0, join_timeout=20, heartbeat_s=0.3, layout="pipeline", **kw
    )
    return PipelineRunner(comms[0], str(path), cfg), workers


def _stop(runner, workers) -> None:
    runner.close()
    for w in workers:
        w.join(10)
        assert w.error is None


@pytest.mark.parametrize(
    "world,groups,link", [(2, 1, "direct"), (2, 2, "direct"), (3, 3, "direct"), (2, 2, "comm")]
)
def test_pipeline_logits_bit_identical_to_one_device(ckpt, world, groups, link) -> None:
    """Three sequences: prompts of different lengths in one step (chunked prefill), then
    decode steps; every logit equals one device's ragged pass bit for bit. One device and
    the stages decode through the compiled step (a stage's over its layer range), batched
    where a micro-batch holds several sequences."""
    ref = load_shard(ckpt).model
    assert fastpath.active(ref), "the reference must decode through the compiled step"
    caches = {i: ref.new_cache() for i in range(3)}
    runner, workers = _start(ckpt, world, micro_batches=groups, link=link)
    try:
        assert sum(r.hi - r.lo for r in runner.ranges) == 5 and len(runner.ranges) == world
        assert runner.model.fast_decode.range == (runner.ranges[0].lo, runner.ranges[0].hi)
        prompts = {0: [5, 9, 200, 3], 1: [7], 2: [1, 2, 3, 4, 5, 6, 7]}
        work = [Work(slot=i, ids=p, start=0) for i, p in prompts.items()]
        pos = {i: len(p) for i, p in prompts.items()}
        for step in range(4):
            got = runner.forward_batch(work)
            # one device running the same batches (a batch's shape changes a GEMM's rounding
            # on one device too, so the reference runs the step's micro-batches one by one)
            want: list[torch.Tensor] = []
            for grp in micro_batches(work, [len(w.ids) for w in work], groups):
                spans = [Span(caches[w.slot], w.start, len(w.ids)) for w in grp]
                ids = torch.tensor([[t for w in grp for t in w.ids]])
                with torch.inference_mode():
                    h = ref.forward_ragged(ref.embed(ids), spans)
                    rows = [sum(len(x.ids) for x in grp[: k + 1]) - 1 for k in range(len(grp))]
                    want.extend(ref.head(h[0, rows]).float())
            for k, g in enumerate(got):
                assert g is not None and torch.equal(g, want[k]), f"step {step} item {k}"
            work = [
                Work(slot=w.slot, ids=[int(got[k].argmax())], start=pos[w.slot])
                for k, w in enumerate(work)
            ]
            for w in work:
                pos[w.slot] += 1
        assert runner.slot_length(2) == 7 + 3  # the prompt and three fed-back tokens
        h = runner.health()
        assert h["layout"] == "pipeline"
        # where the master's time went: every micro-batch of the 4 steps, every token
        n_groups = len(micro_batches(work, [1] * len(work), groups))
        cyc = h["cycle"]
        assert cyc["steps"] == 4 * n_groups and cyc["rows"] == 12 + 3 * 3
        assert cyc["stage_s"] > 0 and cyc["head_s"] > 0 and cyc["wait_s"] >= 0
    finally:
        _stop(runner, workers)


@pytest.mark.parametrize("world,top", [(2, 0), (2, 3), (3, 0)])
def test_steps_in_flight_across_steps_bit_identical(ckpt, world, top) -> None:
    """Two groups of sequences, each a step behind the other (submit A, submit B, collect A,
    submit A's next step, collect B, ...): every logit equals one device's ragged pass over
    the same group bit for bit; collection keeps the order of submission and a cache whose
    step is in flight cannot be stepped again."""
    ref = load_shard(ckpt).model
    caches = {i: ref.new_cache() for i in range(4)}
    runner, workers = _start(ckpt, world, micro_batches=2)
    try:
        assert runner.lanes == 2
        lanes = [
            [Work(slot=0, ids=[5, 9, 200], start=0), Work(slot=1, ids=[7], start=0)],
            [Work(slot=2, ids=[1, 2], start=0), Work(slot=3, ids=[4, 4, 4, 4], start=0)],
        ]
        flying = [runner.submit(lanes[0], top), runner.submit(lanes[1], top)]
        with pytest.raises(RuntimeError, match="in flight"):
            runner.submit([Work(slot=1, ids=[3], start=1)], top)
        with pytest.raises(RuntimeError, match="order"):
            runner.collect(flying[1])
        with pytest.raises(RuntimeError, match="not collected"):
            runner.forward_batch([Work(slot=5, ids=[3], start=0)])
        for step in range(6):
            g = step % 2
            got = runner.collect(flying[g])
            work = lanes[g]
            spans = [Span(caches[w.slot], w.start, len(w.ids)) for w in work]
            ids = torch.tensor([[t for w in work for t in w.ids]])
            with torch.inference_mode():
                h = ref.forward_ragged(ref.embed(ids), spans)
                rows = [sum(len(x.ids) for x in work[: k + 1]) - 1 for k in range(len(work))]
                want = ref.head(h[0, rows]).float()
            for k, lg in enumerate(got):
                assert lg is not None
                if top:  # the sampler's candidates, one device's values
                    best = torch.topk(want[k], top).indices
                    assert torch.equal(lg[best], want[k][best]), f"step {step} item {k}"
                else:
                    assert torch.equal(lg, want[k]), f"step {step} item {k}"
            lanes[g] = [
                Work(slot=w.slot, ids=[int(got[k].argmax())], start=w.start + len(w.ids))
                for k, w in enumerate(work)
            ]
            flying[g] = runner.submit(lanes[g], top)
        runner.reset()  # drops the answers of the steps still in flight
        assert runner.slot_length(0) == 0
        out = runner.forward_batch([Work(slot=0, ids=[1, 2, 3], start=0)])
        assert out[0] is not None and runner.health()["healthy"]
    finally:
        _stop(runner, workers)


@pytest.mark.parametrize("world,groups,share", [(2, 2, None), (3, 1, None), (2, 2, 0.2)])
def test_split_head_gives_the_samplers_candidates_bit_identical(ckpt, world, groups, share) -> None:
    """With ``top`` > 0 the master and the last stage each compute their vocabulary rows of the
    head: the ``top`` best logits equal one device's bit for bit, the rest are -inf. The cut
    follows ``head_share`` where given (the master's fraction of the rows)."""
    ref = load_shard(ckpt).model
    caches = {i: ref.new_cache() for i in range(3)}
    runner, workers = _start(ckpt, world, micro_batches=groups, head_share=share)
    try:
        V = ref.config.vocab_size
        assert 0 < runner.head_lo < V
        if share is not None:
            assert runner.head_lo == round(V * share)
        assert runner.health()["head_rows"] == [[0, runner.head_lo], [runner.head_lo, V]]
        work = [Work(slot=i, ids=p, start=0) for i, p in enumerate([[5, 9, 200], [7], [1, 2]])]
        pos = {w.slot: len(w.ids) for w in work}
        for step in range(3):
            top = 3 if step != 1 else 1
            got = runner.forward_batch(work, top=top)
            want = []
            for grp in micro_batches(work, [len(w.ids) for w in work], groups):
                spans = [Span(caches[w.slot], w.start, len(w.ids)) for w in grp]
                ids = torch.tensor([[t for w in grp for t in w.ids]])
                with torch.inference_mode():
                    h = ref.forward_ragged(ref.embed(ids), spans)
                    rows = [sum(len(x.ids) for x in grp[: k + 1]) - 1 for k in range(len(grp))]
                    want.extend(ref.head(h[0, rows]).float())
            for k, (g, w) in enumerate(zip(got, want)):
                assert g is not None and g.shape == w.shape
                best = torch.topk(w, top).indices
                assert torch.equal(g[best], w[best]), f"step {step} item {k}"
                finite = torch.isfinite(g)
                assert torch.equal(g[finite], w[finite])  # a half's best: one device's value
                assert int(finite.sum()) <= 2 * top and int(g.argmax()) == int(w.argmax())
            work = [
                Work(slot=w.slot, ids=[int(got[k].argmax())], start=pos[w.slot])
                for k, w in enumerate(work)
            ]
            for w in work:
                pos[w.slot] += 1
    finally:
        _stop(runner, workers)


def test_pipeline_engine_texts_match_one_device(ckpt) -> None:
    params = SamplingParams(max_tokens=10)
    # (compiled, as the stages: the eager path may round differently)
    local = Engine(LocalRunner(load_shard(ckpt).model), ByteTokenizer(), model_name="m")
    want = [local.complete(p, params)[0] for p in ("Hello", "Once upon")]
    local.close()
    runner, workers = _start(ckpt, 2, micro_batches=2)
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m")
        threads = [_Thread(lambda p=p: eng.complete(p, params)) for p in ("Hello", "Once upon")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert [t.result[0] for t in threads] == want
        # a shared prefix is copied on every stage: the second request reuses it
        assert eng.complete("Hello", params)[0] == want[0]
    finally:
        runner.close()
        for w in workers:
            w.join(10)


def test_lost_stage_fails_the_request_clearly(ckpt) -> None:
    group = LoopbackGroup(2, timeout=20)
    comms = group.comms()
    worker = _Thread(lambda: run_worker(comms[1], WorkerConfig(join_timeout=20)))
    worker.start()
    # (over the communicator: closing it is the whole device going away for a thread rank);
    # join_timeout bounds the wait for it to come back, after which the status says so
    cfg = ClusterConfig(
        devices=2, op_timeout=2.0, join_timeout=3, heartbeat_s=30, layout="pipeline", link="comm"
    )
    runner = PipelineRunner(comms[0], str(ckpt), cfg)
    try:
        runner.forward([1, 2, 3], 0)
        comms[1].close()  # the stage's device goes away
        worker.join(10)
        with pytest.raises(ClusterUnavailable, match="pipeline stage failed"):
            runner.forward([4], 3)
        assert not runner.health()["healthy"]
        with pytest.raises(ClusterUnavailable, match="not ready"):
            runner.forward([4], 3)
        status = _await(runner, lambda h: h["status"].startswith("failed: the stage workers"))
        assert "did not come back within 3s" in status["status"] and not status["healthy"]
        assert status["last_failure"].startswith("failed: a stage step")
        with pytest.raises(ClusterUnavailable, match="did not come back"):
            runner.forward([4], 3)
    finally:
        runner.close()


# a request that meets the failure: in its step, or in a prefix copy before it (the engine then
# finds the pipeline re-forming)
FAILED = r"pipeline stage failed|pipeline is not ready \((re-forming: .*)?failed: "


def _await(runner, done, timeout: float = 15.0) -> dict:
    """The runner's /health once ``done(health)`` (polled; the last one seen after
    ``timeout``)."""
    deadline = time.monotonic() + timeout
    h = runner.health()
    while not done(h) and time.monotonic() < deadline:
        time.sleep(0.02)
        h = runner.health()
    return h


def _greedy(ckpt, prompts, params) -> list[str]:
    local = Engine(LocalRunner(load_shard(ckpt).model), ByteTokenizer(), model_name="m")
    try:
        return [local.complete(p, params)[0] for p in prompts]
    finally:
        local.close()


def _count_loads(monkeypatch) -> list[tuple[int, int]]:
    """The layer ranges the workers load a stage of (edge.cluster.worker.load_stage), in order."""
    import edge.cluster.worker as worker_mod

    loads: list[tuple[int, int]] = []
    load_stage = worker_mod.load_stage

    def counted(path, rng, *a, **kw):
        loads.append((rng.lo, rng.hi))
        return load_stage(path, rng, *a, **kw)

    monkeypatch.setattr(worker_mod, "load_stage", counted)
    return loads


def test_a_broken_link_fails_the_request_then_the_pipeline_reforms(ckpt, monkeypatch) -> None:
    """The star link breaks mid-generation: that request fails with a clear error, the master
    re-forms the pipeline with the same worker (which keeps its loaded stage: no second load)
    and the next request gives one device's greedy text."""
    loads = _count_loads(monkeypatch)
    params = SamplingParams(max_tokens=16)
    want = _greedy(ckpt, ["Once upon", "Hello"], params)
    runner, workers = _start(ckpt, 2, micro_batches=2)
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m")
        assert eng.complete("Once upon", params)[0] == want[0]
        relay, sent = runner._relay, [0]

        def cut(s, msg, h):  # the link breaks under the 6th step of the next request
            sent[0] += 1
            if sent[0] == 6:
                runner.hub.drop(1)
            relay(s, msg, h)

        runner._relay = cut
        with pytest.raises(ClusterUnavailable, match="pipeline stage failed"):
            eng.complete("Hello", params)
        h = _await(runner, lambda h: h["healthy"])
        assert h["healthy"] and h["status"] == "ok" and h["reformed"] == 1, h
        assert "a stage step" in h["last_failure"]
        assert eng.complete("Hello", params)[0] == want[1]
        assert eng.complete("Once upon", params)[0] == want[0]
        assert loads == [(runner.ranges[1].lo, runner.ranges[1].hi)]  # loaded once, kept
    finally:
        _stop(runner, workers)


@pytest.mark.parametrize("link", ["direct", "comm"])
def test_a_stage_past_its_deadline_fails_the_request_then_the_pipeline_reforms(
    ckpt, monkeypatch, link
) -> None:
    """A stage answers one step after the master's deadline: the request fails, the pipeline
    re-forms with the same worker, and its late answer (on the communicator, or on the link
    the master dropped) never reaches a later step: the next request gives one device's
    text."""
    import edge.cluster.worker as worker_mod
    from edge.cluster.protocol import StageStep

    params = SamplingParams(max_tokens=8)
    want = _greedy(ckpt, ["Once upon"], params)[0]
    step, calls = worker_mod.HANDLERS[StageStep.OP], [0]

    def slow(comm, cfg, st, msg, tensors):
        calls[0] += 1
        if calls[0] == 12:
            time.sleep(1.5)  # past the master's op_timeout of 1 s
        step(comm, cfg, st, msg, tensors)

    monkeypatch.setitem(worker_mod.HANDLERS, StageStep.OP, slow)
    runner, workers = _start(ckpt, 2, micro_batches=1, link=link)
    runner.cfg = replace(runner.cfg, op_timeout=1.0)  # (started with the usual 5 s)
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m")
        assert eng.complete("Once upon", params)[0] == want
        with pytest.raises(ClusterUnavailable, match="pipeline stage failed"):
            eng.complete("Once upon", params)
        h = _await(runner, lambda h: h["healthy"])
        assert h["healthy"] and h["reformed"] == 1, h
        assert eng.complete("Once upon", params)[0] == want
        assert eng.complete("Once upon", params)[0] == want
    finally:
        _stop(runner, workers)


@pytest.mark.parametrize("world", [2, 3])
def test_a_lost_stage_worker_is_replaced_and_the_pipeline_reforms(ckpt, world, monkeypatch) -> None:
    """The last stage's device dies (its communicator and its link): the request fails, later
    ones fail fast while it is missing, and a newcomer takes its stage (the other stages keep
    theirs loaded); the next request gives one device's greedy text."""
    loads = _count_loads(monkeypatch)
    params = SamplingParams(max_tokens=10)
    want = _greedy(ckpt, ["Once upon"], params)[0]
    group = LoopbackGroup(world, timeout=20)
    runner, workers = _start(ckpt, world, group=group)
    eng = Engine(runner, ByteTokenizer(), model_name="m")
    try:
        assert eng.complete("Once upon", params)[0] == want
        group.kill(world - 1)
        runner.hub.drop(world - 1)  # (a dead process's TCP connections close)
        with pytest.raises(ClusterUnavailable, match=FAILED):
            eng.complete("Once upon", params)
        workers[-1].join(10)
        assert workers[-1].error is not None  # the dead worker's thread ended
        with pytest.raises(ClusterUnavailable, match="not ready"):
            eng.complete("Once upon", params)
        assert runner.health()["status"].startswith(("failed", "re-forming"))
        newcomer = group.join()
        back = _Thread(lambda: run_worker(newcomer, WorkerConfig(join_timeout=20)))
        back.start()
        workers[-1] = back
        h = _await(runner, lambda h: h["healthy"])
        assert h["healthy"] and h["epoch"] >= 1 and h["reformed"] == 1, h
        assert eng.complete("Once upon", params)[0] == want
        # each stage loaded once, the lost one again by the newcomer
        stages = [(r.lo, r.hi) for r in runner.ranges[1:]]
        assert sorted(loads) == sorted(stages + stages[-1:])
    finally:
        _stop(runner, workers)


def test_layer_range_refuses_nonsense() -> None:
    with pytest.raises(ConfigError):
        LayerRange(3, 3, 5)
    with pytest.raises(ConfigError):
        ClusterConfig(devices=2, layout="ring")
    with pytest.raises(ConfigError):
        ClusterConfig(devices=2, micro_batches=0)
    with pytest.raises(ConfigError):
        ClusterConfig(devices=2, head_share=1.0)


def _dev(name, layer_ms, rtt=0.0, mem=1e6):
    from edge.planner import LayoutDevice

    return LayoutDevice(name=name, layer_ms=layer_ms, memory_mb=mem, rtt_ms=rtt)


def test_plan_layout_by_round_trip_speed_and_memory() -> None:
    from edge.planner import plan_layout

    # Wi-Fi (4 ms): tensor parallelism pays 2 * 18 round trips; the model fits the worker
    # too: replicas (one stream on the master alone: one device's cost), not the links
    p = plan_layout(18, 10.0, [_dev("m", 1.0), _dev("w", 1.0, rtt=4.0)])
    assert p.layout == "replica" and p.predicted_ms["tp"] > 140 and p.devices == 2
    assert p.predicted_ms["replica"] == p.predicted_ms["single"]
    # the model fits the master, not the worker: one device wins
    p = plan_layout(18, 10.0, [_dev("m", 1.0), _dev("w", 1.0, rtt=4.0, mem=100)])
    assert p.layout == "single" and p.devices == 1 and "replica" not in p.predicted_ms
    # a fast switch and slow devices: tensor parallelism halves the compute
    p = plan_layout(18, 10.0, [_dev("m", 10.0), _dev("w", 10.0, rtt=0.05)])
    assert p.layout == "tp" and p.devices == 2
    # the model fits no single device: pipeline stages spread its memory
    p = plan_layout(18, 10.0, [_dev("m", 1.0, mem=120), _dev("w", 1.0, rtt=4.0, mem=120)])
    assert p.layout == "pipeline" and sum(p.stages) == 18 and max(p.stages) <= 12
    assert "does not fit" in p.reason and "single" not in p.predicted_ms
    # a worker twice as fast takes about twice the layers
    p = plan_layout(18, 10.0, [_dev("m", 2.0, mem=100), _dev("w", 1.0, rtt=1.0)])
    assert p.layout == "pipeline" and p.stages == (6, 12)
    with pytest.raises(ConfigError):
        plan_layout(18, 10.0, [_dev("m", 1.0, mem=10), _dev("w", 1.0, mem=10)])


def test_auto_keeps_tp_for_tensor_parallel_only_setups(ckpt, tmp_path) -> None:
    from edge.cluster.choose import tp_only

    assert tp_only(str(ckpt), ClusterConfig(devices=2, layout="auto")) is None
    assert "weights" in (tp_only(str(ckpt), ClusterConfig(devices=2, weights=(2.0, 1.0))) or "")
    assert "auto-split" in (tp_only(str(ckpt), ClusterConfig(devices=2, auto_split=True)) or "")


def _busy(name, rtt=0.0):
    """Gemma 3 270M's measured step costs on the 2-core VM (ms per layer at 1, 3, 8 rows)."""
    from edge.planner import LayoutDevice

    b = ((3, 1.11), (8, 2.67))
    return LayoutDevice(name=name, layer_ms=0.61, memory_mb=1e6, rtt_ms=rtt, batch_layer_ms=b)


def test_plan_layout_for_several_streams_ranks_by_aggregate_tokens() -> None:
    """Over Wi-Fi one stream is fastest on one device, while 8 streams in 3 groups keep both
    stages busy: planning for 8 ranks the pipeline above one device (the replicas, where the
    model fits every device, above both); for 1 (the default) the replicas too, one stream
    running on the master alone."""
    from edge.planner import aggregate_tok_s, plan_layout

    devs = [_busy("m"), _busy("w", rtt=4.0)]
    one = plan_layout(18, 10.0, devs)
    assert one.layout == "replica" and one.streams == 1 and "streams" not in one.to_dict()
    assert "one stream runs on the master alone" in one.reason
    busy = plan_layout(18, 10.0, devs, streams=8, groups=3)
    # (the model fits each device: replicas beat the stages there, tests/edge/test_replica.py)
    assert busy.layout == "replica"
    d = busy.to_dict()
    assert d["streams"] == 8 and d["predicted_tok_s"]["pipeline"] > d["predicted_tok_s"]["single"]
    # one stream's figures stay in the plan (a lone stream on the replicas: the master's)
    assert busy.predicted_ms == one.predicted_ms
    assert one.predicted_ms["replica"] == one.predicted_ms["single"]
    # single: 8 rows per step of 18 layers at 2.67 ms; pipeline: 3 groups of 3 rows, the
    # busiest stage's 3 groups (3 * (9 * 1.11 ms + a 2 ms hop each)) outlast one group's round
    # (2 * 10 ms + 6 ms)
    assert aggregate_tok_s("single", 8, (18,), devs) == pytest.approx(8e3 / (18 * 2.67))
    want = 8e3 / (3 * (9 * 1.11 + 2.0))
    assert aggregate_tok_s("pipeline", 8, (9, 9), devs) == pytest.approx(want)
    assert aggregate_tok_s("pipeline", 8, (9, 9), devs, hop_ms=0.5) > want
    # one group cannot hide the link: its round (both stages and the round trip) is the cycle
    far = [_busy("m"), _busy("w", rtt=40.0)]
    got = aggregate_tok_s("pipeline", 8, (9, 9), far, groups=1)
    assert got == pytest.approx(8e3 / (2 * 9 * 2.67 + 42.0))
    assert plan_layout(18, 10.0, far, streams=2, groups=1).layout == "single"
    with pytest.raises(ConfigError):
        plan_layout(18, 10.0, devs, streams=0)


def test_layout_device_step_cost_between_measured_batches() -> None:
    d = _busy("m")
    assert d.step_ms(1) == 0.61 and d.step_ms(3) == 1.11 and d.step_ms(8) == 2.67
    assert d.step_ms(2) == pytest.approx((0.61 + 1.11) / 2)
    assert d.step_ms(16) == pytest.approx(2 * 2.67)  # beyond: the largest batch's per-row cost
    with pytest.raises(ConfigError):
        _busy("m").__class__(name="x", layer_ms=1.0, memory_mb=1.0, batch_layer_ms=((0, 1.0),))
    with pytest.raises(ConfigError):
        ClusterConfig(devices=2, plan_streams=0)


def test_measure_step_ms_runs_batched_steps_and_frees_its_slots(ckpt) -> None:
    from edge.cluster.choose import measure_step_ms

    shard = load_shard(ckpt)
    runner = LocalRunner(shard.model, shard.close)
    try:
        assert measure_step_ms(runner, 3, steps=4) > 0
        assert all(runner.slot_length(s) == 0 for s in (1, 2, 3))
    finally:
        runner.close()
