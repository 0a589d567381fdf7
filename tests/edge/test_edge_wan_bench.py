"""``python -m benchmarks.edge_wan``: a smoke run on a tiny random model (root + iproute2 + TUN):
every arm starts, answers, and the auto arm reports the layout it chose and why."""

from __future__ import annotations

import pytest

from tests.conftest import run_json_module
from transport.links.tun.testbed import available

needs_tun = pytest.mark.skipif(available() is not None, reason=f"tun: {available()}")


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(400)
@needs_tun
def test_every_arm_decodes_over_the_emulated_link():
    args = ["--tiny", "--profiles", "ethernet", "--repeats", "1", "--tokens", "6"]
    out = run_json_module("benchmarks.edge_wan", *args, "--streams", "2", "--json", timeout=390)
    (p,) = out["profiles"]
    assert p["errors"] == {}
    for arm in ("single", "tp", "pipeline", "replica", "auto"):
        assert p["ms_per_token"][arm]["median"] > 0
        assert p["aggregate_tokens_per_s"][arm]["median"] > 0
    plan = p["auto_health"]["plan"]
    assert plan["layout"] in ("single", "tp", "pipeline", "replica") and plan["reason"]
    assert p["measured_rtt"]["median_ms"] > 0
    # the master's time per step (pipeline) and the emulator's own CPU are recorded
    assert p["master_cycle"]["pipeline"]["steps"] > 0
    assert sum(p["master_cycle"]["replica"]["rows"]) > 0
    assert p["forwarder_spin_us"] == 300.0  # a sub-2 ms path: the forwarder spins
    assert p["forwarder_cpu_during_streams"]["single"]["median"] >= 0
    # the planner told the benchmark's concurrency plans for it and says so
    busy = p["auto_busy_health"]["plan"]
    assert busy["streams"] == 2
    assert set(busy["predicted_tok_s"]) >= {"single", "pipeline", "replica"}
    assert p["aggregate_tokens_per_s"]["auto-busy"]["median"] > 0


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(300)
@needs_tun
def test_the_model_that_fits_no_device_arms_decode():
    """--budget-frac: one device that holds it all, one streaming its layers from paced storage
    within the budget, two devices in pipeline each within it; memory and the measured round
    trip's faithfulness are recorded."""
    args = ["--tiny", "--budget-frac", "0.6", "--profiles", "ethernet", "--repeats", "1"]
    args += ["--tokens", "4", "--paced-tokens", "2", "--paced-mbps", "40"]
    out = run_json_module("benchmarks.edge_wan", *args, "--streams", "2", "--json", timeout=290)
    assert 0 < out["memory_budget_mb"] < out["weight_mb"]
    (p,) = out["profiles"]
    assert p["errors"] == {}
    for arm in ("single", "window", "pipeline"):
        assert p["ms_per_token"][arm]["median"] > 0
        assert p["aggregate_tokens_per_s"][arm]["median"] > 0
        assert all(m["rss"] > 0 for m in p["memory_mb"][arm])
    assert len(p["memory_mb"]["pipeline"]) == 2  # the master and its worker
    assert isinstance(p["measured_rtt"]["within_tolerance"], bool)
    assert p["measured_rtt"]["tolerance_ms"] == pytest.approx(0.08)


_POST = (
    "import json,sys,urllib.request,urllib.error\n"
    "req=urllib.request.Request('http://127.0.0.1:'+sys.argv[1]+'/v1/completions',"
    "data=json.dumps({'model':'m','prompt':'Hi','max_tokens':8,'ignore_eos':True}).encode(),"
    "headers={'Content-Type':'application/json'})\n"
    "try:\n r=urllib.request.urlopen(req,timeout=120);print(r.status);print(r.read().decode())\n"
    "except urllib.error.HTTPError as e:\n print(e.code);print(e.read().decode())\n"
)


@pytest.mark.slow
@pytest.mark.netns
@pytest.mark.timeout(300)
@needs_tun
def test_a_lost_stage_link_gives_the_client_a_clear_error(tmp_path):
    """Chaos: the link to the pipeline's second stage goes down mid-service; the next request
    fails with a JSON error naming the failed stage (no hang), and /health says unhealthy; once
    the link is back the master re-forms the pipeline and the next request succeeds."""
    import json
    import sys
    import time

    from benchmarks.edge_wan import Arm, Bench, _tiny_model
    from transport.links.tun.shape import PathConfig
    from transport.links.tun.testbed import TunConfig, TunTestbed

    cfg = Bench(model=_tiny_model(tmp_path / "m"), tokens=8, startup_s=180)
    with TunTestbed(TunConfig(path=PathConfig(delay_ms=1.0))) as bed:
        arm = Arm("pipeline", bed, cfg, tmp_path)
        # a step's deadline of 8 s, not the default 30: the request after the cut fails when
        # it passes, and the test need not wait the default out
        arm.master += ["--op-timeout", "8"]
        try:
            arm.start()

            def post() -> tuple[int, dict]:
                r = bed.run_in(
                    0, [sys.executable, "-c", _POST, str(arm.port)], capture_output=True,
                    text=True, timeout=150,
                )  # fmt: skip
                code, body = r.stdout.strip().split("\n", 1)
                return int(code), json.loads(body)

            assert post()[0] == 200
            bed.down()
            code, body = post()
            assert code == 503, body
            assert "pipeline stage failed" in json.dumps(body)
            health = arm.health()
            assert health is None or health.get("healthy") is False
            bed.up()
            back = time.monotonic()
            while time.monotonic() - back < 120:
                health = arm.health()
                if health is not None and health.get("healthy"):
                    break
                time.sleep(0.2)
            assert health is not None and health["healthy"], health
            assert health["reformed"] == 1 and "failed" in health["last_failure"]
            code, body = post()
            assert code == 200, body
            print(f"re-formed: first request served {time.monotonic() - back:.1f}s after up")
        finally:
            bed.up()
            arm.stop()
