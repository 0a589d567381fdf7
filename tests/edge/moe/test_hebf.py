"""hebf_plan: a pure function, tested on its own (budget, monotonicity, floors, bad budgets)."""

from __future__ import annotations

import random

import pytest

from edge.moe.hebf import hebf_plan, plan_bytes
from lowband.errors import ConfigError

pytestmark = pytest.mark.timeout(60)

# Sizes shaped like a real nested expert: scales + b planes.
SIZE = {8: 8 * 100 + 50, 4: 4 * 100 + 50, 3: 3 * 100 + 50, 2: 2 * 100 + 50}


def uniform_sizes(n: int) -> dict[int, dict[int, int]]:
    return {i: dict(SIZE) for i in range(n)}


def test_everything_fits_at_8_bits() -> None:
    sizes = uniform_sizes(5)
    plan = hebf_plan({i: float(i) for i in range(5)}, sizes, 5 * SIZE[8])
    assert plan == {i: 8 for i in range(5)}


def test_exact_floor_budget_gives_everyone_min_bits() -> None:
    sizes = uniform_sizes(6)
    plan = hebf_plan({i: 1.0 + i for i in range(6)}, sizes, 6 * SIZE[2])
    assert plan == {i: 2 for i in range(6)}


def test_coverage_before_bits_and_hottest_first() -> None:
    sizes = uniform_sizes(4)
    # Room for 2 experts at 2 bits plus change: the two hottest get in, nobody is upgraded
    # past what the leftover allows.
    plan = hebf_plan({0: 0.1, 1: 5.0, 2: 3.0, 3: 0.0}, sizes, 2 * SIZE[2] + 120)
    assert plan[0] == 0 and plan[3] == 0
    assert plan[1] == 3 and plan[2] == 2  # 120 bytes buy one plane (100), for the hottest
    assert plan_bytes(plan, sizes) <= 2 * SIZE[2] + 120


def test_required_experts_get_the_floor_even_when_cold() -> None:
    sizes = uniform_sizes(4)
    plan = hebf_plan({0: 9.0, 1: 8.0, 2: 7.0, 3: 0.0}, sizes, 2 * SIZE[2], required={3})
    assert plan[3] == 2
    assert plan[0] == 2 and plan[1] == 0 and plan[2] == 0


def test_zero_budget_with_experts_is_an_error() -> None:
    with pytest.raises(ConfigError, match="cannot hold one expert"):
        hebf_plan({0: 1.0}, uniform_sizes(1), SIZE[2] - 1)


def test_required_set_larger_than_budget_is_an_error() -> None:
    with pytest.raises(ConfigError, match="routed experts"):
        hebf_plan({}, uniform_sizes(3), 2 * SIZE[2], required={0, 1, 2})


@pytest.mark.parametrize(
    "bad",
    [
        dict(budget=-1),
        dict(min_bits=5),
        dict(hotness={0: -1.0}),
        dict(required={"nope"}),
    ],
)
def test_invalid_arguments(bad: dict) -> None:
    kw = dict(hotness={0: 1.0}, sizes=uniform_sizes(2), budget=10_000, min_bits=2, required=())
    kw.update(bad)
    with pytest.raises(ConfigError):
        hebf_plan(
            kw["hotness"],
            kw["sizes"],
            kw["budget"],
            min_bits=kw["min_bits"],
            required=kw["required"],
        )


def test_random_plans_respect_budget_monotonicity_and_maximality() -> None:
    rng = random.Random(1234)
    for trial in range(300):
        n = rng.randint(1, 40)
        sizes = uniform_sizes(n)
        hot = {i: rng.choice([0.0, rng.random(), rng.random() * 10, 1.0]) for i in range(n)}
        budget = rng.randint(SIZE[2], n * SIZE[8] + 100)
        plan = hebf_plan(hot, sizes, budget)
        used = plan_bytes(plan, sizes)
        assert used <= budget, trial
        assert set(plan) == set(range(n))
        assert all(b in (0, 2, 3, 4, 8) for b in plan.values())
        for a in range(n):  # hotter never has fewer bits than colder (equal sizes)
            for b in range(n):
                if hot[a] > hot[b]:
                    assert plan[a] >= plan[b], (trial, hot[a], hot[b], plan[a], plan[b])
        left = budget - used  # greedy is maximal: no single further step fits
        for i, b in plan.items():
            nxt = {0: 2, 2: 3, 3: 4, 4: 8}.get(b)
            if nxt is not None:
                cost = sizes[i][nxt] - (sizes[i][b] if b else 0)
                assert cost > left, (trial, i, b, left)


def test_mixed_sizes_budget_and_floor() -> None:
    rng = random.Random(7)
    for _ in range(200):
        n = rng.randint(2, 20)
        sizes = {}
        for i in range(n):
            plane, scale = rng.randint(10, 200), rng.randint(1, 40)
            sizes[i] = {b: scale + b * plane for b in (2, 3, 4, 8)}
        hot = {i: rng.random() for i in range(n)}
        required = set(rng.sample(range(n), rng.randint(0, 2)))
        budget = sum(sizes[i][2] for i in required) + rng.randint(
            max(s[2] for s in sizes.values()), 3000
        )
        plan = hebf_plan(hot, sizes, budget, required=required)
        assert plan_bytes(plan, sizes) <= budget
        assert all(plan[i] >= 2 for i in required)


def test_measured_errors_steer_upgrades() -> None:
    sizes = uniform_sizes(2)
    # Same hotness; expert 1's weights lose far more at 2 bits: it gets the spare plane.
    err = {0: {2: 0.01, 3: 0.009, 4: 0.008, 8: 0.0}, 1: {2: 0.5, 3: 0.1, 4: 0.02, 8: 0.0}}
    plan = hebf_plan({0: 1.0, 1: 1.0}, sizes, 2 * SIZE[2] + 100, error=err)
    assert plan == {0: 2, 1: 3}


def test_plan_is_deterministic() -> None:
    sizes = uniform_sizes(30)
    hot = {i: float(i % 3) for i in range(30)}
    plans = {tuple(sorted(hebf_plan(hot, sizes, 30 * SIZE[3] + 77).items())) for _ in range(5)}
    assert len(plans) == 1
