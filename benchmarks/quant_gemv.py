"""Micro-benchmark: weight-only quantized GEMV (``edge.quant``) vs fp32 ``F.linear`` at decode.

``python -m benchmarks.quant_gemv --json`` (run it under ``taskset -c 1`` on a shared machine)
prints a table and, with ``--json``, one JSON object as its last line::

    {"bench": "quant_gemv", "threads": 1, "rows": 1, "isa": ..., "kernel_available": ...,
     "results": {"1536x512": {"fp32": {"median_us", "min_us", "max_us", "runs_us"},
                              "q8": {..., "speedup"}, "q4g32": ..., "q4g64": ...,
                              "fallback_q4g32": ...},
                 ...}}

Shapes are ``N x K`` (out x in features) of a Llama-style decoder; the activation is ``[rows, K]``.
Methods: ``fp32`` = ``F.linear``; ``q8`` = Q8 G=32 kernel; ``q4g32``/``q4g64`` = Q4 kernel;
``fallback_q4g32`` = the PyTorch fallback (dequantize + ``F.linear``).  Each method runs
``--repeats`` rounds, alternating methods within each round; a round times a batch of calls
sized to ~``--target-ms``.  Times are microseconds per call; ``speedup`` = fp32 median / median.

``--prefill`` instead times ``QuantLinear`` kernel vs dequantize+matmul for rows 1..128 (the data
behind ``DEFAULT_MAX_KERNEL_ROWS``).  ``--ggml`` instead times the GGUF block kernels
(``kernel.ggml_gemv``: Q4_1 .. Q6_K on random blocks) against the Q4_0 kernel (``q4g32``) and
fp32 at 2048x2048 and 2048x8192 (``speedup`` vs fp32 as above).  ``--tiny`` is a fast smoke run
(small shapes, 2 rounds).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F

from edge.quant import kernel
from edge.quant.formats import quantize

SHAPES = [(1536, 512), (512, 1536), (1408, 512), (32000, 512), (2048, 5632)]
TINY_SHAPES = [(256, 256), (64, 512)]
PREFILL_SHAPES = [(1536, 512), (2048, 5632)]
PREFILL_ROWS = [1, 4, 16, 32, 64, 128, 256, 512]
GGML_SHAPES = [(2048, 2048), (2048, 8192)]


def _calls_for(fn: Callable[[], object], target_s: float) -> int:
    fn()
    t = time.perf_counter()
    fn()
    dt = max(time.perf_counter() - t, 1e-7)
    return max(1, int(target_s / dt))


def _time(
    methods: dict[str, Callable[[], object]], repeats: int, target_s: float
) -> dict[str, list[float]]:
    calls = {k: _calls_for(f, target_s) for k, f in methods.items()}
    runs: dict[str, list[float]] = {k: [] for k in methods}
    for r in range(repeats):
        order = list(methods) if r % 2 == 0 else list(reversed(methods))  # alternate
        for k in order:
            f, n = methods[k], calls[k]
            t = time.perf_counter()
            for _ in range(n):
                f()
            runs[k].append((time.perf_counter() - t) / n * 1e6)
    return runs


def _summary(us: list[float]) -> dict:
    return {
        "median_us": round(statistics.median(us), 2),
        "min_us": round(min(us), 2),
        "max_us": round(max(us), 2),
        "runs_us": [round(u, 2) for u in us],
    }


def bench_decode(shapes, rows: int, repeats: int, target_s: float, fallback: bool) -> dict:
    g = torch.Generator().manual_seed(0)
    out = {}
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) / k**0.5
        x = torch.randn(rows, k, generator=g)
        p8 = quantize(w, 8, 32)
        p4 = quantize(w, 4, 32)
        p4b = quantize(w, 4, 64)
        methods: dict[str, Callable[[], object]] = {
            "fp32": lambda: F.linear(x, w),
            "q8": lambda: kernel.gemv(x, p8.qweight, p8.scales, 8, 32),
            "q4g32": lambda: kernel.gemv(x, p4.qweight, p4.scales, 4, 32),
            "q4g64": lambda: kernel.gemv(x, p4b.qweight, p4b.scales, 4, 64),
        }
        if fallback:
            methods["fallback_q4g32"] = lambda: kernel.gemv(
                x, p4.qweight, p4.scales, 4, 32, force_fallback=True
            )
        runs = _time(methods, repeats, target_s)
        base = statistics.median(runs["fp32"])
        res = {}
        for m, us in runs.items():
            res[m] = _summary(us)
            if m != "fp32":
                res[m]["speedup"] = round(base / statistics.median(us), 2)
        out[f"{n}x{k}"] = res
    return out


def bench_prefill(shapes, rows_list, repeats: int, target_s: float) -> dict:
    from edge.quant.linear import QuantLinear

    g = torch.Generator().manual_seed(0)
    out = {}
    for n, k in shapes:
        lin = torch.nn.Linear(k, n, bias=False)
        for bits, group in ((8, 32), (4, 32)):
            ql = QuantLinear.from_linear(lin, bits, group)
            for m in rows_list:
                x = torch.randn(m, k, generator=g)
                kern = QuantLinear.from_packed(ql.packed, max_kernel_rows=1 << 30)
                deq = QuantLinear.from_packed(ql.packed, max_kernel_rows=0)
                with torch.no_grad():
                    runs = _time(
                        {
                            "kernel": lambda: kern(x),
                            "dequant_matmul": lambda: deq(x),
                            "fp32": lambda: lin(x),
                        },
                        repeats,
                        target_s,
                    )
                out[f"{n}x{k}/q{bits}g{group}/M{m}"] = {key: _summary(v) for key, v in runs.items()}
    return out


def _ggml_weight(name: str, n: int, k: int, g: torch.Generator):
    """Random blocks of ggml type ``name`` with finite fp16 scale fields (~0.01)."""
    from edge.quant.ggml import GGML_TYPES, GGMLWeight

    t = GGML_TYPES[name]
    raw = torch.randint(0, 256, (n, k // t.qk, t.size), generator=g, dtype=torch.uint8)
    fields = {"Q2_K": (80, 82), "Q3_K": (108,), "Q6_K": (208,), "Q5_0": (0,)}.get(name, (0, 2))
    for at in fields:
        d = (torch.randn(n, k // t.qk, 1, generator=g) * 1e-3).half()
        raw[:, :, at : at + 2] = d.view(torch.uint8)
    return GGMLWeight(t, (n, k), raw.reshape(n, -1))


def bench_ggml(shapes, rows: int, repeats: int, target_s: float) -> dict:
    from edge.quant.ggml import GGML_TYPES

    g = torch.Generator().manual_seed(0)
    out = {}
    for n, k in shapes:
        w = torch.randn(n, k, generator=g) / k**0.5
        x = torch.randn(rows, k, generator=g)
        p4 = quantize(w, 4, 32)
        methods: dict[str, Callable[[], object]] = {
            "fp32": lambda: F.linear(x, w),
            "q4g32": lambda: kernel.gemv(x, p4.qweight, p4.scales, 4, 32),
        }
        for name in GGML_TYPES:
            gw = _ggml_weight(name, n, k, g)
            methods[name] = lambda gw=gw: kernel.ggml_gemv(x, gw)
        runs = _time(methods, repeats, target_s)
        base = statistics.median(runs["fp32"])
        res = {}
        for m, us in runs.items():
            res[m] = _summary(us)
            if m != "fp32":
                res[m]["speedup"] = round(base / statistics.median(us), 2)
        out[f"{n}x{k}"] = res
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON line last")
    ap.add_argument("--tiny", action="store_true", help="fast smoke run")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--target-ms", type=float, default=40.0, help="time per batch of calls")
    ap.add_argument("--rows", type=int, default=1, help="activation rows (decode: 1)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--isa", choices=["native", "avx2", "portable"], default="native")
    ap.add_argument("--no-fallback", action="store_true", help="skip the (slow) fallback timing")
    ap.add_argument("--prefill", action="store_true", help="kernel vs dequant+matmul over rows")
    ap.add_argument("--ggml", action="store_true", help="GGUF block kernels (Q4_1..Q6_K) vs Q4_0")
    args = ap.parse_args(argv)

    torch.set_num_threads(args.threads)
    kernel.configure(isa=args.isa)
    shapes = TINY_SHAPES if args.tiny else SHAPES
    repeats = 2 if args.tiny else max(args.repeats, 1)
    target_s = (2.0 if args.tiny else args.target_ms) / 1e3
    avail = kernel.available()
    report = {
        "bench": "quant_gemv",
        "threads": torch.get_num_threads(),
        "rows": args.rows,
        "repeats": repeats,
        "torch": torch.__version__,
        "isa_config": args.isa,
        "isa": kernel.isa(),
        "kernel_available": avail,
        "unavailable_reason": kernel.unavailable_reason(),
    }
    if args.prefill:
        rows = [1, 16, 64] if args.tiny else PREFILL_ROWS
        report["prefill"] = bench_prefill(
            TINY_SHAPES[:1] if args.tiny else PREFILL_SHAPES, rows, repeats, target_s
        )
        for key, r in report["prefill"].items():
            print(f"{key:28s} " + "  ".join(f"{m}={v['median_us']:9.1f}us" for m, v in r.items()))
    else:
        if args.ggml:
            gshapes = TINY_SHAPES if args.tiny else GGML_SHAPES
            report["results"] = bench_ggml(gshapes, args.rows, repeats, target_s)
        else:
            report["results"] = bench_decode(
                shapes, args.rows, repeats, target_s, not args.no_fallback
            )
        print(
            f"isa={report['isa']} threads={report['threads']} rows={args.rows} "
            "(us/call: median [min-max], speedup vs fp32)"
        )
        for shape, r in report["results"].items():
            cells = [
                f"{m}={v['median_us']:.1f}[{v['min_us']:.1f}-{v['max_us']:.1f}]"
                + (f" x{v['speedup']}" if "speedup" in v else "")
                for m, v in r.items()
            ]
            print(f"{shape:>10s}  " + "  ".join(cells))
    if args.json:
        print(json.dumps(report))
    return report


if __name__ == "__main__":
    main()
