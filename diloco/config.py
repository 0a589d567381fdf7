"""Configuration of a training run: frozen dataclasses, validated on construction, plus presets.

Every field that has a symbol in the papers names it: H (inner steps), P (fragments), τ (overlap
delay), α (merge weight), M (workers). References: DiLoCo (Douillard et al. 2023, arXiv
2311.08105) and Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512).

Invalid values raise :class:`lowband.errors.ConfigError` naming the field, so a bad command line
fails before any process starts. Presets are plain functions returning a :class:`TrainConfig`;
``dataclasses.replace`` derives variants.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Literal

import torch

from diloco.lora import DEFAULT_TARGETS, LoraConfig
from lowband.codecs import codec_names
from lowband.errors import ConfigError
from lowband.models.config import ModelConfig

OptimizerFactory = Callable[[Iterable[torch.nn.Parameter]], torch.optim.Optimizer]

OPTIMIZERS = ("adamw", "adam", "sgd")


@dataclass(frozen=True, kw_only=True)
class OptimizerConfig:
    """A torch optimizer by name (``adamw``, ``adam``, ``sgd``) or built by ``factory``.

    ``factory`` makes any ``torch.optim.Optimizer`` usable (it receives the parameters); the
    named fields then only describe it for logs and the run signature. The learning rate is
    scaled by the run's :class:`LrSchedule` where one applies (inner optimizer only).
    """

    name: str = "adamw"
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    momentum: float = 0.0
    nesterov: bool = False
    factory: OptimizerFactory | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.factory is None and self.name not in OPTIMIZERS:
            raise ConfigError(
                "optimizer.name",
                f"unknown optimizer {self.name!r}; one of {OPTIMIZERS}, or pass factory=",
            )
        if not self.lr > 0:
            raise ConfigError("optimizer.lr", f"must be > 0, got {self.lr}")
        if self.weight_decay < 0:
            raise ConfigError("optimizer.weight_decay", f"must be >= 0, got {self.weight_decay}")
        if not 0 <= self.momentum < 1:
            raise ConfigError("optimizer.momentum", f"must be in [0, 1), got {self.momentum}")
        if self.nesterov and self.momentum == 0:
            raise ConfigError("optimizer.nesterov", "Nesterov needs momentum > 0")

    def build(
        self, params: Iterable[torch.nn.Parameter], kernels: dict[str, bool] | None = None
    ) -> torch.optim.Optimizer:
        """``kernels``: torch's ``fused=`` / ``foreach=`` switch (``diloco.device``)."""
        if self.factory is not None:
            return self.factory(params)
        kw = kernels or {}
        if self.name == "sgd":
            return torch.optim.SGD(
                params,
                lr=self.lr,
                momentum=self.momentum,
                nesterov=self.nesterov,
                weight_decay=self.weight_decay,
                **kw,
            )
        cls = torch.optim.AdamW if self.name == "adamw" else torch.optim.Adam
        return cls(
            params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay, **kw
        )


