"""Device, precision and the inner step's options (``diloco.device``, ``ComputeConfig``).

CPU tests check the CPU twin of every CUDA code path; tests that need a GPU carry the ``cuda``
marker and are skipped, with the reason printed, where torch sees none.
"""

from __future__ import annotations

import json

import pytest
import torch

from diloco.common import InnerLoop, hash_state
from diloco.config import (
    ComputeConfig,
    TrainConfig,
    config_from_dict,
    config_to_dict,
    with_overrides,
)
from diloco.device import autocast, optimizer_kernels, resolve_device
from diloco.launch import run_threads
from diloco.staging import HostStaging
from diloco.task import lm_task
from lowband.errors import ConfigError
from tests.diloco.configs import small_lm

pytestmark = pytest.mark.timeout(120)

NO_CUDA = not torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device visible to torch (CPU build or no GPU): CUDA path not exercised"


def test_compute_config_is_validated():
    with pytest.raises(ConfigError, match="compute.device"):
        ComputeConfig(device="tpu")
    with pytest.raises(ConfigError, match="compute.precision"):
        ComputeConfig(precision="int4")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="micro_batches"):
        small_lm(compute=ComputeConfig(micro_batches=3))  # 3 does not divide B = 4
    assert resolve_device("cpu") == torch.device("cpu")
    if NO_CUDA:
        with pytest.raises(ConfigError, match="no CUDA"):
            resolve_device("cuda:0")
        assert resolve_device("auto") == torch.device("cpu")


def test_compute_survives_json_and_overrides():
    cfg = with_overrides(
        small_lm(),
        device="cpu",
        precision="bf16",
        micro_batches=2,
        activation_checkpointing=True,
        optimizer_impl="foreach",
    )
    assert cfg.compute == ComputeConfig(
        device="cpu",
        precision="bf16",
        micro_batches=2,
        activation_checkpointing=True,
        optimizer_impl="foreach",
    )
    assert config_from_dict(json.loads(json.dumps(config_to_dict(cfg)))) == cfg
    old = config_to_dict(small_lm())
    del old["compute"]  # a config.json written before the field existed
    assert config_from_dict(old).compute == ComputeConfig()


def _train(cfg: TrainConfig, steps: int = 4) -> list[torch.Tensor]:
    task = lm_task(cfg)
    model = task.build_model()
    loop = InnerLoop(cfg, task, model, torch.device("cpu"))
    for _ in range(steps):
        loop.run_step(0)
    return [p.detach().clone() for p in model.parameters()]


def test_micro_batches_equal_one_large_batch():
    one = _train(small_lm())
    two = _train(small_lm(compute=ComputeConfig(device="cpu", micro_batches=2)))
    for a, b in zip(one, two):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_activation_checkpointing_and_optimizer_kernels_match_the_plain_step():
    ref = _train(small_lm(compute=ComputeConfig(device="cpu", optimizer_impl="loop")))
    for compute in (
        ComputeConfig(device="cpu", activation_checkpointing=True),
        ComputeConfig(device="cpu", optimizer_impl="foreach"),
        ComputeConfig(device="cpu", optimizer_impl="fused"),
    ):
        got = _train(small_lm(compute=compute))
        for a, b in zip(ref, got):
            torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_kernel_choice():
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert optimizer_kernels("adamw", cpu, "auto") == {"fused": True}  # no sqrt(v) temporary
    assert optimizer_kernels("sgd", cpu, "auto") == {"foreach": True}
    assert optimizer_kernels("adamw", gpu, "auto") == {"fused": True}
    assert optimizer_kernels("sgd", cpu, "foreach") == {"foreach": True}


def test_host_staging_cpu_twin_is_the_identity():
    s = HostStaging(torch.device("cpu"))
    x = torch.randn(10)
    assert s.to_host(x, key=0) is x  # no copy on the hot path
    assert s.to_device(x) is x


