"""``lowband edge ...``: split, generate, serve, worker, run (and the MoE engineer's commands).

Thin: parse into config dataclasses and call ``edge.launch``/``edge.shardio``. Heavy imports
happen inside the handlers so ``lowband --help`` stays fast on a Raspberry Pi.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cli.auth import (
    add_api_key,
    add_auth,
    add_curve_authorized,
    authorized_keys,
    resolve_api_key,
    resolve_auth,
)
from cli.liveness import add_liveness, add_register_timeout, liveness
from lowband.errors import ConfigError, LowbandError


def _weights(text: str | None) -> tuple[float, ...] | None:
    if not text:
        return None
    try:
        return tuple(float(x) for x in text.split(","))
    except ValueError:
        raise ConfigError(
            "weights", f"expected comma-separated numbers like 2,1,1, got {text!r}"
        ) from None


def _cores(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise ConfigError("cores", f"expected comma-separated core ids, got {text!r}") from None


def _add_device(p: argparse.ArgumentParser) -> None:
    p.add_argument("--threads", type=int, help="torch threads on this device")
    p.add_argument("--cores", help="pin this process to these CPU cores, e.g. 0 or 0,1")


def _add_model(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="compute dtype (default: the checkpoint's)",
    )
    g = p.add_mutually_exclusive_group()
    g.add_argument("--window", type=int, help="sliding window: layer blocks kept resident")
    g.add_argument(
        "--memory-budget-mb",
        type=float,
        help="sliding window sized to fit this many MB of weights per device (--layout "
        "pipeline: each device's stage sized to hold its layers within it, no window)",
    )


def _add_experts(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("bit-nested MoE (a directory from 'lowband edge quantize --nested')")
    g.add_argument(
        "--expert-budget-mb",
        type=float,
        help="MB of expert weights kept in memory (over all devices; each device gets "
        "the share its experts take at int8). Required for a nested directory",
    )
    g.add_argument(
        "--expert-policy",
        choices=("hebf", "lru"),
        help="hebf: hot experts get more bits (default); lru: one width, LRU eviction",
    )
    g.add_argument(
        "--expert-lru-bits",
        type=int,
        choices=(8, 4, 3, 2),
        help="width of every expert with --expert-policy lru (default 8)",
    )
    g.add_argument(
        "--expert-min-bits",
        type=int,
        choices=(4, 3, 2),
        help="narrowest width HEBF serves (default 2)",
    )
    g.add_argument(
        "--expert-prefetch",
        type=int,
        help="experts of the next layer to prefetch per layer (0: off; default 2)",
    )
    g.add_argument(
        "--expert-read-mb-per-s",
        type=float,
        help="model a storage device this fast (default: the real file system)",
    )
    g.add_argument(
        "--expert-no-verify",
        action="store_true",
        help="skip checksumming every expert file when opening (faster start)",
    )


_EXPERT_KNOBS = (
    "expert_policy",
    "expert_lru_bits",
    "expert_min_bits",
    "expert_prefetch",
    "expert_read_mb_per_s",
    "expert_no_verify",
)


def _experts(args):
    from edge.moe.serve import ExpertServeConfig

    if args.expert_budget_mb is None:
        given = [k for k in _EXPERT_KNOBS if getattr(args, k) not in (None, False)]
        if given:
            raise ConfigError(given[0], "needs --expert-budget-mb (and a nested MoE directory)")
        return None
    kw = {
        k: v
        for k, v in (
            ("policy", args.expert_policy),
            ("lru_bits", args.expert_lru_bits),
            ("min_bits", args.expert_min_bits),
            ("prefetch", args.expert_prefetch),
            ("read_mb_per_s", args.expert_read_mb_per_s),
        )
        if v is not None
    }
    return ExpertServeConfig(
        budget_mb=args.expert_budget_mb, verify=not args.expert_no_verify, **kw
    )


def _add_serve(p: argparse.ArgumentParser) -> None:
    _add_model(p)
    _add_experts(p)
    _add_device(p)
    p.add_argument("--host", default="127.0.0.1", help="HTTP listen address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="HTTP port (default 8000)")
    p.add_argument("--name", help="model id in the API (default: directory name)")
    p.add_argument("--weights", help="relative device capacities for an uneven split, e.g. 2,1,1")
    p.add_argument(
        "--auto-split",
        action="store_true",
        help="profile every device and choose the split automatically (see /health)",
    )
    p.add_argument(
        "--layout",
        choices=["auto", "tp", "pipeline", "replica", "single"],
        help="how the model spreads over the devices: tp (every layer split, two round trips "
        "per layer), pipeline (each device a range of layers, one hop per device), replica "
        "(the whole model on every device, the streams spread over them), single "
        "(the master alone) or auto (chosen from the measured round trips and device "
        "speed; shown in /health). Default: auto for serve, tp for run",
    )
    p.add_argument(
        "--micro-batches",
        type=int,
        default=3,
        help="pipeline layout: groups of streams in flight through the stages (default 3)",
    )
    p.add_argument(
        "--replica-lanes",
        type=int,
        default=1,
        help="replica layout: groups of streams in flight per device (default 1; 2: a worker "
        "computes its next group while its answer travels, each step has half the rows)",
    )
    p.add_argument(
        "--head-share",
        type=float,
        help="pipeline layout: the master's share of the LM head's vocabulary rows, the "
        "rest on the last stage (default: in proportion to their layers)",
    )
    p.add_argument(
        "--plan-streams",
        type=int,
        default=1,
        help="--layout auto: plan for this many concurrent streams (default 1: one stream's "
        "ms/token decides; e.g. 8 for a busy server: aggregate tokens/s decides)",
    )
    p.add_argument(
        "--wire",
        default="fp32",
        choices=["fp32", "fp16", "bf16", "int8"],
        help="activation encoding on the wire (default fp32)",
    )
    p.add_argument(
        "--link",
        default="direct",
        choices=["direct", "comm"],
        help="activation path: direct star link (default, lowest latency) or the "
        "general communicator (then --algorithm applies)",
    )
    p.add_argument(
        "--algorithm",
        default="star",
        choices=["star", "ring", "auto"],
        help="all-reduce schedule with --link comm (default star)",
    )
    p.add_argument(
        "--link-spin-us",
        type=float,
        default=1000.0,
        help="microseconds each device polls the direct link for an all-reduce "
        "answer before sleeping (default 1000; 0 saves power, adds latency)",
    )
    add_auth(p, client=False, server=True)
    add_api_key(p)
    p.add_argument(
        "--discover",
        nargs="?",
        const="lowband",
        metavar="CLUSTER",
        help="advertise this master on the LAN (mDNS) with its CURVE public key's fingerprint, so "
        "'edge worker --discover --master-key KEY' finds it (default name: lowband)",
    )
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    p.add_argument(
        "--pooling",
        choices=["mean", "last", "cls"],
        default="mean",
        help="/v1/embeddings: pool the final hidden states by their mean, the last token's or "
        "the first token's row (llama-server's --pooling; default %(default)s)",
    )
    g = p.add_argument_group("batching")
    g.add_argument(
        "--parallel",
        type=int,
        help="sequences decoded together in one batch (default: sized from free memory, 1..16)",
    )
    g.add_argument(
        "--prefill-chunk",
        type=int,
        default=256,
        help="prompt tokens per step, prefilled alongside the running decodes "
        "(default %(default)s)",
    )
    p.add_argument(
        "--fast-prompts",
        action="store_true",
        help="prompt chunks through the eager GEMMs (no faster on Gemma 3 270M here); "
        "temperature 0 then depends on how a prompt was cut (prefix cache, "
        "chunking); default: every prompt token computed as a decode would, repeatable",
    )
    g.add_argument(
        "--decode-stall",
        type=float,
        default=2.0,
        help="while more streams decode than prompts wait, a step that also prefills may take "
        "about this many times a plain decode step (the chunk is sized from measured step "
        "times; as many or more waiting: whole chunks; default %(default)s)",
    )
    g.add_argument(
        "--lookup",
        action="store_true",
        help="speculative decoding with prompt lookup: draft tokens from n-gram matches in the "
        "prompt and output (exact: same output, several tokens per pass on repetitive text)",
    )
    g.add_argument(
        "--draft",
        metavar="FILE",
        help="speculative decoding with this draft model (same vocabulary, run on the master; "
        "like llama-server's -md)",
    )
    g.add_argument("--draft-max", type=int, default=8, help="most draft tokens a pass (1..15)")
    g.add_argument(
        "--draft-min",
        type=int,
        default=1,
        help="fewest draft tokens a drafting pass (k is 0, a plain pass, where no draft pays)",
    )
    g.add_argument(
        "--prefix-cache",
        type=int,
        help="finished sequences whose KV caches are kept for prefix reuse (default: --parallel)",
    )
    g.add_argument(
        "--repack",
        choices=["auto", "on", "off"],
        default="auto",
        help="keep a copy of the K-quant weights in the batch GEMM's layout (AVX-512 VNNI CPUs): "
        "batches of 5+ rows skip unpacking the weights, 1.1-1.5 bytes per weight more memory, the "
        "same outputs; auto: when --parallel > 1 and the copy fits half the free memory (each "
        "device of a cluster its own slice, judged by its own memory; default auto)",
    )
    p.add_argument(
        "--op-timeout",
        type=float,
        default=30.0,
        help="seconds a forward step may take before the worker counts as failed",
    )
    p.add_argument(
        "--replan-after-s",
        type=float,
        help="after a worker has been gone this long, re-split the model over the "
        "devices left (plain checkpoints only; default: wait for it)",
    )
    p.add_argument(
        "--ship",
        action="store_true",
        help="stream the model to every worker (checked by sha256, cached on the worker, "
        "resumed after a broken transfer): workers then need --cache-dir, not a copy",
    )
    add_liveness(p, default_heartbeat=1.0)


_MODEL_HELP = "checkpoint or split directory, or a .gguf file (read as it is, no conversion)"


def register(sub: argparse._SubParsersAction) -> None:
    edge = sub.add_parser(
        "edge",
        help="tensor-parallel inference on edge devices",
        description="Run Llama-family models across phones / Raspberry Pis.",
    )
    es = edge.add_subparsers(dest="edge_command", metavar="EDGE_COMMAND")

    p = es.add_parser("split", help="write per-device, per-layer shard files")
    p.add_argument(
        "model",
        help="HF checkpoint directory (config.json + *.safetensors) or a .gguf file (each "
        "device's tensors keep the file's quantization)",
    )
    p.add_argument("--devices", type=int, required=True)
    p.add_argument("--weights", help="relative device capacities, e.g. 2,1,1")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--out", required=True)
    p.set_defaults(func=_split)

    p = es.add_parser(
        "convert",
        help="a GGUF file (F32/F16/BF16/Q8_0/Q4_0) to a checkpoint "
        "directory every edge command reads (quantized blocks kept as they are)",
    )
    p.add_argument("gguf", help="a .gguf file (llama, qwen2, qwen3 or gemma3 architecture)")
    p.add_argument("--out", required=True)
    p.set_defaults(func=_convert)

    p = es.add_parser("generate", help="one completion on this device")
    p.add_argument("model_dir", help=_MODEL_HELP)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--stop", action="append", default=[])
    _add_model(p)
    _add_experts(p)
    _add_device(p)
    p.set_defaults(func=_generate)

    p = es.add_parser("serve", help="the master: OpenAI-compatible HTTP API (+ coordinator)")
    p.add_argument("model_dir", help=_MODEL_HELP)
    p.add_argument("--workers", type=int, default=0, help="number of worker devices to wait for")
    p.add_argument("--bind", default="tcp://0.0.0.0:29500", help="coordinator address for workers")
    _add_serve(p)
    add_curve_authorized(p, who="workers")
    p.set_defaults(func=_serve)

    p = es.add_parser("worker", help="a device serving one shard for a master")
    p.add_argument("--master", help="tcp://HOST:PORT printed by 'edge serve'")
    p.add_argument(
        "--discover",
        nargs="?",
        const="lowband",
        metavar="CLUSTER",
        help="find the master on the LAN (mDNS) instead of --master; CLUSTER as "
        "given to 'edge serve --discover' (default: lowband)",
    )
    p.add_argument(
        "--discover-timeout",
        type=float,
        default=60.0,
        help="seconds to look for the master (default 60)",
    )
    p.add_argument(
        "--model-dir",
        help="the model (directory, split dir or GGUF file) this device serves: an assign "
        "from the master naming any other path is refused (this or --cache-dir required)",
    )
    p.add_argument(
        "--cache-dir",
        help="take the model from a master started with --ship and keep it here (verified "
        "by sha256; a restart fetches only what is missing)",
    )
    p.add_argument(
        "--cache-budget-mb",
        type=float,
        default=0.0,
        help="refuse a shipped model larger than this (default: no bound)",
    )
    add_auth(p, client=True, server=False)
    p.add_argument(
        "--master-key",
        metavar="FILE|Z85",
        help="the master's CURVE public key (printed by 'edge serve'): with --discover only "
        "a master advertising it is joined, and the connection uses CURVE with it",
    )
    p.add_argument("--op-timeout", type=float, default=30.0)
    add_register_timeout(p)
    _add_device(p)
    p.set_defaults(func=_worker)

    p = es.add_parser("run", help="a local N-process cluster with the HTTP API")
    p.add_argument("model_dir", help=_MODEL_HELP)
    p.add_argument("--devices", type=int, default=2)
    p.add_argument("--pin-cores", action="store_true", help="one core and one thread per device")
    p.add_argument(
        "--bind",
        default="tcp://127.0.0.1:0",
        help="coordinator address (default: loopback, a free port; the devices' data sockets "
        "and the star link follow it)",
    )
    _add_serve(p)
    p.set_defaults(func=_run)

    try:  # the bit-nested MoE commands (another module, optional in a build)
        moe = importlib.import_module("cli.edge_moe")
    except ModuleNotFoundError as exc:
        if exc.name != "cli.edge_moe":
            raise
    else:
        moe.register(es)
    edge.set_defaults(func=lambda args: (edge.print_help(), 2)[1])


def _fail(exc: LowbandError) -> int:
    print(f"lowband edge: {exc}", file=sys.stderr)
    return 2


def _device(args):
    from edge.launch import DeviceConfig

    return DeviceConfig(threads=args.threads, cores=_cores(args.cores))


def _split(args) -> int:
    from edge.shardio import split_checkpoint

    try:
        out = split_checkpoint(
            args.model, args.out, args.devices, _weights(args.weights), args.dtype
        )
    except LowbandError as exc:
        return _fail(exc)
    print(
        f"wrote {args.devices} device shard(s) to {out}; copy {out}/rankN plus the json files "
        f"to device N"
    )
    return 0


def _convert(args) -> int:
    from edge.formats.gguf import convert_gguf

    try:
        out = convert_gguf(args.gguf, args.out)
    except LowbandError as exc:
        return _fail(exc)
    print(
        f"wrote {out} (the file's tokenizer and chat template in {out}/tokenizer.gguf); serve "
        f"it with 'lowband edge serve {out}'"
    )
    return 0


def _generate(args) -> int:
    from edge.launch import GenerateConfig, generate_main
    from edge.sampling import SamplingParams
    from edge.shardio import WindowConfig

    try:
        win = None
        if args.window is not None or args.memory_budget_mb is not None:
            win = WindowConfig(window=args.window, memory_budget_mb=args.memory_budget_mb)
        cfg = GenerateConfig(
            model_dir=args.model_dir,
            prompt=args.prompt,
            dtype=args.dtype,
            window=win,
            experts=_experts(args),
            device=_device(args),
            sampling=SamplingParams(
                max_tokens=args.max_tokens,
                temperature=args.temperature,
                top_k=args.top_k,
                top_p=args.top_p,
                seed=args.seed,
                stop=tuple(args.stop),
            ),
        )
        return generate_main(cfg)
    except LowbandError as exc:
        return _fail(exc)


def _serve_config(args, devices: int, layout: str = "tp"):
    """``layout``: the command's default when --layout is not given (serve: auto, run: tp)."""
    import os

    from edge.cluster import ClusterConfig
    from edge.embeddings import EmbeddingConfig
    from edge.launch import BatchConfig, ServeMasterConfig, SpecServeConfig, listen_host
    from edge.server import ServerConfig

    auth = resolve_auth(args, os.environ, client=False, server=True)
    host = listen_host(args.bind)  # coordinator, data socket and star link of the master
    exposed = devices > 1 and auth.check(host, what=f"the master's coordinator on {args.bind}")
    return ServeMasterConfig(
        model_dir=args.model_dir,
        name=args.name,
        bind=args.bind,
        token=auth.token,
        curve=auth.curve,
        curve_authorized=authorized_keys(getattr(args, "curve_authorized", None) or []),
        discover=args.discover,
        liveness=liveness(args, default_heartbeat=1.0),
        device=_device(args),
        server=ServerConfig(
            host=args.host,
            port=args.port,
            max_queue=args.max_queue,
            insecure=exposed,
            api_key=resolve_api_key(args, os.environ),
            embeddings=EmbeddingConfig(pooling=args.pooling),
        ),
        batch=BatchConfig(
            parallel=args.parallel,
            prefill_chunk=args.prefill_chunk,
            repeatable=not args.fast_prompts,
            prefix_cache=args.prefix_cache,
            decode_stall=args.decode_stall,
            repack=args.repack,
            spec=(
                SpecServeConfig(
                    lookup=args.lookup,
                    draft=args.draft,
                    draft_max=args.draft_max,
                    draft_min=args.draft_min,
                )
                if args.lookup or args.draft
                else None
            ),
        ),
        cluster=ClusterConfig(
            devices=devices,
            link_host=host,
            weights=_weights(args.weights),
            wire=args.wire,
            algorithm=args.algorithm,
            link=args.link,
            dtype=args.dtype,
            link_spin_us=args.link_spin_us,
            window=args.window,
            memory_budget_mb=args.memory_budget_mb,
            op_timeout=args.op_timeout,
            replan_after_s=args.replan_after_s,
            ship=getattr(args, "ship", False),
            experts=_experts(args),
            auto_split=args.auto_split,
            layout=args.layout or layout,
            micro_batches=args.micro_batches,
            replica_lanes=args.replica_lanes,
            head_share=args.head_share,
            plan_streams=args.plan_streams,
        ),
    )


