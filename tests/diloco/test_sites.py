"""Multi-rank sites (diloco.site, diloco.sharding): torch.distributed inside, lowband across.

Tiers: pure shard arithmetic; then real processes (Gloo inside a site, the ZeroMQ transport with
one coordinator per shard across sites), spawned the way torchrun would (RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT), each in its own session and killed in teardown.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import transformers  # in the dev extra: a broken install must fail loudly
from safetensors.torch import load_file

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
from lowband.errors import ConfigError, IncompatiblePeer
from lowband.models.weights import load_pretrained
from transport.config import ZmqConfig
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.zmq_comm import connect

# Several outer steps per fragment with P > 1 and τ > 0, on the tiny preset (~0.13 M params).
RUN = ["--preset", "tiny", "--steps", "20", "-H", "10", "-P", "2", "--tau", "1",
       "--workers", "2", "--eval-every", "0", "--audit-every", "1", "--checkpoint-every", "10"]


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
    gathered = gather_rows(parts[0], rows, size,
                           lambda out, _: [o.copy_(torch.cat([p, o[p.shape[0]:]]))
                                           for o, p in zip(out, parts)])
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


# ---- processes -------------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Sites:
    """``sites`` sites of ``ranks`` ranks each; one coordinator per shard group."""

    def __init__(self, tmp: Path, ranks: int, engine: str = "fsdp2", heartbeat: float = 1.0):
        self.tmp, self.ranks, self.engine = tmp, ranks, engine
        self.coords = [Coordinator(CoordinatorConfig(bind="tcp://127.0.0.1:0",
                                                     heartbeat_interval=heartbeat)).start()
                       for _ in range(ranks)]
        self.procs: list[subprocess.Popen] = []

    def start_site(self, site: int, extra: Sequence[str] = ()) -> list[subprocess.Popen]:
        port, out = _free_port(), self.tmp / f"site{site}"
        addrs = ",".join(c.address for c in self.coords)
        started = []
        for r in range(self.ranks):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(self.ranks),
                       MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            args = [sys.executable, "-m", "lowband", "worker", "--coordinator", addrs,
                    "--site", self.engine, "--id", f"s{site}", "--threads", "1",
                    "--bind-host", "127.0.0.1", "--same-host", "off",  # bytes on TCP
                    "--out", str(out), *RUN, *extra]
            log = (self.tmp / f"site{site}-r{r}-{len(self.procs)}.log").open("w")
            started.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                            start_new_session=True))
        self.procs += started
        return started

    def finals(self, site: int) -> list[dict]:
        out = []
        for r in range(self.ranks):
            recs = [json.loads(line) for line in
                    (self.tmp / f"site{site}" / f"metrics-s{site}-r{r}.jsonl").read_text().splitlines()]
            out.append({"final": [x for x in recs if x["event"] == "final"][-1],
                        "sync_bytes": sum(x["bytes_sent"] for x in recs if x["event"] == "sync")})
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
    cfg = replace(cfg, steps=20, workers=2, eval_every=0, audit_every=1,
                  mode=replace(cfg.mode, inner_steps=10, n_fragments=2, tau=1))
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
            assert any(k.startswith("inner.") for k in ta) and any(k.startswith("local.") for k in ta)
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
    shards = [load_sharded(sites.tmp / f"site{site}" / "checkpoints" / "final",
                           key=f"s{site}-r{r}")[0] for r in range(2)]
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
        first = connect(coord.address, ZmqConfig(bind_host="127.0.0.1"), signature="sig-2", meta={"layout": two})
        try:
            with pytest.raises(IncompatiblePeer) as err:
                connect(coord.address, ZmqConfig(bind_host="127.0.0.1"), signature="sig-4", meta={"layout": four})
            assert "a site of 4 rank(s)" in str(err.value) and "a site of 2 rank(s)" in str(err.value)
        finally:
            first.close()