def test_bf16_autocast_run_converges():
    cfg = small_lm(compute=ComputeConfig(device="cpu", precision="bf16"), steps=36)
    task = lm_task(cfg)
    start = task.evaluate(task.build_model())
    results = run_threads(cfg, task=task)
    final = results[0].final_eval
    assert final is not None and final < start - 0.5, (start, final)
    assert len({r.state_hash for r in results}) == 1
    with autocast(torch.device("cpu"), "bf16"):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
    # master weights stay float32 under autocast
    w = task.build_model()
    assert all(p.dtype == torch.float32 for p in w.parameters())


def test_fp16_scaler_path_trains():
    cfg = small_lm(compute=ComputeConfig(device="cpu", precision="fp16"), steps=12)
    task = lm_task(cfg)
    start = task.evaluate(task.build_model())
    results = run_threads(cfg, task=task)
    assert results[0].final_eval is not None and results[0].final_eval < start


def _state_like() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    return [
        torch.randn(70_001, generator=g),
        torch.randn(33, generator=g).to(torch.bfloat16),
        torch.zeros(0),
        torch.arange(3, dtype=torch.uint8),
        torch.randn(5, 7, generator=g),
    ]


def test_state_hash_sees_every_word_and_the_counters():
    """The audit digest moves on a flipped bit in any 16-bit word (first, last, past a row of
    2**15 words, in an odd-sized byte tensor), on two swapped values, on a moved tensor boundary
    and on the counters; equal states give equal digests."""
    ts = _state_like()
    ref = hash_state(ts, 5, 2)
    assert hash_state([t.clone() for t in ts], 5, 2) == ref
    assert hash_state(ts, 5, 3) != ref and hash_state(ts, 2, 5) != ref
    for ti, i in [(0, 0), (0, 40_000), (0, 2 * 70_001 - 1), (1, 32), (4, 69)]:
        ys = [t.clone() for t in ts]
        ys[ti].view(torch.int16).view(-1)[i] ^= 1
        assert hash_state(ys, 5, 2) != ref, (ti, i)
    ys = [t.clone() for t in ts]
    ys[3][2] = 7
    assert hash_state(ys, 5, 2) != ref
    ys = [t.clone() for t in ts]
    ys[0][[3, 40_000]] = ys[0][[40_000, 3]]
    assert hash_state(ys, 5, 2) != ref
    split = [ts[0][:10], ts[0][10:], *ts[1:]]  # the same bytes cut differently
    assert hash_state(split, 5, 2) != ref


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_state_hash_equals_the_cpu_one():
    """Computed on the GPU (no copy of the state to the host), the audit digest is the CPU's:
    CPU and GPU workers of one run compare equal."""
    ts = _state_like()
    assert hash_state([t.cuda() for t in ts], 1, 2) == hash_state(ts, 1, 2)
    big = torch.randn(3_000_017)
    assert hash_state([big.cuda()], 0) == hash_state([big], 0)


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_run_matches_cpu_within_tolerance():
    cpu = run_threads(small_lm(compute=ComputeConfig(device="cpu")))
    gpu = run_threads(small_lm(compute=ComputeConfig(device="cuda")))
    assert abs(cpu[0].final_eval - gpu[0].final_eval) < 0.05
    assert len({r.state_hash for r in gpu}) == 1


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_staging_round_trip():
    s = HostStaging(torch.device("cuda"))
    x = torch.randn(1000, device="cuda")
    host = s.to_host(x, key=0)
    assert host.device.type == "cpu" and host.is_pinned()
    torch.testing.assert_close(host, x.cpu())
    back = s.to_device(host * 2)
    torch.testing.assert_close(back, 2 * x)


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
def test_cuda_bf16_run_converges():
    cfg = small_lm(compute=ComputeConfig(device="cuda", precision="bf16"), steps=36)
    task = lm_task(cfg)
    start = task.evaluate(task.build_model())
    results = run_threads(cfg, task=task)
    assert results[0].final_eval < start - 0.5
