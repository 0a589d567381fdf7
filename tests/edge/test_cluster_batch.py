"""Continuous batching on a TP cluster (MasterRunner as an edge.engine.BatchRunner): concurrent
requests give one device's texts, prefixes are reused across requests (copied on every rank
when a running sequence holds them), a batched step makes as many all-reduces as a one-sequence
step, and a worker lost mid-batch fails every running request, after which the cluster heals
and recomputes what the lost caches held."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Iterator

import pytest

from edge.engine import ClusterUnavailable, Engine, Event, Work
from edge.sampling import SamplingParams
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained
from tests.edge.test_edge_cluster import CFG, _local_engine, _start_cluster, _Thread
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(240)

GREEDY = SamplingParams(max_tokens=16)
# different prompts, several sharing a prefix (the engine reuses it across requests)
PROMPTS = [
    "The quick brown fox",
    "The quick brown dog",
    "Once upon a time",
    "Once upon a midnight",
    "Hello",
    "abc def ghi",
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    d = tmp_path_factory.mktemp("ck")
    m = LlamaForCausalLM(ModelConfig(**CFG)).eval()
    init_weights(m, std=0.2, seed=11)
    save_pretrained(m, d)
    ByteTokenizer().save(d)
    return d


@pytest.fixture(scope="module")
def reference(ckpt) -> dict[str, str]:
    """Each prompt's greedy text on one device, one request at a time."""
    eng = _local_engine(ckpt)
    try:
        return {p: eng.complete(p, GREEDY)[0] for p in PROMPTS}
    finally:
        eng.close()


def _wait(cond, what: str, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def _stop(runner, workers) -> None:
    runner.close()
    for w in workers:
        w.join(10)


@contextmanager
def _admitted_together(eng: Engine, n: int) -> Iterator[None]:
    """The scheduler held in a call (``Engine.call``) until ``n`` requests wait, so the engine
    admits and batches them together. (Holding the runner's lock instead also held the
    scheduler's admission, which may copy a cached prefix through the runner.)"""
    running, gate = threading.Event(), threading.Event()

    def hold() -> None:
        running.set()
        gate.wait(30)

    eng.call(hold)
    try:
        # (the scheduler admits what waits before it runs a call: start nothing until then)
        assert running.wait(20)
        yield
        with eng._cv:
            if not eng._cv.wait_for(lambda: len(eng._waiting) == n, timeout=20):
                raise AssertionError("timed out waiting for queueing")
    finally:
        gate.set()


def _complete_all(eng: Engine, runner, prompts, params=GREEDY) -> list[_Thread]:
    """Every prompt from its own thread, all queued before the first step runs, so the engine
    really batches them."""
    threads = [_Thread(lambda p=p: eng.complete(p, params)) for p in prompts]
    with _admitted_together(eng, len(prompts)):
        for t in threads:
            t.start()
    for t in threads:
        t.join(60)
    return threads


def test_concurrent_requests_match_one_device(ckpt, reference) -> None:
    group = LoopbackGroup(2, timeout=20)
    runner, workers = _start_cluster(ckpt, 2, group)
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=4)
        threads = _complete_all(eng, runner, PROMPTS)
        assert [t.error for t in threads] == [None] * len(PROMPTS)
        assert {p: t.result[0] for p, t in zip(PROMPTS, threads)} == reference
        m = eng.metrics.snapshot()
        assert m["batch_sequences_mean"] > 1.5  # several sequences per step, not one at a time
        assert m["requests_failed"] == 0 and m["completion_tokens_total"] == 6 * 16
        # a seeded top-k draw, and prompt/top logprobs (every row's logits through the
        # vocabulary-parallel head at once), both batched beside greedy requests
        local = _local_engine(ckpt)
        sampled = SamplingParams(max_tokens=12, temperature=0.9, top_k=8, seed=3)
        echo = SamplingParams(max_tokens=4, logprobs=3, prompt_logprobs=True)
        want_s = local.complete("Once upon", sampled)[0]
        want_e = list(local.generate("The quick", echo))
        local.close()
        got: dict[str, list[Event]] = {}
        ts = [
            _Thread(lambda: eng.complete("Once upon", sampled)),
            _Thread(lambda: got.setdefault("e", list(eng.generate("The quick", echo)))),
            _Thread(lambda: eng.complete("Hello", GREEDY)),
        ]
        with _admitted_together(eng, 3):
            for t in ts:
                t.start()
        for t in ts:
            t.join(60)
        assert [t.error for t in ts] == [None] * 3
        assert ts[0].result[0] == want_s and ts[2].result[0] == reference["Hello"]
        e = got["e"]
        assert [ev.token for ev in e] == [ev.token for ev in want_e]
        for a, b in zip(e[0].prompt_logprobs[1:], want_e[0].prompt_logprobs[1:]):
            assert a[0] == b[0] and a[1] == pytest.approx(b[1], abs=1e-4)
            assert [t for t, _ in a[2]] == [t for t, _ in b[2]]
        for a, b in zip(e, want_e):
            assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
    finally:
        _stop(runner, workers)
    assert all(not w.is_alive() and w.error is None for w in workers)


