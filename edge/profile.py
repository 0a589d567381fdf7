"""Device profiling for the automatic split (``edge/planner.py``), and the two control ops that
carry it between master and workers.

Each device measures what the planner's cost model needs, at the model's own shapes and dtype:

* ``layer_fixed_ms`` / ``ms_per_mb``: a stack of real decoder layers (random weights) run at
  decode shape (one token, a short KV cache) twice, at the full layer and at the smallest
  slice (one KV group, a few FFN columns); the two points give the fixed cost per layer and
  the cost per MB of weights. The stack is made large enough (>= 96 MB when the model allows)
  that the weights do not sit in the CPU caches, as they would not while decoding.
* ``memory_mb``: ``MemAvailable`` of ``/proc/meminfo`` times a safety fraction.
* ``storage_mb_s``: one weight file read after dropping it from the page cache.
* ``rtt_ms``: measured by the master (echo round trips over the control channel, an upper
  bound on the all-reduce link's round trip).

Control ops: the master sends ``edge.cluster.protocol``'s ``Echo`` and ``Profile`` on
``edge.ctl``; a worker answers with :class:`EchoReply` on ``edge.echo{n}`` and
:class:`ProfileReport` (``DeviceProfile.to_dict``) on ``edge.profile{n}``, typed messages of
:mod:`lowband.schema` like the cluster's.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import torch

from edge.cluster.protocol import CTL, Echo, Profile, decode
from edge.planner import DeviceProfile, LayerShape, SplitPlan, plan_split
from lowband.comm import Communicator
from lowband.errors import ConfigError, ProtocolError
from lowband.models.config import ModelConfig
from lowband.models.llama import DecoderLayer, KVCache, rope_cos_sin, rope_inv_freq
from lowband.schema import Record

logger = logging.getLogger(__name__)

TORCH_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}
STACK_MB = 96.0  # weights per timed stack: beyond a desktop CPU's last-level cache
MEMORY_FRACTION = 0.8  # of MemAvailable: leave room for activations, KV cache, the OS


def _stack_ms(
    cfg: ModelConfig, dtype: torch.dtype, n_layers: int, reps: int, min_s: float = 0.25
) -> float:
    """Mean ms of one decode step through ``n_layers`` decoder layers of ``cfg``, over at least
    ``reps`` steps and ``min_s`` seconds. The mean, not the median: a device throttled by a CPU
    quota (or sharing its core) runs fast bursts between pauses, and decoding pays both."""
    torch.manual_seed(0)
    layers = [DecoderLayer(cfg, i).to(dtype).eval() for i in range(n_layers)]
    for layer in layers:
        for p in layer.parameters():
            p.requires_grad_(False).normal_(0, 0.02)
    cache, ctx = KVCache(n_layers), 16
    cos, sin = rope_cos_sin(rope_inv_freq(cfg), torch.arange(4096), dtype)
    x = torch.randn(1, ctx, cfg.hidden_size, dtype=dtype)
    with torch.inference_mode():
        for layer in layers:
            layer(x, cos[:ctx], sin[:ctx], cache, 0)
        h = x[:, :1]
        pos, steps, t0 = ctx, 0, 0.0
        while steps < reps or time.perf_counter() - t0 < min_s:
            if pos == ctx + 3:  # the first steps grow the KV cache and warm the allocator
                t0, steps = time.perf_counter(), 0
            y = h
            for layer in layers:
                y = layer(y, cos[pos : pos + 1], sin[pos : pos + 1], cache, pos)
            pos, steps = pos + 1, steps + 1
            if pos >= 4000:  # the RoPE table's end: enough samples in any case
                break
        return 1e3 * (time.perf_counter() - t0) / steps


def _compute(cfg: ModelConfig, dtype: str, reps: int) -> tuple[float, float]:
    """(layer_fixed_ms, ms_per_mb) from the full layer and the smallest slice."""
    shape = LayerShape.of(cfg, dtype)
    G = cfg.num_attention_heads // cfg.n_kv_heads
    small = ModelConfig.from_hf_dict(
        {
            **cfg.to_hf_dict(),
            "num_attention_heads": G,
            "num_key_value_heads": 1,
            "head_dim": cfg.dim_per_head,
            "intermediate_size": 8,
        }
    )
    small_mb = shape.group_mb + 8 * shape.column_mb
    n = max(2, min(cfg.num_hidden_layers, math.ceil(STACK_MB / shape.layer_mb)))
    dt = TORCH_DTYPES[dtype]
    full_ms = _stack_ms(cfg, dt, n, reps) / n
    n_small = max(2, min(cfg.num_hidden_layers, 8))
    small_ms = _stack_ms(small, dt, n_small, reps) / n_small
    per_mb = max(1e-6, (full_ms - small_ms) / max(1e-9, shape.layer_mb - small_mb))
    fixed = max(0.0, small_ms - per_mb * small_mb)
    return fixed, per_mb


def memory_available_mb() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024.0
    raise OSError("no MemAvailable in /proc/meminfo")


def storage_mb_s(model_dir: str | Path, limit_mb: float = 64.0) -> float:
    """Read speed of the largest weight file, cold: dropped from the page cache first."""
    files = sorted(Path(model_dir).rglob("*.safetensors"), key=lambda p: p.stat().st_size)
    if not files:
        raise ConfigError("model_dir", f"no .safetensors file under {model_dir} to time")
    path, limit = files[-1], int(limit_mb * 2**20)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t, n = time.perf_counter(), 0
        while n < limit:
            chunk = os.read(fd, 4 << 20)
            if not chunk:
                break
            n += len(chunk)
        return (n / 2**20) / max(1e-6, time.perf_counter() - t)
    finally:
        os.close(fd)


def profile_device(
    cfg: ModelConfig,
    model_dir: str | Path,
    *,
    name: str,
    dtype: str | None = None,
    memory_mb: float | None = None,
    reps: int = 15,
) -> DeviceProfile:
    """Measure this device for ``cfg`` (see the module docstring); ``rtt_ms`` is left at 0."""
    dname = dtype or cfg.torch_dtype
    if dname not in TORCH_DTYPES:
        raise ConfigError("dtype", f"unknown dtype {dname!r}; one of {sorted(TORCH_DTYPES)}")
    t = time.perf_counter()
    fixed, per_mb = _compute(cfg, dname, reps)
    mem = memory_mb if memory_mb is not None else MEMORY_FRACTION * memory_available_mb()
    prof = DeviceProfile(
        name=name,
        layer_fixed_ms=round(fixed, 5),
        ms_per_mb=round(per_mb, 6),
        memory_mb=round(mem, 1),
        storage_mb_s=round(storage_mb_s(model_dir), 1),
    )
    logger.info("profiled %s in %.1f s: %s", name, time.perf_counter() - t, prof)
    return prof


# ---- the control ops -----------------------------------------------------------------------------
@dataclass(frozen=True, kw_only=True)
class EchoReply(Record):
    """A worker's answer to ``echo`` n, on ``edge.echo{n}``."""

    NAME: ClassVar[str] = "echo reply"
    n: int