@dataclass(frozen=True, kw_only=True)
class LrSchedule:
    """Inner learning-rate multiplier: linear warmup, then cosine (or constant) decay."""

    warmup_steps: int = 0
    decay: Literal["cosine", "constant"] = "cosine"
    min_ratio: float = 0.1  # final lr / peak lr for cosine

    def __post_init__(self) -> None:
        if self.warmup_steps < 0:
            raise ConfigError("lr_schedule.warmup_steps", f"must be >= 0, got {self.warmup_steps}")
        if self.decay not in ("cosine", "constant"):
            raise ConfigError(
                "lr_schedule.decay", f"must be 'cosine' or 'constant', got {self.decay!r}"
            )
        if not 0 <= self.min_ratio <= 1:
            raise ConfigError("lr_schedule.min_ratio", f"must be in [0, 1], got {self.min_ratio}")

    def factor(self, step: int, total: int) -> float:
        """Multiplier for inner step ``step`` (0-based) of ``total``. Pure."""
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        if self.decay == "constant" or total <= self.warmup_steps:
            return 1.0
        progress = min(1.0, (step - self.warmup_steps) / max(1, total - self.warmup_steps))
        return self.min_ratio + (1 - self.min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


DataKind = Literal["embedded", "text", "jsonl", "tokens"]
TOKEN_DTYPES = ("uint16", "uint32")


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where tokens come from and how batches are cut.

    ``kind``: ``embedded`` (the Shakespeare sample shipped in the package), ``text`` (a UTF-8 file
    or a directory of ``*.txt``), ``jsonl`` (a file or directory of ``*.jsonl``, one JSON object
    with a ``"text"`` field per line) or ``tokens`` (pre-tokenized shards as nanoGPT/torchtitan
    write them: ``*.bin`` raw little-endian ``token_dtype`` or ``*.npy`` arrays, memory-mapped).
    Text is byte-tokenized unless ``tokenizer`` names a Hugging Face ``tokenizer.json`` (or
    ``bpe:N``: a byte-level BPE of N tokens trained on the embedded sample's training split).

    Splits, in corpus order: ``[train | validation | test]``; the test split is the last
    ``test_fraction`` (0: none, as before), validation the ``eval_fraction`` before it.
    ``eval_split`` picks which one the run's evaluations report: tune on ``validation``, report
    on ``test``. ``slices`` > 0 gives data slot s its own disjoint part of the training split
    (slice s mod ``slices``), as sites that each hold their own data.
    """

    kind: DataKind = "embedded"
    path: str | None = None
    tokenizer: str | None = None  # tokenizer.json path or "bpe:N"; None: bytes (vocabulary 256)
    token_dtype: Literal["uint16", "uint32"] = "uint16"  # of *.bin shards
    seq_len: int = 64  # T: tokens per training sequence
    batch_size: int = 8  # B: sequences per worker per inner step
    eval_fraction: float = 0.1  # validation share of the corpus
    test_fraction: float = 0.0  # test share (the end of the corpus)
    eval_split: Literal["validation", "test"] = "validation"
    eval_batches: int = 8  # fixed held-out batches of batch_size sequences
    slices: int = 0  # disjoint training slices over the data slots (0: all share everything)

    def __post_init__(self) -> None:
        if self.kind not in ("embedded", "text", "jsonl", "tokens"):
            raise ConfigError(
                "data.kind", f"must be embedded, text, jsonl or tokens, got {self.kind!r}"
            )
        if self.token_dtype not in TOKEN_DTYPES:
            raise ConfigError(
                "data.token_dtype", f"one of {TOKEN_DTYPES}, got {self.token_dtype!r}"
            )
        if self.kind == "tokens" and self.tokenizer is not None:
            raise ConfigError("data.tokenizer", "pre-tokenized shards take no tokenizer")
        if self.tokenizer is not None and self.tokenizer.startswith("bpe:"):
            n = self.tokenizer[4:]
            if not n.isdigit() or not 256 < int(n) <= 65536:
                raise ConfigError("data.tokenizer", f"bpe:N needs 256 < N <= 65536, got {n!r}")
        if not 0 <= self.test_fraction < 1 or self.eval_fraction + self.test_fraction >= 1:
            raise ConfigError(
                "data.test_fraction",
                f"must be in [0, 1) with eval_fraction + "
                f"test_fraction < 1, got {self.test_fraction}",
            )
        if self.eval_split not in ("validation", "test"):
            raise ConfigError("data.eval_split", f"validation or test, got {self.eval_split!r}")
        if self.eval_split == "test" and self.test_fraction == 0:
            raise ConfigError("data.eval_split", "eval_split='test' needs test_fraction > 0")
        if self.slices < 0:
            raise ConfigError("data.slices", f"must be >= 0, got {self.slices}")
        if self.kind == "embedded" and self.path is not None:
            raise ConfigError("data.path", "the embedded corpus takes no path; use kind='text'")
        if self.kind != "embedded" and not self.path:
            raise ConfigError("data.path", f"kind={self.kind!r} needs a path")
        if self.seq_len < 1:
            raise ConfigError("data.seq_len", f"must be >= 1, got {self.seq_len}")
        if self.batch_size < 1:
            raise ConfigError("data.batch_size", f"must be >= 1, got {self.batch_size}")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError("data.eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")
        if self.eval_batches < 1:
            raise ConfigError("data.eval_batches", f"must be >= 1, got {self.eval_batches}")


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """A ``torch.profiler`` (Kineto) trace of ``steps`` inner steps after ``wait`` steps, with
    the SEND/APPLY work between them (ranges ``lowband.inner_step``, ``lowband.outer_step``,
    ``lowband.encode``, ``lowband.merge``): ``dir/trace-slot{slot}-step{first}.json``, opened
    in chrome://tracing or Perfetto. One worker per process is profiled (Kineto is one per
    process); choose ``steps`` ≥ H/P so that the window holds a fragment sync."""

    dir: str  # where the trace is written (created if missing)
    steps: int = 12  # inner steps recorded
    wait: int = 2  # steps run before recording starts (compilation, allocator warm-up)

    def __post_init__(self) -> None:
        if not self.dir:
            raise ConfigError("compute.profile.dir", "needs a directory")
        if self.steps < 1:
            raise ConfigError("compute.profile.steps", f"must be >= 1, got {self.steps}")
        if self.wait < 0:
            raise ConfigError("compute.profile.wait", f"must be >= 0, got {self.wait}")


PRECISIONS = ("fp32", "bf16", "fp16")
OPTIMIZER_IMPLS = ("auto", "fused", "foreach", "loop")


@dataclass(frozen=True, kw_only=True)
class ComputeConfig:
    """Where and how one worker computes (``diloco.device``). Sites of one run may differ here
    (a GPU site next to a CPU site): none of it enters the run signature.

    Master weights, inner moments, θ_g and the outer optimizer state are always float32;
    ``precision`` only sets the autocast dtype of forward and backward.
    """

    device: str = "auto"  # auto | cpu | cuda | cuda:N (auto: the first GPU if any)
    precision: Literal["fp32", "bf16", "fp16"] = "fp32"
    micro_batches: int = 1  # gradient accumulation: B is split into this many micro-batches
    # torch.compile the model's forward (static shapes); None: on for CUDA, off on the CPU
    compile: bool | None = None
    compile_backend: str = "inductor"  # torch.compile backend ("aot_eager": no codegen)
    activation_checkpointing: bool = False  # recompute block activations in backward
    optimizer_impl: Literal["auto", "fused", "foreach", "loop"] = "auto"  # torch kernels
    profile: ProfileConfig | None = None  # a Kineto trace of a few steps (None: no profiler)

    def __post_init__(self) -> None:
        dev = self.device
        if not (dev in ("auto", "cpu", "cuda") or (dev.startswith("cuda:") and dev[5:].isdigit())):
            raise ConfigError("compute.device", f"must be auto, cpu, cuda or cuda:N, got {dev!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError("compute.precision", f"one of {PRECISIONS}, got {self.precision!r}")
        if self.micro_batches < 1:
            raise ConfigError("compute.micro_batches", f"must be >= 1, got {self.micro_batches}")
        if not self.compile_backend:
            raise ConfigError("compute.compile_backend", "needs a torch.compile backend name")
        if self.optimizer_impl not in OPTIMIZER_IMPLS:
            raise ConfigError(
                "compute.optimizer_impl", f"one of {OPTIMIZER_IMPLS}, got {self.optimizer_impl!r}"
            )


def _nesterov() -> OptimizerConfig:
    return OptimizerConfig(name="sgd", lr=0.7, momentum=0.9, nesterov=True)


@dataclass(frozen=True, kw_only=True)
class DilocoConfig:
    """Streaming DiLoCo. ``n_fragments=1, tau=0, alpha=0`` is plain DiLoCo."""

    inner_steps: int = 50  # H: inner steps between two syncs of the same fragment
    n_fragments: int = 1  # P: fragment p syncs at steps ≡ p·H/P (mod H)
    tau: int = 0  # τ: a sync launched at step t is applied at t+τ (overlap); needs τ < H/P
    alpha: float = 0.0  # α: θ_local ← α·θ_local + (1−α)·θ_global after an outer step
    fragment_strategy: Literal["strided", "sequential"] = "strided"
    codec: str = "fp32"  # wire format of the pseudo-gradient (lowband.codecs name)
    error_feedback: bool = False  # carry each fragment's quantization residual to its next sync
    outer: OptimizerConfig = field(default_factory=_nesterov)  # SGD Nesterov lr 0.7, μ 0.9
    algorithm: Literal["auto", "ring", "star"] = "auto"  # all-reduce schedule of the syncs

    def __post_init__(self) -> None:
        if self.inner_steps < 1:
            raise ConfigError("inner_steps", f"H must be >= 1, got {self.inner_steps}")
        if self.n_fragments < 1:
            raise ConfigError("n_fragments", f"P must be >= 1, got {self.n_fragments}")
        if self.inner_steps % self.n_fragments:
            raise ConfigError(
                "n_fragments",
                f"P={self.n_fragments} must divide "
                f"inner_steps H={self.inner_steps} (fragments sync every H/P steps)",
            )
        if not 0 <= self.tau < self.inner_steps // self.n_fragments:
            raise ConfigError(
                "tau",
                f"τ={self.tau} must be in [0, H/P) = "
                f"[0, {self.inner_steps // self.n_fragments}): at most one fragment "
                "sync may be in flight",
            )
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError("alpha", f"α must be in [0, 1], got {self.alpha}")
        if self.fragment_strategy not in ("strided", "sequential"):
            raise ConfigError(
                "fragment_strategy",
                f"must be 'strided' or 'sequential', got {self.fragment_strategy!r}",
            )
        if self.codec not in codec_names():
            raise ConfigError("codec", f"unknown codec {self.codec!r}; one of {codec_names()}")
        if self.algorithm not in ("auto", "ring", "star"):
            raise ConfigError("algorithm", f"must be auto, ring or star, got {self.algorithm!r}")

    @property
    def stride(self) -> int:
        """H/P: steps between two consecutive fragment syncs."""
        return self.inner_steps // self.n_fragments


@dataclass(frozen=True, kw_only=True)
class DDPConfig:
    """Data-parallel baseline: gradients all-reduced (averaged) after every step."""

    codec: str = "fp32"  # wire format of the gradients

    def __post_init__(self) -> None:
        if self.codec not in codec_names():
            raise ConfigError("codec", f"unknown codec {self.codec!r}; one of {codec_names()}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run, identical on every worker.

    ``model`` is the shape of the default task's Llama-family model; a custom
    :class:`diloco.task.Task` brings its own ``nn.Module`` and may leave it ``None``.
    """

    model: ModelConfig | None = None
    hf_model: str | None = None  # a Hugging Face config.json or checkpoint dir (instead of model)
    # A GGUF file whose weights (dequantized to fp32) and tokenizer the run starts from, read by
    # the ``Pretrained`` reader the composition root hands the task (instead of model).
    gguf_model: str | None = None
    data: DataConfig = field(default_factory=DataConfig)
    compute: ComputeConfig = field(default_factory=ComputeConfig)
    mode: DilocoConfig | DDPConfig = field(default_factory=DilocoConfig)
    inner: OptimizerConfig = field(
        default_factory=lambda: OptimizerConfig(
            name="adamw", lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95)
        )
    )
    lr_schedule: LrSchedule = field(default_factory=LrSchedule)
    steps: int = 1000  # T: inner steps per worker (DDP: optimizer steps)
    workers: int = 2  # M: workers the run waits for before starting
    seed: int = 0
    grad_clip: float | None = 1.0
    eval_every: int = 100  # steps between evaluations of the global model (0: only at the end)
    audit_every: int = 4  # outer syncs between state-hash audits across workers (0: never)
    checkpoint_every: int = 0  # steps between checkpoints (0: only the final one)
    log_every: int = 10  # steps between per-step JSONL records
    sync_timeout: float = 60.0  # seconds one collective may take before TransportTimeout
    # Seconds a worker lost near the end has to come back before the others finish without it
    # (then it receives the final state instead of finishing apart); 0: nobody waits.
    final_grace: float = 30.0
    # LoRA: only low-rank adapters train and sync (DiLoCo only); None: every parameter.
    lora: LoraConfig | None = None

    def __post_init__(self) -> None:
        if self.lora is not None and not isinstance(self.mode, DilocoConfig):
            raise ConfigError("lora", "LoRA adapters train under Streaming DiLoCo (mode diloco)")
        if self.steps < 1:
            raise ConfigError("steps", f"must be >= 1, got {self.steps}")
        if self.workers < 1:
            raise ConfigError("workers", f"M must be >= 1, got {self.workers}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError("grad_clip", f"must be > 0 or None, got {self.grad_clip}")
        for name in ("eval_every", "audit_every", "checkpoint_every"):
            if getattr(self, name) < 0:
                raise ConfigError(name, f"must be >= 0, got {getattr(self, name)}")
        if self.log_every < 1:
            raise ConfigError("log_every", f"must be >= 1, got {self.log_every}")
        if not self.sync_timeout > 0:
            raise ConfigError("sync_timeout", f"must be > 0 seconds, got {self.sync_timeout}")
        if not 0 <= self.final_grace <= 86400:
            raise ConfigError("final_grace", f"must be in [0, 86400] s, got {self.final_grace}")
        if self.data.batch_size % self.compute.micro_batches:
            raise ConfigError(
                "compute.micro_batches",
                f"{self.compute.micro_batches} must divide data.batch_size {self.data.batch_size}",
            )
        if self.hf_model is not None and self.model is not None:
            raise ConfigError(
                "hf_model", "give either a lowband ModelConfig or a Hugging Face model, not both"
            )
        if self.gguf_model is not None and (self.model is not None or self.hf_model is not None):
            raise ConfigError(
                "gguf_model", "a GGUF file brings its own model: give no ModelConfig or hf_model"
            )
        if self.model is not None and self.data.seq_len > self.model.max_position_embeddings:
            raise ConfigError(
                "data.seq_len",
                f"{self.data.seq_len} exceeds the model's "
                f"max_position_embeddings {self.model.max_position_embeddings}",
            )

    def tokens_per_step(self) -> int:
        """Tokens one worker consumes per inner step."""
        return self.data.batch_size * self.data.seq_len


# ---- JSON: how the launcher hands one configuration to every worker process -----------------
def _plain(obj: Any) -> dict:
    out = {}
    for f in fields(obj):
        if f.name == "factory":
            if getattr(obj, "factory") is not None:
                raise ConfigError(
                    "optimizer.factory",
                    "a factory callable cannot be written to "
                    "JSON; build the workers in Python to use one",
                )
            continue
        value = getattr(obj, f.name)
        if isinstance(value, ProfileConfig):
            value = _plain(value)
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out


_NESTED = ("model", "data", "mode", "inner", "lr_schedule", "compute", "lora")


def config_to_dict(cfg: TrainConfig) -> dict:
    """A JSON-able description of ``cfg`` (inverse: :func:`config_from_dict`)."""
    mode = cfg.mode
    mode_d = (
        {"kind": "diloco", **_plain(mode), "outer": _plain(mode.outer)}
        if isinstance(mode, DilocoConfig)
        else {"kind": "ddp", **_plain(mode)}
    )
    return {
        "model": _plain(cfg.model) if cfg.model is not None else None,
        "data": _plain(cfg.data),
        "mode": mode_d,
        "inner": _plain(cfg.inner),
        "lr_schedule": _plain(cfg.lr_schedule),
        "compute": _plain(cfg.compute),
        "lora": _plain(cfg.lora) if cfg.lora is not None else None,
        **{f.name: getattr(cfg, f.name) for f in fields(cfg) if f.name not in _NESTED},
    }


def _optim(d: dict) -> OptimizerConfig:
    d = dict(d)
    if "betas" in d:
        d["betas"] = tuple(d["betas"])
    return OptimizerConfig(**d)


def _compute(d: dict) -> ComputeConfig:
    d = dict(d)
    if d.get("profile") is not None:
        d["profile"] = ProfileConfig(**d["profile"])
    return ComputeConfig(**d)


def _lora(d: dict | None) -> LoraConfig | None:
    if d is None:
        return None
    return LoraConfig(**{**d, "targets": tuple(d.get("targets", DEFAULT_TARGETS))})


def config_from_dict(d: dict) -> TrainConfig:
    try:
        mode_d = dict(d["mode"])
        kind = mode_d.pop("kind")
        if kind == "diloco":
            mode: DilocoConfig | DDPConfig = DilocoConfig(
                **{**mode_d, "outer": _optim(mode_d["outer"])}
            )
        elif kind == "ddp":
            mode = DDPConfig(**mode_d)
        else:
            raise ConfigError("mode.kind", f"must be 'diloco' or 'ddp', got {kind!r}")
        rest = {k: v for k, v in d.items() if k not in _NESTED}
        return TrainConfig(
            model=ModelConfig(**d["model"]) if d.get("model") else None,
            data=DataConfig(**d["data"]),
            mode=mode,
            inner=_optim(d["inner"]),
            lr_schedule=LrSchedule(**d["lr_schedule"]),
            compute=_compute(d.get("compute", {})),
            lora=_lora(d.get("lora")),
            **rest,
        )
    except (KeyError, TypeError) as exc:
        raise ConfigError("config", f"not a lowband training configuration: {exc}") from None


# ---- overrides: the command line's flat names onto the nested configuration ----------------
_MODE_KEYS = {
    "inner_steps",
    "n_fragments",
    "tau",
    "alpha",
    "codec",
    "error_feedback",
    "fragment_strategy",
    "algorithm",
}
_TOP_KEYS = {
    "steps",
    "workers",
    "seed",
    "eval_every",
    "checkpoint_every",
    "audit_every",
    "log_every",
    "sync_timeout",
    "final_grace",
    "grad_clip",
}
_DATA_KEYS = {
    "batch_size",
    "seq_len",
    "eval_batches",
    "tokenizer",
    "token_dtype",
    "test_fraction",
    "eval_split",
    "slices",
}
_COMPUTE_KEYS = {
    "device",
    "precision",
    "micro_batches",
    "compile",
    "compile_backend",
    "profile",
    "activation_checkpointing",
    "optimizer_impl",
}


def with_overrides(cfg: TrainConfig, **changes: object) -> TrainConfig:
    """``cfg`` with flat overrides applied (None values are ignored). Keys: the fields of
    TrainConfig listed in ``_TOP_KEYS``, DilocoConfig's fields, DataConfig's batch fields, and
    ``mode`` ("diloco"/"ddp"), ``outer_lr``, ``outer_momentum``, ``inner_lr``, ``warmup_steps``,
    ``data_kind``, ``data_path``, ComputeConfig's fields, ``hf_model`` (a path: the run
    trains that Hugging Face model instead of the preset's) and ``lora_rank`` (LoRA of rank r).
    Every result is validated like any config."""
    # Values are checked by the dataclasses' __post_init__ when replaced in below.
    ch: dict[str, Any] = {k: v for k, v in changes.items() if v is not None}
    unknown = (
        set(ch)
        - _MODE_KEYS
        - _TOP_KEYS
        - _DATA_KEYS
        - _COMPUTE_KEYS
        - {
            "mode",
            "outer_lr",
            "outer_momentum",
            "inner_lr",
            "warmup_steps",
            "data_kind",
            "data_path",
            "hf_model",
            "gguf_model",
            "lora_rank",
        }
    )
    if unknown:
        raise ConfigError(sorted(unknown)[0], "unknown override")
    mode = cfg.mode
    if ch.get("mode") == "ddp":
        mode = DDPConfig(codec=str(ch.get("codec", "fp32")))
    elif ch.get("mode") == "diloco" and not isinstance(mode, DilocoConfig):
        mode = DilocoConfig()
    elif ch.get("mode") not in (None, "diloco", "ddp"):
        raise ConfigError("mode", f"must be 'diloco' or 'ddp', got {ch['mode']!r}")
    if isinstance(mode, DilocoConfig):
        outer = mode.outer
        if "outer_lr" in ch or "outer_momentum" in ch:
            momentum = float(ch.get("outer_momentum", outer.momentum))
            outer = replace(
                outer,
                lr=float(ch.get("outer_lr", outer.lr)),
                momentum=momentum,
                nesterov=outer.nesterov and momentum > 0,
            )
        mode = replace(mode, outer=outer, **{k: ch[k] for k in _MODE_KEYS if k in ch})
    elif "codec" in ch:
        mode = DDPConfig(codec=str(ch["codec"]))
    data = cfg.data
    if "data_kind" in ch or "data_path" in ch:
        data = replace(data, kind=ch.get("data_kind", "text"), path=ch.get("data_path"))
    data = replace(data, **{k: ch[k] for k in _DATA_KEYS if k in ch})
    inner = replace(cfg.inner, lr=float(ch["inner_lr"])) if "inner_lr" in ch else cfg.inner
    sched = (
        replace(cfg.lr_schedule, warmup_steps=int(ch["warmup_steps"]))
        if "warmup_steps" in ch
        else cfg.lr_schedule
    )
    compute = replace(cfg.compute, **{k: ch[k] for k in _COMPUTE_KEYS if k in ch})
    model = cfg.model
    hf = cfg.hf_model
    gguf = cfg.gguf_model
    if "hf_model" in ch:
        model, hf, gguf = None, str(ch["hf_model"]), None
    if "gguf_model" in ch:
        model, hf, gguf = None, None, str(ch["gguf_model"])
    return replace(
        cfg,
        mode=mode,
        data=data,
        inner=inner,
        lr_schedule=sched,
        compute=compute,
        model=model,
        hf_model=hf,
        gguf_model=gguf,
        lora=LoraConfig(rank=int(ch["lora_rank"])) if "lora_rank" in ch else cfg.lora,
        **{k: ch[k] for k in _TOP_KEYS if k in ch},
    )


# ---- presets -------------------------------------------------------------------------------
def byte_llama(
    hidden: int, layers: int, heads: int, *, seq_len: int = 256, vocab_size: int = 256
) -> ModelConfig:
    """A small Llama (SwiGLU, RMSNorm, RoPE), by default over the 256 byte vocabulary."""
    inter = int(8 * hidden / 3 + 7) // 8 * 8
    return ModelConfig(
        model_type="llama",
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def llama_350m(seq_len: int = 1024) -> ModelConfig:
    """The 368 M-parameter Llama of the H100 overhead figures (docs/benchmarks.md): hidden 1024,
    24 layers, 16 heads (no GQA), SwiGLU 2736, vocabulary 32000, untied head."""
    return byte_llama(1024, 24, 16, seq_len=seq_len, vocab_size=32000)


def llama_1b(seq_len: int = 2048) -> ModelConfig:
    """A 1.1 B-parameter Llama in TinyLlama's shape: hidden 2048, 22 layers, 32 query heads
    over 4 KV heads (GQA), SwiGLU 5632, vocabulary 32000, untied head (1,100,048,384 weights)."""
    return ModelConfig(
        model_type="llama",
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=seq_len,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
    )


def tiny() -> TrainConfig:
    """Seconds on a laptop: tests and smoke runs (~0.13 M parameters)."""
    return TrainConfig(
        model=byte_llama(64, 2, 4),
        data=DataConfig(seq_len=64, batch_size=8),
        mode=DilocoConfig(inner_steps=10, n_fragments=2),
        lr_schedule=LrSchedule(warmup_steps=10),
        steps=60,
        eval_every=20,
    )


def tuned_diloco(*, outer_lr: float) -> DilocoConfig:
    """The Streaming DiLoCo settings the presets share (H=60, P=3, τ=5, α=0.5, NF4 + error
    feedback, outer Nesterov μ 0.9); only the outer learning rate differs between them."""
    return DilocoConfig(
        inner_steps=60,
        n_fragments=3,
        tau=5,
        alpha=0.5,
        codec="nf4",
        error_feedback=True,
        outer=OptimizerConfig(name="sgd", lr=outer_lr, momentum=0.9, nesterov=True),
    )


def shakespeare() -> TrainConfig:
    """The default of ``lowband train``: Streaming DiLoCo on the embedded Shakespeare sample with
    the settings ``benchmarks.diloco`` tuned on the sample's *validation* split only (2 workers,
    H=60, P=3, τ=5, α=0.5, NF4 + error feedback, outer Nesterov lr 1.0 μ 0.9, inner AdamW 6e-3,
    3200 steps): ~0.13 M parameters, a few minutes on 2 CPU cores.

    Why these: H=60 with a 4-bit codec is what keeps ≥ 400× fewer bytes than DDP (int8 would
    need H ≥ 102); on validation, P ∈ {3, 6, 12}, τ ∈ {0, 2, 3, 5}, α, outer lr/μ and inner lr
    moved the loss by no more than the seed noise or made it worse, while doubling the budget
    from 1600 to 3200 steps cut the gap to DDP (at its best lr) from +3.0 % to +1.7 %
    (the validation-split trials: docs/training.md and benchmarks/results/)."""
    return TrainConfig(
        model=byte_llama(64, 2, 4),
        data=DataConfig(seq_len=64, batch_size=8, eval_batches=16),
        mode=tuned_diloco(outer_lr=1.0),
        inner=OptimizerConfig(name="adamw", lr=6e-3, weight_decay=0.1),
        lr_schedule=LrSchedule(warmup_steps=60),
        steps=3200,
        workers=2,
        eval_every=400,
    )


def wide() -> TrainConfig:
    """A larger byte-level Llama (~0.4 M parameters): slower, better samples."""
    return replace(
        shakespeare(),
        model=byte_llama(96, 3, 4),
        inner=OptimizerConfig(name="adamw", lr=3e-3, weight_decay=0.1),
    )


SCALE_VOCAB = 4096


def scale() -> TrainConfig:
    """A real experiment on 2 CPU cores in about 15 minutes (DDP and DiLoCo together, one seed:
    464 s + 435 s measured with ``benchmarks.diloco --scale``): a
    byte-level BPE of 4096 tokens trained here on the embedded sample, a 6.8 M-parameter Llama
    (hidden 256, 6 layers), M = 4 workers on disjoint slices, NF4 + error feedback, H = 60,
    P = 3, τ = 5. Splits train / validation (tuning) / test (reporting, 10 %). NF4, not int8:
    at H = 60 int8 (8.125 bits per value) sends ~236× fewer bytes than DDP, below the 400× goal;
    NF4 sends ~450×, and cost no measurable loss against fp32 on the small model."""
    return TrainConfig(
        model=byte_llama(256, 6, 8, seq_len=128, vocab_size=SCALE_VOCAB),
        data=DataConfig(
            tokenizer=f"bpe:{SCALE_VOCAB}",
            seq_len=128,
            batch_size=8,
            eval_fraction=0.1,
            test_fraction=0.1,
            eval_batches=16,
            slices=4,
        ),
        mode=tuned_diloco(outer_lr=0.9),
        inner=OptimizerConfig(name="adamw", lr=2e-3, weight_decay=0.1),
        lr_schedule=LrSchedule(warmup_steps=30),
        steps=360,
        workers=4,
        eval_every=120,
    )


PRESETS: dict[str, Callable[[], TrainConfig]] = {
    "tiny": tiny,
    "shakespeare": shakespeare,
    "wide": wide,
    "scale": scale,
}


def preset(name: str) -> TrainConfig:
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError("preset", f"unknown preset {name!r}; one of {sorted(PRESETS)}") from None
