"""Continuous batching in the engine: batched == unbatched outputs, chunked prefill riding
along with decodes, prefix reuse, cancellation, log-probabilities, failures."""

from __future__ import annotations

import threading

import pytest
import torch

from edge.engine import Engine, EngineError, LocalRunner, SerialRunner, Work
from edge.quant.linear import quantize_modules
from edge.sampling import SamplingParams
from lowband.errors import ConfigError
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama

WIDE = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=512)

PROMPTS = [
    "Once upon a time",
    "The quick brown fox jumps over the lazy dog, again and again and again",
    "A",
    "Hello there, friend",
    "Hello there, stranger",
    "lorem ipsum dolor sit amet " * 6,
    "x",
    "To be or not to be",
]


def _model(quant: int | None = None, **kw) -> LlamaForCausalLM:
    m = LlamaForCausalLM(tiny_llama(**{**WIDE, **kw})).eval()
    init_weights(m, std=0.3, seed=1)
    if quant is not None:
        quantize_modules(m.model.layers, quant, 32)
    return m


class Recording(LocalRunner):
    """A LocalRunner that records every batched step's work."""

    def __init__(self, model) -> None:
        super().__init__(model)
        self.steps: list[list[Work]] = []

    def forward_batch(self, work, top=0):
        self.steps.append(list(work))
        return super().forward_batch(work, top)


def _concurrently(engine: Engine, prompts, params) -> list[str]:
    out: list[str | None] = [None] * len(prompts)
    barrier = threading.Barrier(len(prompts))

    def one(i: int) -> None:
        barrier.wait(timeout=30)
        out[i] = engine.complete(prompts[i], params)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert all(not t.is_alive() for t in threads)
    return [o for o in out if o is not None]


@pytest.mark.parametrize("quant", [None, 8, 4])
def test_batched_greedy_equals_one_at_a_time(quant) -> None:
    model = _model(quant)
    params = SamplingParams(max_tokens=24)
    alone = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=1)
    want = [alone.complete(p, params)[0] for p in PROMPTS]
    runner = Recording(model)
    eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=4, prefill_chunk=16)
    got = _concurrently(eng, PROMPTS, params)
    assert got == want
    assert max(len(s) for s in runner.steps) >= 2  # sequences did share steps
    m = eng.metrics.snapshot()
    assert m["requests_total"] == len(PROMPTS) and m["requests_running"] == 0
    assert m["batch_sequences_mean"] > 1
    eng.close()
    alone.close()


def test_seeded_sampling_is_reproducible_under_load() -> None:
    model = _model()
    params = SamplingParams(max_tokens=16, temperature=0.9, top_k=20, seed=7)
    alone = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    want = [alone.complete(p, params)[0] for p in PROMPTS[:4]]
    eng = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=4)
    assert _concurrently(eng, PROMPTS[:4], params) == want


