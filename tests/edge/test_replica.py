"""The replica layout (edge.cluster.replica): the whole model on every device, each running its
own streams. Logits bit for bit one device's (every device runs the same kernels over the same
rows: the compiled step computes each row as its token alone), streams placed on both devices,
caches moved, copied and dropped, a lost worker failing the request clearly, and the planner
choosing it where it fits and several streams are planned for."""

from __future__ import annotations

import threading

import pytest
import torch

from edge.cluster import ClusterConfig, WorkerConfig, run_worker
from edge.cluster.replica import MIGRATE_TOKENS, ReplicaRunner, move_home, split_pays
from edge.engine import ClusterUnavailable, Engine, LocalRunner, Work
from edge.sampling import SamplingParams
from edge.shardio import load_shard
from lowband.errors import ConfigError
from lowband.models.llama import Span
from lowband.models.tokenizer import ByteTokenizer
from tests.edge.test_edge_cluster import _Thread
from tests.edge.test_pipeline import write_ckpt
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_ckpt(tmp_path_factory.mktemp("replica"), 3, 7)


# ms of one decoder layer per step of that many rows: no gain from batching (splitting the
# streams over the devices pays from 2 streams on), and batching for free (it never pays)
LINEAR = ((1, 10.0), (8, 80.0))
FLAT = ((1, 10.0), (8, 10.0))


def _start(path, world=2, step_ms=LINEAR, **kw):
    group = LoopbackGroup(world, timeout=20)
    comms = group.comms()
    workers = [_Thread(lambda c=c: run_worker(c, WorkerConfig(join_timeout=20))) for c in comms[1:]]
    for w in workers:
        w.start()
    cfg = ClusterConfig(
        devices=world, op_timeout=5.0, join_timeout=20, heartbeat_s=0.3, layout="replica", **kw
    )
    return ReplicaRunner(comms[0], str(path), cfg, step_ms=step_ms), workers, comms


def _stop(runner, workers) -> None:
    runner.close()
    for w in workers:
        w.join(10)
        assert w.error is None


class _Ref:
    """One device running the same groups (a group's rows as one ragged pass)."""

    def __init__(self, path) -> None:
        self.model = load_shard(path).model
        self.caches: dict = {}

    def step(self, group: list[Work]) -> list[torch.Tensor]:
        spans = [
            Span(self.caches.setdefault(w.slot, self.model.new_cache()), w.start, len(w.ids))
            for w in group
        ]
        ids = torch.tensor([[t for w in group for t in w.ids]])
        rows = [sum(len(x.ids) for x in group[: k + 1]) - 1 for k in range(len(group))]
        with torch.inference_mode():
            h = self.model.forward_ragged(self.model.embed(ids), spans)
            return list(self.model.head(h[0, rows]).float())


def _same(got: torch.Tensor, want: torch.Tensor, top: int) -> None:
    if not top:
        assert torch.equal(got, want)
        return
    v, i = torch.topk(want, top)  # the worker's candidates equal one device's, -inf elsewhere
    assert torch.equal(got[i], v) and int(torch.isfinite(got).sum()) == top


@pytest.mark.parametrize("top,link", [(0, "direct"), (3, "direct"), (0, "comm")])
def test_groups_in_flight_on_both_devices_bit_identical(ckpt, top, link) -> None:
    """Two groups a step behind each other (submit A, submit B, collect A, ...): A lands on
    the master (nothing in flight), B on the worker (the master busy); every logit equals
    one device's pass over the same group bit for bit (top 0: the worker's hidden rows
    through the master's head; top k: its k best logits)."""
    ref = _Ref(ckpt)
    runner, workers, _ = _start(ckpt, link=link)
    try:
        assert runner.lanes == 2  # one per device (ClusterConfig.replica_lanes)
        prompts = {0: [5, 9, 200, 3], 1: [7], 2: [1, 2, 3], 3: [4, 4]}
        lanes = {"A": [0, 1], "B": [2, 3]}
        work = {k: [Work(s, prompts[s], 0) for s in v] for k, v in lanes.items()}
        pos = {s: len(p) for s, p in prompts.items()}
        fa = runner.submit(work["A"], top)
        fb = runner.submit(work["B"], top)
        for step in range(4):
            for name, f in (("A", fa), ("B", fb)):
                got = runner.collect(f)
                want = ref.step(work[name])
                for g, w in zip(got, want):
                    assert g is not None
                    _same(g, w, top if name == "B" else 0)  # (the master: every logit)
                nxt = [
                    Work(w.slot, [int(g.argmax())], pos[w.slot]) for w, g in zip(work[name], got)
                ]
                for w in nxt:
                    pos[w.slot] += 1
                work[name] = nxt
                if step < 3:
                    f2 = runner.submit(nxt, top)
                    fa, fb = (f2, fb) if name == "A" else (fa, f2)
        h = runner.health()
        assert h["layout"] == "replica" and h["slots"] == [2, 2]
        rows = h["cycle"]["rows"]
        assert rows == [5 + 3 * 2, 5 + 3 * 2]  # both devices ran rows: a prompt, 3 decodes
        assert runner.slot_length(0) == 4 + 3  # the prompt and three fed-back tokens
    finally:
        _stop(runner, workers)


