"""Tier 2: DiLoCo and DDP workers over the loopback communicator (ranks as threads).

The numerics are checked against independent re-statements of the algorithms written here
(plain DiLoCo, streaming with overlap, large-batch SGD); failures (kill, join, corrupted state,
NaN, wrong model) against the group's invariants: every worker ends bit-identical in θ_g.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import threading

import pytest
import torch
from torch import nn

from diloco.checkpoint import load_state
from diloco.common import InnerLoop
from diloco.config import DDPConfig, DilocoConfig, LrSchedule, OptimizerConfig, TrainConfig, tiny
from diloco.ddp import DDPWorker
from diloco.fragments import plan_fragments
from diloco.launch import run_threads
from diloco.outer import FragmentSync
from diloco.schedule import Kind, drain_actions, fragment_actions
from diloco.task import lm_task
from diloco.trainer import DilocoWorker
from lowband.codecs import get_codec
from lowband.errors import IncompatiblePeer
from tests.conftest import rank_outcomes
from tests.diloco.configs import small_lm
from transport.loopback import LoopbackGroup

pytestmark = pytest.mark.timeout(120)


class Regression:
    """A tiny non-LM task: any nn.Module can be trained. y = sin(x·w) regression."""

    def __init__(self, d: int = 6, batch: int = 16) -> None:
        self.d, self.batch = d, batch
        self.w = torch.randn(d, generator=torch.Generator().manual_seed(99))
        g = torch.Generator().manual_seed(7)
        self.eval_x = torch.randn(64, d, generator=g)

    def build_model(self) -> nn.Module:
        torch.manual_seed(0)  # every worker builds the same model
        return nn.Sequential(
            nn.Linear(self.d, 16), nn.Tanh(), nn.Linear(16, 8), nn.Tanh(), nn.Linear(8, 1)
        )

    def train_batch(self, slot: int, step: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(1000 * slot + step)
        return torch.randn(self.batch, self.d, generator=g)

    def loss(self, model: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return ((model(x).squeeze(-1) - torch.sin(x @ self.w)) ** 2).mean()

    @torch.no_grad()
    def evaluate(self, model: nn.Module) -> float:
        return float(self.loss(model, self.eval_x))

    def tokens_per_batch(self) -> int:
        return self.batch


def reg_cfg(**mode) -> TrainConfig:
    return TrainConfig(
        model=None,
        mode=DilocoConfig(**mode),
        workers=3,
        steps=24,
        inner=OptimizerConfig(name="adamw", lr=1e-2),
        eval_every=0,
        lr_schedule=LrSchedule(warmup_steps=3),
        audit_every=1,
    )


def lm_cfg(**over) -> TrainConfig:
    """The shared small run with this file's outer step: fp32 on the wire, no error feedback."""
    mode = DilocoConfig(inner_steps=6, n_fragments=2, tau=1, alpha=0.5)
    return small_lm(**{"mode": mode, **over})


def run_group(cfg, task, comms, **kw):
    workers = [
        DilocoWorker(cfg, c, task, **kw)
        if isinstance(cfg.mode, DilocoConfig)
        else DDPWorker(cfg, c, task, **kw)
        for c in comms
    ]
    return workers, run_all([w.run for w in workers])


def run_all(fns, timeout=100.0):
    return rank_outcomes(fns, timeout)


