"""Does tensor parallelism give the one-device answer on a GGUF file?
``python -m benchmarks.edge_tp_agreement --gguf FILE --json`` (last line of output is JSON).

Both arms run in this process: one device (``load_gguf``), and ``--world`` ranks as threads on
the loopback communicator (``load_gguf_shard`` + ``edge.tp.make_reduce``: the slices and
reduce points of ``lowband edge run --devices N``; the real transport's float32 star sum adds
the same partials). Each arm runs the compiled step where it installs (``--eager``: the eager
layers), teacher-forced over ``--len`` token ids, and reports:

* ``top1_vs_1dev``: the fraction of positions whose next-token argmax under TP equals one
  device's (TP's argmax is the vocabulary-parallel head's exact top-1 gather, as greedy
  ``edge run`` picks it);
* ``hidden_bit_equal``: the fraction of positions whose final hidden state (after the last
  all-reduce) has the same bits as one device's, and ``hidden_max_abs_diff``;
* ``greedy_equal``: for ``--prompts`` random prompts, whether ``--tokens`` greedy tokens
  decoded one at a time through the KV cache are the same.

``--no-split`` turns the split-K tree off on both arms (what the runtime computed before it);
``--speed`` instead times one device with and without the tree (decode ms/token, a
``--prefill-len`` prompt), alternating, ``--repeats`` rounds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch


def _ids(vocab: int, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(x) for x in rng.integers(3, min(vocab, 100_000), n)]


def _arm(model, plan, rank: int, reduce, ids: list[int], a) -> dict | None:
    """Teacher-forced hidden states and argmaxes of one rank (rank 0's returned), then greedy
    continuations of the prompts."""
    from edge import fastpath
    from edge.tp import exact_reduce, gather_logits

    if not a.eager:
        why = fastpath.install(model)
        if why is not None:
            raise RuntimeError(f"the compiled step does not install: {why}")
    V = model.config.vocab_size
    split = plan is not None and plan.vocab_split

    def top1(h: torch.Tensor) -> list[tuple[int, float]]:
        """(argmax, max) per row of h (1, T, H): the whole head, or the split head's gather."""
        rows = []
        for t in range(h.shape[1]):
            if not split:
                if rank != 0:
                    rows.append((0, 0.0))
                    continue
                lg = model.head(h[:, t : t + 1])[0, 0].float()
            else:
                lo, hi = plan.vocab_rows(rank, V)
                local = model.head(h[:, t : t + 1])[0, 0] if hi > lo else None
                lg = gather_logits(local, plan, rank, V, 1, exact_reduce(reduce))
                if rank != 0:
                    continue
            i = int(torch.argmax(lg))
            rows.append((i, float(lg[i])))
        return rows

    embed = model.embed if rank == 0 else None
    with torch.inference_mode():
        x = embed(torch.tensor([ids])) if embed is not None else None
        x = _bcast(x, rank, reduce, (1, len(ids), model.config.hidden_size))
        cache = model.new_cache() if not a.eager else None
        h = model.forward_layers(x, cache=cache, start=0)
        tf = top1(h)
        greedy = []
        for p in range(a.prompts):
            prompt = _ids(V, a.prompt_len, a.seed + 100 + p)
            cache = model.new_cache()
            xp = _bcast(
                embed(torch.tensor([prompt])) if embed is not None else None,
                rank,
                reduce,
                (1, len(prompt), model.config.hidden_size),
            )
            hp = model.forward_layers(xp, cache=cache, start=0)
            first = top1(hp[:, -1:])  # every rank: the split head's gather is a collective
            tok, pos, out = first[0][0] if rank == 0 else 0, len(prompt), []
            for _ in range(a.tokens):
                out.append(tok)
                xt = _bcast(
                    embed(torch.tensor([[tok]])) if embed is not None else None,
                    rank,
                    reduce,
                    (1, 1, model.config.hidden_size),
                )
                ht = model.forward_layers(xt, cache=cache, start=pos)
                pos += 1
                step = top1(ht)
                tok = step[0][0] if rank == 0 else 0
            greedy.append(out)
    if rank != 0:
        return None
    return {"hidden": h[0].float().clone(), "top1": tf, "greedy": greedy}


def _bcast(x: torch.Tensor | None, rank: int, reduce, shape: tuple[int, ...]) -> torch.Tensor:
    """Rank 0's embedded rows to every rank: a float32 sum where the others add zeros (exact)."""
    if reduce is None:
        assert x is not None
        return x
    from edge.tp import exact_reduce

    buf = x.float().contiguous() if rank == 0 and x is not None else torch.zeros(shape)
    return exact_reduce(reduce)(buf)


def _unsplit(model, a):
    """With ``--no-split``: every matrix unsplit (``split_k(0)``), the arithmetic before the
    split-K tree (each rank then adds its columns in its kernel's own order)."""
    if getattr(a, "no_split", False):
        from edge.quant.linear import GGMLLinear

        for m in model.modules():
            if isinstance(m, GGMLLinear):
                m.split_k(0)
    return model


def measure(a) -> dict:
    from edge.formats.gguf import load_gguf, load_gguf_shard
    from edge.tp import make_reduce
    from transport.loopback import LoopbackGroup, run_ranks

    one = _unsplit(load_gguf(a.gguf), a)
    ids = _ids(one.config.vocab_size, a.len, a.seed)
    t0 = time.perf_counter()
    ref = _arm(one, None, 0, None, ids, a)
    del one
    comms = LoopbackGroup(a.world, timeout=a.timeout).comms()

    def rank_fn(r: int):
        def body():
            reduce = make_reduce(comms[r], timeout=a.timeout)
            model, plan = load_gguf_shard(a.gguf, r, a.world, reduce=reduce)
            return _arm(_unsplit(model, a), plan, r, reduce, ids, a)

        return body

    got = run_ranks([rank_fn(r) for r in range(a.world)], a.timeout)[0]
    h1, h2 = ref["hidden"], got["hidden"]
    bit_rows = (h1.view(torch.int32) == h2.view(torch.int32)).all(-1)
    top = [p[0] == q[0] for p, q in zip(ref["top1"], got["top1"])]
    return {
        "bench": "edge_tp_agreement",
        "file": Path(a.gguf).name,
        "world": a.world,
        "path": "eager" if a.eager else "compiled",
        "split_k": not getattr(a, "no_split", False),
        "positions": len(ids),
        "top1_vs_1dev": round(sum(top) / len(top), 4),
        "first_top1_diff": next((i for i, t in enumerate(top) if not t), None),
        "max_logit_abs_diff": max(abs(p[1] - q[1]) for p, q in zip(ref["top1"], got["top1"])),
        "hidden_bit_equal": round(float(bit_rows.float().mean()), 4),
        "hidden_max_abs_diff": float((h1 - h2).abs().max()),
        "greedy_equal": [p == q for p, q in zip(ref["greedy"], got["greedy"])],
        "greedy_tokens": a.tokens,
        "seconds": round(time.perf_counter() - t0, 1),
    }


def speed(a) -> dict:
    """One device's decode and prompt with the split-K tree (as loaded) and without it
    (``split_k(0)`` on every matrix), the compiled step re-installed for each, alternating,
    ``--repeats`` rounds on ``--threads`` threads: what bit-exact TP costs a single device."""
    from edge import fastpath
    from edge.formats.gguf import load_gguf
    from edge.quant.linear import GGMLLinear
    from edge.tp import split_row_parallel

    torch.set_num_threads(a.threads)
    model = load_gguf(a.gguf)
    prompt = _ids(model.config.vocab_size, a.prompt_len, a.seed)
    long = _ids(model.config.vocab_size, a.prefill_len, a.seed + 1)

    def arm(split: bool) -> tuple[float, float]:
        if split:
            split_row_parallel(model)
        else:
            for m in model.modules():
                if isinstance(m, GGMLLinear):
                    m.split_k(0)
        why = fastpath.install(model)
        if why is not None:
            raise RuntimeError(f"the compiled step does not install: {why}")
        with torch.inference_mode():
            cache = model.new_cache()
            t0 = time.perf_counter()
            model.forward_layers(model.embed(torch.tensor([long])), cache=cache, start=0)
            prefill = time.perf_counter() - t0
            cache = model.new_cache()
            logits = model(torch.tensor([prompt]), cache=cache)
            tok, pos, times = int(logits[0, -1].argmax()), len(prompt), []
            for _ in range(a.tokens):
                t = time.perf_counter()
                logits = model(torch.tensor([[tok]]), cache=cache, start=pos)
                times.append(time.perf_counter() - t)
                tok, pos = int(logits[0, -1].argmax()), pos + 1
        return 1e3 * sorted(times)[len(times) // 2], 1e3 * prefill

    runs: dict[str, list[tuple[float, float]]] = {"split": [], "unsplit": []}
    for i in range(a.repeats):
        for name in ("split", "unsplit") if i % 2 == 0 else ("unsplit", "split"):
            runs[name].append(arm(name == "split"))

    def stats(xs: list[float]) -> dict:
        xs = sorted(xs)
        return {
            "median": round(xs[len(xs) // 2], 3),
            "min": round(xs[0], 3),
            "max": round(xs[-1], 3),
        }

    return {
        "bench": "edge_tp_agreement.speed",
        "file": Path(a.gguf).name,
        "threads": a.threads,
        "repeats": a.repeats,
        "tokens": a.tokens,
        "decode_ms_per_token": {k: stats([r[0] for r in v]) for k, v in runs.items()},
        "prefill_ms": {k: stats([r[1] for r in v]) for k, v in runs.items()},
        "prefill_len": a.prefill_len,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m benchmarks.edge_tp_agreement", description=__doc__.split("\n")[0]
    )
    p.add_argument("--gguf", required=True)
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--len", type=int, default=1000, help="teacher-forced positions")
    p.add_argument("--prompts", type=int, default=5)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eager", action="store_true", help="the eager layers, not the compiled step")
    p.add_argument(
        "--no-split",
        action="store_true",
        help="no split-K tree on either arm (the arithmetic before bit-exact TP)",
    )
    p.add_argument("--timeout", type=float, default=1800.0)
    p.add_argument(
        "--speed",
        action="store_true",
        help="instead: one device's decode/prefill with and without the split-K tree",
    )
    p.add_argument("--threads", type=int, default=1, help="with --speed")
    p.add_argument("--repeats", type=int, default=5, help="with --speed")
    p.add_argument("--prefill-len", type=int, default=512, help="with --speed")
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    res = speed(a) if a.speed else measure(a)
    if not a.json:
        print(json.dumps(res, indent=2))
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