def test_long_prompt_is_prefilled_in_chunks_beside_the_decodes() -> None:
    model = _model()
    runner = Recording(model)
    eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=4, prefill_chunk=8)
    params = SamplingParams(max_tokens=40)
    long_prompt = "the long prompt arrives while others decode. " * 6  # 276 bytes
    started = threading.Event()
    texts: dict[str, str] = {}

    def short(i: int) -> None:
        for k, ev in enumerate(eng.generate(f"short {i}", params)):
            if k == 2:
                started.set()
            texts[f"s{i}"] = texts.get(f"s{i}", "") + ev.text

    threads = [threading.Thread(target=short, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    assert started.wait(60)
    texts["long"] = eng.complete(long_prompt, SamplingParams(max_tokens=4))[0]
    for t in threads:
        t.join(timeout=120)
    long_ids = tuple(long_prompt.encode())
    n_long = len(long_ids)
    first = next(
        w for step in runner.steps for w in step if w.start == 0 and w.ids == long_ids[: len(w.ids)]
    )
    long_chunks = [
        (w, step)
        for step in runner.steps
        for w in step
        if w.slot == first.slot
        and w.start < n_long
        and w.ids == long_ids[w.start : w.start + len(w.ids)]
    ]
    assert sum(len(w.ids) for w, _ in long_chunks) == n_long
    assert all(len(w.ids) <= 8 for w, _ in long_chunks)  # never more than the chunk budget
    # while the long prompt was being prefilled the short streams kept decoding in the
    # same steps (one token each)
    mixed = [step for w, step in long_chunks if any(x.slot != first.slot for x in step)]
    assert len(mixed) >= len(long_chunks) // 2
    # and the outputs are those of each request alone
    alone = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    assert texts["long"] == alone.complete(long_prompt, SamplingParams(max_tokens=4))[0]
    assert texts["s0"] == alone.complete("short 0", params)[0]


def test_prefix_reuse_across_requests() -> None:
    model = _model()
    eng = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=2)
    system = "You are a helpful assistant who answers briefly. "
    params = SamplingParams(max_tokens=8)
    first = eng.complete(system + "Q: one?", params)[0]
    before = eng.metrics.snapshot()
    second = eng.complete(system + "Q: two?", params)[0]
    after = eng.metrics.snapshot()
    assert after["prefix_cache_hits_total"] == before["prefix_cache_hits_total"] + 1
    reused = after["prefix_cache_tokens_reused_total"] - before["prefix_cache_tokens_reused_total"]
    assert reused >= len(system)
    computed = after["prompt_tokens_computed_total"] - before["prompt_tokens_computed_total"]
    assert computed == len((system + "Q: two?").encode()) - reused
    fresh = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    assert first == fresh.complete(system + "Q: one?", params)[0]
    fresh2 = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    assert second == fresh2.complete(system + "Q: two?", params)[0]


def test_prefix_copied_from_a_running_sequence() -> None:
    """Two requests with the same long prefix in flight at once: the second copies the
    first's keys and values instead of recomputing them."""
    model = _model()
    eng = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=2)
    prefix = "shared context " * 8
    it = eng.generate(prefix + "first", SamplingParams(max_tokens=30))
    next(it)  # the first request is decoding: its slot holds the whole prefix
    second = eng.complete(prefix + "second", SamplingParams(max_tokens=6))[0]
    it.close()
    m = eng.metrics.snapshot()
    assert m["prefix_cache_hits_total"] == 1
    assert m["prefix_cache_tokens_reused_total"] >= len(prefix)
    fresh = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    assert second == fresh.complete(prefix + "second", SamplingParams(max_tokens=6))[0]


def test_prefix_copied_into_a_slot_an_earlier_request_filled() -> None:
    """The copy goes into a cache the runner filled before (under inference mode): it is
    made, not refused (it raised, and the engine recomputed the whole prompt)."""
    model = _model()
    eng = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=2, prefix_cache=0)
    prefix = "shared context " * 8
    # 1st round: the other slot computes a prompt of its own; 2nd: a copy goes into it
    for second in ("z" * len(prefix + "one"), prefix + "one more"):  # (caches of one size)
        it = eng.generate(prefix + "one", SamplingParams(max_tokens=30, ignore_eos=True))
        next(it)  # decoding: its slot holds its whole prompt
        before = eng.metrics.snapshot()
        text = eng.complete(second, SamplingParams(max_tokens=6))[0]
        after = eng.metrics.snapshot()
        it.close()
    reused = after["prefix_cache_tokens_reused_total"] - before["prefix_cache_tokens_reused_total"]
    assert reused >= len(prefix + "one")
    fresh = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    assert text == fresh.complete(second, SamplingParams(max_tokens=6))[0]


def test_a_prompt_sharing_little_takes_an_empty_slot_not_a_cached_prompt() -> None:
    """One sequence at a time, one cache slot kept: a request that shares only its first
    character with the cached prompt goes to the empty slot, so the cached prompt (a tool
    list sent with every request) is still there for its next repeat."""
    eng = Engine(LocalRunner(_model()), ByteTokenizer(), model_name="m", parallel=1)
    tools = "x tools: add_person(name, age), weather(city). " * 3
    params = SamplingParams(max_tokens=4)
    for prompt in (tools + "Q1", "x short one", tools + "Q2"):
        before = eng.metrics.snapshot()
        eng.complete(prompt, params)
    after = eng.metrics.snapshot()
    reused = after["prefix_cache_tokens_reused_total"] - before["prefix_cache_tokens_reused_total"]
    assert reused >= len(tools)


