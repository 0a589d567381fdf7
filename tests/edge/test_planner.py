"""The automatic split planner (edge/planner.py): pure, so tested on made-up device profiles."""

from __future__ import annotations

import itertools

import pytest

from edge.planner import DeviceProfile, LayerShape, SplitPlan, plan_split, predict_ms
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig

pytestmark = pytest.mark.timeout(60)

CFG = ModelConfig(
    vocab_size=256,
    hidden_size=1024,
    intermediate_size=2816,
    num_hidden_layers=32,
    num_attention_heads=16,
    num_key_value_heads=4,
    max_position_embeddings=1024,
)


def dev(
    name: str,
    ms_per_mb: float = 0.1,
    *,
    fixed: float = 0.1,
    mem: float = 8000.0,
    storage: float = 500.0,
    rtt: float = 0.05,
) -> DeviceProfile:
    return DeviceProfile(
        name=name,
        layer_fixed_ms=fixed,
        ms_per_mb=ms_per_mb,
        memory_mb=mem,
        storage_mb_s=storage,
        rtt_ms=rtt,
    )


def test_layer_shape_counts_every_weight_of_a_layer() -> None:
    s = LayerShape.of(CFG)
    H, F = 1024, 2816
    expected = (2 * H * H + 2 * H * (H // 4)) + 3 * H * F  # q,o: HxH; k,v: Hx(H/4); FFN: 3 HxF
    assert s.layer_mb == pytest.approx(expected * 4 / 2**20)
    assert LayerShape.of(CFG, "bf16").layer_mb == pytest.approx(s.layer_mb / 2)


def test_equal_devices_split_evenly() -> None:
    p = plan_split(CFG, [dev("a"), dev("b")])
    assert p.weights == pytest.approx((0.5, 0.5), abs=0.02)
    assert p.predicted_ms == pytest.approx(p.even_ms, rel=1e-3)


def test_twice_as_fast_device_gets_about_two_thirds() -> None:
    p = plan_split(CFG, [dev("fast", 0.1), dev("slow", 0.2)])
    assert p.devices == ("fast", "slow")
    assert p.weights[0] == pytest.approx(2 / 3, abs=0.04)
    assert p.predicted_ms < 0.8 * p.even_ms
    # balanced: neither device waits long for the other
    assert abs(p.device_ms[0] - p.device_ms[1]) < 0.05 * max(p.device_ms)


def test_plan_is_no_worse_than_any_hand_picked_split() -> None:
    """The planner's discrete split beats a grid of hand-picked weights under its own model."""
    profiles = [dev("a", 0.1), dev("b", 0.25, fixed=0.3), dev("c", 0.15)]
    p = plan_split(CFG, profiles, min_gain=0.0)
    grid = [w for w in itertools.product(range(1, 10), repeat=3)]
    best_hand = min(predict_ms(CFG, profiles, w)[0] for w in grid)
    assert p.predicted_ms <= best_hand * 1.001


def test_weak_device_is_left_out_with_a_reason() -> None:
    p = plan_split(CFG, [dev("m"), dev("w"), dev("phone", 3.0, rtt=0.6)])
    assert p.devices == ("m", "w")
    why = p.left_out["phone"]
    assert "ms/token" in why and "round trip" in why
    assert "left out phone" in p.explain()


def test_slow_link_leaves_out_even_a_fast_device() -> None:
    # 2 all-reduces x 32 layers x 5 ms = 320 ms per token: more than it saves
    p = plan_split(CFG, [dev("m"), dev("far", 0.05, rtt=5.0)])
    assert p.devices == ("m",) and p.weights == (1.0,)
    assert "far" in p.left_out


def test_device_that_barely_helps_is_not_used() -> None:
    """min_gain: a device predicted to save < 3 % is not worth another failure point."""
    p = plan_split(CFG, [dev("m", 0.1), dev("tiny", 20.0, rtt=0.0)])
    assert p.devices == ("m",)
    q = plan_split(CFG, [dev("m", 0.1), dev("tiny", 20.0, rtt=0.0)], min_gain=0.0)
    assert len(q.devices) in (1, 2) and q.predicted_ms <= p.predicted_ms


def test_short_memory_gets_a_window_and_a_smaller_share() -> None:
    roomy = plan_split(CFG, [dev("m"), dev("w")])
    short = plan_split(CFG, [dev("m"), dev("w", mem=300.0, storage=200.0)])
    assert roomy.memory_budget_mb == (None, None)
    assert short.weights[1] < roomy.weights[1]
    # 300 MB of 1376 MB: the share that balances includes some streaming, so a window
    assert short.memory_budget_mb == (None, 300.0)
    assert "window within 300 MB" in short.explain()
    # a fast device with little memory still gets work, less than its speed alone would earn
    fast_small = plan_split(CFG, [dev("m", 0.3), dev("w", 0.1, mem=300.0, storage=2000.0)])
    fast_roomy = plan_split(CFG, [dev("m", 0.3), dev("w", 0.1)])
    assert fast_small.weights[1] < fast_roomy.weights[1]
    assert fast_small.predicted_ms < fast_small.even_ms


def test_plan_is_pure_and_serialisable() -> None:
    profiles = [dev("a", 0.1), dev("b", 0.3, rtt=0.2)]
    p1, p2 = plan_split(CFG, profiles), plan_split(CFG, profiles)
    assert p1 == p2
    d = p1.to_dict()
    assert d["devices"] == ["a", "b"] and "explanation" in d
    assert DeviceProfile.from_dict(profiles[1].to_dict()) == profiles[1]
    assert isinstance(p1, SplitPlan)


def test_join_and_leave_replan() -> None:
    """A third device joining shortens the prediction; its leaving restores the old plan."""
    two = plan_split(CFG, [dev("a"), dev("b")])
    three = plan_split(CFG, [dev("a"), dev("b"), dev("c")])
    assert len(three.devices) == 3 and three.predicted_ms < two.predicted_ms
    assert plan_split(CFG, [dev("a"), dev("b")]) == two


def test_many_devices_use_the_greedy_search() -> None:
    profiles = [dev(f"d{i}", 0.1 + 0.02 * i) for i in range(12)]
    p = plan_split(CFG, profiles)
    assert 1 <= len(p.devices) <= 12 and p.predicted_ms < predict_ms(CFG, profiles[:1], [1.0])[0]


def test_invalid_inputs_name_the_field() -> None:
    with pytest.raises(ConfigError, match="ms_per_mb"):
        dev("x", 0.0)
    with pytest.raises(ConfigError, match="rtt_ms"):
        dev("x", rtt=-1.0)
    with pytest.raises(ConfigError, match="devices"):
        plan_split(CFG, [])
    with pytest.raises(ConfigError, match="devices"):
        plan_split(CFG, [dev("a"), dev("a")])
    with pytest.raises(ConfigError, match="min_gain"):
        plan_split(CFG, [dev("a")], min_gain=1.5)
    moe = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_local_experts=4,
    )
    with pytest.raises(ConfigError, match="model"):
        plan_split(moe, [dev("a")])


# ---- wired into the cluster: profile, plan, dismiss, serve (loopback communicator) -------------
def test_auto_split_cluster_matches_one_device(tmp_path) -> None:
    import threading

    import torch

    from edge.cluster import ClusterConfig, MasterRunner, WorkerConfig, run_worker
    from edge.engine import Engine, LocalRunner
    from edge.sampling import SamplingParams
    from edge.shardio import load_shard
    from lowband.models.llama import LlamaForCausalLM, init_weights
    from lowband.models.tokenizer import ByteTokenizer
    from lowband.models.weights import save_pretrained
    from transport.loopback import LoopbackGroup

    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    m = LlamaForCausalLM(cfg).eval()
    init_weights(m, std=0.2, seed=11)
    save_pretrained(m, tmp_path)
    ByteTokenizer().save(tmp_path)
    p = SamplingParams(max_tokens=8)
    ref = Engine(LocalRunner(load_shard(tmp_path).model), ByteTokenizer(), model_name="m").complete(
        "The quick", p
    )[0]
    comms = LoopbackGroup(3, timeout=20).comms()
    errors: list[BaseException] = []

    def worker(c) -> None:
        try:
            run_worker(c, WorkerConfig(join_timeout=20))
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            errors.append(exc)
        finally:
            c.close()  # as edge.launch.serve_worker_main does: a dismissed device leaves the group

    threads = [threading.Thread(target=worker, args=(c,), daemon=True) for c in comms[1:]]
    for t in threads:
        t.start()
    torch.manual_seed(0)
    runner = MasterRunner(
        comms[0],
        tmp_path,
        ClusterConfig(
            devices=3, auto_split=True, op_timeout=10.0, join_timeout=30, heartbeat_s=0.3
        ),
    )
    try:
        split = runner.health()["split"]
        assert len(split["devices"]) + len(split["left_out"]) == 3
        assert runner.devices == len(split["devices"]) and "predicted" in split["explanation"]
        assert runner.health()["connected"] == runner.devices  # the dismissed ones are gone
        eng = Engine(runner, ByteTokenizer(), model_name="m")
        assert eng.complete("The quick", p)[0] == ref
    finally:
        runner.close()
        for t in threads:
            t.join(10)
    assert not errors


def test_auto_split_excludes_weights() -> None:
    from edge.cluster import ClusterConfig

    with pytest.raises(ConfigError, match="auto_split"):
        ClusterConfig(devices=2, weights=(1.0, 2.0), auto_split=True)
