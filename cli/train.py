"""``lowband train`` (a coordinator + N local worker processes) and ``lowband worker`` (join a run).

Thin: parse into :class:`diloco.launch.LocalLaunch` / :class:`diloco.launch.WorkerLaunch` (a
preset plus flat overrides, validated by the config dataclasses before any process starts) and
call ``train_main`` / ``worker_main``. Heavy imports happen inside the handlers.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from cli.auth import add_auth, resolve_auth
from cli.liveness import add_liveness, add_register_timeout, liveness


def _add_run_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group(
        "configuration (a preset plus overrides; workers of one run must agree)"
    )
    g.add_argument(
        "--preset",
        default="shakespeare",
        help="tiny | shakespeare (default) | wide | scale (BPE, ~6.5 M params, M=4)",
    )
    g.add_argument(
        "--config",
        type=Path,
        help="a config.json written by `lowband train` "
        "(instead of --preset; overrides still apply)",
    )
    g.add_argument("--mode", choices=["diloco", "ddp"], help="Streaming DiLoCo or the DDP baseline")
    g.add_argument("--steps", type=int, help="T: inner steps per worker")
    g.add_argument(
        "-H",
        "--inner-steps",
        type=int,
        dest="inner_steps",
        help="H: inner steps between two syncs of a fragment",
    )
    g.add_argument("-P", "--fragments", type=int, dest="n_fragments", help="P: fragments")
    g.add_argument(
        "--tau", type=int, help="τ: overlap, steps between launching and applying a sync"
    )
    g.add_argument("--alpha", type=float, help="α: merge weight of the local parameters")
    g.add_argument("--codec", help="wire format: fp32 fp16 bf16 int8 fp4 nf4 e3m0")
    g.add_argument(
        "--error-feedback",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="carry quantization residuals to the next sync",
    )
    g.add_argument("--fragment-strategy", choices=["strided", "sequential"])
    g.add_argument(
        "--lora-rank",
        type=int,
        help="r: train and sync only LoRA adapters of this rank on the attention and MLP "
        "projections (merged into the weights at export; needs peft)",
    )
    g.add_argument("--outer-lr", type=float, help="outer Nesterov learning rate (default 0.7)")
    g.add_argument("--outer-momentum", type=float, help="outer momentum μ (default 0.9)")
    g.add_argument("--inner-lr", type=float, help="peak AdamW learning rate")
    g.add_argument("--warmup-steps", type=int)
    g.add_argument("--batch-size", type=int, help="B: sequences per worker per step")
    g.add_argument("--seq-len", type=int, help="T: tokens per sequence")
    g.add_argument(
        "--data",
        type=Path,
        dest="data_path",
        help="a UTF-8 text file/dir (or token shards with --data-kind tokens); "
        "default: the embedded Shakespeare sample",
    )
    g.add_argument(
        "--corpus",
        type=Path,
        dest="corpus",
        help="a UTF-8 text file to train on (same as --data PATH --data-kind text)",
    )
    g.add_argument("--data-kind", choices=["text", "jsonl", "tokens"])
    g.add_argument(
        "--tokenizer",
        help="a Hugging Face tokenizer.json (or its directory), or "
        "bpe:N (a byte-level BPE of N tokens trained on the embedded sample); "
        "default: bytes",
    )
    g.add_argument("--token-dtype", choices=["uint16", "uint32"], help="of *.bin token shards")
    g.add_argument(
        "--test-fraction",
        type=float,
        help="share of the corpus held out as the test split (reported, never tuned on)",
    )
    g.add_argument(
        "--eval-split",
        choices=["validation", "test"],
        help="which held-out split evaluations report",
    )
    g.add_argument(
        "--slices",
        type=int,
        help="give each data slot its own disjoint slice of the training split (0: all share it)",
    )
    g.add_argument(
        "--model",
        dest="model_spec",
        help="hf:PATH trains a Hugging Face causal LM "
        "(a config.json for a random init, or a checkpoint directory); FILE.gguf fine-tunes "
        "a GGUF model (every family `edge run` loads; weights dequantized to fp32, its "
        "tokenizer unless --tokenizer); default: the preset's lowband Llama",
    )
    c = p.add_argument_group("compute (per site; may differ between workers)")
    c.add_argument("--device", help="auto (default) | cpu | cuda | cuda:N")
    c.add_argument(
        "--precision",
        choices=["fp32", "bf16", "fp16"],
        help="autocast dtype (master weights stay fp32)",
    )
    c.add_argument(
        "--micro-batches",
        type=int,
        help="gradient accumulation: split B into this many micro-batches",
    )
    c.add_argument(
        "--compile",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="torch.compile the model's forward (default: on with CUDA, off on the CPU)",
    )
    c.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="write a torch.profiler (Kineto) trace of --profile-steps inner steps, with the "
        "fragment syncs among them, to DIR/trace-slot*-step*.json",
    )
    c.add_argument(
        "--profile-steps", type=int, default=12, help="inner steps the trace records (>= H/P)"
    )
    c.add_argument(
        "--activation-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="recompute block activations in backward",
    )
    c.add_argument(
        "--optimizer-impl",
        choices=["auto", "fused", "foreach", "loop"],
        help="torch optimizer kernels (auto: fused on CUDA)",
    )
    g.add_argument("--seed", type=int)
    g.add_argument("--eval-every", type=int)
    g.add_argument("--checkpoint-every", type=int)
    g.add_argument("--audit-every", type=int, help="syncs between state-hash audits")
    g.add_argument("--sync-timeout", type=float, help="seconds a collective may take")
    g.add_argument(
        "--final-grace",
        type=float,
        metavar="S",
        help="seconds a worker lost near the end has to come back for the final state before "
        "the others finish without it (default 30; 0: none)",
    )


def _train_config(args: argparse.Namespace, base=None, **extra: object):
    """``--config`` or ``--preset`` (or ``base`` when the caller has its own default and neither
    was given) with the flat overrides applied; validated like any TrainConfig."""
    from diloco.config import ProfileConfig, config_from_dict, preset, with_overrides
    from lowband.errors import ConfigError

    if args.config:
        base = config_from_dict(json.loads(args.config.read_text()))
    elif base is None or args.preset is not None:
        base = preset(args.preset)
    hf_model = gguf_model = None
    if args.model_spec is not None:
        if args.model_spec.startswith("hf:"):
            hf_model = args.model_spec[3:]
        elif _is_gguf(args.model_spec):
            gguf_model = str(Path(args.model_spec).resolve())
        else:
            raise ConfigError(
                "model", f"--model takes hf:PATH or a GGUF file, got {args.model_spec!r}"
            )
    data_path, data_kind = args.data_path, args.data_kind
    if args.corpus is not None:
        if data_path is not None:
            raise ConfigError("corpus", "give --corpus or --data, not both")
        data_path, data_kind = args.corpus, data_kind or "text"
    return with_overrides(
        base,
        hf_model=hf_model,
        gguf_model=gguf_model,
        device=args.device,
        precision=args.precision,
        micro_batches=args.micro_batches,
        compile=args.compile,
        profile=(
            None
            if args.profile is None
            else ProfileConfig(dir=str(args.profile), steps=args.profile_steps)
        ),
        activation_checkpointing=args.activation_checkpointing,
        optimizer_impl=args.optimizer_impl,
        tokenizer=args.tokenizer,
        token_dtype=args.token_dtype,
        test_fraction=args.test_fraction,
        eval_split=args.eval_split,
        slices=args.slices,
        mode=args.mode,
        steps=args.steps,
        inner_steps=args.inner_steps,
        n_fragments=args.n_fragments,
        tau=args.tau,
        alpha=args.alpha,
        codec=args.codec,
        error_feedback=args.error_feedback,
        fragment_strategy=args.fragment_strategy,
        lora_rank=args.lora_rank,
        outer_lr=args.outer_lr,
        outer_momentum=args.outer_momentum,
        inner_lr=args.inner_lr,
        warmup_steps=args.warmup_steps,
        batch_size=args.batch_size,
        seq_len=args.seq_len,
        data_path=str(data_path) if data_path else None,
        data_kind=data_kind,
        seed=args.seed,
        eval_every=args.eval_every,
        checkpoint_every=args.checkpoint_every,
        audit_every=args.audit_every,
        sync_timeout=args.sync_timeout,
        final_grace=args.final_grace,
        **extra,
    )


def _is_gguf(spec: str) -> bool:
    from edge.formats.gguf_arch import is_gguf

    return Path(spec).is_file() and is_gguf(spec)


def _pretrained(train):
    """The GGUF reader the trainer needs when the run starts from a GGUF file."""
    if train.gguf_model is None:
        return None
    from edge.formats.gguf_train import GGUFPretrained

    return GGUFPretrained()


def _connections(text: str) -> int:
    """``--connections``, refused by the parser with the transport's own bound check."""
    from lowband.errors import ConfigError
    from transport.config import ZmqConfig

    try:
        return ZmqConfig(connections=int(text)).connections
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _fail(exc: Exception) -> int:
    print(f"lowband: error: {exc}", file=sys.stderr)
    return 2


