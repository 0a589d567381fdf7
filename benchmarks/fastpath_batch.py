"""Benchmark: the compiled decode step for B sequences at once (``FastDecode.layers_batch``).

``taskset -c 0 python -m benchmarks.fastpath_batch --json`` builds a model with random packed
weights at Llama-3.2-1B's decoder shapes (hidden 2048, 16 layers, 32 query / 8 KV heads of 64,
FFN 8192; the embedding and LM head are left out: a small vocabulary stands in) and times one
decode step of every layer for B = 1, 4, 8, 16 sequences, each with its own cache at a
different position, against B separate single-sequence steps. ``--weights`` picks ``q4``
(Q4_0-style ``QuantLinear``, group 32), ``q4_k`` (ggml Q4_K blocks, ``GGMLLinear``), ``q8`` or
``fp32``; ``--layers`` and ``--hidden`` shrink the model (``--tiny`` is a fast smoke run).

Each B runs ``--repeats`` rounds alternating the two methods and reports the median milliseconds
per step (``batch_ms``: one ``layers_batch`` call for B rows; ``single_ms``: B ``layers`` calls),
the thread's CPU milliseconds of the same (``*_cpu_ms``: at ``--threads 1`` the step's cost
even on a core shared with other processes) and tokens per second of the batch. The weights
are random bytes: the arithmetic and the memory traffic are a real model's, the tokens are not.
The last line with ``--json`` is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from edge import fastpath
from edge.quant import QuantLinear, kernel
from edge.quant.ggml import GGML_TYPES, GGMLWeight
from edge.quant.linear import GGMLLinear
from lowband.models.config import ModelConfig
from lowband.models.llama import KVCache, LlamaForCausalLM, fuse_projections, rope_inv_freq


def _packed(kind: str, n: int, k: int, gen: torch.Generator) -> nn.Module:
    if kind == "q4_k":
        t = GGML_TYPES["Q4_K"]
        raw = torch.randint(0, 256, (n, k // t.qk, t.size), dtype=torch.uint8, generator=gen)
        d = (torch.randn(n, k // t.qk, 2, generator=gen) * 1e-4).to(torch.float16)
        raw[:, :, :4] = d.view(torch.uint8).view(n, k // t.qk, 4)  # finite d, dmin
        return GGMLLinear(GGMLWeight(t, (n, k), raw.view(n, -1)))
    bits = 4 if kind == "q4" else 8
    m = QuantLinear(k, n, bias=False, bits=bits, group=32)
    lo, hi = (0, 256) if bits == 4 else (-127, 128)
    q = torch.randint(lo, hi, m.qweight.shape, generator=gen).to(m.qweight.dtype)
    m.qweight = q
    m.scales = (torch.rand(m.scales.shape, generator=gen) * 1e-3).to(torch.float16)
    return m


def build(kind: str, hidden: int, layers: int, inter: int, heads: int, kv: int) -> LlamaForCausalLM:
    """A model on random weights without materialising fp32 copies of the packed ones."""
    cfg = ModelConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
    )
    gen = torch.Generator().manual_seed(0)
    with torch.device("meta"):
        m = LlamaForCausalLM(cfg)
    for name, mod in list(m.named_modules()):
        if type(mod) is not nn.Linear or name == "lm_head":
            continue
        n, k = mod.weight.shape
        if kind == "fp32":
            new: nn.Module = nn.Linear(k, n, bias=False)
            nn.init.normal_(new.weight, std=0.02, generator=gen)
        else:
            new = _packed(kind, n, k, gen)
        parent, _, child = name.rpartition(".")
        setattr(m.get_submodule(parent), child, new)
    for mod in m.modules():  # norms, embedding, head: small, real
        for pname, p in list(mod.named_parameters(recurse=False)):
            if p.is_meta:
                fill = torch.ones if "norm" in type(mod).__name__.lower() else torch.randn
                setattr(mod, pname, nn.Parameter(fill(p.shape), requires_grad=False))
    m.inv_freq = rope_inv_freq(cfg)
    fuse_projections(m)
    return m.eval()


def _time(fn) -> tuple[float, float]:
    """(wall ms, this thread's CPU ms) of one call: at one thread the kernels run inline, so the
    CPU time is the step's cost even when other processes share the core."""
    t0, c0 = time.perf_counter(), time.thread_time()
    fn()
    return 1e3 * (time.perf_counter() - t0), 1e3 * (time.thread_time() - c0)


def run(args: argparse.Namespace) -> dict:
    torch.set_num_threads(args.threads)
    m = build(args.weights, args.hidden, args.layers, args.inter, args.heads, args.kv)
    why = fastpath.install(m)
    if why is not None:
        raise SystemExit(f"the compiled step is unavailable: {why}")
    fast = m.fast_decode
    H = args.hidden
    gen = torch.Generator().manual_seed(1)
    results: dict[str, dict] = {}
    with torch.inference_mode():
        for B in args.batch:
            caches = [KVCache(args.layers, None) for _ in range(B)]
            # every sequence at its own position: the first step of row b writes position b
            pos = [args.context + 3 * b for b in range(B)]
            for c, p in zip(caches, pos):
                c.reserve(
                    p + 4 * args.repeats + 8, 1, m.config.n_kv_heads, H // args.heads, torch.float32
                )
                c.length = p
            x = torch.randn(B, 1, H, generator=gen)

            def batch() -> None:
                fast.layers_batch(x, caches, [c.length for c in caches])

            def single() -> None:
                for b, c in enumerate(caches):
                    fast.layers(x[b : b + 1], c, c.length)
                    c.length += 1

            batch()  # warm-up (scratch, tables)
            single()
            runs_b, runs_s = [], []
            for _ in range(args.repeats):  # alternate so drift in the machine's load hits both
                runs_b.append(_time(batch))
                runs_s.append(_time(single))
            bm, bc = (statistics.median(r) for r in zip(*runs_b))
            sm, sc = (statistics.median(r) for r in zip(*runs_s))
            results[str(B)] = {
                "batch_ms": round(bm, 3),
                "batch_cpu_ms": round(bc, 3),
                "single_ms": round(sm, 3),
                "single_cpu_ms": round(sc, 3),
                "batch_tok_s": round(1e3 * B / bm, 1),
                "speedup": round(sm / bm, 2),
                "batch_runs_ms": [round(t, 2) for t, _ in runs_b],
            }
            print(
                f"B={B:3d}  batch {bm:8.2f} ms/step (cpu {bc:8.2f}, {1e3 * B / bm:7.1f} tok/s)"
                f"   {B} x single {sm:8.2f} ms (cpu {sc:8.2f})   speedup {sm / bm:5.2f}x",
                flush=True,
            )
    return {
        "bench": "fastpath_batch",
        "weights": args.weights,
        "shape": {
            "hidden": H,
            "layers": args.layers,
            "heads": args.heads,
            "kv_heads": args.kv,
            "ffn": args.inter,
        },
        "threads": args.threads,
        "context": args.context,
        "isa": kernel.isa(),
        "results": results,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--weights", choices=["q4", "q4_k", "q8", "fp32"], default="q4")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--inter", type=int, default=8192)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv", type=int, default=8)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--context", type=int, default=64, help="position of the first row")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tiny", action="store_true", help="small shapes, 2 rounds (smoke run)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.tiny:
        args.hidden, args.layers, args.inter, args.heads, args.kv = 256, 2, 512, 4, 2
        args.repeats, args.batch = 2, [1, 3]
    out = run(args)
    if args.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()