def test_prefix_reuse_on_the_cluster(ckpt, reference) -> None:
    """A finished request's cache serves the next prompt sharing its prefix; a running one's
    prefix is copied to a free cache on every rank (copy message); outputs are unchanged."""
    group = LoopbackGroup(2, timeout=20)
    runner, workers = _start_cluster(ckpt, 2, group)
    copies: list[tuple[int, int, int]] = []
    copy = runner.copy_prefix

    def counting(src: int, dst: int, n: int) -> None:
        copy(src, dst, n)
        copies.append((src, dst, n))

    runner.copy_prefix = counting  # type: ignore[method-assign]
    try:
        eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=2)
        assert eng.complete(PROMPTS[0], GREEDY)[0] == reference[PROMPTS[0]]
        # the finished sequence's cache holds "The quick brown " for the next prompt
        assert eng.complete(PROMPTS[1], GREEDY)[0] == reference[PROMPTS[1]]
        m = eng.metrics.snapshot()
        assert m["prefix_cache_hits_total"] == 1
        assert m["prefix_cache_tokens_reused_total"] == len("The quick brown ")
        # a running sequence holds the prefix: the second request copies it
        long = SamplingParams(max_tokens=120, ignore_eos=True)
        stream = eng.generate("Once upon a time", long)
        first = next(stream)
        assert first.token is not None  # the first request is decoding now
        assert eng.complete("Once upon a midnight", GREEDY)[0] == reference["Once upon a midnight"]
        rest = [first] + list(stream)
        assert len(rest) == 120
        assert copies and copies[-1][2] == len("Once upon a ")
        m = eng.metrics.snapshot()
        assert m["prefix_cache_hits_total"] == 2 and m["requests_failed"] == 0
        # and the copied cache is right on every rank: the copying request continues from it
        assert eng.complete("Once upon a time", GREEDY)[0] == reference["Once upon a time"]
    finally:
        _stop(runner, workers)
    assert all(not w.is_alive() and w.error is None for w in workers)


def test_a_batched_step_makes_one_exchange_per_reduce_point(ckpt) -> None:
    """All-reduces of a decode step over the star link: 2 per layer plus one for the head's
    candidates, for 1 sequence and for 4 alike (the whole batch in each)."""
    group = LoopbackGroup(2, timeout=20)
    runner, workers = _start_cluster(ckpt, 2, group)
    try:
        seqs = [list(p.encode()) for p in PROMPTS[:4]]
        runner.forward_batch([Work(i, s, 0) for i, s in enumerate(seqs)], top=1)
        counts = {}
        for n in (1, 4):
            before = runner.hub._seq
            step = [Work(i, [7], len(seqs[i])) for i in range(n)]
            out = runner.forward_batch(step, top=1)
            counts[n] = runner.hub._seq - before
            assert len(out) == n and all(o is not None and o.shape == (256,) for o in out)
            for i in range(n):
                seqs[i].append(7)
                assert runner.slot_length(i) == len(seqs[i])
        assert counts[1] == counts[4] == 2 * CFG["num_hidden_layers"] + 1
    finally:
        _stop(runner, workers)


def test_worker_lost_mid_batch(ckpt, reference) -> None:
    group = LoopbackGroup(2, timeout=20)
    runner, workers = _start_cluster(ckpt, 2, group)
    eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=4)
    long = SamplingParams(max_tokens=200, ignore_eos=True)
    started = [threading.Event() for _ in range(4)]

    def stream(i: int) -> int:
        n = 0
        for _ in eng.generate(PROMPTS[i], long):
            n += 1
            started[i].set()
        return n

    try:
        assert eng.complete(PROMPTS[4], GREEDY)[0] == reference[PROMPTS[4]]
        threads = [_Thread(lambda i=i: stream(i)) for i in range(4)]
        for t in threads:
            t.start()
        for ev in started:
            assert ev.wait(20)  # every request is decoding
        with runner._lock:  # between two steps: the device dies (communicator and link)
            slot = runner._slot(1)
            group.kill(1)
            runner.hub.drop(slot)
        for t in threads:
            t.join(20)
        assert all(isinstance(t.error, ClusterUnavailable) for t in threads), [
            t.error for t in threads
        ]
        assert eng.metrics.snapshot()["requests_failed"] == 4
        workers[0].join(10)
        assert workers[0].error is not None  # the dead worker's thread ended with PeerLost
        newcomer = group.join()
        back = _Thread(lambda: run_worker_thread(newcomer))
        back.start()
        workers.append(back)
        _wait(lambda: runner.health()["healthy"], "recovery")
        # every cache was dropped everywhere: the engine recomputes (the finished "Hello"
        # sequence's cache included, which the next request would otherwise reuse)
        assert all(runner.slot_length(i) == 0 for i in range(8))
        threads = _complete_all(eng, runner, PROMPTS)
        assert [t.error for t in threads] == [None] * len(PROMPTS)
        assert {p: t.result[0] for p, t in zip(PROMPTS, threads)} == reference
    finally:
        _stop(runner, workers)


def run_worker_thread(comm) -> int:
    from edge.cluster import WorkerConfig, run_worker

    return run_worker(comm, WorkerConfig(join_timeout=20))