def reference_streaming(cfg: TrainConfig, task, world: int) -> nn.Module:
    """Streaming DiLoCo re-stated plainly: M local models, one global model, P outer optimizers."""
    m = cfg.mode
    glob = task.build_model()
    loops = [InnerLoop(cfg, task, copy.deepcopy(glob)) for _ in range(world)]
    gp = dict(glob.named_parameters())
    lps = [dict(lp.model.named_parameters()) for lp in loops]
    plan = plan_fragments(list(gp.items()), m.n_fragments, m.fragment_strategy)
    outer = [m.outer.build([gp[n] for n in names]) for names in plan.names]
    sent: dict[int, list[torch.Tensor]] = {}

    @torch.no_grad()
    def act(a):
        names = plan.names[a.fragment]
        if a.kind is Kind.SEND:  # Δ_m = θ_g − θ_m, flattened
            sent[a.fragment] = [
                torch.cat([(gp[n] - lp[n]).reshape(-1) for n in names]) for lp in lps
            ]
            return
        rows = sent.pop(a.fragment)
        total = rows[0].clone()
        for row in rows[1:]:
            total += row
        avg, off = total / world, 0
        for n in names:
            gp[n].grad = avg[off : off + gp[n].numel()].view_as(gp[n]).clone()
            off += gp[n].numel()
        outer[a.fragment].step()
        outer[a.fragment].zero_grad()
        for lp in lps:
            for n in names:
                lp[n].copy_(m.alpha * lp[n] + (1 - m.alpha) * gp[n] if m.alpha else gp[n])

    for step in range(1, cfg.steps + 1):
        for r, loop in enumerate(loops):
            loop.run_step(r)
        for a in fragment_actions(step, m.n_fragments, m.inner_steps, m.tau):
            act(a)
    for a in drain_actions(cfg.steps, m.n_fragments, m.inner_steps, m.tau):
        act(a)
    return glob


@pytest.mark.parametrize(
    "mode",
    [
        dict(inner_steps=6),  # plain DiLoCo: P=1, τ=0, α=0
        dict(inner_steps=6, n_fragments=2, tau=2, alpha=0.5),
        dict(inner_steps=6, n_fragments=3, tau=1, fragment_strategy="sequential"),
    ],
)
def test_matches_reference_streaming_diloco(mode):
    cfg = reg_cfg(**mode)
    task = Regression()
    workers, (results, errors) = run_group(cfg, task, LoopbackGroup(3).comms())
    assert errors == [None] * 3
    ref = reference_streaming(cfg, task, 3)
    for (name, p), (_, q) in zip(
        workers[0].global_model.named_parameters(), ref.named_parameters()
    ):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert len({r.state_hash for r in results}) == 1
    assert results[0].outer_syncs == cfg.steps // (cfg.mode.inner_steps // cfg.mode.n_fragments)


def test_outer_sgd_lr1_is_model_averaging(monkeypatch):
    cfg = dataclasses.replace(
        reg_cfg(inner_steps=24, outer=OptimizerConfig(name="sgd", lr=1.0)), audit_every=0
    )
    task = Regression()
    locals_at_sync = []
    orig = DilocoWorker._send

    def spy(self, action):  # θ_local of each worker right before the only sync (step 24)
        locals_at_sync.append([p.detach().clone() for p in self.model.parameters()])
        orig(self, action)

    monkeypatch.setattr(DilocoWorker, "_send", spy)
    workers, (_, errors) = run_group(cfg, task, LoopbackGroup(3).comms())
    assert errors == [None] * 3 and len(locals_at_sync) == 3
    for i, p in enumerate(workers[0].global_model.parameters()):
        mean = sum(loc[i] for loc in locals_at_sync) / 3
        torch.testing.assert_close(p, mean, rtol=1e-5, atol=1e-6)


def test_ddp_equals_single_process_large_batch():
    cfg = dataclasses.replace(lm_cfg(), mode=DDPConfig(), steps=6)
    task = lm_task(cfg)
    workers, (results, errors) = run_group(cfg, task, LoopbackGroup(2).comms())
    assert errors == [None, None]

    class Concat:  # one process, batch = both workers' batches side by side
        def __getattr__(self, k):
            return getattr(task, k)

        def train_batch(self, slot, step):
            return torch.cat([task.train_batch(r, step) for r in range(2)])

    ref = InnerLoop(cfg, Concat(), task.build_model())
    for _ in range(cfg.steps):
        ref.run_step(0)
    for p, q in zip(workers[1].model.parameters(), ref.model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)
    assert results[0].state_hash == results[1].state_hash
    n_params = sum(p.numel() for p in ref.model.parameters())
    # fp32 gradients every step (2 ranks: each sends one copy) + the 16-byte start check
    assert results[0].bytes_sent == cfg.steps * 4 * n_params + 16


