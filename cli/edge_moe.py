"""``lowband edge quantize MODEL_DIR --nested --out DIR`` and ``lowband edge moe-generate``.

Registered into the ``lowband edge`` subcommands by ``cli.edge``. Parsing only: the
work is ``edge.moe.checkpoint.quantize_nested_checkpoint`` and ``edge.moe.store.open_store``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from lowband.errors import LowbandError


def register(edge_sub: argparse._SubParsersAction) -> None:
    p = edge_sub.add_parser(
        "quantize",
        help="weight-only int8/4-bit linears (--bits), or bit-nested MoE experts (--nested)",
        description="--bits 8|4: quantize every dense linear to Q8_0/Q4_0-style groups (served by "
        "the edge runtime's GEMV kernel). --nested: quantize every expert to per-group "
        "int8 stored as bit-planes (MSB first), so it can be served at 8, 4, 3 or 2 bits "
        "by reading a prefix of its file; non-expert weights are copied unchanged.",
    )
    p.add_argument(
        "model_dir",
        metavar="MODEL_DIR",
        help="HF checkpoint (config.json + *.safetensors), or with --bits a float .gguf file",
    )
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--bits", type=int, choices=(8, 4), help="dense weight-only quantization")
    mode.add_argument(
        "--nested",
        action="store_true",
        help="bit-nested (matryoshka) expert planes of a mixture of experts",
    )
    p.add_argument(
        "--group",
        type=int,
        default=64,
        choices=(32, 64, 128),
        help="--bits: weights per fp16 scale (32 = llama.cpp's Q8_0/Q4_0)",
    )
    p.add_argument(
        "--skip",
        action="append",
        default=[],
        help="--bits: leave linears matching this pattern in float (e.g. lm_head)",
    )
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--group-size", type=int, default=64, help="--nested: weights per scale/offset pair (g)"
    )
    p.set_defaults(func=_quantize)

    p = edge_sub.add_parser(
        "moe-generate",
        help="generate with a nested MoE under an expert memory budget",
        description="Serve a converted MoE with its experts in a budgeted cache (HEBF or LRU).",
    )
    p.add_argument(
        "nested_dir", metavar="NESTED_DIR", help="output of 'lowband edge quantize --nested'"
    )
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--budget-mb", type=float, required=True, help="bytes of experts kept in memory, MB"
    )
    p.add_argument("--policy", choices=("hebf", "lru"), default="hebf")
    p.add_argument("--lru-bits", type=int, choices=(8, 4, 3, 2), default=8)
    p.add_argument(
        "--min-bits", type=int, choices=(4, 3, 2), default=2, help="HEBF narrowest width"
    )
    p.add_argument("--prefetch", type=int, default=2, help="experts to prefetch per layer (0: off)")
    p.add_argument(
        "--read-mb-per-s",
        type=float,
        default=None,
        help="model a storage device this fast (default: the real file system)",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.set_defaults(func=_moe_generate)


def _quantize_dense(args: argparse.Namespace) -> int:
    from edge.formats.gguf import quantize_gguf
    from edge.formats.gguf_arch import is_gguf
    from edge.formats.quantized_checkpoint import QuantConfig, quantize_checkpoint

    try:
        t0 = time.perf_counter()
        cfg = QuantConfig(bits=args.bits, group=args.group, skip=tuple(args.skip))
        if is_gguf(args.model_dir):
            out = quantize_gguf(Path(args.model_dir), Path(args.out), cfg)
        else:
            out = quantize_checkpoint(args.model_dir, args.out, cfg)
    except LowbandError as exc:
        print(f"lowband edge quantize: {exc}", file=sys.stderr)
        return 2
    mb = sum(f.stat().st_size for f in out.glob("*.safetensors")) / 1e6
    print(
        f"wrote {args.bits}-bit (group {args.group}) checkpoint to {out} ({mb:.1f} MB) "
        f"in {time.perf_counter() - t0:.1f}s"
    )
    return 0


def _quantize(args: argparse.Namespace) -> int:
    if not args.nested:
        return _quantize_dense(args)
    from edge.moe.checkpoint import quantize_nested_checkpoint
    from edge.moe.quant import NestedQuantConfig

    try:
        cfg = NestedQuantConfig(group_size=args.group_size)
        t0 = time.perf_counter()
        out = quantize_nested_checkpoint(args.model_dir, args.out, cfg)
    except LowbandError as exc:
        print(f"lowband edge quantize: {exc}", file=sys.stderr)
        return 2
    manifest = json.loads((out / "nested.json").read_text())
    mb = {b: sum(e["bytes"][b] for e in manifest["experts"]) / 1e6 for b in ("8", "4", "3", "2")}
    print(
        f"wrote {len(manifest['experts'])} experts to {out} in {time.perf_counter() - t0:.1f}s; "
        "expert MB at 8/4/3/2 bits: " + " / ".join(f"{v:.1f}" for v in mb.values())
    )
    return 0


def _moe_generate(args: argparse.Namespace) -> int:
    from edge.engine import Engine, LocalRunner
    from edge.moe.store import ExpertStoreConfig, HEBFConfig, LRUConfig, PrefetchConfig, open_store
    from edge.sampling import SamplingParams
    from lowband.models.tokenizer import load_tokenizer

    try:
        policy = (
            HEBFConfig(min_bits=args.min_bits)
            if args.policy == "hebf"
            else LRUConfig(bits=args.lru_bits)
        )
        cfg = ExpertStoreConfig(
            budget_bytes=int(args.budget_mb * 1e6),
            policy=policy,
            prefetch=PrefetchConfig(top=args.prefetch) if args.prefetch else None,
            read_mb_per_s=args.read_mb_per_s,
        )
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, seed=args.seed
        )
        model, cache = open_store(args.nested_dir, cfg)
    except LowbandError as exc:
        print(f"lowband edge moe-generate: {exc}", file=sys.stderr)
        return 2
    try:
        eos = model.config.eos_token_id
        tok = load_tokenizer(args.nested_dir, eos if isinstance(eos, int) else None)
        engine = Engine(LocalRunner(model), tok, model_name=str(args.nested_dir))
        t0 = time.perf_counter()
        text, _reason, n = engine.complete(args.prompt, params)
        dt = time.perf_counter() - t0
        print(text)
        rep = cache.report()
        stats = {
            "tokens": n,
            "tokens_per_s": round(n / dt, 2),
            "hit_rate": round(rep["hit_rate"], 3),
            "mean_bits": rep["mean_bits_per_call"],
            "peak_expert_mb": rep["peak_bytes"] / 1e6,
            "budget_mb": args.budget_mb,
        }
        print(json.dumps(stats), file=sys.stderr)
    finally:
        cache.close()
    return 0