def test_engine_texts_match_one_device(ckpt) -> None:
    params = SamplingParams(max_tokens=8)
    prompts = ["Hello", "Once upon", "The cat", "A long time ago"]
    local = Engine(LocalRunner(load_shard(ckpt).model), ByteTokenizer(), model_name="m")
    want = [local.complete(p, params)[0] for p in prompts]
    local.close()
    runner, workers, _ = _start(ckpt)
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=4)
        assert eng.lanes == 2
        # the four requests admitted together (the scheduler held until they all wait)
        assert _run_streams(eng, prompts, params) == want
        rows = runner.health()["cycle"]["rows"]
        assert rows[0] > 0 and rows[1] > 0, rows  # both devices ran streams
        # a lone stream whose prefix is cached (on either device): the same text
        assert eng.complete("Hello", params)[0] == want[0]
        assert eng.complete("The cat", params)[0] == want[2]
        eng.close()
    finally:
        _stop(runner, workers)


def test_eight_streams_in_four_lanes_two_per_device_match_one_device(ckpt) -> None:
    """8 streams, 4 lanes (2 per device) of 2 streams: each device holds 2 lanes' caches
    (4 each) and the greedy texts are one device's."""
    params = SamplingParams(max_tokens=8)
    prompts = ["Hello", "Once upon", "The cat", "A long time ago", "Zebra", "x", "Hi all", "So"]
    local = Engine(LocalRunner(load_shard(ckpt).model), ByteTokenizer(), model_name="m")
    want = [local.complete(p, params)[0] for p in prompts]
    local.close()
    runner, workers, _ = _start(ckpt, replica_lanes=2)
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=8)
        assert eng.lanes == 4
        assert _run_streams(eng, prompts, params) == want
        h = runner.health()
        assert h["slots"] == [4, 4] and h["lanes"] == 4 and h["devices"] == 2
        assert h["cycle"]["moved"] == 0  # each lane's streams stayed on their device
        eng.close()
    finally:
        _stop(runner, workers)


def test_a_lone_stream_comes_home_when_its_round_trips_outweigh_recomputing() -> None:
    assert not move_home(100, 10, 4.0, 2.0)  # 10 tokens x 4 ms < 100 positions x 2 ms
    assert move_home(100, 60, 4.0, 2.0)
    assert not move_home(100, 0, 1e3, 0.1)  # nothing decoded yet: nothing to go by


def test_a_long_cache_on_the_worker_moves_home_by_the_estimate(ckpt) -> None:
    ref = _Ref(ckpt)
    runner, workers, _ = _start(ckpt)
    try:
        assert len(runner.rtt_ms) == 1 and runner.rtt_ms[0] > 0  # measured at start
        long = list(range(1, MIGRATE_TOKENS + 9))
        a = runner.submit([Work(0, [1, 2], 0)])  # the master
        b = runner.submit([Work(1, long, 0)])  # the master busy: the worker
        ref.step([Work(0, [1, 2], 0)])
        ref.step([Work(1, long, 0)])
        runner.collect(a)
        runner.collect(b)
        pos, tok = len(long), 7
        runner.rtt_ms = [1e-6]  # a round trip that costs nothing: it stays (pinned)
        for _ in range(3):
            got = runner.forward_batch([Work(1, [tok], pos)])[0]
            assert torch.equal(got, ref.step([Work(1, [tok], pos)])[0])
            pos, tok = pos + 1, int(got.argmax())
        assert runner.health()["slots"] == [1, 1] and runner.health()["cycle"]["home"] == 0
        # with another step in flight it stays whatever the round trip costs
        runner.rtt_ms = [1e6]
        busy = runner.submit([Work(0, [3], 2)])
        other = runner.submit([Work(1, [tok], pos)])
        ref.step([Work(0, [3], 2)])
        want = ref.step([Work(1, [tok], pos)])[0]
        runner.collect(busy)
        got = runner.collect(other)[0]
        assert torch.equal(got, want) and runner.health()["cycle"]["home"] == 0
        pos, tok = pos + 1, int(got.argmax())
        # alone, 4 tokens decoded x 1000 s > recomputing: recomputed on the master, same bits
        got = runner.forward_batch([Work(1, [tok], pos)])[0]
        assert torch.equal(got, ref.step([Work(1, [tok], pos)])[0])
        h = runner.health()
        assert h["cycle"]["home"] == 1 and h["cycle"]["moved"] == pos
        assert h["slots"] == [2, 0] and runner.slot_length(1) == pos + 1
    finally:
        _stop(runner, workers)