@pytest.mark.parametrize("codec", ["fp16", "bf16", "int8", "fp4", "nf4", "e3m0"])
def test_each_codec_trains_and_shrinks_the_wire(codec):
    mode = DilocoConfig(inner_steps=6, n_fragments=2, tau=1, codec=codec, error_feedback=True)
    cfg = lm_cfg(mode=mode)
    res = run_threads(cfg)
    base = run_threads(lm_cfg(mode=dataclasses.replace(mode, codec="fp32", error_feedback=False)))
    assert res[0].state_hash == res[1].state_hash
    assert res[0].final_eval < 5.0 and res[0].final_eval == pytest.approx(
        base[0].final_eval, rel=0.05
    )
    ratio = res[0].bytes_sent / base[0].bytes_sent
    expected = {"fp16": 0.5, "bf16": 0.5, "int8": 0.25, "fp4": 0.125, "nf4": 0.125, "e3m0": 0.125}
    assert expected[codec] < ratio < expected[codec] * 1.25, ratio


def test_error_feedback_keeps_the_running_sum():
    p_local = nn.Parameter(torch.zeros(1000))
    p_glob = nn.Parameter(torch.zeros(1000))
    delta = torch.linspace(-1, 1, 1000) ** 3 * 1e-3
    opt = torch.optim.SGD([p_glob], lr=1.0)
    sums = {}
    for ef in (False, True):
        frag = FragmentSync(0, ["w"], [p_local], [p_glob], opt, get_codec("e3m0"), ef)
        sent = torch.zeros(1000)
        for _ in range(20):
            with torch.no_grad():
                p_local.copy_(p_glob - delta)
            x, valid = frag.contribution()
            assert valid
            sent += frag.codec.decode(frag.codec.encode(x)).reshape(-1)
        sums[ef] = (sent - 20 * delta).abs().max().item()
    # without feedback the rounding bias grows with every round; with it, it stays one step's
    assert sums[True] < 0.2 * sums[False]
    assert sums[True] <= (delta.abs().max().item())


def test_nan_contribution_is_dropped(caplog):
    cfg = lm_cfg(workers=3, mode=DilocoConfig(inner_steps=4))
    task = lm_task(cfg)

    class Poison:
        def __getattr__(self, k):
            return getattr(task, k)

        def loss(self, model, batch):
            loss = task.loss(model, batch)
            return loss * float("nan") if batch is poisoned else loss

    poisoned = task.train_batch(1, 2)
    orig_batch = task.train_batch
    p = Poison()
    p.train_batch = lambda slot, step: (
        poisoned if (slot, step) == (1, 2) else orig_batch(slot, step)
    )
    with caplog.at_level(logging.WARNING):
        workers, (results, errors) = run_group(cfg, p, LoopbackGroup(3).comms())
    assert errors == [None] * 3
    assert "non-finite pseudo-gradient" in caplog.text and "2 of 3 workers" in caplog.text
    assert len({r.state_hash for r in results}) == 1
    for w in workers:
        assert all(torch.isfinite(q).all() for q in w.global_model.parameters())
        assert all(torch.isfinite(q).all() for q in w.model.parameters())  # merge healed it
    assert results[0].final_eval < 5.0


class _Killed(Exception):
    pass


def test_killed_worker_does_not_stop_the_others():
    # final_grace 0: the killed worker never comes back, so nobody holds for it at the end.
    cfg = lm_cfg(
        workers=3,
        steps=24,
        final_grace=0.0,
        mode=DilocoConfig(inner_steps=10, n_fragments=2, tau=2),
    )
    task = lm_task(cfg)
    group = LoopbackGroup(3, timeout=30)
    comms = group.comms()

    def die(step):
        if step == 4:  # before its first SEND at step 5: the survivors' sync must fail
            group.kill(comms[2])
            raise _Killed

    workers = [
        DilocoWorker(cfg, c, task, on_step=die if r == 2 else None) for r, c in enumerate(comms)
    ]
    results, errors = run_all([w.run for w in workers])
    assert isinstance(errors[2], _Killed) and errors[:2] == [None, None]
    assert [r.steps for r in results[:2]] == [24, 24]
    assert results[0].state_hash == results[1].state_hash
    assert results[0].retries == results[1].retries == 1  # the lost sync was redone by 2
    assert results[1].rank == 1 and workers[0].comm.world_size == 2


