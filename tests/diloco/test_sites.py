"""Multi-rank sites (diloco.site, diloco.sharding): torch.distributed inside, lowband across.

Tiers: pure shard arithmetic and device mapping; the CLI's composition (in-process, the site
itself stubbed); then real processes (Gloo inside a site, the ZeroMQ transport with one
coordinator per shard across sites), spawned the way torchrun would (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each in its own session and killed in teardown. The same
runs with NCCL on a GPU carry the ``cuda`` marker and are skipped, with the reason printed,
where torch sees no GPU (listed in .ci/allowed-skips).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers  # in the dev extra: a broken install must fail loudly
from safetensors.torch import load_file

from benchmarks.diloco_sites import start_site
from diloco.checkpoint import load_sharded
from diloco.config import DilocoConfig, tiny
from diloco.launch import run_threads
from diloco.sharding import (
    ShardLayout,
    batch_rows,
    gather_rows,
    local_shard,
    shard_rows,
)
from diloco.site import collective_device
from diloco.site_launch import SiteLaunch, site_device
from lowband.errors import ConfigError, IncompatiblePeer
from lowband.models.weights import load_pretrained
from transport.config import ZmqConfig
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.zmq_comm import connect

# Several outer steps per fragment with P > 1 and τ > 0, on the tiny preset (~0.13 M params).
RUN = [
    "--preset",
    "tiny",
    "--steps",
    "20",
    "-H",
    "10",
    "-P",
    "2",
    "--tau",
    "1",
    "--workers",
    "2",
    "--eval-every",
    "0",
    "--audit-every",
    "1",
    "--checkpoint-every",
    "10",
]


# ---- pure ------------------------------------------------------------------------------------
@pytest.mark.timeout(10)
@pytest.mark.parametrize("rows,size", [(8, 2), (7, 2), (3, 4), (1, 3), (256, 4)])
def test_shard_rows_are_torch_chunk(rows: int, size: int) -> None:
    t = torch.arange(rows * 2).reshape(rows, 2)
    chunks = torch.chunk(t, size, dim=0)
    for r in range(size):
        a, b = shard_rows(rows, size, r)
        want = chunks[r] if r < len(chunks) else t[:0]
        assert torch.equal(t[a:b], want)
    parts = [local_shard(t, ShardLayout(size=size, rank=r, engine="ddp")) for r in range(size)]
    gathered = gather_rows(
        parts[0],
        rows,
        size,
        lambda out, _: [o.copy_(torch.cat([p, o[p.shape[0] :]])) for o, p in zip(out, parts)],
    )
    assert torch.equal(gathered, t)


@pytest.mark.timeout(10)
def test_layout_and_batch_errors_name_the_field() -> None:
    assert batch_rows(8, 2, 1) == slice(4, 8)
    with pytest.raises(ConfigError, match="data.batch_size"):
        batch_rows(6, 4, 0)
    with pytest.raises(ConfigError, match="site.rank"):
        ShardLayout(size=2, rank=2)
    with pytest.raises(ConfigError, match="site.engine"):
        ShardLayout(size=2, rank=0, engine="zero3")  # type: ignore[arg-type]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "spec,backend,engine,local_rank,cuda,want",
    [
        ("auto", "nccl", "fsdp2", 3, True, "cuda:3"),  # one GPU per rank of a host
        ("cuda", "nccl", "ddp", 1, True, "cuda:1"),
        ("cuda:2", "nccl", "fsdp2", 0, True, "cuda:2"),  # an explicit index is the user's
        ("auto", "gloo", "fsdp2", 1, True, "cpu"),  # Gloo is the CPU backend ...
        ("auto", "gloo", "ddp", 1, False, "cpu"),
        ("cpu", "gloo", "ddp", 0, True, "cpu"),
        ("cuda", "gloo", "ddp", 1, True, "cuda:1"),  # ... unless asked: DDP over Gloo on GPUs
        ("cuda:0", "gloo", "ddp", 1, True, "cuda:0"),  # Gloo ranks may share one GPU
    ],
)
def test_site_device_maps_local_rank(spec, backend, engine, local_rank, cuda, want) -> None:
    got = site_device(spec, backend=backend, engine=engine, local_rank=local_rank, cuda=cuda)
    assert got == want


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "spec,backend,engine,cuda,match",
    [
        ("cpu", "nccl", "fsdp2", True, "nccl runs collectives on CUDA tensors only"),
        ("auto", "nccl", "ddp", False, "nccl needs one CUDA GPU per rank and torch sees none"),
        ("cuda", "nccl", "fsdp2", False, "torch sees no CUDA device.*--site-backend gloo"),
        ("cuda:1", "gloo", "ddp", False, "torch sees no CUDA device.*--device cpu"),
        ("cuda", "gloo", "fsdp2", True, "FSDP2 over Gloo cannot compute on 'cuda:0'"),
    ],
)
def test_site_device_refusals_say_what_to_use(spec, backend, engine, cuda, match) -> None:
    with pytest.raises(ConfigError, match=match):
        site_device(spec, backend=backend, engine=engine, local_rank=0, cuda=cuda)


@pytest.mark.timeout(10)
def test_site_collectives_run_on_the_backends_device() -> None:
    assert collective_device("nccl", torch.device("cuda:1")) == torch.device("cuda:1")
    assert collective_device("gloo", torch.device("cuda:0")) == torch.device("cpu")
    assert collective_device("gloo", torch.device("cpu")) == torch.device("cpu")
    with pytest.raises(ConfigError, match="nccl needs CUDA tensors"):
        collective_device("nccl", torch.device("cpu"))


def _on(device: str):
    cfg = tiny()
    return replace(cfg, compute=replace(cfg.compute, device=device))


@pytest.mark.timeout(10)
def test_site_launch_refuses_nccl_on_cpu_and_unmapped_devices() -> None:
    base = {"coordinators": ("tcp://a:1",), "rank": 0, "size": 1, "master": "127.0.0.1:1"}
    assert SiteLaunch(train=_on("cuda:0"), backend="nccl", **base).dist_timeout == 60.0
    with pytest.raises(ConfigError, match="nccl runs collectives on CUDA tensors only"):
        SiteLaunch(train=_on("cpu"), backend="nccl", **base)
    with pytest.raises(ConfigError, match="map it with site_device"):
        SiteLaunch(train=_on("auto"), **base)
    with pytest.raises(ConfigError, match="site.backend"):
        SiteLaunch(train=_on("cpu"), backend="mpi", **base)
    with pytest.raises(ConfigError, match="site.dist_timeout"):
        SiteLaunch(train=_on("cpu"), dist_timeout=0.0, **base)


class _Stub:
    """Stands in for ``site_main``: records the SiteLaunch the CLI composed."""

    def __init__(self) -> None:
        self.cfg: SiteLaunch | None = None

    def __call__(self, cfg: SiteLaunch):
        self.cfg = cfg
        return self

    def summary(self) -> dict:
        return {"stub": True}


def _site_cli(
    monkeypatch, args: list[str], local_rank: str | None, cuda: bool, site_main=None
) -> tuple[int, _Stub]:
    """``lowband worker --site …`` as rank 5 of 8 under torchrun's environment, with
    ``site_main`` replaced (default: a stub that records its SiteLaunch)."""
    import diloco.site_launch
    from cli import main

    stub = _Stub()
    monkeypatch.setattr(diloco.site_launch, "site_main", site_main or stub)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    env = {"RANK": "5", "WORLD_SIZE": "8", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if local_rank is None:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    else:
        monkeypatch.setenv("LOCAL_RANK", local_rank)
    coords = ",".join(f"tcp://127.0.0.1:{9000 + r}" for r in range(8))
    return main(["worker", "--coordinator", coords, "--preset", "tiny", *args]), stub


@pytest.mark.timeout(30)
@pytest.mark.parametrize("local_rank,want", [("1", "cuda:1"), (None, "cuda:5")])
def test_cli_puts_an_nccl_rank_on_its_local_gpu(monkeypatch, local_rank, want) -> None:
    """torchrun's LOCAL_RANK (RANK when started by hand on one host) picks the GPU; the
    library gets the value, and --dist-timeout reaches the SiteLaunch."""
    rc, stub = _site_cli(
        monkeypatch,
        ["--site", "fsdp2", "--site-backend", "nccl", "--dist-timeout", "7.5"],
        local_rank,
        cuda=True,
    )
    assert rc == 0 and stub.cfg is not None
    assert stub.cfg.train.compute.device == want and stub.cfg.backend == "nccl"
    assert (stub.cfg.rank, stub.cfg.size, stub.cfg.dist_timeout) == (5, 8, 7.5)


@pytest.mark.timeout(30)
def test_cli_keeps_a_gloo_site_on_the_cpu(monkeypatch) -> None:
    rc, stub = _site_cli(monkeypatch, ["--site", "fsdp2"], "1", cuda=True)
    assert rc == 0 and stub.cfg is not None
    assert stub.cfg.train.compute.device == "cpu" and stub.cfg.dist_timeout == 60.0


@pytest.mark.timeout(30)
def test_cli_refuses_nccl_on_the_cpu(monkeypatch, capsys) -> None:
    rc, stub = _site_cli(
        monkeypatch, ["--site", "ddp", "--site-backend", "nccl", "--device", "cpu"], "0", cuda=True
    )
    assert rc == 2 and stub.cfg is None
    assert "nccl runs collectives on CUDA tensors only" in capsys.readouterr().err


@pytest.mark.timeout(30)
@pytest.mark.parametrize("cause,code", [("config", 2), ("refused", 2), ("crash", 1)])
def test_cli_site_refusal_is_one_line_and_exit_2(monkeypatch, capsys, caplog, cause, code) -> None:
    """A rank stopped by a refusal (bad settings, an incompatible group) leaves like any failed
    rank (SiteFailed) but reports one line and exits 2, as a single-process worker does; a
    crash exits 1 with its traceback (torchrun restarts the site)."""
    from diloco.site_launch import SiteFailed

    errors = {
        "config": ConfigError("batch_size", "not divisible by the site's 3 ranks"),
        "refused": IncompatiblePeer("a site of 4 rank(s) vs a site of 2 rank(s)"),
        "crash": RuntimeError("boom"),
    }

    def fail(cfg):
        raise SiteFailed("rank 5 of site 'site' stopped") from errors[cause]

    def exit_(rc):
        raise SystemExit(rc)

    monkeypatch.setattr("os._exit", exit_)
    with pytest.raises(SystemExit) as done:
        _site_cli(monkeypatch, ["--site", "ddp"], "0", cuda=False, site_main=fail)
    assert done.value.code == code
    err = capsys.readouterr().err
    if code == 2:
        assert err.startswith("lowband: error: ") and str(errors[cause]) in err
        assert "Traceback" not in err
    else:  # logged with the cause's traceback
        assert "rank 5 of site 'site' stopped" in caplog.text and "boom" in caplog.text


# ---- processes -------------------------------------------------------------------------------


class Sites:
    """``sites`` sites of ``ranks`` ranks each; one coordinator per shard group."""

    def __init__(self, tmp: Path, ranks: int, engine: str = "fsdp2", heartbeat: float = 1.0):
        self.tmp, self.ranks, self.engine = tmp, ranks, engine
        tmp.mkdir(parents=True, exist_ok=True)
        self.coords = [
            Coordinator(
                CoordinatorConfig(bind="tcp://127.0.0.1:0", heartbeat_interval=heartbeat)
            ).start()
            for _ in range(ranks)
        ]
        self.procs: list[subprocess.Popen] = []

    def start_site(self, site: int, extra: Sequence[str] = ()) -> list[subprocess.Popen]:
        n = len(self.procs)
        started = start_site(
            site,
            self.ranks,
            self.engine,
            ",".join(c.address for c in self.coords),
            self.tmp / f"site{site}",
            [*RUN, *extra],
            lambda r: (self.tmp / f"site{site}-r{r}-{n}.log").open("w"),
        )
        self.procs += started
        return started

    def finals(self, site: int) -> list[dict]:
        out = []
        for r in range(self.ranks):
            recs = [
                json.loads(line)
                for line in (self.tmp / f"site{site}" / f"metrics-s{site}-r{r}.jsonl")
                .read_text()
                .splitlines()
            ]
            out.append(
                {
                    "final": [x for x in recs if x["event"] == "final"][-1],
                    "sync_bytes": sum(x["bytes_sent"] for x in recs if x["event"] == "sync"),
                }
            )
        return out

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
        for c in self.coords:
            c.stop()


def _run(tmp: Path, ranks: int, extra: Callable[[int], list[str]] = lambda site: []) -> Sites:
    sites = Sites(tmp, ranks)
    try:
        for s in range(2):
            sites.start_site(s, extra(s))
        for p in sites.procs:
            assert p.wait(timeout=240) == 0, (tmp / "logs", p.args)
    except BaseException:
        sites.close()
        raise
    sites.close()
    return sites


def _exported(tmp: Path) -> dict[str, torch.Tensor]:
    found = sorted(tmp.glob("site*/model/model.safetensors"))
    assert len(found) == 1, found  # rank 0 of the site that is rank 0 of group 0 exports
    return load_file(str(found[0]))


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Sites]:
    return {n: _run(tmp_path_factory.mktemp(f"sites2x{n}"), n) for n in (1, 2)}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_two_sites_of_two_fsdp2_ranks_match_two_single_rank_sites(runs, tmp_path) -> None:
    """2 sites × 2 ranks (FSDP2, Gloo) == 2 sites × 1 rank == the plain worker, after 4 outer
    syncs (P=2, τ=1). Tolerance: fp32 reduction order only (FSDP2 reduce-scatters the halves'
    gradients, the grad-norm is summed per shard), amplified a little by AdamW's 1/√v."""
    two, one = _exported(runs[2].tmp), _exported(runs[1].tmp)
    cfg = tiny()
    cfg = replace(
        cfg,
        steps=20,
        workers=2,
        eval_every=0,
        audit_every=1,
        mode=replace(cfg.mode, inner_steps=10, n_fragments=2, tau=1),
    )
    assert isinstance(cfg.mode, DilocoConfig)
    run_threads(cfg, out_dir=tmp_path)
    plain = load_file(str(tmp_path / "model" / "model.safetensors"))
    assert set(two) == set(plain) == set(one)
    for name in plain:
        torch.testing.assert_close(one[name], plain[name], rtol=1e-4, atol=1e-5, msg=name)
        torch.testing.assert_close(two[name], plain[name], rtol=1e-4, atol=1e-5, msg=name)
    # every shard group agrees on its shard of the state
    for sites in runs.values():
        finals = [sites.finals(s) for s in range(2)]
        for r in range(sites.ranks):
            assert finals[0][r]["final"]["state_hash"] == finals[1][r]["final"]["state_hash"]
            assert finals[0][r]["final"]["outer_syncs"] == 4


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_bytes_per_site_rank_are_one_nth(runs) -> None:
    """The outer-sync bytes each rank of a 2-rank site sends (transport stats of its sync
    all-reduces) are half those of a 1-rank site's rank."""
    single = runs[1].finals(0)[0]["sync_bytes"]
    for site in range(2):
        per_rank = [f["sync_bytes"] for f in runs[2].finals(site)]
        assert sum(per_rank) == pytest.approx(single, rel=0.01)
        for b in per_rank:
            assert b == pytest.approx(single / 2, rel=0.02)