def test_caches_move_copy_drop_and_reset(ckpt) -> None:
    ref = _Ref(ckpt)
    runner, workers, _ = _start(ckpt)
    try:
        busy = runner.submit([Work(0, [1, 2], 0)])  # on the master: nothing was in flight
        remote = runner.submit([Work(1, [3, 4, 5], 0)])  # the master busy: on the worker
        ref.step([Work(0, [1, 2], 0)])
        want = ref.step([Work(1, [3, 4, 5], 0)])[0]
        runner.collect(busy)
        assert torch.equal(runner.collect(remote)[0], want)
        assert runner.health()["slots"] == [1, 1]
        # a prefix of the worker's cache copied: the copy lives on the worker too
        runner.copy_prefix(1, 2, 2)
        assert runner.slot_length(2) == 2 and runner.health()["slots"] == [1, 2]
        ref.caches[2] = ref.model.new_cache()
        ref.caches[2].copy_prefix(ref.caches[1], 2)
        # a lone step of a short cache on the worker moves it to the master (its positions
        # recomputed there, the same bits): the copy, then its source
        got = runner.forward_batch([Work(2, [9], 2)])[0]
        assert torch.equal(got, ref.step([Work(2, [9], 2)])[0])
        assert runner.health()["cycle"]["moved"] == 2 and runner.health()["slots"] == [2, 1]
        got = runner.forward_batch([Work(1, [6], 3)])[0]
        assert torch.equal(got, ref.step([Work(1, [6], 3)])[0])
        assert runner.health()["cycle"]["moved"] == 2 + 3
        assert runner.health()["slots"] == [3, 0]
        with pytest.raises(RuntimeError):
            runner.forward_batch([Work(1, [6], 9)])  # beyond what the cache holds
        runner.drop(2)
        assert runner.slot_length(2) == 0 and runner.health()["slots"] == [2, 0]
        assert runner.health()["cycle"]["rows"] == [2 + 3 + 4, 3]
        with pytest.raises(RuntimeError):
            runner.copy_prefix(2, 3, 1)  # nothing held
        runner.reset()
        assert runner.slot_length(0) == 0 and runner.slot_length(1) == 0
        assert runner.health()["slots"] == [0, 0]
        assert MIGRATE_TOKENS >= 4
    finally:
        _stop(runner, workers)


def test_lost_worker_fails_the_request_clearly(ckpt) -> None:
    runner, workers, comms = _start(ckpt, link="comm")
    try:
        a = runner.submit([Work(0, [1, 2], 0)])
        b = runner.submit([Work(1, [3], 0)])  # on the worker
        runner.collect(a)
        runner.collect(b)
        comms[1].close()  # the worker's device goes away
        workers[0].join(10)
        runner.submit([Work(0, [5], 2)])
        with pytest.raises(ClusterUnavailable, match="replica device failed"):
            runner.collect(runner.submit([Work(1, [4], 1)]))
        assert not runner.health()["healthy"]
        with pytest.raises(ClusterUnavailable, match="not ready"):
            runner.forward([4], 3)
    finally:
        runner.close()


def _dev(name, rtt=0.0, mem=1e6):
    """Gemma 3 270M's measured step costs at one thread (ms per layer at 1, 2, 4, 8 rows)."""
    from edge.planner import LayoutDevice

    b = ((2, 11.1 / 18), (4, 17.6 / 18), (8, 38.0 / 18))
    return LayoutDevice(name=name, layer_ms=7.8 / 18, memory_mb=mem, rtt_ms=rtt, batch_layer_ms=b)


def _costs(dev):
    return ((1, dev.layer_ms), *dev.batch_layer_ms)