def _train(args: argparse.Namespace) -> int:
    from lowband.errors import ConfigError

    try:
        return _train_checked(args)
    except ConfigError as exc:  # bad flags or data: one line, before any process starts
        return _fail(exc)


def _train_checked(args: argparse.Namespace) -> int:
    from diloco.launch import LocalLaunch, train_main

    train = _train_config(args, workers=args.workers)
    cfg = LocalLaunch(
        train=train,
        pretrained=_pretrained(train),
        out_dir=args.out,
        resume=args.resume,
        loopback=args.loopback,
        bind=args.bind,
        threads=args.threads,
        progress=not args.no_progress,
        liveness=liveness(args, default_heartbeat=2.0),
    )
    summary = train_main(cfg)
    _keep_tokenizer(train, args.out / "model")
    print(json.dumps(summary))
    return 0 if summary["finished"] else 1


def _keep_tokenizer(train, model_dir: Path) -> None:
    """Beside a fine-tune's exported weights, the tokenizer it trained with: the starting GGUF's
    (``tokenizer.gguf``, what ``edge`` and ``lowband export`` read) or ``--tokenizer``'s
    ``tokenizer.json``."""
    import shutil

    if not model_dir.is_dir() or train.data.tokenizer is None and train.gguf_model is None:
        return
    if train.data.tokenizer is not None:
        src = Path(train.data.tokenizer)
        src = src / "tokenizer.json" if src.is_dir() else src
        if src.name == "tokenizer.json" and src.is_file():
            shutil.copyfile(src, model_dir / "tokenizer.json")
        return
    from edge.formats.gguf import write_tokenizer_gguf
    from edge.formats.gguf_arch import TOKENIZER_GGUF

    write_tokenizer_gguf(train.gguf_model, model_dir / TOKENIZER_GGUF)