def test_worker_lost_during_an_audit_is_logged_as_left(tmp_path):
    """A peer that dies inside a reconciliation (an audit's verify all-gather) is absorbed by the
    retry's quorum, not the sync point's: that membership change is logged all the same."""
    from diloco.metrics import MetricsLog, read_jsonl

    cfg = lm_cfg(
        workers=3,
        steps=24,
        audit_every=1,
        final_grace=0.0,  # the victim never comes back
        mode=DilocoConfig(inner_steps=10, n_fragments=2, tau=2),
    )
    task = lm_task(cfg)
    group = LoopbackGroup(3, timeout=30)
    comms = group.comms()
    workers = [
        DilocoWorker(cfg, c, task, log=MetricsLog(tmp_path / f"m{r}.jsonl"))
        for r, c in enumerate(comms)
    ]
    victim = workers[2]
    real_verify = victim.reconciler._verify

    def verify_then_die(tag, reason, stale, mine):
        if reason == "audit":
            group.kill(comms[2])
            raise _Killed
        return real_verify(tag, reason, stale, mine)

    victim.reconciler._verify = verify_then_die  # type: ignore[method-assign]
    results, errors = run_all([w.run for w in workers])
    assert isinstance(errors[2], _Killed) and errors[:2] == [None, None]
    assert results[0].state_hash == results[1].state_hash
    for w in workers[:2]:
        w.log.close()
    for r in (0, 1):
        changes = [e for e in read_jsonl(tmp_path / f"m{r}.jsonl") if e["event"] == "membership"]
        assert any(len(e["left"]) == 1 for e in changes), changes


def test_joining_worker_gets_bit_identical_state():
    cfg = lm_cfg(workers=2, steps=30, mode=DilocoConfig(inner_steps=10, n_fragments=2, tau=2))
    task = lm_task(cfg)
    group = LoopbackGroup(2, timeout=30)
    joined: dict = {}

    def spawn_joiner(step):
        if step == 3:
            w = DilocoWorker(cfg, group.join(), task)
            joined["worker"] = w
            t = threading.Thread(target=lambda: joined.setdefault("result", w.run()), daemon=True)
            joined["thread"] = t
            t.start()

    workers = [
        DilocoWorker(cfg, c, task, on_step=spawn_joiner if r == 0 else None)
        for r, c in enumerate(group.comms())
    ]
    results, errors = run_all([w.run for w in workers])
    joined["thread"].join(60)
    assert errors == [None, None] and "result" in joined
    new = joined["result"]
    assert new.start_step >= 7 and new.transfers == 1 and new.steps == 30
    assert results[0].state_hash == results[1].state_hash == new.state_hash
    assert workers[0].comm.world_size == 3


def test_corrupted_state_is_healed_by_the_audit():
    cfg = lm_cfg(audit_every=1)
    task = lm_task(cfg)
    comms = LoopbackGroup(2).comms()

    def corrupt(step):
        if step == 4:
            with torch.no_grad():
                next(workers[1].global_model.parameters()).add_(1.0)

    workers = [
        DilocoWorker(cfg, c, task, on_step=corrupt if r == 1 else None) for r, c in enumerate(comms)
    ]
    results, errors = run_all([w.run for w in workers])
    assert errors == [None, None]
    assert results[1].transfers == 1 and results[0].transfers == 0
    assert results[0].state_hash == results[1].state_hash