def test_planner_chooses_replica_where_the_model_fits_and_streams_are_many() -> None:
    from edge.planner import aggregate_tok_s, plan_layout

    devs = [_dev("m"), _dev("w", rtt=4.0)]
    busy = plan_layout(18, 10.0, devs, streams=8, groups=3)
    assert busy.layout == "replica" and busy.devices == 2 and busy.stages == ()
    rate = busy.to_dict()["predicted_tok_s"]
    assert rate["replica"] > 1.4 * rate["single"] and rate["replica"] > rate["pipeline"]
    # each device runs 4 of the 8 streams; one lane: the worker's group also waits its round
    # trip; two lanes of 2 rows: the master runs both (a hop per worker group), the worker's
    # second group hides the first one's round trip
    want = 8e3 / max(18 * devs[0].step_ms(4) + 2.0, 18 * devs[1].step_ms(4) + 4.0 + 2.0)
    assert aggregate_tok_s("replica", 8, (18,), devs) == pytest.approx(want)
    two = 2 * 18 * devs[0].step_ms(2)
    want = 8e3 / max(two + 2 * 2.0, two, two / 2 + 4.0 + 2.0)
    assert aggregate_tok_s("replica", 8, (18,), devs, lanes=2) == pytest.approx(want)
    assert busy.predicted_ms["replica"] == busy.predicted_ms["single"]  # one stream: the master
    # one stream planned for: replicas tie one device there and gain when busy
    one = plan_layout(18, 10.0, devs)
    assert one.layout == "replica" and one.predicted_ms["replica"] == one.predicted_ms["single"]
    assert "one stream runs on the master alone" in one.reason and "8 streams" in one.reason
    # where splitting loses (split_pays, which the runner's lanes_for asks), one step of them
    kept = [k for k in range(2, 9) if not split_pays(k, 18, _costs(devs[0]), [4.0])]
    assert kept and f"{', '.join(map(str, kept))} streams run as one step" in one.reason
    # a worker so far away that its streams lose more than the master's gain: one device
    far = plan_layout(18, 10.0, [_dev("m"), _dev("w", rtt=400.0)])
    assert far.layout == "single" and "replica" in far.predicted_ms
    # the model fits neither device alone: pipeline stages, never replicas
    small = [_dev("m", mem=120), _dev("w", rtt=4.0, mem=120)]
    p = plan_layout(18, 10.0, small, streams=8)
    assert p.layout == "pipeline" and "replica" not in p.predicted_ms


def test_replica_layout_configuration() -> None:
    from edge.cluster.layout import LAYOUTS
    from edge.launch import check_model
    from lowband.errors import ConfigError

    assert "replica" in LAYOUTS
    assert ClusterConfig(devices=2, layout="replica").layout == "replica"
    assert ClusterConfig(devices=2).replica_lanes == 1
    with pytest.raises(ConfigError, match="replica_lanes"):
        ClusterConfig(devices=2, replica_lanes=0)
    with pytest.raises(ConfigError, match="whole model"):
        check_model("unused", ClusterConfig(devices=2, layout="replica", memory_budget_mb=10.0))


def test_a_worker_without_the_model_gets_it_shipped(ckpt, tmp_path) -> None:
    """--ship: the worker's own path does not exist, the master streams the whole model into
    its cache directory and the worker's group gives one device's logits."""
    ref = _Ref(ckpt)
    master, wcomm = LoopbackGroup(2, timeout=20).comms()
    wcfg = WorkerConfig(
        model_dir=str(tmp_path / "nothing"), cache_dir=str(tmp_path / "cache"), join_timeout=20
    )
    w = _Thread(lambda: run_worker(wcomm, wcfg))
    w.start()
    cfg = ClusterConfig(
        devices=2, op_timeout=5.0, join_timeout=20, heartbeat_s=0.3, layout="replica", ship=True
    )
    runner = ReplicaRunner(master, str(ckpt), cfg)
    try:
        a = runner.submit([Work(0, [1, 2], 0)])
        b = runner.submit([Work(1, [3, 4], 0)])  # the master busy: on the worker
        runner.collect(a)
        assert torch.equal(runner.collect(b)[0], ref.step([Work(1, [3, 4], 0)])[0])
        assert runner.health()["slots"] == [1, 1]
    finally:
        runner.close()
        w.join(10)
    assert w.error is None


def test_split_pays_by_the_step_costs() -> None:
    """One device's batched step against splitting the streams (the planner's rates): Gemma 3
    270M's step costs on one core (1 row 7.8 ms, 2: 11.1, 3: 14.7, 4: 17.6, 8: 38; 18
    layers) over a 4 ms round trip keep 2-3 streams on one device and split 4 or more."""
    gemma = [(b, ms / 18) for b, ms in ((1, 7.8), (2, 11.1), (3, 14.7), (4, 17.6), (8, 38.0))]
    assert [split_pays(n, 18, gemma, [4.0]) for n in range(1, 9)] == [False] * 3 + [True] * 5
    assert split_pays(2, 18, gemma, [0.5])  # a fast link splits two already
    assert not split_pays(8, 18, gemma, [80.0])  # a slow one never
    assert [split_pays(n, 3, LINEAR, [0.1]) for n in (1, 2, 8)] == [False, True, True]
    assert not any(split_pays(n, 3, FLAT, [0.1]) for n in range(1, 9))
    assert not split_pays(4, 18, gemma, [])  # no worker
    with pytest.raises(ConfigError, match="one-row"):
        split_pays(4, 18, [(4, 1.0)], [1.0])