def _worker(args: argparse.Namespace) -> int:
    from lowband.errors import ConfigError, IncompatiblePeer

    try:
        return _worker_checked(args)
    except (ConfigError, IncompatiblePeer) as exc:
        return _fail(exc)


def _worker_auth(args: argparse.Namespace, coordinators: list[str]):
    """Resolve the worker's credentials and its data socket's interface, and refuse an exposed
    unprotected setup (transport.auth.check_exposure) before anything connects. Without
    --bind-host the data socket stays on loopback when every coordinator is."""
    import os

    from transport.auth import endpoint_host, is_loopback

    auth = resolve_auth(args, os.environ, client=True, server=False)
    hosts = [endpoint_host(c) for c in coordinators]
    bind_host = args.bind_host
    if bind_host is None:
        local = all(h is None or is_loopback(h) for h in hosts)
        bind_host = "127.0.0.1" if local else "0.0.0.0"
    auth.check(bind_host, *hosts, what=f"this worker (data socket on {bind_host})")
    return auth, bind_host


def _worker_checked(args: argparse.Namespace) -> int:
    if args.site is not None:
        return _site_rank(args)
    from diloco.launch import WorkerLaunch, worker_main
    from transport.config import ZmqConfig

    auth, bind_host = _worker_auth(args, [args.coordinator])

    train = _train_config(args, workers=args.workers)
    cfg = WorkerLaunch(
        train=train,
        pretrained=_pretrained(train),
        coordinator=args.coordinator,
        worker_id=args.id,
        out_dir=args.out,
        resume=args.resume,
        threads=args.threads,
        progress=args.progress,
        transport=ZmqConfig(
            bind_host=bind_host,
            advertise_host=args.advertise_host,
            token=auth.token,
            curve=auth.curve,
            curve_server_key=auth.server_key,
            data_port=args.data_port,
            advertise_port=args.advertise_port,
            same_host=args.same_host,
            register_timeout=args.register_timeout,
            reachable={"auto": None, "yes": True, "no": False}[args.reachable],
            relay=args.relay,
            connections=args.connections,
        ),
    )
    result = worker_main(cfg)
    print(json.dumps(result.summary()))
    return 0