def test_cancelled_request_leaves_and_frees_its_slot() -> None:
    eng = Engine(LocalRunner(_model()), ByteTokenizer(), model_name="m", parallel=1)
    it = eng.generate("cancel me", SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(3):
        next(it)
    it.close()  # the client went away
    text, reason, n = eng.complete("next one", SamplingParams(max_tokens=5))
    assert n == 5 and reason == "length"
    m = eng.metrics.snapshot()
    assert m["requests_cancelled"] == 1 and m["requests_running"] == 0
    assert m["completion_tokens_total"] < 200


def test_logprobs_match_a_full_forward() -> None:
    model = _model()
    eng = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=2)
    prompt = "Logprobs of"
    ids = list(prompt.encode())
    params = SamplingParams(max_tokens=5, logprobs=3, prompt_logprobs=True)
    events = list(eng.generate(prompt, params))
    toks = [e.token for e in events if e.token is not None]
    with torch.inference_mode():
        full = torch.log_softmax(model(torch.tensor([ids + toks]))[0].float(), -1)
    pl = events[0].prompt_logprobs
    assert pl is not None and len(pl) == len(ids) and pl[0] == (ids[0], None, ())
    for t in range(1, len(ids)):
        tok, lp, top = pl[t]
        assert tok == ids[t]
        assert lp == pytest.approx(float(full[t - 1, tok]), abs=1e-4)
        assert [i for i, _ in top] == torch.topk(full[t - 1], 3).indices.tolist()
    for j, e in enumerate(e for e in events if e.token is not None):
        row = full[len(ids) - 1 + j]
        assert e.logprob == pytest.approx(float(row[e.token]), abs=1e-4)
        assert e.top_logprobs[0][0] == e.token  # greedy: the most likely one
        assert len(e.top_logprobs) == 3


def test_prompt_logprobs_alone_with_max_tokens_zero() -> None:
    eng = Engine(LocalRunner(_model()), ByteTokenizer(), model_name="m")
    params = SamplingParams(max_tokens=0, logprobs=1, prompt_logprobs=True)
    events = list(eng.generate("score this", params))
    assert len(events) == 1 and events[0].token is None
    assert events[0].finish_reason == "length"
    assert len(events[0].prompt_logprobs or []) == len(b"score this")


def test_ignore_eos_runs_to_max_tokens() -> None:
    model = _model()
    probe = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    first = next(probe.generate("eos", SamplingParams(max_tokens=1)))

    class EosAtFirst(ByteTokenizer):
        eos_token_id = first.token  # the greedy first token counts as end of sequence

    eng = Engine(LocalRunner(model), EosAtFirst(), model_name="m")
    assert eng.complete("eos", SamplingParams(max_tokens=6))[1:] == ("stop", 0)
    assert eng.complete("eos", SamplingParams(max_tokens=6, ignore_eos=True))[1:] == (
        "length",
        6,
    )


def test_runner_failure_fails_running_requests_and_engine_recovers() -> None:
    model = _model()

    class Flaky(LocalRunner):
        fail = 0

        def forward_batch(self, work, top=0):
            if self.fail:
                self.fail -= 1
                raise RuntimeError("device fell over")
            return super().forward_batch(work, top)

    runner = Flaky(model)
    eng = Engine(runner, ByteTokenizer(), model_name="m", parallel=2)
    runner.fail = 1
    with pytest.raises(EngineError, match="device fell over"):
        eng.complete("boom", SamplingParams(max_tokens=4))
    assert eng.complete("fine", SamplingParams(max_tokens=4))[2] == 4
    assert eng.metrics.snapshot()["requests_failed"] == 1


