"""Train a small Mixtral-style MoE on Shakespeare bytes, so quantization quality has a meaning.

The bit-nested expert work (``edge.moe.quant``, ``edge.moe.planes``, ``edge.moe.store``) is
judged by held-out perplexity, which needs a model that has actually learned something: a
randomly initialised MoE has perplexity ~256 at every precision. This module trains one with a
plain AdamW loop on the byte tokenizer (vocabulary 256) in a few minutes on two CPU cores.

Routers are trained with the Switch/Mixtral load-balancing loss (Fedus et al. 2021, eq. 4):
``aux = E * sum_e f_e * P_e`` where ``f_e`` is the fraction of routed slots that went to expert
``e`` and ``P_e`` the mean router probability of ``e``. Without it a few experts take almost
every token, which would make expert caching look easier than it is on real MoE checkpoints.

The corpus is ``MoETrainConfig.data``; the presets default to the Shakespeare sample packaged in
``lowband/data/``, so a clone reproduces the same model (a larger text is passed explicitly).

``python -m edge.moe.train --out DIR [--preset bench|tiny] [--steps N] [--data TEXT]``
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from lowband import SAMPLE_TEXT
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, init_weights
from lowband.models.tokenizer import ByteTokenizer
from lowband.models.weights import save_pretrained

logger = logging.getLogger(__name__)

TRAIN_LOG = "train_log.json"


@dataclass(frozen=True, kw_only=True)
class MoETrainConfig:
    """A training run. Symbols: B batch, T sequence length, E experts, k experts per token."""

    model: ModelConfig
    data: Path  # UTF-8 text; the last ``heldout_frac`` is never trained on
    out_dir: Path
    steps: int = 600
    batch_size: int = 16  # B
    seq_len: int = 128  # T
    lr: float = 3e-3  # peak AdamW learning rate, cosine-decayed to lr/10
    warmup: int = 30
    weight_decay: float = 0.1
    aux_coef: float = 0.01  # weight of the load-balancing loss (Mixtral uses 0.02, Switch 0.01)
    grad_clip: float = 1.0
    heldout_frac: float = 0.05
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.model.is_moe:
            raise ConfigError(
                "model", "num_local_experts must be > 0: this trainer is for MoE models"
            )
        if self.model.vocab_size != 256:
            raise ConfigError(
                "model.vocab_size", f"must be 256 (byte tokenizer), got {self.model.vocab_size}"
            )
        for name in ("steps", "batch_size", "seq_len"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if not 0.0 < self.heldout_frac < 0.5:
            raise ConfigError("heldout_frac", f"must be in (0, 0.5), got {self.heldout_frac}")
        if self.lr <= 0 or self.aux_coef < 0 or self.warmup < 0:
            raise ConfigError("lr", "lr must be > 0, aux_coef and warmup >= 0")


def bench_model() -> ModelConfig:
    """The MoE the benchmark serves: 4 layers, 32 experts (top-2) of 128->512->128.

    Experts hold 25.2M of the 25.5M parameters, as in real MoEs where experts dominate memory.
    """
    return ModelConfig(
        model_type="mixtral",
        vocab_size=256,
        hidden_size=128,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=32,
        num_experts_per_tok=2,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
    )


def tiny_model() -> ModelConfig:
    """A model small enough for unit tests (trains in seconds)."""
    return ModelConfig(
        model_type="mixtral",
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=512,
    )


def bench_preset(out_dir: Path, data: Path = SAMPLE_TEXT) -> MoETrainConfig:
    return MoETrainConfig(
        model=bench_model(),
        data=data,
        out_dir=out_dir,
        steps=600,
        batch_size=16,
        seq_len=128,
    )


def tiny_preset(out_dir: Path, data: Path = SAMPLE_TEXT) -> MoETrainConfig:
    return MoETrainConfig(
        model=tiny_model(),
        data=data,
        out_dir=out_dir,
        steps=40,
        batch_size=8,
        seq_len=64,
        warmup=5,
    )


def load_splits(path: Path, heldout_frac: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Byte tokens of ``path`` split into (train, held-out); held-out is the contiguous tail."""
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise ConfigError("data", f"no text file at {path}") from None
    ids = torch.frombuffer(bytearray(raw), dtype=torch.uint8).long()
    cut = int(len(ids) * (1 - heldout_frac))
    if cut < 1024 or len(ids) - cut < 1024:
        raise ConfigError("data", f"{path} is too small ({len(ids)} bytes) to split")
    return ids[:cut], ids[cut:]


def balance_loss(logits: list[torch.Tensor], top_k: int) -> torch.Tensor:
    """Switch-style load-balancing loss averaged over layers; logits: per layer (N, E)."""
    total = logits[0].new_zeros(())
    for lg in logits:
        probs = F.softmax(lg, dim=-1, dtype=torch.float32)  # (N, E)
        chosen = torch.topk(probs, top_k, dim=-1).indices  # (N, k)
        n_exp = probs.shape[-1]
        frac = F.one_hot(chosen, n_exp).float().sum(dim=(0, 1)) / chosen.numel()  # f_e
        total = total + n_exp * (frac * probs.mean(dim=0)).sum()
    return total / len(logits)


