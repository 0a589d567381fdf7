"""Issue 26, faults on the real link: Streaming DiLoCo between two sites of the TUN WAN emulator
(:mod:`transport.links.tun`: kernel TCP in network namespaces sees the delay, the rate, the loss
and the outage), with the link cut and lossy while a fragment sync is on the wire.

* a short flap (every path down for less than the liveness deadline) and a burst of
  Gilbert-Elliott loss: TCP retransmits, nobody is declared lost, no sync is redone or lost;
* a long outage of one site (longer than the deadline): it is declared lost, the other site
  redoes the sync alone and trains on; when the link is back the site rejoins, receives the
  state and both finish the run bit-identical.

Root, iproute2 and /dev/net/tun (the tests skip with the reason otherwise). The coordinator runs
in this process on the testbed's host endpoint; each worker is a ``lowband worker`` process in
its site, in its own session, killed with its group in teardown; the namespaces and TUN devices
go with the testbed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from diloco.config import DilocoConfig, config_to_dict, tiny
from diloco.schedule import syncs_launched
from tests.chaos_helpers import events, last_step, wait_for
from transport.coordinator import Coordinator, CoordinatorConfig
from transport.links.tun.shape import GilbertElliott, PathConfig
from transport.links.tun.testbed import TunConfig, TunTestbed, available

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.slow,
    pytest.mark.netns,
    pytest.mark.timeout(420),
    pytest.mark.skipif(available() is not None, reason=f"tun: {available()}"),
]

# 20 ms RTT at 4 Mbit/s: a fragment of the tiny model (~0.26 MB in fp32) is ~0.5 s on the wire,
# so a sync is in flight a good part of the time (τ = 5 steps of overlap).
WAN = PathConfig(delay_ms=10.0, rate_mbit=4.0)
HEARTBEAT = 3.0  # s: a peer silent with a dead connection for 2 × this is declared lost
H, P, TAU = 20, 2, 5
NET = 227  # 10.227.0.0/24: away from the other testbeds' defaults (229, 231, 232)
SITE_PATHS = ("0->1", "1->0")


def _train_config(steps: int, batch: int) -> dict[str, Any]:
    base = tiny()
    cfg = dataclasses.replace(
        base,
        steps=steps,
        mode=DilocoConfig(inner_steps=H, n_fragments=P, tau=TAU),
        data=dataclasses.replace(base.data, batch_size=batch),
        eval_every=0,
        audit_every=2,
        sync_timeout=60.0,
    )
    return config_to_dict(cfg)


class Sites:
    """A coordinator on the host endpoint and one ``lowband worker`` per site."""

    def __init__(self, bed: TunTestbed, out: Path) -> None:
        self.bed, self.out = bed, out
        self.coord = Coordinator(
            CoordinatorConfig(bind=f"tcp://{bed.host}:0", heartbeat_interval=HEARTBEAT)
        ).start()
        self.procs: list[subprocess.Popen] = []

    def start(self, config: dict[str, Any]) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "config.json").write_text(json.dumps(config))
        for i in range(len(self.bed.ns)):
            log = (self.out / f"worker{i}.log").open("w")
            args = [
                sys.executable,
                "-m",
                "cli",
                "worker",
                "--coordinator",
                self.coord.address,
                "--config",
                str(self.out / "config.json"),
                "--id",
                str(i),
                "--threads",
                "1",
                "--bind-host",
                self.bed.addr(i),
                "--insecure",  # a lab network that exists only inside this test
                "--out",
                str(self.out),
            ]
            self.procs.append(
                self.bed.popen(
                    i, args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            )

    def wait(self, timeout: float) -> list[dict[str, Any]]:
        """Every worker's exit code must be 0; their final JSON lines."""
        deadline = time.monotonic() + timeout
        codes = [p.wait(max(1.0, deadline - time.monotonic())) for p in self.procs]
        logs = [(self.out / f"worker{i}.log").read_text() for i in range(len(self.procs))]
        assert codes == [0] * len(codes), "\n---\n".join(t[-3000:] for t in logs)
        return [json.loads(t.strip().splitlines()[-1]) for t in logs]

    def events(self, worker: int, event: str) -> list[dict[str, Any]]:
        return events(self.out / f"metrics-worker{worker}.jsonl", event)

    def step(self, worker: int) -> int:
        return last_step(self.out / f"metrics-worker{worker}.jsonl")

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            p.wait(10)
        self.coord.stop()


def _namespaces() -> str:
    return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


