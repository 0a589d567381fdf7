"""Pseudo-gradient codecs: lowband's pure-PyTorch codecs vs bitsandbytes' blockwise kernels.

    python -m benchmarks.diloco_codecs --json [--numel 1000000]

Encode/decode time (best of ``repeats``, one torch thread), bytes on the wire and mean absolute
error on a Gaussian tensor. bitsandbytes is optional (the ``train`` extra); without it only the
pure-PyTorch rows are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from typing import Any, Callable

import torch

from lowband.codecs import get_codec


def _best_ms(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return round(best * 1e3, 3)


def _bnb_rows(x: torch.Tensor, repeats: int) -> list[dict[str, Any]]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import bitsandbytes.functional as bnb
    except ImportError:
        return []
    rows = []
    q, state = bnb.quantize_blockwise(x, blocksize=256)
    rows.append(
        {
            "codec": "int8",
            "impl": "bitsandbytes",
            "block": 256,
            "encode_ms": _best_ms(lambda: bnb.quantize_blockwise(x, blocksize=256), repeats),
            "decode_ms": _best_ms(lambda: bnb.dequantize_blockwise(q, state), repeats),
            "bytes": q.numel() + state.absmax.numel() * 4,
            "mae": float((bnb.dequantize_blockwise(q, state) - x).abs().mean()),
        }
    )
    for kind in ("nf4", "fp4"):
        q4, s4 = bnb.quantize_4bit(x, blocksize=128, quant_type=kind)
        rows.append(
            {
                "codec": kind,
                "impl": "bitsandbytes",
                "block": 128,
                "encode_ms": _best_ms(
                    lambda k=kind: bnb.quantize_4bit(x, blocksize=128, quant_type=k), repeats
                ),
                "decode_ms": _best_ms(lambda q=q4, s=s4: bnb.dequantize_4bit(q, s), repeats),
                "bytes": q4.numel() * q4.element_size() + s4.absmax.numel() * 4,
                "mae": float((bnb.dequantize_4bit(q4, s4) - x).abs().mean()),
            }
        )
    return rows


def run(numel: int, repeats: int) -> dict[str, Any]:
    torch.set_num_threads(1)
    x = torch.randn(numel, generator=torch.Generator().manual_seed(0))
    rows = []
    for name in ("fp16", "int8", "nf4", "fp4", "e3m0"):
        codec = get_codec(name)
        enc = codec.encode(x)
        rows.append(
            {
                "codec": name,
                "impl": "lowband (PyTorch)",
                "encode_ms": _best_ms(lambda c=codec: c.encode(x), repeats),
                "decode_ms": _best_ms(lambda c=codec, e=enc: c.decode(e), repeats),
                "bytes": enc.nbytes,
                "mae": float((codec.decode(enc) - x).abs().mean()),
            }
        )
    return {"numel": numel, "threads": 1, "rows": rows + _bnb_rows(x, repeats)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.diloco_codecs",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--json", action="store_true")
    p.add_argument("--numel", type=int, default=1_000_000)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)
    result = run(args.numel, args.repeats)
    if not args.json:
        for r in result["rows"]:
            print(
                f"{r['codec']:5} {r['impl']:18} enc {r['encode_ms']:8.2f} ms "
                f"dec {r['decode_ms']:8.2f} ms  {r['bytes']:>9} B  mae {r['mae']:.4f}"
            )
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