def _site_rank(args: argparse.Namespace) -> int:
    """One rank of a multi-rank site: torchrun's environment names the rank and rendezvous.

    ``LOCAL_RANK`` (the rank on this host) picks the rank's GPU: ``--device cuda`` (or ``auto``
    with ``--site-backend nccl``) becomes ``cuda:LOCAL_RANK``. Without torchrun (ranks started
    by hand on one host) ``LOCAL_RANK`` defaults to ``RANK``."""
    import dataclasses
    import logging
    import os

    import torch

    from diloco.site_launch import SiteFailed, SiteLaunch, site_device, site_main
    from lowband.errors import ConfigError, IncompatiblePeer
    from transport.config import ZmqConfig

    env = {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    missing = [k for k, v in env.items() if v is None]
    if missing:
        raise ConfigError("site", f"--site runs under torchrun (missing {', '.join(missing)})")
    rank = int(env["RANK"])  # type: ignore[arg-type]
    auth, bind_host = _worker_auth(args, args.coordinator.split(","))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    train = _train_config(args, workers=args.workers)
    device = site_device(
        train.compute.device,
        backend=args.site_backend,
        engine=args.site,
        local_rank=local_rank,
        cuda=torch.cuda.is_available(),
    )
    train = dataclasses.replace(train, compute=dataclasses.replace(train.compute, device=device))
    cfg = SiteLaunch(
        train=train,
        coordinators=tuple(args.coordinator.split(",")),
        rank=rank,
        size=int(env["WORLD_SIZE"]),  # type: ignore[arg-type]
        master=f"{env['MASTER_ADDR']}:{env['MASTER_PORT']}",
        engine=args.site,
        backend=args.site_backend,
        site_id=args.id or "site",
        out_dir=args.out,
        threads=args.threads,
        # Only what a rank's group needs: ranks of a site share a host, so no fixed data
        # port, and the site rejoins through torchrun, not a register deadline of its own.
        transport=ZmqConfig(
            bind_host=bind_host,
            advertise_host=args.advertise_host,
            token=auth.token,
            curve=auth.curve,
            curve_server_key=auth.server_key,
            same_host=args.same_host,
            connections=args.connections,
        ),
        dist_timeout=args.dist_timeout,
        resume=args.resume,
    )
    try:
        result = site_main(cfg)
    except SiteFailed as exc:
        # Exit now: the rank has left its lowband group and closed its logs, and the
        # interpreter's teardown of a torch.distributed group whose other ranks are dead can
        # block for seconds (measured ~3 s on Gloo). A crash exits 1 with its traceback (a
        # torchrun restart of the site follows); a refusal (bad settings, an incompatible
        # group) is one line and exit 2, as a single-process worker gives it.
        code = 1
        if isinstance(exc.__cause__, (ConfigError, IncompatiblePeer)):
            code = _fail(exc.__cause__)
        else:
            logging.getLogger(__name__).error("%s", exc, exc_info=exc.__cause__)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    print(json.dumps(result.summary()))
    return 0


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "train",
        help="train with Streaming DiLoCo (or DDP) on this machine",
        description="Start a coordinator and N worker processes on this machine "
        "and train the preset model (default: a small Llama on the embedded "
        "Shakespeare sample). Writes metrics-*.jsonl, summary.json, "
        "eval_vs_bytes.png, checkpoints/ and model/ (loadable by `lowband edge`).",
    )
    p.add_argument("--workers", type=int, default=2, help="M: worker processes (default 2)")
    p.add_argument("--out", type=Path, default=Path("lowband-run"), help="run directory")
    p.add_argument("--resume", type=Path, help="a checkpoints/step-* directory to continue from")
    p.add_argument(
        "--loopback", action="store_true", help="workers as threads of this process (no sockets)"
    )
    p.add_argument("--bind", default="tcp://127.0.0.1:0", help="coordinator endpoint")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker (default 1)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_liveness(p, default_heartbeat=2.0)
    _add_run_options(p)
    p.set_defaults(func=_train)

    p = sub.add_parser(
        "worker",
        help="join a training run as one worker",
        description="Connect to a run's coordinator and train as one worker. "
        "Use the same preset/overrides (or --config) as the other workers: a "
        "different model or configuration is refused at join.",
    )
    p.add_argument(
        "--coordinator",
        required=True,
        help="tcp://HOST:PORT of the coordinator "
        "(with --site: one per site rank r, comma-separated, rank r joins the r-th)",
    )
    p.add_argument(
        "--site",
        choices=["fsdp2", "ddp"],
        help="this process is one rank of a multi-rank site started by torchrun: "
        "FSDP2 or DDP inside the site, sharded outer sync across sites",
    )
    p.add_argument(
        "--site-backend",
        default="gloo",
        choices=["gloo", "nccl"],
        help="torch.distributed backend inside the site (default gloo): nccl puts "
        "rank r of a host on cuda:LOCAL_RANK (--device auto or cuda) and refuses a "
        "CPU device; gloo computes on the CPU (auto) or, with --site ddp and "
        "--device cuda / cuda:N, on GPUs",
    )
    p.add_argument(
        "--dist-timeout",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="with --site: seconds a torch.distributed collective inside the site "
        "may wait before the rank gives up (a dead rank takes its site down after "
        "at most this long; default 60)",
    )
    p.add_argument(
        "--workers",
        type=int,
        help="M: founding workers to wait for before starting (default: the preset's)",
    )
    p.add_argument("--id", help="worker id for file names (default: the transport peer id)")
    p.add_argument("--out", type=Path, help="directory for metrics and checkpoints")
    p.add_argument("--resume", type=Path, help="a checkpoints/step-* directory to continue from")
    p.add_argument("--threads", type=int, help="torch intra-op threads")
    p.add_argument("--progress", action="store_true", help="show a progress bar")
    p.add_argument(
        "--bind-host",
        help="interface for the data socket (default: 127.0.0.1 when the coordinator is on "
        "loopback, else 0.0.0.0)",
    )
    p.add_argument("--advertise-host", help="address other workers should connect to")
    add_auth(p, client=True, server=False)
    p.add_argument(
        "--data-port", type=int, default=0, help="data socket port (default: a free one)"
    )
    p.add_argument(
        "--advertise-port",
        type=int,
        help="port other workers should dial, when a relay sits in front of this one",
    )
    p.add_argument(
        "--same-host",
        default="auto",
        choices=["auto", "shm", "ipc", "off"],
        help="shortcuts to workers on this host (off: TCP only, for shaped links)",
    )
    p.add_argument(
        "--connections",
        type=_connections,
        default=4,
        metavar="K",
        help="TCP connections to each other worker, 1-64 (default %(default)s). On a long path "
        "with cubic or small TCP buffers more carry more (16 at 160 ms); with bbr on a short one, "
        "1-2 (docs/training.md, Measured)",
    )
    p.add_argument(
        "--reachable",
        default="auto",
        choices=["auto", "yes", "no"],
        help="can other workers dial this one's data port? auto (default): the coordinator "
        "dials back at registration; no (behind NAT): links into this worker go through the "
        "coordinator's relay",
    )
    p.add_argument(
        "--relay",
        default="auto",
        choices=["auto", "always", "off"],
        help="auto (default): peers that cannot be dialled are reached through the "
        "coordinator's relay; always: every peer through it; off: direct only",
    )
    add_register_timeout(p)
    _add_run_options(p)
    p.set_defaults(func=_worker)

    p = sub.add_parser(
        "export",
        help="write a trained model (a run's model/ directory) as a GGUF file",
        description="Convert the HF directory a run exported (OUT/model) into one GGUF file "
        "that `lowband edge` and llama.cpp load (Llama, Qwen2 or Gemma 3; unscaled rotary).",
    )
    p.add_argument("model_dir", type=Path, help="the run's model/ directory")
    p.add_argument("--gguf", type=Path, required=True, help="the GGUF file to write")
    p.add_argument("--ftype", default="f32", choices=["f32", "f16", "q8_0", "q4_0"])
    p.add_argument(
        "--tokenizer",
        type=Path,
        help="a GGUF whose tokenizer the file carries (e.g. the one the fine-tune started "
        "from); default: the directory's tokenizer.gguf, else placeholder tokens",
    )
    p.set_defaults(func=_export)


def _export(args: argparse.Namespace) -> int:
    from edge.formats.gguf import export_gguf
    from lowband.errors import ConfigError

    try:
        out = export_gguf(
            args.model_dir, args.gguf, ftype=args.ftype, tokenizer_from=args.tokenizer
        )
    except ConfigError as exc:
        return _fail(exc)
    print(f"wrote {out}; serve it with `lowband edge run {out}`")
    return 0


if __name__ == "__main__":  # pragma: no cover
    from cli import main

    sys.exit(main(["train", *sys.argv[1:]]))
