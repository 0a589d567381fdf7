"""The engine's lanes (edge.engine, a PipelinedRunner): several steps in flight at once, each
sequence in at most one, collected in the order submitted; outputs equal to one sequence at
a time; cancellation, failures and queued calls while steps are in flight."""

from __future__ import annotations

import threading
from collections import deque

import pytest

from edge.engine import Engine, EngineError, LocalRunner, runner_lanes
from edge.sampling import SamplingParams
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama
from tests.edge.test_engine_batch import PROMPTS, WIDE, _concurrently

pytestmark = pytest.mark.timeout(120)


def _model() -> LlamaForCausalLM:
    m = LlamaForCausalLM(tiny_llama(**WIDE)).eval()
    init_weights(m, std=0.3, seed=1)
    return m


class Lanes(LocalRunner):
    """A LocalRunner that keeps ``lanes`` steps in flight as a pipeline's master does: the
    step is computed at submit, its logits handed out at collect. It refuses what a pipeline
    must never see (a cache in two steps in flight, collection out of order, more than
    ``lanes`` steps in flight) and records the steps."""

    def __init__(self, model, lanes: int = 2) -> None:
        super().__init__(model)
        self.lanes = lanes
        self.flying: deque = deque()
        self.most = 0  # the most steps in flight at once
        self.steps: list[list[int]] = []  # each submitted step's caches
        self.fail_collect = 0
        self.calls_in_flight: list[int] = []

    def submit(self, work, top=0):
        slots = {w.slot for f in self.flying for w in f[0]}
        if any(w.slot in slots for w in work):
            raise RuntimeError("a cache in two steps in flight")
        if len(self.flying) >= self.lanes:
            raise RuntimeError("more steps in flight than lanes")
        flight = (list(work), super().forward_batch(work, top))
        self.flying.append(flight)
        self.steps.append([w.slot for w in work])
        self.most = max(self.most, len(self.flying))
        return flight

    def collect(self, flight):
        if not self.flying or self.flying[0] is not flight:
            raise RuntimeError("collected out of order")
        self.flying.popleft()
        if self.fail_collect:
            self.fail_collect -= 1
            self.flying.clear()
            raise RuntimeError("a stage fell over")
        return flight[1]

    def forward_batch(self, work, top=0):
        raise AssertionError("a pipelined runner's steps are submitted")

    def reset(self) -> None:
        self.flying.clear()
        super().reset()


def test_lanes_keep_steps_in_flight_and_equal_one_at_a_time() -> None:
    model = _model()
    params = SamplingParams(max_tokens=24)
    alone = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=1)
    want = [alone.complete(p, params)[0] for p in PROMPTS]
    alone.close()
    runner = Lanes(model)
    eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=8, prefill_chunk=16)
    assert eng.lanes == runner_lanes(runner) == 2
    try:
        assert _concurrently(eng, PROMPTS, params) == want
        assert runner.most == 2  # two steps were in flight at once
        # each step carries one lane's share of the running sequences (8 over 2 lanes)
        assert max(len(s) for s in runner.steps) <= 4
        assert sum(len(s) >= 3 for s in runner.steps) > 10
        m = eng.metrics.snapshot()
        assert m["requests_total"] == len(PROMPTS) and m["requests_running"] == 0
        assert not runner.flying
    finally:
        eng.close()


def test_a_lone_stream_and_a_call_between_steps() -> None:
    runner = Lanes(_model(), lanes=3)
    eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=4)
    try:
        it = eng.generate("stream", SamplingParams(max_tokens=40, ignore_eos=True))
        next(it)
        # a queued call runs only when no step is in flight (it may use the runner)
        seen = eng.call(lambda: len(runner.flying)).result(timeout=30)
        assert seen == 0
        assert sum(1 for _ in it) >= 30
        assert runner.most == 1  # one sequence: one step at a time
    finally:
        eng.close()


def test_cancel_in_flight_and_failure_at_collect() -> None:
    runner = Lanes(_model())
    eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=4)
    try:
        it = eng.generate("cancel me", SamplingParams(max_tokens=200, ignore_eos=True))
        other = threading.Thread(
            target=lambda: eng.complete("beside", SamplingParams(max_tokens=30, ignore_eos=True))
        )
        other.start()
        for _ in range(3):
            next(it)
        it.close()  # the client goes while its step may be in flight
        other.join(60)
        assert not other.is_alive()
        assert eng.complete("next one", SamplingParams(max_tokens=5))[2] == 5
        assert eng.metrics.snapshot()["requests_cancelled"] == 1
        runner.fail_collect = 1
        with pytest.raises(EngineError, match="fell over"):
            eng.complete("boom", SamplingParams(max_tokens=4))
        assert eng.complete("fine", SamplingParams(max_tokens=4))[2] == 4
        assert eng.metrics.snapshot()["requests_failed"] == 1
    finally:
        eng.close()
