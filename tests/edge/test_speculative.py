"""Speculative decoding: greedy output identical to plain decoding (prompt lookup and a draft
model), the rejection rule's distribution by counting, rollback, stop strings / logprobs /
n with drafting on, the draft length rule, and the incompatible-draft error."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from edge import fastpath
from edge.draft import DraftModel, IncompatibleDraft, check_compatible
from edge.engine import Engine, LocalRunner
from edge.lookup import LookupConfig, LookupDrafter
from edge.sampling import Sampler, SamplingParams
from edge.speculative import (
    Draft,
    DraftLength,
    PassCost,
    SpecConfig,
    Speculation,
    drafting_allowed,
    verify,
)
from lowband.errors import ConfigError
from lowband.models.llama import (
    ROWWISE_ROWS,
    LlamaForCausalLM,
    Span,
    head_rows,
    init_weights,
    linear_rows,
)
from lowband.models.tokenizer import ByteTokenizer
from tests.conftest import tiny_llama

WIDE = dict(hidden_size=64, intermediate_size=128, max_position_embeddings=512)
PROMPTS = [
    "def add(a, b):\n    return a + b\n\ndef add(a, b):\n    return a + b\n",
    "the cat sat on the mat, the cat sat on the mat, the cat",
    "x",
]


def _model(seed: int = 1, **kw) -> LlamaForCausalLM:
    m = LlamaForCausalLM(tiny_llama(**{**WIDE, **kw})).eval()
    init_weights(m, std=0.3, seed=seed)
    return m


def _engine(model, spec: Speculation | None, parallel: int = 1) -> Engine:
    return Engine(
        LocalRunner(model), ByteTokenizer(), model_name="t", parallel=parallel, speculation=spec
    )


def _lookup(k: int = 6) -> Speculation:
    return Speculation(SpecConfig(draft_max=k, adaptive=False), LookupDrafter)


def _run(engine: Engine, params: SamplingParams) -> list[tuple[str, str, int]]:
    try:
        return [engine.complete(p, params) for p in PROMPTS]
    finally:
        engine.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_greedy_lookup_is_identical(family: str) -> None:
    kw: dict[str, Any] = (
        {} if family == "llama" else dict(model_type="gemma3_text", sliding_window=8)
    )
    try:
        model = _model(**kw)
    except (TypeError, ConfigError) as exc:
        pytest.skip(f"tiny {family} not constructible here: {exc}")
    params = SamplingParams(max_tokens=48)
    plain = _run(_engine(model, None), params)
    eng = _engine(model, _lookup())
    spec = _run(eng, params)
    assert spec == plain
    m = eng.metrics.snapshot()
    assert m["spec_passes_total"] > 0
    if family == "llama":  # this tiny model's greedy text loops: both branches run
        assert 0 < m["spec_accepted_tokens_total"] < m["spec_draft_tokens_total"]
        assert m["spec_tokens_per_pass"] > 1.0


FAMILIES = {"llama": {}, "gemma3": dict(model_type="gemma3_text", sliding_window=8)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_compiled_verification_rows_equal_single_token_steps(family: str) -> None:
    """A verification group through the compiled step (``layers_spans``: k + 1 rows of one
    sequence sharing its cache, beside another sequence's group and a lone token) gives every
    row the bits of the same token decoded alone, and leaves the same K/V behind."""
    model = _model(**FAMILIES[family])
    if fastpath.install(model) is not None:
        pytest.skip(f"the compiled step is unavailable: {fastpath.unsupported_reason(model)}")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(0, 256, (1, n), generator=g) for n in (11, 6, 9)]
    tails = [torch.randint(0, 256, (1, n), generator=g) for n in (5, 1, 3)]

    def prefilled() -> list:
        caches = [model.new_cache() for _ in prompts]
        for c, p in zip(caches, prompts):
            model.forward_layers(model.embed(p), cache=c, start=0)
        return caches

    with torch.inference_mode():
        alone, want = prefilled(), []
        for c, p, t in zip(alone, prompts, tails):  # token by token: the compiled single step
            for j in range(t.shape[1]):
                h = model.forward_layers(model.embed(t[:, j : j + 1]), cache=c, start=c.length)
                want.append(model.head(h[0])[0])
        batched = prefilled()
        spans = [Span(c, p.shape[1], t.shape[1]) for c, p, t in zip(batched, prompts, tails)]
        h = model.forward_ragged(model.embed(torch.cat(tails, dim=1)), spans)
        got = model.head(h[0])
    assert torch.equal(got, torch.stack(want))
    for a, b in zip(alone, batched):
        assert a.length == b.length
        for ka, kb in zip(a.k, b.k):
            assert ka is not None and kb is not None
            assert torch.equal(ka[:, :, : a.length - a.base], kb[:, :, : b.length - b.base])


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_lookup_is_identical_on_the_compiled_step(family: str) -> None:
    model = _model(**FAMILIES[family])
    if fastpath.install(model) is not None:
        pytest.skip(f"the compiled step is unavailable: {fastpath.unsupported_reason(model)}")
    params = SamplingParams(max_tokens=48)
    plain = _run(_engine(model, None), params)
    eng = _engine(model, _lookup())
    assert _run(eng, params) == plain
    assert eng.metrics.snapshot()["spec_passes_total"] > 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_greedy_lookup_is_identical_on_real_gemma3(real_gemma3) -> None:
    """The published Gemma 3 270M file (near-tie logits: the eager verification pass used to
    flip its greedy text within ~50 tokens of a code-editing prompt), adaptive k."""
    from benchmarks.edge_speculative import WORKLOADS
    from edge.shardio import load_shard
    from edge.source import resolve_model

    model = load_shard(str(real_gemma3)).model
    tok = resolve_model(str(real_gemma3)).tokenizer()
    params = SamplingParams(max_tokens=64, ignore_eos=True)
    prompt = tok.encode(WORKLOADS["code-edit"])
    out = []
    for spec in (None, Speculation(SpecConfig(), LookupDrafter)):
        eng = Engine(LocalRunner(model), tok, model_name="g", speculation=spec)
        try:
            out.append([e.token for e in eng.generate(prompt, params) if e.token is not None])
        finally:
            eng.close()
    assert out[1] == out[0]
    assert eng.metrics.snapshot()["spec_accepted_tokens_total"] > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_greedy_draft_model_is_identical() -> None:
    target = _model(seed=1)
    params = SamplingParams(max_tokens=24)
    plain = _run(_engine(target, None), params)
    for draft_seed in (1, 2):  # the same weights (all accepted), others (mostly rejected)
        dm = DraftModel(_model(seed=draft_seed, num_hidden_layers=1), ByteTokenizer())
        dm.check(target.config.vocab_size, ByteTokenizer())
        spec = Speculation(SpecConfig(draft_max=5, adaptive=False), dm.drafter)
        eng = _engine(target, spec)
        assert _run(eng, params) == plain
        assert eng.metrics.snapshot()["spec_passes_total"] > 0
    same = DraftModel(target, ByteTokenizer())
    eng = _engine(target, Speculation(SpecConfig(draft_max=4, adaptive=False), same.drafter))
    assert _run(eng, params) == plain
    m = eng.metrics.snapshot()
    assert m["spec_accepted_tokens_total"] == m["spec_draft_tokens_total"] > 0


def test_draft_model_keeps_finished_caches_for_shared_prefixes() -> None:
    """A finished request's draft cache is kept: the next request with the same prompt reads
    only its last token into the draft model, and proposes exactly what a fresh drafter does;
    at most ``keep`` caches are kept, none with keep=0, and a cache a failed forward left
    half-written is dropped."""
    draft = _model(seed=2, num_hidden_layers=1)
    greedy = Sampler(SamplingParams(max_tokens=8))
    ids = list(PROMPTS[1].encode())
    dm = DraftModel(draft, ByteTokenizer(), keep=2)
    first = dm.drafter()
    a = first.propose(ids, 4, greedy)
    assert a.fed == len(ids) + 3  # the whole prompt, then one position per proposal but the last
    first.close()
    second = dm.drafter()
    b = second.propose(ids, 4, greedy)
    assert b.tokens == a.tokens and b.fed == 1 + 3  # the kept cache: only the last token again
    fresh = DraftModel(draft, ByteTokenizer(), keep=0).drafter()
    assert fresh.propose(ids, 4, greedy).tokens == a.tokens
    second.close()
    # a longer prompt sharing the first one reads only what it adds
    longer = dm.drafter()
    assert longer.propose(ids + [65, 66], 2, greedy).fed == 2 + 1
    longer.close()
    other = [dm.drafter() for _ in range(3)]
    for i, d in enumerate(other):
        d.propose([70 + i, 71], 1, greedy)
        d.close()
    assert len(dm._pool) == 2  # the oldest left: keep=2
    off = DraftModel(draft, ByteTokenizer(), keep=0)
    d = off.drafter()
    d.propose(ids, 1, greedy)
    d.close()
    assert off._pool == []
    with pytest.raises(ConfigError):
        DraftModel(draft, ByteTokenizer(), keep=-1)
    broken = DraftModel(draft, ByteTokenizer(), keep=2)
    d = broken.drafter()
    d.propose(ids, 1, greedy)
    with pytest.raises(IndexError):
        d.propose(ids + [10**6], 1, greedy)  # an id outside the vocabulary: the forward fails
    d.close()
    assert broken._pool == []
    with pytest.raises(RuntimeError, match="closed"):
        d.propose(ids, 1, greedy)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_rollback_keeps_cache_consistent_across_requests() -> None:
    """Rejected rows are rolled back: a follow-up request reusing the cached prefix (and a
    batch of two streams) decodes exactly as without speculation."""
    model = _model()
    params = SamplingParams(max_tokens=30)
    prompts = [PROMPTS[1], PROMPTS[1] + " on the"]
    plain_e = _engine(model, None, parallel=2)
    plain = [plain_e.complete(p, params) for p in prompts]
    plain_e.close()
    eng = _engine(model, _lookup(4), parallel=2)
    try:
        spec = [eng.complete(p, params) for p in prompts]
        assert eng.metrics.snapshot()["prefix_cache_hits_total"] > 0
    finally:
        eng.close()
    assert spec == plain
    assert (
        eng.metrics.snapshot()["spec_accepted_tokens_total"]
        < eng.metrics.snapshot()["spec_draft_tokens_total"]
    )


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_stop_strings_logprobs_and_length_with_drafting() -> None:
    model = _model()
    for params in (
        SamplingParams(max_tokens=40, logprobs=3),
        SamplingParams(max_tokens=40, stop=("at",)),
        SamplingParams(max_tokens=7),
    ):
        want = [list(_engine(model, None).generate(p, params)) for p in PROMPTS[:2]]
        eng = _engine(model, _lookup())
        got = [list(eng.generate(p, params)) for p in PROMPTS[:2]]
        eng.close()
        assert [[(e.text, e.token, e.finish_reason) for e in g] for g in got] == [
            [(e.text, e.token, e.finish_reason) for e in w] for w in want
        ]
        for g, w in zip(got, want):  # verification rows' logprobs: a batched head's rounding
            for a, b in zip(g, w):
                assert (a.logprob is None) == (b.logprob is None)
                if a.logprob is not None:
                    assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
                    assert [t for t, _ in a.top_logprobs] == [t for t, _ in b.top_logprobs]
        assert sum(e.token is not None for e in got[0]) <= params.max_tokens


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sampled_requests_run_and_respect_seed() -> None:
    model = _model()
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
    a = _run(_engine(model, _lookup()), params)
    b = _run(_engine(model, _lookup()), params)
    assert a == b and all(n == 24 for _, _, n in a)


def _chi2(counts: torch.Tensor, p: torch.Tensor) -> float:
    n = float(counts.sum())
    exp = p * n
    keep = exp > 0
    assert float(counts[~keep].sum()) == 0.0  # never a token the target cannot produce
    return float(((counts[keep] - exp[keep]) ** 2 / exp[keep]).sum())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("deterministic", [True, False])
def test_rejection_rule_preserves_the_target_distribution(deterministic: bool) -> None:
    """Counting over a 5-token vocabulary: the first emitted token follows p whatever the
    draft, to a chi-square bound (4 degrees of freedom, 99.9% quantile 18.5); drafts that
    were always kept would not (checked too, so the test can fail)."""
    torch.manual_seed(0)
    V, N = 5, 20000
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0], [0.0, 0.3, 1.0, 0.0, -2.0]])
    sampler = Sampler(SamplingParams(temperature=1.0, seed=7))
    p = torch.softmax(logits[0], -1)
    q_row = torch.tensor([0.05, 0.6, 0.05, 0.2, 0.1])
    counts = torch.zeros(V)
    naive = torch.zeros(V)
    gen = torch.Generator().manual_seed(11)
    for _ in range(N):
        if deterministic:  # a lookup drafter: always proposes token 1
            draft = Draft((1,))
        else:
            d = int(torch.multinomial(q_row, 1, generator=gen).item())
            draft = Draft((d,), q_row[None].clone())
        toks, _ = verify(draft, logits, sampler)
        counts[toks[0]] += 1
        naive[draft.tokens[0]] += 1
    assert _chi2(counts, p) < 18.5
    assert _chi2(naive + (naive == 0) * 1e-9, p) > 100  # the test discriminates


def test_greedy_verify_keeps_the_argmax_prefix() -> None:
    sampler = Sampler(SamplingParams())
    logits = torch.full((4, 6), -1.0)
    for j, t in enumerate((3, 4, 0, 5)):
        logits[j, t] = 1.0
    assert verify(Draft((3, 4, 1)), logits, sampler) == ([3, 4, 0], 2)
    assert verify(Draft((3, 4, 0)), logits, sampler) == ([3, 4, 0, 5], 3)
    assert verify(Draft((2, 4, 0)), logits, sampler) == ([3], 0)
    with pytest.raises(ValueError):
        verify(Draft((3,)), logits, sampler)


def test_lookup_proposes_the_latest_continuation() -> None:
    d = LookupDrafter(LookupConfig(ngram_max=2))
    seq = [1, 2, 3, 4, 9, 2, 3, 5, 6, 2, 3]
    assert d.propose(seq, 3).tokens == (5, 6, 2)  # the latest "2 3" was followed by 5
    assert d.propose(seq + [5], 2).tokens == (6, 2)
    assert d.propose([7, 8], 4).tokens == ()
    assert LookupDrafter().propose([1, 2, 3], 4).tokens == ()


def test_draft_length_follows_acceptance() -> None:
    cfg = SpecConfig(draft_max=10, draft_min=2)
    cost = PassCost()
    hi, lo = DraftLength(cfg), DraftLength(cfg)
    for _ in range(60):
        hi.observe(8, 8)
        lo.observe(8, 0)
    assert hi.choose(cost) == 2  # nothing timed yet: a pass of at most EXPLORE rows more
    cost.observe(1, 1.0)
    cost.observe(11, 1.05)
    assert hi.choose(cost) == 10
    cost = PassCost()
    # drafts that are all rejected: plain one-token passes, a k_min probe every `probe` passes
    assert [lo.choose(cost) for _ in range(2 * lo.probe)].count(2) == 2
    assert lo.choose(cost) == 0
    lo.observe(2, 2)  # a probe that was kept counts: acceptance climbs back
    assert lo.alpha > 0.15
    for _ in range(20):  # rows nearly free: longer drafts pay even at moderate acceptance
        cost.observe(1, 1.0)
        cost.observe(9, 1.04)
    mid = DraftLength(cfg, alpha=0.7)
    assert mid.choose(cost) > DraftLength(cfg, alpha=0.3).choose(cost) > 0
    dear = PassCost()  # every row costs about what a one-row pass costs: only high acceptance
    for _ in range(20):
        dear.observe(1, 1.0)
        dear.observe(5, 4.0)
    assert DraftLength(cfg, alpha=0.5).choose(dear) == 0
    assert DraftLength(cfg, alpha=0.95).choose(dear) >= 2
    # in a batch of 8 the pass's fixed cost is shared: a row costs more of a sequence's share
    cost8 = PassCost()
    for _ in range(20):
        cost8.observe(8, 1.0)
        cost8.observe(40, 2.0)
    assert DraftLength(cfg, alpha=0.6).choose(cost8, batch=8) < DraftLength(cfg, alpha=0.6).choose(
        cost8, batch=1
    )
    slow = DraftLength(cfg, alpha=0.9)  # a drafter whose tokens cost a plain pass each
    slow.observe_drafting(1, 100.0)  # the first proposal also read the prompt: not counted
    assert slow.draft_s == 0.0
    slow.observe_drafting(4, 4.0)
    assert slow.choose(dear) < DraftLength(cfg, alpha=0.9).choose(dear)
    # acceptance counts the tokens put to the test: 2 kept then a rejection is 2/3, not 2/8
    est = DraftLength(cfg, alpha=0.5, weight=0.5)
    est.observe(8, 2)
    assert est.alpha == pytest.approx(0.5 * 0.125 + (2 / 3) * 0.875)
    assert DraftLength(SpecConfig(draft_max=6, adaptive=False), alpha=0.0).choose(cost) == 6
    # a request's first tested tokens weigh like a mean over what it has seen (prior 2):
    # two kept tokens take α from 0.6 to 0.8 (by weight 0.1 alone: 0.676), later ones forget
    # at the weight
    new = DraftLength(cfg, alpha=0.6)
    new.observe(2, 2)
    assert new.alpha == pytest.approx(0.5 * 0.6 + 0.5 * 1.0)
    for _ in range(40):
        new.observe(1, 1)
    before = new.alpha
    new.observe(1, 0)
    assert new.alpha == pytest.approx(0.9 * before)
    shadow = DraftLength(cfg, alpha=0.6)
    shadow.observe_shadow(False)
    assert shadow.alpha == pytest.approx(0.6 * (1 - 1 / 3))
    with pytest.raises(ConfigError):
        SpecConfig(draft_max=ROWWISE_ROWS)
    with pytest.raises(ConfigError):
        SpecConfig(draft_max=3, draft_min=4)


def test_draft_length_grows_as_larger_passes_are_timed() -> None:
    """k keeps a pass within EXPLORE rows of the largest measured: a single stream starts at
    k = 2 and grows as its verification passes are timed; beside a batch of 8 plain rows a
    sequence may add 2, and once another added them, none."""
    cfg = SpecConfig(draft_max=8)
    cost = PassCost()
    cost.observe(1, 1.0)
    sure = DraftLength(cfg, alpha=0.95)
    assert sure.choose(cost) == 2
    cost.observe(3, 1.05)
    assert sure.choose(cost) == 4
    for rows in (5, 7, 9):
        cost.observe(rows, 1.0 + 0.02 * rows)
    assert sure.choose(cost) == 8
    assert cost.relatives(8) == [cost.relative(k + 1) for k in range(9)]
    batch = PassCost()
    for _ in range(3):
        batch.observe(8, 1.0)
    assert DraftLength(cfg, alpha=0.95).choose(batch, batch=8) <= 2
    assert DraftLength(cfg, alpha=0.95).choose(batch, batch=8, added=2) == 0


def test_timings_believe_a_faster_pass_sooner_than_a_slower_one() -> None:
    """A shared machine's noise only adds time: one slow pass moves a row count's cost by a
    tenth of the difference, a faster one by half (so a draft length seldom chosen does not
    keep a hiccup's cost)."""
    cost = PassCost()
    cost.observe(3, 1.0)
    cost.observe(3, 3.0)  # a hiccup
    assert cost.seconds(3) == pytest.approx(1.2)
    cost.observe(3, 0.6)
    assert cost.seconds(3) == pytest.approx(0.9)
    d = DraftLength(SpecConfig(draft_max=4))
    d.observe_drafting(9, 1.0, 4)  # the first proposal read the prompt: not counted
    d.observe_drafting(4, 0.4, 4)
    d.observe_drafting(4, 4.0, 4)
    assert d.draft_s == pytest.approx(0.1 + 0.1 * 0.9)
    d.observe_drafting(4, 0.2, 4)
    assert d.draft_s == pytest.approx(0.19 + 0.5 * (0.05 - 0.19))


def test_penalised_requests_are_not_drafted() -> None:
    assert drafting_allowed(SamplingParams())
    assert drafting_allowed(SamplingParams(temperature=0.7, top_k=40, top_p=0.9))
    for kw in (
        {"presence_penalty": 0.5},
        {"frequency_penalty": 0.5},
        {"repeat_penalty": 1.1},
        {"logit_bias": ((7, -100.0),)},
        {"min_p": 0.05},
        {"typical_p": 0.9},
    ):
        assert not drafting_allowed(SamplingParams(**kw)), kw


def test_head_rows_keep_every_argmax() -> None:
    torch.manual_seed(0)
    head = nn.Linear(64, 300, bias=False)
    x = torch.randn(1, 9, 64)
    x[0, 3] = x[0, 2]  # a tie-prone row among them
    with torch.inference_mode():
        one = torch.cat([head(x[:, i : i + 1]) for i in range(9)], dim=1)
        got = head_rows(head, x)
    assert torch.equal(got.argmax(-1), one.argmax(-1))
    assert torch.allclose(got, one, atol=1e-4)


def test_linear_rows_match_single_row_decode() -> None:
    torch.manual_seed(0)
    lin = nn.Linear(640, 2048, bias=False)
    x = torch.randn(1, ROWWISE_ROWS, 640)
    with torch.inference_mode():
        one = torch.cat([lin(x[:, i : i + 1]) for i in range(ROWWISE_ROWS)], dim=1)
        for n in (2, 3, 5, ROWWISE_ROWS):
            assert torch.equal(linear_rows(lin, x[:, :n]), one[:, :n])


class _OtherTokenizer(ByteTokenizer):
    def decode(self, ids):
        return super().decode([(int(i) + 1) % 256 for i in ids])


def test_incompatible_draft_is_refused_with_a_clear_error() -> None:
    tok = ByteTokenizer()
    check_compatible(256, tok, 256, ByteTokenizer())
    with pytest.raises(IncompatibleDraft, match="vocabulary of 512 tokens, target has 256"):
        check_compatible(256, tok, 512, tok)
    with pytest.raises(IncompatibleDraft, match="different string"):
        check_compatible(256, tok, 256, _OtherTokenizer())
    assert issubclass(IncompatibleDraft, ConfigError)


def _saturated_cost() -> PassCost:
    """Pass times measured at 2 threads (Gemma 3 270M Q4_K_M, ms): one to four one-row
    sequences, eight, and eight with one sequence's verification group of 5 or 9 rows, and
    16 and 24 one-row sequences. A sequence's share of the eight-row pass is 2.9; a row past
    eight costs about 1.8. The least-squares line through them lies under the eight-row
    mean (its T(9) is less than the measured T(8)): a row is not free."""
    cost = PassCost()
    for _ in range(10):
        for rows, ms in ((1, 7.0), (2, 7.9), (4, 10.6), (8, 23.0), (12, 30.2), (16, 36.9)):
            cost.observe(rows, ms / 1000)
        cost.observe(24, 48.1 / 1000)
    return cost


def test_draft_rows_cost_their_margin_in_a_busy_batch() -> None:
    cost = _saturated_cost()
    # a row beside the eight costs what the measured means say, never a fit-vs-mean difference
    assert cost.seconds(9) >= cost.seconds(8)
    assert cost.relative(2, batch=8) == pytest.approx(1 + (30.2 - 23.0) / 4 / (23.0 / 8))
    cfg = SpecConfig(draft_max=8)
    # mediocre acceptance at 8 streams: a row costs more than the tokens it is expected to add
    assert DraftLength(cfg, alpha=0.5).choose(cost, batch=8) == 0
    # good acceptance pays even there
    assert DraftLength(cfg, alpha=0.9).choose(cost, batch=8) > 0
    # the same stream alone (its share is a whole pass; extra rows are cheap beside it) drafts
    assert DraftLength(cfg, alpha=0.5).choose(cost, batch=1) > 0
    assert DraftLength(cfg, alpha=0.85).choose(cost, batch=1) >= 2
    dear = PassCost()  # past 8 rows every row costs a whole share (compute-bound)
    for _ in range(10):
        for rows in (8, 16, 24):
            dear.observe(rows, rows / 8 * 0.024)
    assert DraftLength(cfg, alpha=0.9).choose(dear, batch=8) == 0
    # rows already added by other sequences in this pass: the next draft pays the margin there
    steep = PassCost()  # cheap rows up to 12, then a share each
    for _ in range(10):
        for rows, ms in ((8, 24.0), (12, 25.0), (16, 37.0), (24, 61.0)):
            steep.observe(rows, ms / 1000)
    assert DraftLength(cfg, alpha=0.7).choose(steep, batch=8, added=0) > 0
    assert DraftLength(cfg, alpha=0.7).choose(steep, batch=8, added=4) == 0


def test_shadow_proposals_track_acceptance_without_probes() -> None:
    cfg = SpecConfig(draft_max=4, draft_min=1)
    cost = _saturated_cost()
    d = DraftLength(cfg, alpha=0.5)
    ks = []
    for i in range(3 * d.probe):
        ks.append(d.choose(cost, batch=8))
        d.observe_shadow(i % 10 >= 7)  # 30 % of the guesses were the emitted token
    assert 0.2 < d.alpha < 0.45
    assert ks == [0] * len(ks)  # no draft, not even a probe, while the shadows come
    ks = [d.choose(cost, batch=8) for _ in range(d.probe)]
    assert ks.count(cfg.draft_min) == 1  # without them, a probe draft
    for _ in range(40):
        d.observe_shadow(True)
    assert d.alpha > 0.9
    assert d.choose(cost, batch=8) > 0
    for _ in range(40):
        d.observe_shadow(False)
    assert d.alpha < 0.1


class _Guess:
    """A free drafter that always proposes the same token."""

    TOKEN = ByteTokenizer().encode("c")[-1]
    free = True

    def propose(self, tokens, k: int, sampler=None) -> Draft:
        return Draft((self.TOKEN,) * k)

    def close(self) -> None:
        pass


def test_free_drafter_shadows_keep_greedy_text_and_count_acceptance(monkeypatch) -> None:
    """At a cost that makes every draft lose (each extra row costs a whole pass: no
    acceptance below 1 pays), the engine drafts nothing, still asks prompt lookup for a
    one-token guess each step to keep the acceptance known, and the text is the plain
    engine's."""
    model = _model()
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    prompt = "abcabcabcabcabcabc"
    plain = Engine(LocalRunner(model), ByteTokenizer(), model_name="m")
    want = [ev.token for ev in plain.generate(prompt, params) if ev.token is not None]
    plain.close()
    eng = Engine(
        LocalRunner(model),
        ByteTokenizer(),
        model_name="m",
        speculation=Speculation(SpecConfig(draft_max=4), _Guess),
    )
    seen: list[bool] = []
    shadow = DraftLength.observe_shadow
    monkeypatch.setattr(
        DraftLength, "observe_shadow", lambda self, ok: (seen.append(ok), shadow(self, ok))[1]
    )
    for _ in range(20):
        eng.pass_cost.observe(1, 1.0)
        eng.pass_cost.observe(5, 5.0)
    try:
        got = [ev.token for ev in eng.generate(prompt, params) if ev.token is not None]
    finally:
        eng.close()
    assert got == want
    assert eng.metrics.spec_passes == 0
    # one guess per plain decode step (the first token comes from the prompt's pass; the
    # last step has no room for a draft), each scored against the token that step emitted
    assert seen == [t == _Guess.TOKEN for t in got[1:-1]]


def test_no_probe_where_no_acceptance_would_pay() -> None:
    """A drafter whose tokens cost a sequence's share each, beside a busy batch: not even a
    sure draft pays, so no probe is spent; alone, the same drafter probes while k = 0."""
    cfg = SpecConfig(draft_max=8, draft_min=1)
    cost = _saturated_cost()
    slow = DraftLength(cfg, alpha=0.1)
    slow.observe_drafting(1, 1.0)  # the first proposal is not counted
    slow.observe_drafting(1, cost.share_s(8))
    assert [slow.choose(cost, batch=8) for _ in range(3 * slow.probe)] == [0] * 3 * slow.probe
    alone = [slow.choose(cost, batch=1) for _ in range(2 * slow.probe)]
    assert alone.count(cfg.draft_min) == 2 and alone.count(0) == 2 * slow.probe - 2


def test_drafting_time_is_per_proposed_token_while_the_drafter_keeps_up() -> None:
    d = DraftLength(SpecConfig(draft_max=8))
    d.observe_drafting(180, 5.0, proposed=4)  # the first proposal reads the prompt
    d.observe_drafting(17, 0.002, proposed=1)  # caught up on 16 missed tokens in one forward
    assert d.draft_s == 0.0
    d.observe_drafting(5, 0.004, proposed=4)  # steady: one forward per proposed token
    assert d.draft_s == pytest.approx(0.001)