@dataclass(frozen=True, kw_only=True)
class ProfileReport(Record):
    """A worker's answer to ``profile`` n, on ``edge.profile{n}``: ``DeviceProfile.to_dict``."""

    NAME: ClassVar[str] = "profile report"
    profile: dict


def answer(comm: Communicator, master: int, meta: dict, model_dir: str | None) -> None:
    """Worker side of ``echo`` and ``profile`` (called from ``edge.cluster``'s control loop
    with the message's meta dict)."""
    msg = decode(meta)
    if isinstance(msg, Echo):
        comm.send(master, [], EchoReply(n=msg.n).to_wire(), tag=f"edge.echo{msg.n}")
        return
    if not isinstance(msg, Profile):
        raise ProtocolError(f"edge.profile answers echo and profile, not {msg.OP!r}")
    model_dir = model_dir or msg.model_dir
    cfg = ModelConfig.from_json(model_dir)
    prof = profile_device(
        cfg,
        model_dir,
        name=comm.membership.peer_id,
        dtype=msg.dtype,
        memory_mb=msg.memory_mb,
    )
    report = ProfileReport(profile=prof.to_dict())
    comm.send(master, [], report.to_wire(), tag=f"edge.profile{msg.n}")


def gather_profiles(
    comm: Communicator,
    ranks: Sequence[int],
    model_dir: str,
    *,
    dtype: str | None,
    timeout: float,
    start_n: int,
    echoes: int = 7,
    worker_model_dir: str | None = None,
) -> list[DeviceProfile]:
    """Master side: the master's own profile first, then every worker's with its round trip.
    Workers profile concurrently (each on its own device) while the master profiles itself."""
    peers = comm.membership.peers
    n = start_n
    rtts: dict[int, float] = {}
    for r in ranks:
        times = []
        for _ in range(echoes):
            n += 1
            t = time.perf_counter()
            comm.send(r, [], Echo(n=n).encode(), tag=CTL)
            _, meta = comm.recv(r, tag=f"edge.echo{n}", timeout=timeout)
            EchoReply.from_wire(meta)
            times.append(1e3 * (time.perf_counter() - t))
        rtts[r] = statistics.median(times)
    n += 1
    for r in ranks:
        ask = Profile(n=n, dtype=dtype, model_dir=worker_model_dir or model_dir)
        comm.send(r, [], ask.encode(), tag=CTL)
    cfg = ModelConfig.from_json(model_dir)
    out = [profile_device(cfg, model_dir, name=peers[comm.rank], dtype=dtype)]
    for r in ranks:
        _, meta = comm.recv(r, tag=f"edge.profile{n}", timeout=timeout)
        d = dict(ProfileReport.from_wire(meta).profile, rtt_ms=round(rtts[r], 4))
        out.append(DeviceProfile.from_dict(d))
    return out


def auto_split(
    comm: Communicator,
    ranks: Sequence[int],
    model_dir: str,
    *,
    dtype: str | None,
    timeout: float,
    start_n: int,
    worker_model_dir: str | None = None,
) -> tuple[SplitPlan, list[int]]:
    """Profile everyone and plan; returns the plan and the comm ranks it uses, in slot order
    (slot 0, the master, is not among them)."""
    profiles = gather_profiles(
        comm,
        ranks,
        model_dir,
        dtype=dtype,
        timeout=timeout,
        start_n=start_n,
        worker_model_dir=worker_model_dir,
    )
    plan = plan_split(ModelConfig.from_json(model_dir), profiles, dtype=dtype)
    by_name = {comm.membership.peers[r]: r for r in ranks}
    logger.info("automatic split: %s", plan.explain())
    return plan, [by_name[d] for d in plan.devices[1:]]