def test_a_runner_without_batching_serves_one_at_a_time() -> None:
    model = _model()

    class OneAtATime:
        def __init__(self) -> None:
            self.inner = LocalRunner(model)
            self.config = model.config

        def __getattr__(self, name):
            if name == "forward_batch":
                raise AttributeError(name)
            return getattr(self.inner, name)

    eng = Engine(OneAtATime(), ByteTokenizer(), model_name="m", parallel=4)  # type: ignore[arg-type]
    assert isinstance(eng.batch, SerialRunner) and eng.parallel == 1
    params = SamplingParams(max_tokens=10)
    alone = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    want = [alone.complete(p, params)[0] for p in PROMPTS[:3]]
    assert _concurrently(eng, PROMPTS[:3], params) == want
    # the one cache is reused by a follow-up that extends the previous prompt
    eng.complete(PROMPTS[0], params)
    eng.complete(PROMPTS[0] + " and then", params)
    assert eng.metrics.snapshot()["prefix_cache_hits_total"] >= 1


@pytest.mark.parametrize(
    "kw",
    [dict(parallel=0), dict(prefill_chunk=0), dict(prefix_cache=-1)],
)
def test_bad_engine_config(kw) -> None:
    with pytest.raises(ConfigError):
        Engine(LocalRunner(_model()), ByteTokenizer(), model_name="m", **kw)


@pytest.mark.parametrize(
    "kw",
    [dict(max_tokens=0), dict(logprobs=-1), dict(logprobs=21), dict(max_tokens=-1)],
)
def test_bad_sampling_params(kw) -> None:
    with pytest.raises(ConfigError):
        SamplingParams(**kw)


def test_sliding_window_model_batches() -> None:
    model = _model(sliding_window=16)
    params = SamplingParams(max_tokens=20)
    alone = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    want = [alone.complete(p, params)[0] for p in PROMPTS[:5]]
    eng = Engine(LocalRunner(model), ByteTokenizer(), model_name="m", parallel=3, prefill_chunk=8)
    assert _concurrently(eng, PROMPTS[:5], params) == want


def test_pace_sizes_prompt_chunks_from_measured_step_times() -> None:
    from edge.engine import Pace

    pace = Pace(stall=3.0)
    assert pace.budget(256, decoding=4) == Pace.FIRST  # nothing measured yet
    pace.observe(4, 0, 0.100)  # a decode step of 4 sequences: 100 ms
    assert pace.budget(256, decoding=4) == Pace.FIRST  # one step size: no fit yet
    pace.observe(4, 50, 0.600)  # 54 rows: 600 ms, so 10 ms a row on a 60 ms base
    base, per_row = pace.fit()
    assert abs(base - 0.06) < 1e-9 and abs(per_row - 0.01) < 1e-9
    # a step may take 3x the plain step of 4 decodes (100 ms): 200 ms of prompt, 20 tokens
    assert pace.budget(256, decoding=4, prefilling=1) == 20
    assert pace.budget(256, decoding=12, prefilling=1) == 36  # 12 decodes: a 180 ms plain step
    assert pace.budget(8, decoding=4, prefilling=1) == 8  # never beyond the configured chunk
    # as many prompts waiting as sequences decoding: the waiting majority gets a whole chunk
    assert pace.budget(256, decoding=4, prefilling=4) == 256
    assert pace.budget(256, decoding=0, prefilling=3) == 256
    for _ in range(60):  # steps got much faster: the old ones are forgotten
        pace.observe(4, 0, 0.010)
        pace.observe(8, 0, 0.014)
    assert pace.budget(256, decoding=8, prefilling=1) == 28  # (0.006 + 8 * 0.001) * 2 / 0.001
    slow = Pace(stall=1.5)
    slow.observe(1, 0, 0.01)
    slow.observe(1, 10, 1.01)
    assert slow.budget(256, decoding=1) == 1  # at least one token, so a prompt always progresses


def test_bad_decode_stall() -> None:
    with pytest.raises(ConfigError):
        Engine(LocalRunner(_model()), ByteTokenizer(), model_name="m", decode_stall=1.0)
