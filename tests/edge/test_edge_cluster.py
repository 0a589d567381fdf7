"""Engine and TP cluster on the loopback communicator: outputs match one device; a killed
worker fails the request, the master stays up, and a returning worker heals the cluster."""

from __future__ import annotations

import threading
import time

import pytest

from edge.cluster import ClusterConfig, MasterRunner, WorkerConfig, run_worker
from edge.engine import ClusterUnavailable, Engine, LocalRunner
from edge.sampling import SamplingParams
from edge.shardio import load_shard, split_checkpoint
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from transport.loopback import LoopbackGroup

CFG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, std=0.2, seed=11)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    return d


class _Thread(threading.Thread):
    def __init__(self, fn):
        super().__init__(daemon=True)
        self.fn, self.error, self.result = fn, None, None

    def run(self):
        try:
            self.result = self.fn()
        except BaseException as e:  # noqa: BLE001 - inspected by the test
            self.error = e


def _local_engine(path) -> Engine:
    return Engine(LocalRunner(load_shard(path).model), ByteTokenizer(), model_name="m")


def test_engine_generates_and_reuses_prefix(ckpt) -> None:
    eng = _local_engine(ckpt)
    p = SamplingParams(max_tokens=12)
    text, reason, n = eng.complete("Hello there", p)
    assert reason == "length" and n == 12
    again, _, _ = eng.complete("Hello there", p)
    assert again == text
    assert eng.cached_prefix()[:11] == list(b"Hello there")
    # a stop sequence taken from the greedy output ends the completion early
    cut = text.encode("utf-8", "replace")
    eng2 = _local_engine(ckpt)
    if len(text) > 4 and "\ufffd" not in text[:4]:
        stop = text[2:4]
        t2, r2, _ = eng2.complete("Hello there", SamplingParams(max_tokens=12, stop=(stop,)))
        assert r2 == "stop" and t2 == text[: text.find(stop)]
    m = eng.metrics.snapshot()
    assert m["requests_total"] == 2 and m["completion_tokens_total"] == 24 and cut


def test_engine_notices_a_dropped_cache(ckpt) -> None:
    """A runner may drop its KV cache between requests (a cluster that regrouped while idle):
    the next request must not reuse a prefix the cache no longer holds."""
    p = SamplingParams(max_tokens=8)
    want = _local_engine(ckpt).complete("Hello there, friend", p)[0]
    eng = _local_engine(ckpt)
    eng.complete("Hello there", p)
    eng.runner.reset()
    assert eng.complete("Hello there, friend", p)[0] == want


def _start_cluster(path, world, group, weights=None, **kw):
    comms = group.comms()
    workers = [_Thread(lambda c=c: run_worker(c, WorkerConfig(join_timeout=20))) for c in comms[1:]]
    for w in workers:
        w.start()
    cfg = ClusterConfig(
        devices=world, weights=weights, op_timeout=5.0, join_timeout=20, heartbeat_s=0.3, **kw
    )
    runner = MasterRunner(comms[0], path, cfg)
    return runner, workers


def test_cluster_sampling_draws_what_one_device_draws(ckpt, tmp_path) -> None:
    """The vocabulary-parallel head sends the master only the candidates its sampler can pick
    (top_k: each rank's k best; no top_k: every logit): a seeded completion is the same text
    as on one device, and a top-k request moves fewer bytes than a full-distribution one."""
    local = _local_engine(ckpt)
    group = LoopbackGroup(2, timeout=20)
    runner, workers = _start_cluster(ckpt, 2, group, link="direct")
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m")
        per_token = {}
        for name, params in (
            ("top_k", SamplingParams(max_tokens=12, temperature=0.9, top_k=8, top_p=0.9, seed=3)),
            ("all", SamplingParams(max_tokens=12, temperature=0.9, seed=4)),
        ):
            want, _, _ = local.complete("Once upon", params)
            got, _, n = eng.complete("Once upon", params)
            assert got == want and n == 12, name
            per_token[name] = eng.metrics.snapshot()["wire_bytes_per_token"]
        assert runner.shard.plan.vocab_split
        assert per_token["top_k"] < per_token["all"]
    finally:
        runner.close()
        for w in workers:
            w.join(10)
    assert all(not w.is_alive() and w.error is None for w in workers)