def test_mismatched_model_is_refused_at_join():
    cfg = lm_cfg(steps=24, mode=DilocoConfig(inner_steps=6, n_fragments=2))
    other = dataclasses.replace(
        cfg, model=dataclasses.replace(cfg.model, hidden_size=48, intermediate_size=96)
    )
    task, other_task = lm_task(cfg), lm_task(other)
    group = LoopbackGroup(2, timeout=30)
    out: dict = {}

    def spawn(step):
        if step == 2:
            w = DilocoWorker(other, group.join(), other_task)

            def body():
                try:
                    w.run()
                except IncompatiblePeer as e:
                    out["error"] = e

            out["t"] = threading.Thread(target=body, daemon=True)
            out["t"].start()

    workers = [
        DilocoWorker(cfg, c, task, on_step=spawn if r == 0 else None)
        for r, c in enumerate(group.comms())
    ]
    results, errors = run_all([w.run for w in workers])
    out["t"].join(30)
    assert errors == [None, None] and "error" in out
    assert results[0].state_hash == results[1].state_hash
    assert workers[0].comm.world_size == 2


def test_resume_gives_the_same_curve_and_bits(tmp_path):
    cfg = lm_cfg(
        steps=24,
        checkpoint_every=12,
        mode=DilocoConfig(inner_steps=6, n_fragments=2, tau=1, codec="int8", error_feedback=True),
    )
    full = run_threads(cfg, out_dir=tmp_path / "a")
    # a sync is in flight at step 12 (sent at 12, applied at 13): the checkpoint waits a step
    ckpt = tmp_path / "a" / "checkpoints" / "step-000013"
    assert (ckpt / "worker-1.safetensors").exists()
    resumed = run_threads(cfg, resume=ckpt)
    for a, b in zip(full, resumed):
        assert b.start_step == 13
        assert [b.losses[s] for s in range(14, 25)] == [a.losses[s] for s in range(14, 25)]
        assert a.state_hash == b.state_hash


def test_export_loads_in_edge(tmp_path):
    from lowband.models.tokenizer import ByteTokenizer, load_tokenizer
    from lowband.models.weights import load_pretrained

    cfg = lm_cfg(steps=6)
    run_threads(cfg, out_dir=tmp_path)
    model = load_pretrained(tmp_path / "model")
    assert isinstance(load_tokenizer(tmp_path / "model"), ByteTokenizer)
    ids = torch.tensor([list(b"To be, or not")])
    task = lm_task(cfg)
    w = DilocoWorker(cfg, LoopbackGroup(1).comms()[0], task)
    w.load(*load_state(tmp_path / "checkpoints" / "final" / "worker-0"), own=True)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), w.global_model(ids), rtol=0, atol=0)
    events = [
        json.loads(line)["event"]
        for line in (tmp_path / "metrics-worker0.jsonl").read_text().splitlines()
    ]
    assert {"step", "sync", "eval", "audit", "final"} <= set(events)


def test_run_threads_waits_for_the_whole_run_unless_capped() -> None:
    """No fixed cap by default (a 600 s one stopped ``lowband train`` on threads); ``timeout``
    caps the whole run, not each thread's join."""
    cfg = dataclasses.replace(
        tiny(),
        steps=8,
        eval_every=0,
        workers=2,
        mode=DilocoConfig(inner_steps=4, n_fragments=2, tau=1),
    )
    task = lm_task(cfg)
    gate = threading.Event()
    plain = task.train_batch

    def gated(slot, step):
        if step >= 2:
            gate.wait(30)  # held until the test lets go
        return plain(slot, step)

    task.train_batch = gated  # type: ignore[method-assign]
    with pytest.raises(TimeoutError):
        run_threads(cfg, task=task, timeout=0.5)
    gate.set()
    for t in threading.enumerate():  # the capped run's workers finish once released
        if t.name.startswith("worker"):
            t.join(30)
    gate.clear()
    threading.Timer(1.0, gate.set).start()  # longer than the cap above: the default waits
    results = run_threads(cfg, task=task)
    assert [r.steps for r in results] == [8, 8] and results[0].state_hash == results[1].state_hash
