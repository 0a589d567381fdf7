"""A target/draft pair trained here on the same corpus, for draft-model speculative decoding.

Both are byte-level Llamas (vocabulary 256, ``diloco.config.byte_llama``) trained by lowband's
own trainer (``diloco.launch.run_threads``, one worker, DDP mode: plain AdamW steps) on the
embedded Shakespeare sample, the default corpus of ``lowband train``; the target is the larger,
the draft several times smaller in parameters and FLOPs per token. Each is exported as an F32
GGUF (``edge.formats.gguf.export_gguf``: placeholder token names, callers feed token ids) and,
where llama.cpp's quantizer is installed, as its Q4_K_M, so llama-server's ``-md`` runs the same
files. The recipe is fixed (seed, steps, shapes), so the files are a pure function of it and are
built once under ``CACHE/<name>-<recipe hash>/`` (``build_pair``; the ``.ok`` marker is written
last). Random weights say nothing about acceptance: two models trained on the same text agree
where the text is predictable, which is what a draft model is for.

    python -m benchmarks.spec_pair            # build (or find) the pair, print its paths as JSON
    python -m benchmarks.spec_pair --tiny     # a seconds-long recipe (the smoke test)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

CACHE = Path.home() / ".cache/lowband/bench"

# shapes (hidden, layers, heads) and training (steps, batch, seq, lr, warmup) of each model
RECIPES: dict[str, dict] = {
    # target 10.8 M parameters (hidden 384, 6 layers), draft 0.46 M (hidden 128, 2 layers):
    # about 23x fewer FLOPs per token. Both see the same 160 batches (seq 128, batch 16: 2048
    # tokens a step, 0.33 M tokens, a third of the sample's training split) at the same lr;
    # sized to train in minutes on 2 CPU cores.
    "shakespeare-pair": dict(
        target=dict(hidden=384, layers=6, heads=6, steps=160, batch=16, seq=128, lr=4e-3),
        draft=dict(hidden=128, layers=2, heads=4, steps=160, batch=16, seq=128, lr=4e-3),
        max_positions=2048,
        seed=0,
    ),
    "tiny-pair": dict(
        target=dict(hidden=64, layers=2, heads=4, steps=20, batch=4, seq=64, lr=3e-3),
        draft=dict(hidden=32, layers=1, heads=2, steps=20, batch=4, seq=64, lr=3e-3),
        max_positions=1024,
        seed=0,
    ),
}


def recipe_key(name: str) -> str:
    """``name-<12 hex>``: the recipe's hash names its cache folder (a changed recipe rebuilds)."""
    blob = json.dumps(RECIPES[name], sort_keys=True).encode()
    return f"{name}-{hashlib.sha256(blob).hexdigest()[:12]}"


def _train_one(spec: dict, max_positions: int, seed: int, out: Path) -> dict:
    """Train one model of the pair with the library's trainer; its HF checkpoint is out/model."""
    from diloco.config import (
        DataConfig,
        DDPConfig,
        LrSchedule,
        OptimizerConfig,
        TrainConfig,
        byte_llama,
    )
    from diloco.launch import run_threads
    from lowband.models.llama import LlamaForCausalLM

    cfg = TrainConfig(
        model=byte_llama(spec["hidden"], spec["layers"], spec["heads"], seq_len=max_positions),
        data=DataConfig(seq_len=spec["seq"], batch_size=spec["batch"]),
        mode=DDPConfig(),
        inner=OptimizerConfig(name="adamw", lr=spec["lr"], weight_decay=0.1, betas=(0.9, 0.95)),
        lr_schedule=LrSchedule(warmup_steps=max(1, spec["steps"] // 10)),
        steps=spec["steps"],
        workers=1,
        seed=seed,
        eval_every=0,
        log_every=50,
    )
    t0 = time.perf_counter()
    res = run_threads(cfg, out_dir=out)
    return {
        "params": sum(p.numel() for p in LlamaForCausalLM(cfg.model).parameters()),
        "train_s": round(time.perf_counter() - t0, 1),
        "heldout_loss": None if res[0].final_eval is None else round(res[0].final_eval, 4),
        "steps": spec["steps"],
    }


def _q4_k_m(src: Path, dst: Path) -> bool:
    """llama.cpp's Q4_K_M of ``src``; False where llama-cpp-python is not installed."""
    try:
        import llama_cpp
    except ImportError:
        return False
    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M
    p.nthread = 2
    tmp = dst.with_suffix(".part")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p) != 0:
        raise RuntimeError(f"llama_model_quantize Q4_K_M of {src} failed")
    tmp.rename(dst)
    return True


def build_pair(name: str = "shakespeare-pair", cache: Path = CACHE) -> dict:
    """The pair's files (built if missing): ``{role: {"f32": path, "q4_k_m": path | None}}``
    for role ``target`` and ``draft``, and ``info`` (parameters, training time, held-out loss)."""
    import torch

    from edge.formats.gguf import export_gguf

    r = RECIPES[name]
    root = cache / recipe_key(name)
    ok = root / ".ok"
    if not ok.exists():
        root.mkdir(parents=True, exist_ok=True)
        info = {}
        threads = torch.get_num_threads()
        for role in ("target", "draft"):
            print(f"# training the {role} of {name}", file=sys.stderr, flush=True)
            info[role] = _train_one(r[role], r["max_positions"], r["seed"], root / role)
            f32 = export_gguf(root / role / "model", root / f"{role}-f32.gguf")
            _q4_k_m(f32, root / f"{role}-q4_k_m.gguf")
        info["threads"] = threads
        (root / "info.json").write_text(json.dumps(info, indent=1))
        ok.write_text("")
    out: dict = {"info": json.loads((root / "info.json").read_text()), "dir": str(root)}
    for role in ("target", "draft"):
        q = root / f"{role}-q4_k_m.gguf"
        out[role] = {
            "f32": str(root / f"{role}-f32.gguf"),
            "q4_k_m": str(q) if q.exists() else None,
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--cache", type=Path, default=CACHE)
    a = p.parse_args(argv)
    print(json.dumps(build_pair("tiny-pair" if a.tiny else "shakespeare-pair", a.cache)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
