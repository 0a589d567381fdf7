"""The inner step's fast path and DiLoCo's own work off it (issue 27), as CPU twins.

Compiled vs eager losses, no host read inside a step, SDPA's causal kernel without a mask,
the batch prefetcher, the foreach outer step and merge against the per-tensor loops they
replaced, and the profiler's trace. CUDA-only checks carry the ``cuda`` marker.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from diloco.common import InnerLoop
from diloco.config import ComputeConfig, OptimizerConfig, ProfileConfig
from diloco.launch import run_threads
from diloco.outer import FragmentSync
from diloco.prefetch import BatchPrefetcher
from diloco.profiling import ENCODE, INNER_STEP, MERGE, OUTER_STEP
from diloco.task import lm_task
from lowband.codecs import get_codec
from tests.diloco.configs import small_lm

pytestmark = pytest.mark.timeout(240)

NO_CUDA = not torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device visible to torch (CPU build or no GPU): CUDA path not exercised"


def _losses(compute: ComputeConfig, steps: int = 4) -> list[float]:
    cfg = small_lm(compute=compute)
    task = lm_task(cfg)
    loop = InnerLoop(cfg, task, task.build_model(), torch.device("cpu"))
    out = [loop.run_step(0) for _ in range(steps)]
    loop.close()
    return torch.stack(out).tolist()


def test_compile_defaults_on_for_cuda_only():
    from diloco.device import compiles

    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert compiles(None, gpu) and not compiles(None, cpu)
    assert not compiles(False, gpu) and compiles(True, cpu)
    loop = InnerLoop(small_lm(), lm_task(small_lm()), lm_task(small_lm()).build_model(), cpu)
    assert loop.forward_model is loop.model  # CPU default: eager


@pytest.mark.parametrize(
    "backend",
    [
        "aot_eager",
        # C++ code generation: ~30 s with a warm inductor cache on 2 cores, minutes cold
        pytest.param("inductor", marks=[pytest.mark.slow, pytest.mark.timeout(900)]),
    ],
)
def test_compiled_step_gives_the_eager_losses(backend):
    """torch.compile(dynamic=False) of the forward: the same losses as eager over 4 steps.
    aot_eager traces forward and backward through AOTAutograd without generating code;
    inductor generates C++ on the CPU (the kernels CUDA gets as Triton)."""
    eager = _losses(ComputeConfig(device="cpu", compile=False))
    torch._dynamo.reset()
    compiled = _losses(ComputeConfig(device="cpu", compile=True, compile_backend=backend))
    assert eager[0] > eager[-1]  # it trains
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)


_HOST_READS = ("item", "tolist", "__bool__", "__float__", "__int__")


def test_inner_step_makes_no_host_read(monkeypatch):
    """No Tensor → Python value inside a step (on a GPU each one waits for the device): the
    loss stays a device tensor, clipping scales by a tensor, the lr is a Python float."""
    for compute in (
        ComputeConfig(device="cpu"),
        ComputeConfig(device="cpu", precision="bf16", micro_batches=2, optimizer_impl="fused"),
    ):
        cfg = small_lm(compute=compute)
        task = lm_task(cfg)
        loop = InnerLoop(cfg, task, task.build_model(), torch.device("cpu"))
        loop.run_step(0)  # lazy state (optimizer moments) made outside the watched steps
        # foreach AdamW reads its step counters, which torch keeps on the host for exactly that
        # reason (no device involved); every other read is one the step must not make.
        counters = {
            id(s["step"]) for s in loop.opt.state.values() if s["step"].device.type == "cpu"
        }
        calls: list[str] = []
        with monkeypatch.context() as m:
            for name in _HOST_READS:
                orig = getattr(torch.Tensor, name)

                def watch(self, *a, _name=name, _orig=orig, **kw):
                    if id(self) not in counters:
                        calls.append(_name)
                    return _orig(self, *a, **kw)

                m.setattr(torch.Tensor, name, watch)
            losses = [loop.run_step(0) for _ in range(3)]
        assert calls == [], calls
        assert all(isinstance(x, torch.Tensor) and x.dim() == 0 for x in losses)
        # the watch itself sees reads: a read outside the step is counted
        with monkeypatch.context() as m:
            m.setattr(torch.Tensor, "item", lambda self: calls.append("item") or 0.0)
            losses[0].item()
        assert calls == ["item"]


def test_training_attention_is_causal_sdpa_without_a_mask(monkeypatch):
    seen: list[tuple[bool, bool]] = []
    sdpa = F.scaled_dot_product_attention

    def spy(q, k, v, attn_mask=None, is_causal=False, **kw):
        seen.append((attn_mask is None, is_causal))
        return sdpa(q, k, v, attn_mask=attn_mask, is_causal=is_causal, **kw)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    cfg = small_lm()
    task = lm_task(cfg)
    InnerLoop(cfg, task, task.build_model(), torch.device("cpu")).run_step(0)
    layers = cfg.model.num_hidden_layers
    assert seen == [(True, True)] * layers  # forward only: backward does not call it again


def test_prefetcher_hands_over_exactly_the_asked_batch():
    made: list[tuple[int, int]] = []

    def make(slot: int, step: int) -> torch.Tensor:
        made.append((slot, step))
        return torch.tensor([slot, step])

    p = BatchPrefetcher(make, torch.device("cpu"), threaded=True)
    try:
        for step in range(3):
            assert p.get(1, step).tolist() == [1, step]
        assert p.get(1, 7).tolist() == [1, 7]  # a jump (resume): the prepared batch is dropped
        assert p.get(0, 8).tolist() == [0, 8]  # another slot
        assert p.get(0, 9).tolist() == [0, 9]
    finally:
        p.close()
    # the next steps were made ahead, each once ((1, 3) may be cancelled before it runs)
    assert made[:3] == [(1, 0), (1, 1), (1, 2)] and made.count((1, 1)) == 1
    assert {(1, 7), (0, 8), (0, 9)} <= set(made)
    inline = BatchPrefetcher(make, torch.device("cpu"))  # the CPU default: no thread
    made.clear()
    assert inline.get(2, 5).tolist() == [2, 5] and made == [(2, 5)]


# ---- DiLoCo's own work: foreach kernels against the per-tensor loops -------------------------
def _fragment(impl: str, seed: int = 0, codec: str | None = None) -> FragmentSync:
    g = torch.Generator().manual_seed(seed)
    shapes = [(33, 17), (17,), (5, 3, 2), (1,), (64,)]
    glob = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
    local = [
        torch.nn.Parameter(x.detach() + 0.01 * torch.randn(x.shape, generator=g)) for x in glob
    ]
    kernels = {"foreach": impl == "foreach"}
    outer = OptimizerConfig(name="sgd", lr=0.7, momentum=0.9, nesterov=True).build(glob, kernels)
    names = [f"p{i}" for i in range(len(shapes))]
    return FragmentSync(0, names, local, glob, outer, get_codec(codec) if codec else None, True)


def _loop_reference(f: FragmentSync, avg: list[torch.Tensor], buf: list, alpha: float) -> None:
    """The per-tensor loops outer.py had: Nesterov SGD (torch's single-tensor maths) and merge."""
    for g, d, i in zip(f.global_, avg, range(len(avg))):
        buf[i] = d.clone() if buf[i] is None else buf[i].mul_(0.9).add_(d)
        g.data.add_(d.add(buf[i], alpha=0.9), alpha=-0.7)
    for g, m in zip(f.global_, f.local):
        m.data.mul_(alpha).add_(g, alpha=1.0 - alpha)


@pytest.mark.parametrize("alpha", [0.0, 0.5])
def test_foreach_outer_step_and_merge_equal_the_loops_bit_for_bit(alpha):
    fast, ref = _fragment("foreach"), _fragment("loop")
    buf: list = [None] * len(ref.global_)
    for round_ in range(3):
        for f in (fast, ref):  # the inner steps: each local copy moves the same way
            for n, m in enumerate(f.local):
                m.data.add_(0.003 * (round_ + 1) * (n + 1))
        delta = fast.pseudo_gradient()
        expect = torch.cat([(g - m).reshape(-1) for g, m in zip(ref.global_, ref.local)])
        assert torch.equal(delta, expect)
        avg = delta * 0.5  # as if averaged with a peer
        fast.outer_step(avg.clone())  # torch's foreach Nesterov overwrites its gradients
        assert fast.merge(alpha) == []
        _loop_reference(
            ref, [a.view_as(g) for a, g in zip(avg.split(ref.sizes), ref.global_)], buf, alpha
        )
        for a, b in zip(fast.global_ + fast.local, ref.global_ + ref.local):
            assert torch.equal(a, b)


def test_merge_restarts_a_non_finite_tensor_from_the_global_copy():
    f = _fragment("foreach")
    f.local[1].data[3] = float("nan")
    reset = f.merge(0.5)
    assert reset == [f.local[1]]
    assert torch.equal(f.local[1], f.global_[1])
    assert all(torch.isfinite(m).all() for m in f.local)


def test_error_feedback_residual_unchanged_by_the_foreach_delta():
    f = _fragment("foreach", codec="int8")
    for m in f.local:
        m.data.mul_(1.01)
    x, flag = f.device_contribution()
    q = get_codec("int8")
    delta = torch.cat([(g - m).reshape(-1) for g, m in zip(f.global_, f.local)])
    assert flag.tolist() == [1.0] and torch.equal(x, delta)
    assert torch.equal(f.residual, delta - q.decode(q.encode(delta)).reshape(-1))


# ---- profiler ---------------------------------------------------------------------------------
def test_profile_writes_a_kineto_trace_with_the_outer_step(tmp_path):
    """A window of 6 steps (H/P = 3) holds a SEND and an APPLY: the trace names them."""
    prof = ProfileConfig(dir=str(tmp_path / "prof"), steps=6, wait=2)
    results = run_threads(small_lm(compute=ComputeConfig(device="cpu", profile=prof)), timeout=200)
    assert len({r.state_hash for r in results}) == 1
    traces = list((tmp_path / "prof").glob("trace-slot*-step2.json"))
    assert len(traces) == 1  # one worker per process is profiled
    events = json.loads(traces[0].read_text())["traceEvents"]
    names = [e.get("name") for e in events]
    assert names.count(INNER_STEP) >= 6
    for name in (ENCODE, OUTER_STEP, MERGE):
        assert name in names, name


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_compiled_step_syncs_nothing_and_matches_eager():
    """On a GPU: the default (compiled, fused AdamW, bf16, prefetched batches) step under
    ``torch.cuda.set_sync_debug_mode('error')`` raises on any synchronising call, and its
    losses stay within bf16 tolerance of the eager step's."""

    def losses(compile: bool, watch: bool) -> list[float]:
        cfg = small_lm(compute=ComputeConfig(device="cuda", precision="bf16", compile=compile))
        task = lm_task(cfg)
        loop = InnerLoop(cfg, task, task.build_model().cuda(), torch.device("cuda"))
        out = [loop.run_step(0) for _ in range(2)]  # compilation and lazy state
        if watch:
            torch.cuda.set_sync_debug_mode("error")
        try:
            out += [loop.run_step(0) for _ in range(3)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        loop.close()
        return torch.stack(out).tolist()

    torch.testing.assert_close(losses(True, True), losses(False, False), rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_side_stream_error_feedback_equals_the_main_stream_one():
    """Error feedback queued on the staging's side stream (overlapping the next inner step,
    which rewrites θ_m on the main stream) gives the same x and e_m, bit for bit, over rounds."""
    from diloco.staging import HostStaging

    staging = HostStaging(torch.device("cuda"))
    side, main = _fragment("foreach", codec="int8"), _fragment("foreach", codec="int8")
    for f in (side, main):
        for t in f.local + f.global_:
            t.data = t.data.cuda()
    for round_ in range(3):
        for f in (side, main):
            for m in f.local:
                m.data.mul_(1.0 + 0.01 * (round_ + 1))
        xs, _ = side.device_contribution(staging.stream)
        out = staging.stage_out(("frag", round_), xs)
        saved = [m.detach().clone() for m in side.local]
        for m in side.local:  # the next inner step, queued on the main stream meanwhile
            m.data.add_(1.0)
        xm, _ = main.device_contribution()
        out.wait()
        assert torch.equal(out.host[0], xm.cpu())
        torch.cuda.synchronize()
        assert torch.equal(side.residual, main.residual)
        for m, v in zip(side.local, saved):
            m.data.copy_(v)
    staging.close()


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_profile_has_kernels(tmp_path):
    prof = ProfileConfig(dir=str(tmp_path), steps=6, wait=2)
    run_threads(small_lm(compute=ComputeConfig(device="cuda", profile=prof)), timeout=200)
    (trace,) = tmp_path.glob("trace-*.json")
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e.get("cat") == "kernel" for e in events)
    assert OUTER_STEP in {e.get("name") for e in events}


def test_profile_and_compile_flags_reach_the_config_and_its_json(tmp_path):
    import argparse

    from cli.train import _train_config, register
    from diloco.config import config_from_dict, config_to_dict

    p = argparse.ArgumentParser()
    register(p.add_subparsers(dest="cmd"))
    args = p.parse_args(
        ["train", "--preset", "tiny", "--profile", str(tmp_path), "--profile-steps", "6"]
        + ["--no-compile", "--device", "cpu"]
    )
    cfg = _train_config(args)
    assert cfg.compute.profile == ProfileConfig(dir=str(tmp_path), steps=6)
    assert cfg.compute.compile is False
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    assert _train_config(p.parse_args(["train", "--preset", "tiny"])).compute.compile is None
    with pytest.raises(ValueError, match="profile.steps"):
        ProfileConfig(dir="x", steps=0)