@torch.no_grad()
def heldout_ppl(
    model: LlamaForCausalLM,
    heldout: torch.Tensor,
    *,
    seq_len: int = 256,
    max_tokens: int = 32768,
    batch_size: int = 16,
) -> float:
    """exp(mean next-byte NLL) over non-overlapping windows of the held-out tail."""
    n_win = min(max_tokens, len(heldout) - 1) // seq_len
    if n_win < 1:
        raise ConfigError("heldout", f"needs more than {seq_len} tokens, got {len(heldout)}")
    windows = heldout[: n_win * seq_len + 1]
    nll, count = 0.0, 0
    for s in range(0, n_win, batch_size):
        rows = range(s, min(n_win, s + batch_size))
        x = torch.stack([windows[r * seq_len : (r + 1) * seq_len] for r in rows])
        y = torch.stack([windows[r * seq_len + 1 : (r + 1) * seq_len + 1] for r in rows])
        logits = model(x)
        nll += F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), y.reshape(-1), reduction="sum"
        ).item()
        count += y.numel()
    return math.exp(nll / count)


def _lr_at(step: int, cfg: MoETrainConfig) -> float:
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(cfg: MoETrainConfig) -> Path:
    """Train, save a HF-layout checkpoint (+ byte tokenizer + train_log.json) in ``cfg.out_dir``."""
    torch.manual_seed(cfg.seed)
    train_ids, heldout = load_splits(cfg.data, cfg.heldout_frac)
    model = LlamaForCausalLM(cfg.model)
    init_weights(model, seed=cfg.seed)
    router_logits: list[torch.Tensor] = []
    hooks = [
        layer.block_sparse_moe.gate.register_forward_hook(
            lambda _m, _i, out: router_logits.append(out)
        )
        for layer in model.model.layers
    ]
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": cfg.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    t0, losses = time.perf_counter(), []
    model.train()
    for step in range(cfg.steps):
        starts = torch.randint(
            0, len(train_ids) - cfg.seq_len - 1, (cfg.batch_size,), generator=gen
        )
        x = torch.stack([train_ids[s : s + cfg.seq_len] for s in starts.tolist()])
        y = torch.stack([train_ids[s + 1 : s + cfg.seq_len + 1] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = _lr_at(step, cfg)
        router_logits.clear()
        logits = model(x)
        lm = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
        loss = lm + cfg.aux_coef * balance_loss(router_logits, cfg.model.num_experts_per_tok)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
        opt.step()
        losses.append(lm.item())
        if step % 25 == 0 or step == cfg.steps - 1:
            logger.info(
                "step %d/%d loss %.3f (%.1fs)", step, cfg.steps, lm.item(), time.perf_counter() - t0
            )
    for h in hooks:
        h.remove()
    model.eval()
    train_s = time.perf_counter() - t0
    ppl = heldout_ppl(model, heldout)
    out = save_pretrained(model, cfg.out_dir)
    ByteTokenizer().save(out)
    log = {
        "steps": cfg.steps,
        "tokens": cfg.steps * cfg.batch_size * cfg.seq_len,
        "train_s": round(train_s, 1),
        "final_loss": sum(losses[-20:]) / len(losses[-20:]),
        "heldout_ppl": ppl,
        "data": str(cfg.data),
        "heldout_frac": cfg.heldout_frac,
        "config": {k: v for k, v in asdict(cfg).items() if k not in ("model", "data", "out_dir")},
    }
    (out / TRAIN_LOG).write_text(json.dumps(log, indent=2))
    logger.info("trained in %.0fs: loss %.3f, held-out ppl %.3f", train_s, log["final_loss"], ppl)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m edge.moe.train", description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, required=True, help="checkpoint directory to write")
    p.add_argument("--preset", choices=("bench", "tiny"), default="bench")
    p.add_argument("--steps", type=int, default=None, help="override the preset's step count")
    p.add_argument(
        "--data",
        type=Path,
        default=SAMPLE_TEXT,
        help="UTF-8 text to train on (default: the packaged Shakespeare sample)",
    )
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    # Router probabilities of unchosen experts underflow into float32 denormals, which make
    # x86 backward passes many times slower; flushing them to zero changes no result that matters.
    torch.set_flush_denormal(True)
    cfg = (bench_preset if args.preset == "bench" else tiny_preset)(args.out, args.data)
    if args.steps is not None:
        cfg = replace(cfg, steps=args.steps)
    out = train(cfg)
    print(json.dumps(json.loads((out / TRAIN_LOG).read_text())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