def _run_streams(eng, prompts, params):
    """Each prompt from its own thread, all admitted together (the scheduler held in a call
    until they wait); their texts. ``params``: one SamplingParams for all, or one per prompt."""
    each = params if isinstance(params, list) else [params] * len(prompts)
    gate, running = threading.Event(), threading.Event()
    eng.call(lambda: (running.set(), gate.wait(20)))
    assert running.wait(20)  # (the scheduler admits what waits before it runs a call)
    threads = [_Thread(lambda p=p, q=q: eng.complete(p, q)) for p, q in zip(prompts, each)]
    for t in threads:
        t.start()
    with eng._cv:
        assert eng._cv.wait_for(lambda: len(eng._waiting) == len(prompts), timeout=20)
    gate.set()
    for t in threads:
        t.join(30)
    return [t.result[0] for t in threads]


@pytest.mark.parametrize("costs,n,lanes", [(FLAT, 2, 1), (LINEAR, 8, 2)])
def test_the_engine_runs_the_lanes_that_pay(ckpt, costs, n, lanes) -> None:
    """lanes_for 1 (batching is free): two streams run as one step of both rows on the master;
    2 (splitting pays): eight streams as two steps of four in flight at once, one per device.
    The greedy texts are one device's either way."""
    params = SamplingParams(max_tokens=6)
    prompts = ["Hello", "Once upon", "The cat", "A long time ago", "Zebra", "x", "Hi all", "So"]
    prompts = prompts[:n]
    local = Engine(LocalRunner(load_shard(ckpt).model), ByteTokenizer(), model_name="m")
    want = [local.complete(p, params)[0] for p in prompts]
    local.close()
    runner, workers, _ = _start(ckpt, step_ms=costs)
    sizes, flying = [], []
    submit = runner.submit

    def recording(work, top=0):
        flight = submit(work, top)
        sizes.append(len(work))
        flying.append(len(runner._flights))
        return flight

    runner.submit = recording
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=8)
        assert eng.lanes == 2 and runner.lanes_for(n) == lanes
        assert _run_streams(eng, prompts, params) == want
        assert sizes[0] == n // lanes and max(flying) == lanes
        rows = runner.health()["cycle"]["rows"]
        if lanes == 1:
            assert rows[1] == 0, rows  # all on the master
        else:
            assert rows[0] > 0 and rows[1] > 0, rows
        eng.close()
    finally:
        _stop(runner, workers)


def test_step_costs_measured_at_start_without_the_planners(ckpt) -> None:
    runner, workers, _ = _start(ckpt, step_ms=None)
    try:
        costs = runner.health()["step_ms"]
        assert [b for b, _ in costs] == [1, 4] and all(ms > 0 for _, ms in costs)
        assert runner.lanes_for(1) == 1 and runner.lanes_for(64) in (1, 2)
        assert runner.local.slot_length(1) == 0  # the measuring steps' caches are gone
    finally:
        _stop(runner, workers)


def test_lanes_shrinking_with_steps_in_flight_lose_none(ckpt) -> None:
    """lanes_for drops from 2 to 1 when half the streams finish while a step is in flight:
    that step lands first, then the rest run as one step; every text is one device's."""
    prompts = ["Hello", "Once upon", "The cat", "A long time ago", "Zebra", "x", "Hi all", "So"]
    lens = [2, 9] * 4
    local = Engine(LocalRunner(load_shard(ckpt).model), ByteTokenizer(), model_name="m")
    want = [local.complete(p, SamplingParams(max_tokens=k))[0] for p, k in zip(prompts, lens)]
    local.close()
    runner, workers, _ = _start(ckpt)
    flying = []
    submit = runner.submit

    def recording(work, top=0):
        flight = submit(work, top)
        flying.append(len(runner._flights))
        return flight

    runner.submit = recording
    runner.lanes_for = lambda active: 2 if active > 4 else 1
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=8)
        each = [SamplingParams(max_tokens=k) for k in lens]
        assert _run_streams(eng, prompts, each) == want
        # two steps in flight while eight ran, then one at a time (the last steps: four)
        assert 2 in flying and flying[-3:] == [1, 1, 1], flying
        eng.close()
    finally:
        _stop(runner, workers)