@pytest.fixture
def wan(tmp_path):
    with TunTestbed(TunConfig(sites=2, path=WAN, host=True, net=NET, seed=26)) as bed:
        sites = Sites(bed, tmp_path / "run")
        try:
            yield sites
        finally:
            sites.close()
    assert not any(ns in _namespaces() for ns in bed.ns)
    links = subprocess.run(["ip", "link"], capture_output=True, text=True).stdout
    assert not any(t in links for t in [*bed.tuns, bed.host_tun])


def _site_bytes(bed: TunTestbed) -> int:
    paths = bed.stats()["paths"]
    return sum(paths[k]["delivered_bytes"] for k in SITE_PATHS)


def _sync_on_the_wire(bed: TunTestbed, timeout: float = 60.0) -> None:
    """Return as a fragment sync starts crossing between the sites: a busy 50 ms (> 16 KB, near
    the rate) right after a quiet one, so most of its ~0.5 MB is still to come. Heartbeats go
    to the host endpoint; an audit's rows are a few hundred bytes."""
    deadline = time.monotonic() + timeout
    last, quiet = _site_bytes(bed), False
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = _site_bytes(bed)
        moved, last = now - last, now
        if quiet and moved > 16_000:
            return
        quiet = moved < 4_000
    raise AssertionError(f"no sync started on the wire within {timeout:.0f}s")


def _dropped(bed: TunTestbed, key: str) -> int:
    paths = bed.stats()["paths"]
    return sum(paths[k][key] for k in SITE_PATHS)


def test_a_flap_and_a_loss_burst_mid_sync_lose_nothing(wan):
    steps = 160
    wan.start(_train_config(steps, batch=8))
    bed = wan.bed
    wait_for(lambda: wan.step(0) >= 40, 180, "step 40")
    _sync_on_the_wire(bed)
    bed.down()  # every path of both sites, the coordinator's included
    down_drops = _dropped(bed, "down_drops")
    time.sleep(1.5)  # < the 6 s deadline, and TCP's backoff after it
    bed.up()
    down_drops = _dropped(bed, "down_drops") - down_drops
    wait_for(lambda: wan.step(0) >= 90, 180, "step 90")
    _sync_on_the_wire(bed)
    bursty = dataclasses.replace(WAN, burst=GilbertElliott(p=0.05, r=0.3))  # ~14 %, runs of ~3
    lost = _dropped(bed, "lost")
    for s, d in ((0, 1), (1, 0)):
        bed.set_path(s, d, bursty)
    time.sleep(3.0)
    for s, d in ((0, 1), (1, 0)):
        bed.set_path(s, d, WAN)
    lost = _dropped(bed, "lost") - lost
    finals = wan.wait(240)

    print(json.dumps({"down_drops": down_drops, "burst_lost": lost, "finals": finals}))
    assert down_drops > 0  # the link was cut under a sync's packets
    assert lost > 0  # and the burst dropped some
    assert [f["steps"] for f in finals] == [steps, steps]
    assert finals[0]["state_hash"] == finals[1]["state_hash"]
    launched = syncs_launched(steps, P, H)
    for i, f in enumerate(finals):
        # No lost progress: every sync applied once, none redone, no state handed over.
        assert f["outer_syncs"] == launched and f["retries"] == 0 and f["transfers"] == 0, f
        assert wan.events(i, "recovery") == [] and wan.events(i, "membership") == []


def test_a_site_cut_off_past_the_deadline_rejoins_and_ends_identical(wan):
    steps = 120
    wan.start(_train_config(steps, batch=32))
    bed = wan.bed
    wait_for(lambda: wan.step(1) >= 40, 240, "step 40")
    _sync_on_the_wire(bed)
    cut = [(1, 0), (0, 1), (1, 2), (2, 1)]  # site 1 to site 0 and to the coordinator
    bed.down(cut)
    cut_at = wan.step(1)

    def declared_lost() -> bool:  # site 0 saw site 1 leave: the cut outlasted the 6 s deadline
        return any(c["left"] for c in wan.events(0, "membership"))

    wait_for(declared_lost, 60, "site 1 declared lost")
    bed.up(cut)
    finals = wan.wait(300)

    assert [f["steps"] for f in finals] == [steps, steps]
    assert finals[0]["state_hash"] == finals[1]["state_hash"]
    assert finals[1]["transfers"] >= 1  # it came back behind and received the state
    assert finals[0]["retries"] >= 1  # the sync cut in flight was redone by site 0
    assert finals[0]["outer_syncs"] == syncs_launched(steps, P, H)  # none skipped
    assert sorted(finals[0]["group"]) == sorted(finals[1]["group"])  # together at the end
    changes = wan.events(0, "membership")
    assert any(c["left"] for c in changes) and any(c["joined"] for c in changes), changes
    assert cut_at < steps
