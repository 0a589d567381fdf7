"""benchmarks.diloco_memory on small models: the JSON line, and a bound on a DiLoCo worker's
peak bytes per parameter that a memory regression in the inner step or the sync path breaks."""

from __future__ import annotations

import json
import subprocess
import sys


def _bench(*extra: str, timeout: float = 240) -> dict:
    argv = [sys.executable, "-m", "benchmarks.diloco_memory", "--repeats", "1", "--json"]
    out = subprocess.run(
        [*argv, *extra], capture_output=True, text=True, timeout=timeout, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_memory_bench_prints_bytes_per_param() -> None:
    res = _bench("--model", "llama:128:2", "--steps", "8")
    assert res["benchmark"] == "diloco_memory" and set(res["arms"]) == {"diloco", "ddp"}
    assert 0 < res["params"] < 10_000_000
    for arm in res["arms"].values():
        peak, base = arm["peak_bytes"]["median"], arm["baseline_bytes"]["median"]
        assert peak >= base >= arm["cold_baseline_bytes"]["median"] > 0


def test_diloco_worker_peak_bytes_per_param_is_bounded() -> None:
    """A 6.6 M-parameter Llama, P = 2, int8, τ = 1 (a sync in flight during the next step).

    Held for the whole run: θ_m, θ_g, AdamW's moments, the outer momentum (20 B/param); in the
    inner step also the gradients (24) and the activations; at the SEND one fragment's Δ, whose
    buffer receives the sum (``all_reduce(out=)``), and two encodings (2 + 0.5 + 0.5 at P = 2),
    plus a codec chunk's temporaries, which weigh ~1 B/param at this size. Measured: SEND 25.88,
    inner step 25.83 (27.71 at the SEND when the sum had a buffer of its own). The bound fails
    on any full-model temporary: a separate buffer for the sum (+2), foreach AdamW's sqrt(v),
    ``isfinite`` over a whole fragment (+3.5), the decoded sum held through the next inner step
    (+2), the codec's whole-fragment float32 copies, or freed heap that glibc keeps
    (``limit_heap_retention``)."""
    res = _bench("--model", "llama:512:2", "--steps", "8", "--arms", "diloco")
    per_param = res["arms"]["diloco"]["bytes_per_param"]["median"]
    assert 20.0 <= per_param <= 26.8, per_param