def _serve(args) -> int:
    from edge.launch import serve_main

    try:
        return serve_main(_serve_config(args, args.workers + 1, layout="auto"))
    except LowbandError as exc:
        return _fail(exc)


def _worker_auth(args):
    """Credentials of an edge worker: ``--master-key`` pins the master and is its CURVE key."""
    import dataclasses
    import os

    from transport.auth import parse_public_key

    auth = resolve_auth(args, os.environ, client=True, server=False)
    if args.master_key is None:
        return auth
    key = parse_public_key(args.master_key)
    if auth.server_key is not None and auth.server_key != key and args.curve_server_key:
        raise ConfigError("master-key", "differs from --curve-server-key; give one of them")
    return dataclasses.replace(auth, server_key=key, mode="curve")


def _worker(args) -> int:
    from edge.cluster import WorkerConfig
    from edge.launch import ServeWorkerConfig, edge_transport, listen_host, serve_worker_main
    from transport.auth import is_loopback

    try:
        if (args.master is None) == (args.discover is None):
            raise ConfigError("master", "give either --master tcp://HOST:PORT or --discover")
        auth = _worker_auth(args)
        master = args.master
        if args.discover is not None:
            from edge.discovery import discover

            found = discover(
                cluster=args.discover,
                timeout=args.discover_timeout,
                master_key=auth.server_key.decode() if auth.server_key else None,
                insecure=auth.insecure,
            )
            print(
                f"lowband edge worker: found master {found.address} (cluster "
                f"{found.cluster!r}, key fingerprint {found.fingerprint or 'none'})",
                flush=True,
            )
            master = found.address
        if not master.startswith("tcp://"):
            raise ConfigError("master", f"must look like tcp://HOST:PORT, got {master!r}")
        master_host = listen_host(master)
        bind_host = "127.0.0.1" if is_loopback(master_host) else "0.0.0.0"
        auth.check(bind_host, master_host, what=f"this device (data socket on {bind_host})")
        return serve_worker_main(
            ServeWorkerConfig(
                master=master,
                worker=WorkerConfig(
                    model_dir=args.model_dir,
                    cache_dir=args.cache_dir,
                    cache_budget_mb=args.cache_budget_mb,
                ),
                device=_device(args),
                transport=edge_transport(
                    token=auth.token,
                    curve_server_key=auth.server_key,
                    curve=auth.curve,
                    bind_host=bind_host,
                    timeout=args.op_timeout,
                    register_timeout=args.register_timeout,
                ),
            )
        )
    except LowbandError as exc:
        return _fail(exc)


def _run(args) -> int:
    from edge.launch import RunConfig, run_main

    try:
        return run_main(
            RunConfig(serve=_serve_config(args, args.devices), pin_cores=args.pin_cores)
        )
    except LowbandError as exc:
        return _fail(exc)
