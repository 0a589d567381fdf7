"""A Mixtral-style MoE served under an expert-memory budget: bit-nested experts + HEBF.

    python examples/moe_budget/main.py --out moe-run           # ~1-2 minutes on 2 cores
    python examples/moe_budget/main.py --out moe-run --tiny    # seconds (the smoke test)

1. train a small MoE (8 experts, top-2) on Shakespeare bytes (``edge.moe.train``), saved as an
   HF checkpoint;
2. convert it once to bit-nested experts (``edge.moe.checkpoint.quantize_nested_checkpoint``): every
   expert is per-group int8 stored as 8 bit-planes, so reading a prefix of its file gives the
   same expert at 4, 3 or 2 bits;
3. serve it with only a fraction of the int8 experts' bytes resident (``open_store``):
   * HEBF (hottest expert, bit first) keeps the hot experts wide and the cold ones narrow,
     fitting more experts in the same bytes;
   * an int8 LRU cache of the same budget for comparison, which must evict and re-read instead;
   and report held-out perplexity, cache hit rate, mean bits per expert call and peak resident
   expert bytes (never above the budget) for each.

CLI equivalent: ``lowband edge quantize MODEL --nested --out NESTED`` then
``lowband edge moe-generate NESTED --budget-mb 0.5 --prompt ...``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

from edge.engine import Engine, LocalRunner
from edge.moe.checkpoint import NestedCheckpoint, quantize_nested_checkpoint
from edge.moe.quant import NestedQuantConfig
from edge.moe.store import ExpertStoreConfig, HEBFConfig, LRUConfig, PrefetchConfig, open_store
from edge.moe.train import heldout_ppl, load_splits, tiny_preset, train
from edge.sampling import SamplingParams
from lowband.models.tokenizer import ByteTokenizer


def int8_expert_bytes(nested: Path) -> int:
    """Bytes of every expert at 8 bits: the memory a plain int8 model needs for its experts."""
    ck = NestedCheckpoint(nested, verify=False)
    try:
        return sum(sizes[8] for sizes in ck.sizes().values())
    finally:
        ck.close()


def serve(
    nested: Path, cfg: ExpertStoreConfig, heldout: torch.Tensor, prompt: str, max_tokens: int
) -> dict:
    """Held-out perplexity and a completion with the experts behind ``cfg``'s cache."""
    model, cache = open_store(nested, cfg)
    try:
        with torch.inference_mode():
            ppl = heldout_ppl(model, heldout, seq_len=128, max_tokens=4096)
        engine = Engine(LocalRunner(model), ByteTokenizer(), model_name="moe")
        t0 = time.perf_counter()
        text, _, n = engine.complete(prompt, SamplingParams(max_tokens=max_tokens))
        rate = n / (time.perf_counter() - t0)
        rep = cache.report()
    finally:
        cache.close()
    return {
        "ppl": round(ppl, 3),
        "hit_rate": round(rep["hit_rate"], 3),
        "mean_bits": rep["mean_bits_per_call"],
        "peak_bytes": rep["peak_bytes"],
        "budget_bytes": cfg.budget_bytes,
        "bytes_read": rep["bytes_read"],
        "tokens_per_s": round(rate, 1),
        "text": text,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("moe-run"))
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument(
        "--budget",
        type=float,
        default=0.4,
        help="resident expert bytes as a fraction of the int8 experts (default 0.4)",
    )
    ap.add_argument("--prompt", default="KING HENRY:\nNow, lords,")
    ap.add_argument("--max-tokens", type=int, default=48)
    args = ap.parse_args()
    torch.set_num_threads(1)

    tcfg = tiny_preset(args.out / "model")  # 8 experts of 64->128->64, 2 layers, top-2
    tcfg = dataclasses.replace(tcfg, steps=40 if args.tiny else 400)
    model_dir = train(tcfg)
    nested = quantize_nested_checkpoint(
        model_dir, args.out / "nested", NestedQuantConfig(group_size=32)
    )
    full = int8_expert_bytes(nested)
    budget = int(args.budget * full)
    _, heldout = load_splits(tcfg.data, tcfg.heldout_frac)
    print(
        f"{tcfg.model.num_local_experts} experts x {tcfg.model.num_hidden_layers} layers: "
        f"{full / 1e3:.1f} kB at int8; budget {budget / 1e3:.1f} kB ({args.budget:.0%})"
    )

    policies = {
        "int8, all resident": ExpertStoreConfig(budget_bytes=full, policy=LRUConfig(bits=8)),
        "HEBF (8..2 bits)": ExpertStoreConfig(
            budget_bytes=budget, policy=HEBFConfig(min_bits=2), prefetch=PrefetchConfig(top=2)
        ),
        "int8 LRU": ExpertStoreConfig(budget_bytes=budget, policy=LRUConfig(bits=8)),
    }
    results = {
        name: serve(nested, cfg, heldout, args.prompt, args.max_tokens)
        for name, cfg in policies.items()
    }
    print(
        f"{'policy':<20} {'ppl':>7} {'hit rate':>8} {'mean bits':>9} {'peak kB':>8} "
        f"{'budget kB':>9} {'read kB':>8}"
    )
    for name, r in results.items():
        print(
            f"{name:<20} {r['ppl']:>7.3f} {r['hit_rate']:>8.3f} {r['mean_bits']:>9.2f} "
            f"{r['peak_bytes'] / 1e3:>8.1f} {r['budget_bytes'] / 1e3:>9.1f} "
            f"{r['bytes_read'] / 1e3:>8.1f}"
        )
    print(f"--- HEBF completion ---\n{args.prompt}{results['HEBF (8..2 bits)']['text']}")
    print(json.dumps({"int8_expert_bytes": full, "budget_bytes": budget, "runs": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