@pytest.mark.parametrize(
    "world,weights,split,wire,link",
    [
        (2, None, False, "fp32", "direct"),
        (2, None, False, "fp32", "comm"),
        (3, (2.0, 1.0, 1.0), True, "fp32", "direct"),
        (3, None, False, "int8", "direct"),
        (3, None, False, "int8", "comm"),
        # the planner's floor weight: the master holds no heads or columns, and the whole LM head
        (2, (0.001, 0.999), True, "fp32", "direct"),
    ],
)
def test_cluster_matches_single_device(ckpt, tmp_path, world, weights, split, wire, link) -> None:
    path = split_checkpoint(ckpt, tmp_path / "s", world, weights) if split else ckpt
    ref, _, _ = _local_engine(ckpt).complete("The quick brown", SamplingParams(max_tokens=10))
    group = LoopbackGroup(world, timeout=20)
    runner, workers = _start_cluster(
        path, world, group, weights, wire=wire, link=link, window=2 if split else None
    )
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m")
        text, _, n = eng.complete("The quick brown", SamplingParams(max_tokens=10))
        if wire == "fp32":
            assert text == ref
        assert n == 10
        per_tok = eng.metrics.snapshot()["wire_bytes_per_token"]
        H, L = CFG["hidden_size"], CFG["num_hidden_layers"]
        # star: the master sends x, receives+sends 2L partials per worker, and (greedy, the
        # vocabulary-parallel head) receives+sends one (value, id) candidate pair per rank;
        # a head left whole on the master gathers nothing
        gather = 2 * world * 2 * 4 if runner.shard.plan.vocab_split else 0
        assert runner.shard.plan.vocab_split == (weights is None or min(weights) > 0.01)
        if wire == "fp32":
            assert per_tok == (world - 1) * (H * 4 + 2 * L * 2 * H * 4 + gather)
        else:
            assert per_tok < (world - 1) * (H * 4 + 2 * L * 2 * H * 4) / 2
    finally:
        runner.close()
        for w in workers:
            w.join(10)
    assert all(not w.is_alive() and w.error is None for w in workers)


def test_worker_death_and_recovery(ckpt) -> None:
    world = 3
    group = LoopbackGroup(world, timeout=20)
    runner, workers = _start_cluster(ckpt, world, group)
    eng = Engine(runner, ByteTokenizer(), model_name="m")
    p = SamplingParams(max_tokens=6)
    try:
        ref, _, _ = eng.complete("abc", p)
        # The device dies: its communicator and its star link (a dead process's TCP
        # connections close; decode steps reach a worker over its link, see MasterRunner.forward)
        group.kill(2)
        runner.hub.drop(runner._slot(2))
        with pytest.raises(ClusterUnavailable, match="recovers"):
            eng.complete("abcd", p)  # in flight when the device is gone
        workers[1].join(10)
        assert workers[1].error is not None  # the dead worker's thread ended with PeerLost
        assert runner.health()["healthy"] is False
        with pytest.raises(ClusterUnavailable, match="not ready"):
            eng.complete("abc", p)
        newcomer = group.join()
        back = _Thread(lambda: run_worker(newcomer, WorkerConfig(join_timeout=20)))
        back.start()
        workers.append(back)
        deadline = time.monotonic() + 20
        while not runner.health()["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.health()["healthy"] and runner.health()["epoch"] >= 1
        again, _, _ = eng.complete("abc", p)
        assert again == ref
        assert eng.metrics.snapshot()["requests_failed"] == 2  # in flight + while degraded
    finally:
        runner.close()
        for w in workers:
            w.join(10)


def test_idle_worker_death_is_detected(ckpt) -> None:
    group = LoopbackGroup(2, timeout=20)
    runner, workers = _start_cluster(ckpt, 2, group)
    try:
        assert runner.health()["healthy"]
        group.kill(1)
        deadline = time.monotonic() + 10
        while runner.health()["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        assert runner.health()["healthy"] is False  # the heartbeat noticed, no request needed
    finally:
        runner.close()


def test_replan_onto_survivors(ckpt) -> None:
    """With replan_after_s the master stops waiting and re-splits over the two devices left."""
    ref, _, _ = _local_engine(ckpt).complete("abc", SamplingParams(max_tokens=6))
    group = LoopbackGroup(3, timeout=20)
    runner, workers = _start_cluster(ckpt, 3, group, (1.0, 2.0, 1.0), replan_after_s=0.2)
    eng = Engine(runner, ByteTokenizer(), model_name="m")
    p = SamplingParams(max_tokens=6)
    try:
        assert eng.complete("abc", p)[0] == ref
        group.kill(2)  # the device dies: its communicator and its star link
        runner.hub.drop(runner._slot(2))
        with pytest.raises(ClusterUnavailable):
            eng.complete("abcd", p)
        deadline = time.monotonic() + 20
        while not runner.health()["healthy"] and time.monotonic() < deadline:
            time.sleep(0.05)
        h = runner.health()
        assert h["healthy"] and h["devices"] == 2 and runner.weights == (1.0, 2.0)
        assert eng.complete("abc", p)[0] == ref
        # worker 1 now holds the bigger slice of a 2-way plan
        assert runner.model.model.layers[0].mlp.up_proj.weight.shape[0] < CFG["intermediate_size"]
    finally:
        runner.close()
        for w in workers:
            w.join(10)