def _quiet_checkpoint(sites: Sites, site: int) -> Path:
    """The mid-run checkpoint of a site: the first quiet step at or after step 10 (H/P = 5,
    τ = 1: the sync launched at step 10 is applied at 11)."""
    found = sorted((sites.tmp / f"site{site}" / "checkpoints").glob("step-*"))
    assert [d.name for d in found] == ["step-000011"], found
    return found[0]


def _step_loss(sites: Sites, site: int, rank: int, step: int) -> float:
    path = sites.tmp / f"site{site}" / f"metrics-s{site}-r{rank}.jsonl"
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    return [r for r in recs if r["event"] == "step" and r["step"] == step][-1]["loss"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_dcp_checkpoint_resumes_bit_identically(runs, tmp_path) -> None:
    """2 sites × 2 FSDP2 ranks: the straight 20-step run checkpointed every site rank's shard
    (torch.distributed.checkpoint) at step 11; two fresh sites resumed from those checkpoints
    and run to 20 end bit-identical to the straight run (tolerance 0): per-shard state hashes
    (θ_g, outer optimizer state, step, syncs), every rank's model shard and inner AdamW state
    in the final checkpoint, the loss each rank logged at step 20, and the exported model."""
    straight = runs[2]
    ckpt = {s: _quiet_checkpoint(straight, s) for s in range(2)}
    for s in range(2):
        names = {p.name for p in ckpt[s].iterdir()}
        assert {".metadata", f"site-s{s}-r0.json", f"site-s{s}-r1.json"} <= names, names
    resumed = _run(tmp_path, 2, lambda s: ["--resume", str(ckpt[s])])
    for s in range(2):
        for r, (a, b) in enumerate(zip(straight.finals(s), resumed.finals(s))):
            assert b["final"]["start_step"] == 11 and b["final"]["transfers"] == 0
            assert a["final"]["state_hash"] == b["final"]["state_hash"], (s, r)
            assert _step_loss(straight, s, r, 20) == _step_loss(resumed, s, r, 20)
            key = f"s{s}-r{r}"
            ta, ma = load_sharded(straight.tmp / f"site{s}" / "checkpoints" / "final", key=key)
            tb, mb = load_sharded(resumed.tmp / f"site{s}" / "checkpoints" / "final", key=key)
            assert ma == mb and set(ta) == set(tb)
            assert any(k.startswith("inner.") for k in ta) and any(
                k.startswith("local.") for k in ta
            )
            for k in ta:
                assert torch.equal(ta[k], tb[k]), (key, k)
    a, b = _exported(straight.tmp), _exported(resumed.tmp)
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sharded_run_exports_the_assembled_model_transformers_loads(runs) -> None:
    """The model a 2-rank site exports is θ_g assembled from its ranks' global shards (as
    saved in their final DCP checkpoints, exactly), and transformers loads that directory with
    the logits of lowband's own model of it."""
    sites = runs[2]
    exported = _exported(sites.tmp)
    directory = min(sites.tmp.glob("site*/model"))
    site = int(directory.parent.name.removeprefix("site"))
    shards = [
        load_sharded(sites.tmp / f"site{site}" / "checkpoints" / "final", key=f"s{site}-r{r}")[0]
        for r in range(2)
    ]
    for name, full in exported.items():
        parts = [sh["global." + name] for sh in shards]
        assert torch.equal(torch.cat(parts), full), name
    ours = load_pretrained(directory)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(str(directory))
    ids = torch.tensor([list(b"To be, or not to be: that is")])
    with torch.no_grad():
        torch.testing.assert_close(theirs(input_ids=ids).logits, ours(ids), rtol=0, atol=1e-5)


def test_incompatible_layout_is_named_in_the_refusal():
    """Peers may say what their signature covers (meta "layout", e.g. a DiLoCo site's shard
    layout); a refusal then names both sides, not only two hashes."""
    with Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0")) as coord:
        two = ShardLayout(size=2, rank=0).describe()
        four = ShardLayout(size=4, rank=0).describe()
        first = connect(
            coord.address, ZmqConfig(bind_host="127.0.0.1"), signature="sig-2", meta={"layout": two}
        )
        try:
            with pytest.raises(IncompatiblePeer) as err:
                connect(
                    coord.address,
                    ZmqConfig(bind_host="127.0.0.1"),
                    signature="sig-4",
                    meta={"layout": four},
                )
            assert "a site of 4 rank(s)" in str(err.value) and "a site of 2 rank(s)" in str(
                err.value
            )
        finally:
            first.close()


# ---- CUDA: the same sites with NCCL inside (skipped visibly without a GPU) -----------------------
NO_CUDA = not torch.cuda.is_available()
NO_CUDA_REASON = "no CUDA device visible to torch (CPU build or no GPU): NCCL sites not exercised"
NCCL = ["--site-backend", "nccl", "--device", "cuda"]  # rank r of the host takes cuda:LOCAL_RANK
CPU_SITE = ["--device", "cpu"]


def _assert_cuda_matches_cpu(gpu: dict[str, torch.Tensor], cpu: dict[str, torch.Tensor]) -> None:
    """CUDA vs CPU is the same run with other fp32 kernels (reduction order; TF32 is off for
    matmuls by default): after 20 inner steps and 4 outer syncs every tensor of θ_g agrees to
    ‖a − b‖ ≤ 1e-3·‖b‖ and the largest element difference stays below 1e-2 (AdamW's m/√v can
    amplify a rounding difference to ~lr per step where v is tiny)."""
    assert set(gpu) == set(cpu)
    for name, want in cpu.items():
        a, b = gpu[name].float(), want.float()
        assert (a - b).norm() <= 1e-3 * b.norm() + 1e-6, name
        assert (a - b).abs().max() < 1e-2, name


def _one_site(tmp: Path, engine: str, extra: list[str]) -> Sites:
    """One site of one rank alone in its run (M = 1)."""
    sites = Sites(tmp, 1, engine)
    try:
        (p,) = sites.start_site(0, ["--workers", "1", *extra])
        assert p.wait(timeout=240) == 0, (tmp / "site0-r0-0.log").read_text()[-4000:]
    finally:
        sites.close()
    return sites


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
@pytest.mark.timeout(600)
@pytest.mark.parametrize("engine", ["fsdp2", "ddp"])
def test_cuda_one_rank_nccl_site_matches_the_cpu_site(tmp_path: Path, engine: str) -> None:
    """1 site × 1 rank with NCCL (world size 1 on one GPU), FSDP2 or DDP: the exported θ_g
    equals the same site on the CPU (Gloo) within the CUDA-vs-CPU tolerance, and its sharded
    DCP checkpoints were written from the GPU."""
    gpu = _one_site(tmp_path / "gpu", engine, NCCL)
    cpu = _one_site(tmp_path / "cpu", engine, CPU_SITE)
    _assert_cuda_matches_cpu(_exported(gpu.tmp), _exported(cpu.tmp))
    final = gpu.finals(0)[0]["final"]
    assert final["outer_syncs"] == 4 and final["steps"] == 20
    ckpt = gpu.tmp / "site0" / "checkpoints"
    assert (ckpt / "step-000011" / ".metadata").exists() and (ckpt / "final" / ".metadata").exists()
    tensors, meta = load_sharded(ckpt / "final", key="s0-r0")
    assert meta["step"] == 20 and all(t.device.type == "cpu" for t in tensors.values())


@pytest.mark.cuda
@pytest.mark.skipif(NO_CUDA, reason=NO_CUDA_REASON)
@pytest.mark.timeout(600)
def test_cuda_two_single_rank_nccl_sites_on_one_gpu_match_the_cpu_sites(tmp_path: Path) -> None:
    """2 sites × 1 rank, each its own NCCL group of one on the same GPU, the outer sync over
    lowband's transport: both sites end with one θ_g (equal state hashes), equal to the same
    two sites on the CPU within the CUDA-vs-CPU tolerance."""
    gpu = _run(tmp_path / "gpu", 1, lambda site: NCCL)
    cpu = _run(tmp_path / "cpu", 1, lambda site: CPU_SITE)
    _assert_cuda_matches_cpu(_exported(gpu.tmp), _exported(cpu.tmp))
    a, b = gpu.finals(0)[0]["final"], gpu.finals(1)[0]["final"]
    assert a["state_hash"] == b["state_hash"] and a["outer_syncs"] == b["outer_syncs"] == 4
