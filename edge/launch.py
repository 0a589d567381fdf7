"""Composition roots of ``lowband edge``: wire the ZeroMQ transport to the edge runtime.

``serve_main`` (master: coordinator + HTTP API), ``serve_worker_main`` (a device), ``run_main``
(a local N-process cluster), ``generate_main`` (one completion on this device). Each takes a
frozen config the CLI parsed; nothing here reads the environment.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edge import fastpath
from edge.cluster import (
    MASTER_ID_PREFIX,
    ClusterConfig,
    WorkerConfig,
    check_experts,
    run_worker,
)
from edge.cluster.choose import start_runner
from edge.draft import DraftModel
from edge.engine import DECODE_STALL, PREFILL_CHUNK, Engine, LocalRunner, Runner
from edge.lookup import LookupDrafter
from edge.moe.serve import ExpertServeConfig, load_nested_shard, plan_ranks
from edge.sampling import SamplingParams
from edge.server import ServerConfig, serve_forever
from edge.shardio import REPACK_MODES, WindowConfig, available_memory, is_split_dir, load_shard
from edge.source import check_model_path, is_gguf, resolve_model
from edge.speculative import SpecConfig, Speculation
from lowband.errors import ConfigError, PeerLost
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM
from lowband.proc import die_with_parent

if TYPE_CHECKING:
    from transport.auth import CurveKeys
    from transport.config import ZmqConfig
    from transport.coordinator import Liveness

logger = logging.getLogger(__name__)

SIGNATURE = "lowband-edge/1"  # workers learn the model at assign time, so all edge peers match


@dataclass(frozen=True, kw_only=True)
class DeviceConfig:
    """How this process uses its CPU (the bench pins one core per simulated device)."""

    threads: int | None = None  # torch intra-op threads; None: torch's default
    cores: tuple[int, ...] | None = None  # CPU affinity
    switch_interval_s: float = 2e-4  # Python GIL switch interval (see apply)

    def __post_init__(self) -> None:
        if self.threads is not None and self.threads < 1:
            raise ConfigError("threads", f"must be >= 1, got {self.threads}")

    def apply(self) -> None:
        # The transport's engine thread must get the GIL back quickly between layers; the
        # default 5 ms switch interval would add up to 5 ms to every all-reduce when the
        # compute thread holds the GIL (measured: 2-12 ms per all-reduce vs ~0.4 ms).
        sys.setswitchinterval(self.switch_interval_s)
        if self.cores:
            os.sched_setaffinity(0, set(self.cores))
        if self.threads is not None:
            torch.set_num_threads(self.threads)


@dataclass(frozen=True, kw_only=True)
class SpecServeConfig:
    """Speculative decoding for ``edge run|serve``: prompt lookup and/or a draft model file
    (``edge.speculative``; a draft model wins when both are given)."""

    lookup: bool = False
    draft: str | None = None  # a model of the same vocabulary (llama-server's -md)
    draft_max: int = 8
    draft_min: int = 1

    def __post_init__(self) -> None:
        SpecConfig(draft_max=self.draft_max, draft_min=self.draft_min)  # raises ConfigError
        if not self.lookup and self.draft is None:
            raise ConfigError("speculation", "needs --lookup or --draft FILE")


def build_speculation(spec: SpecServeConfig, runner: Runner, tok) -> Speculation:
    """The engine's drafters: a draft model loaded here (the master), checked against the
    target's vocabulary and tokenizer (``IncompatibleDraft`` otherwise), or prompt lookup."""
    cfg = SpecConfig(draft_max=spec.draft_max, draft_min=spec.draft_min)
    if spec.draft is None:
        return Speculation(cfg, LookupDrafter)
    check_model_path(spec.draft)
    dm = DraftModel(load_shard(spec.draft).model, resolve_model(spec.draft).tokenizer())
    dm.check(runner.config.vocab_size, tok)
    logger.info("speculation: draft model %s, up to %d tokens a pass", spec.draft, cfg.draft_max)
    return Speculation(cfg, dm.drafter)


@dataclass(frozen=True, kw_only=True)
class BatchConfig:
    """How the engine batches requests (see :mod:`edge.engine`)."""

    parallel: int | None = None
    """Sequences decoded together; None: sized from this device's free memory (a KV cache per
    sequence at ``sizing_context`` tokens, a quarter of the available memory, 1..16)."""
    prefill_chunk: int = PREFILL_CHUNK  # the most prompt tokens per step (edge.engine)
    decode_stall: float = DECODE_STALL  # a prefilling step: <= this x a decode step
    prefix_cache: int | None = None  # finished sequences kept for prefix reuse (default parallel)
    sizing_context: int = 4096
    spec: SpecServeConfig | None = None  # speculative decoding (None: off)
    repeatable: bool = True
    """Prompt tokens through the compiled step's rows path, each computed as the token alone,
    so temperature 0 gives the same tokens whether a prefix came from the cache or not and
    whatever shared the step; False: prompt chunks over 16 tokens through the eager GEMMs
    (other rounding: a request's bits then depend on how its prompt was cut; no faster on
    Gemma 3 270M here). See
    :func:`edge.fastpath.set_repeatable`."""
    repack: str = "auto"
    """K-quant weights also kept in the batch GEMM's layout (:func:`repack_for_batches`): "on",
    "off", or "auto" (when more than one sequence is batched and the copy fits half the
    memory available now)."""

    def __post_init__(self) -> None:
        if self.repack not in REPACK_MODES:
            raise ConfigError("repack", f"must be auto, on or off, got {self.repack!r}")
        if self.parallel is not None and not 1 <= self.parallel <= 256:
            raise ConfigError("parallel", f"must be in [1, 256], got {self.parallel}")
        if not 1 <= self.prefill_chunk <= 65536:
            raise ConfigError("prefill_chunk", f"must be in [1, 65536], got {self.prefill_chunk}")
        if not 1.0 < self.decode_stall <= 1000.0:
            raise ConfigError("decode_stall", f"must be in (1, 1000], got {self.decode_stall}")
        if self.prefix_cache is not None and not 0 <= self.prefix_cache <= 1024:
            raise ConfigError("prefix_cache", f"must be in [0, 1024], got {self.prefix_cache}")
        if self.sizing_context < 1:
            raise ConfigError("sizing_context", f"must be >= 1, got {self.sizing_context}")

    def slots(self, model: ModelConfig, available_bytes: int | None = None) -> int:
        """``parallel``, or the number of sequences whose caches fit a quarter of the memory
        available now (each sequence may also leave a prefix-cache slot behind: twice)."""
        if self.parallel is not None:
            return self.parallel
        if available_bytes is None:
            available_bytes = available_memory()
        ctx = min(self.sizing_context, model.max_position_embeddings)
        kv = 2 * model.num_hidden_layers * model.n_kv_heads * model.dim_per_head * 4 * ctx
        return max(1, min(16, available_bytes // 4 // (2 * max(kv, 1))))

    def repack_mode(self, model: ModelConfig) -> str:
        """``repack`` as every device applies it (:meth:`LoadedShard.repack`): "auto" is
        "off" when one sequence at a time is decoded (the copy only helps batches)."""
        return "off" if self.repack == "auto" and self.slots(model) < 2 else self.repack


def make_engine(runner: Runner, tok, name: str, batch: "BatchConfig") -> Engine:
    parallel = batch.slots(runner.config)
    model = getattr(runner, "model", None)
    if isinstance(model, LlamaForCausalLM):
        fastpath.set_repeatable(model, batch.repeatable)
    engine = Engine(
        runner,
        tok,
        model_name=name,
        parallel=parallel,
        prefill_chunk=batch.prefill_chunk,
        prefix_cache=batch.prefix_cache,
        decode_stall=batch.decode_stall,
        speculation=None if batch.spec is None else build_speculation(batch.spec, runner, tok),
    )
    logger.info(
        "engine: %d parallel sequences, prefill chunk %d", engine.parallel, batch.prefill_chunk
    )
    return engine


@dataclass(frozen=True, kw_only=True)
class ServeMasterConfig:
    """The master of ``lowband edge serve``: the model, its coordinator, the cluster of devices
    and the HTTP API in front (``server``, an ``edge.server.ServerConfig``)."""

    model_dir: str
    name: str | None = None  # model id in the API; default: the directory name
    # where the master's coordinator listens (devices > 1); loopback unless told otherwise
    bind: str = "tcp://127.0.0.1:29500"
    token: str | None = None  # shared secret every worker must present
    # The master's CURVE keypair: its coordinator then encrypts and authenticates every
    # connection, and workers are given its public key (--curve-server-key / --master-key).
    curve: CurveKeys | None = None
    # The workers' CURVE public keys the coordinator admits (the master's own key always);
    # empty: any client that has the master's public key.
    curve_authorized: tuple[bytes, ...] = ()
    cluster: ClusterConfig
    discover: str | None = None  # advertise the coordinator on the LAN under this cluster name
    server: ServerConfig = field(default_factory=ServerConfig)
    batch: BatchConfig = field(default_factory=BatchConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    # The master's coordinator deadlines; None: the coordinator's defaults (1 s heartbeat, a
    # worker with a dead connection lost after 2 s, a hung one after 60 s).
    liveness: Liveness | None = None

    def __post_init__(self) -> None:
        check_model_path(self.model_dir)  # a directory or a GGUF file
        if self.curve_authorized and self.curve is None:
            raise ConfigError("curve-authorized", "needs the master's CURVE keypair (--curve-key)")


def _tokenizer(model_dir: str):
    return resolve_model(model_dir).tokenizer()  # a GGUF file's own, or the directory's


def edge_transport(**over) -> "ZmqConfig":
    """The transport of a serving cluster's peers: one connection per pair (activations are a
    few KiB, no striping needed) and a forward step's deadline of 30 s as its ``timeout``;
    ``over`` sets other ``ZmqConfig`` fields."""
    from transport.config import ZmqConfig

    return ZmqConfig(**{"connections": 1, "timeout": 30.0, **over})


def _zmq_config(
    token: str | None,
    timeout: float,
    register_timeout: float = 30.0,
    *,
    bind_host: str,
    server_key: bytes | None = None,
    curve: CurveKeys | None = None,
):
    return edge_transport(
        timeout=timeout,
        token=token,
        register_timeout=register_timeout,
        bind_host=bind_host,
        curve_server_key=server_key,
        curve=curve,
    )


def listen_host(endpoint: str) -> str:
    """The interface a ``tcp://HOST:PORT`` coordinator endpoint listens on, for the master's
    other sockets (data socket, star link): a loopback coordinator keeps them all on loopback."""
    host = endpoint[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    return "0.0.0.0" if host in ("", "*") else host


def _coordinator_config(cfg: ServeMasterConfig):
    from transport.coordinator import Liveness

    # Under CURVE the master registers with the coordinator's own keypair, and the ids workers
    # know the master by are reserved to that key: no other peer can pose as the master.
    return (cfg.liveness or Liveness()).coordinator(
        bind=cfg.bind,
        token=cfg.token,
        curve=cfg.curve,
        # the master registers with the coordinator's own key: on the allow-list too
        curve_authorized=(
            (*cfg.curve_authorized, cfg.curve.public)
            if cfg.curve is not None and cfg.curve_authorized
            else ()
        ),
        reserved_prefix=MASTER_ID_PREFIX if cfg.curve is not None else None,
    )


def lan_host() -> str:
    """This host's first non-loopback IPv4 address (read from its interfaces, no packet sent),
    or 127.0.0.1 when it has none: where remote workers reach a master bound to 0.0.0.0."""
    import fcntl
    import socket
    import struct

    addrs = []
    try:
        names = [name for _, name in socket.if_nameindex()]
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            for name in names:
                try:  # SIOCGIFADDR: the interface's IPv4 address
                    req = struct.pack("256s", name.encode()[:15])
                    addrs.append(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, req)[20:24]))
                except OSError:
                    continue
    except OSError:
        pass
    lan = [a for a in addrs if not a.startswith("127.")]
    return lan[0] if lan else "127.0.0.1"


def build_engine(cfg: ServeMasterConfig, coord=None, master_host: str | None = None):
    """The engine for ``cfg``; for a cluster also the coordinator (started here unless given)
    and this process's communicator, both to be closed by the caller."""
    cfg.device.apply()
    name = cfg.name or Path(cfg.model_dir).resolve().name
    source = resolve_model(cfg.model_dir)
    tok = source.tokenizer()
    # slots sized from free memory once, before a repacked copy takes some of it; every
    # device then repacks its slice (or not) as this decides
    batch = replace(cfg.batch, parallel=cfg.batch.slots(source.config))
    cc = replace(cfg.cluster, repack=batch.repack_mode(source.config))
    check_model(cfg.model_dir, cc)
    if cc.devices == 1:
        shard = _load_local(cfg.model_dir, cc.dtype, cc.window_config(), cc.experts)
        runner: Runner = LocalRunner(shard.model, shard.close, report=shard.store_report)
        shard.repack(cc.repack)
        return make_engine(runner, tok, name, batch), None, None
    from transport.coordinator import Coordinator
    from transport.zmq_comm import connect

    if coord is None:
        coord = Coordinator(_coordinator_config(cfg)).start()
        print(
            f"lowband edge: waiting for {cc.devices - 1} worker(s): "
            f"lowband edge worker --master {coord.address}"
            + (f" --curve-server-key={cfg.curve.public.decode()}" if cfg.curve else ""),
            flush=True,
        )
    # The coordinator tells the workers to reach the master at the address this connection
    # comes from: over 127.0.0.1 that is only reachable on this host, so a coordinator bound to
    # every interface is joined over this host's LAN address (master_host overrides it).
    if master_host is None:
        master_host = lan_host() if coord.address.startswith("tcp://0.0.0.0:") else "127.0.0.1"
    address = coord.address.replace("0.0.0.0", master_host)
    comm = connect(
        address,
        _zmq_config(
            cfg.token,
            cc.op_timeout,
            bind_host=listen_host(cfg.bind),
            server_key=cfg.curve.public if cfg.curve is not None else None,
            curve=cfg.curve,  # the master is the peer holding the coordinator's key
        ),
        signature=SIGNATURE,
        peer_id=f"{MASTER_ID_PREFIX}-{uuid.uuid4().hex[:8]}",
    )
    try:
        runner = start_runner(comm, cfg.model_dir, cc)  # (tp: MasterRunner)
    except BaseException:
        comm.close()
        coord.stop()
        raise
    return make_engine(runner, tok, name, batch), coord, comm


def check_model(model_dir: str, cc: ClusterConfig) -> None:
    """Refuse what cannot be served before any process or socket starts: the window under the
    pipeline layout; for a nested MoE the expert budget of every device (a share smaller than
    its largest expert at the narrowest width) and the window across devices."""
    if cc.layout == "pipeline" and cc.devices > 1 and cc.window is not None:
        # (edge.cluster.stage.load_stage can stream a stage's layers; the layout does not
        # pass the window to its stages. A memory budget sizes the stages instead.)
        raise ConfigError(
            "window",
            "the pipeline layout does not stream weights through the sliding window: give "
            "--memory-budget-mb (each device's stage then fits it, held in memory) or use "
            "--layout tp (or auto) with --window",
        )
    if cc.layout == "replica" and cc.devices > 1 and cc.window_config() is not None:
        raise ConfigError(
            "layout",
            "the replica layout holds the whole model on every device: --window and "
            "--memory-budget-mb do not apply (a model that fits no device: --layout pipeline)",
        )
    # cc.experts is not None when the directory is nested: check_experts refuses that
    if check_experts(model_dir, cc.experts) and cc.experts is not None:
        if cc.window_config() is not None and cc.devices > 1:
            raise ConfigError(
                "window",
                "the sliding window over a nested MoE's backbone runs on "
                "one device; with --devices > 1 use --expert-budget-mb alone",
            )
        plan_ranks(model_dir, cc.devices, cc.weights, cc.experts)


def _load_local(
    model_dir: str,
    dtype: str | None,
    window: WindowConfig | None,
    experts: ExpertServeConfig | None,
):
    # experts is not None when the directory is nested: check_experts refuses that
    if check_experts(model_dir, experts) and experts is not None:
        return load_nested_shard(model_dir, experts=experts, window=window, dtype=dtype)
    if window is not None and not is_split_dir(model_dir) and not is_gguf(model_dir):
        raise ConfigError(
            "model_dir",
            "the sliding window needs a GGUF file or a split directory "
            "(lowband edge split MODEL --devices 1 --out DIR)",
        )
    return load_shard(model_dir, dtype=dtype, window=window)


def _exit_on_sigterm() -> None:
    """SIGTERM (systemd stop, timeout, kill) unwinds like Ctrl-C, so the finally blocks tell the
    workers to leave instead of orphaning them."""
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))


def serve_main(cfg: ServeMasterConfig, coord=None) -> int:
    _exit_on_sigterm()
    advert = None
    if cfg.discover is not None and cfg.cluster.devices > 1:  # edge.discovery: mDNS / DNS-SD
        from edge.discovery import Advertisement
        from transport.coordinator import Coordinator

        if coord is None:
            coord = Coordinator(_coordinator_config(cfg)).start()
        advert = Advertisement(
            coord.address,
            cluster=cfg.discover,
            signature=SIGNATURE,
            key=cfg.curve.public.decode() if cfg.curve is not None else None,
        )
        print(
            f"lowband edge: advertising cluster {cfg.discover!r}: "
            f"lowband edge worker --discover {cfg.discover}"
            + (f" --master-key={cfg.curve.public.decode()}" if cfg.curve else " --insecure"),
            flush=True,
        )
    try:
        engine, coord, comm = build_engine(cfg, coord, *(advert.hosts[:1] if advert else ()))
    except BaseException:
        if advert is not None:
            advert.close()
        raise
    try:
        serve_forever(engine, cfg.server)
    except KeyboardInterrupt:
        pass
    finally:
        if advert is not None:
            advert.close()
        engine.close()
        engine.runner.close()
        if comm is not None:
            comm.close()
        if coord is not None:
            coord.stop()
    return 0


@dataclass(frozen=True, kw_only=True)
class ServeWorkerConfig:
    """One device of a serving cluster (``lowband edge worker``): joins the master's coordinator."""

    master: str  # the master's coordinator address, tcp://HOST:PORT
    worker: WorkerConfig = field(default_factory=WorkerConfig)
    device: DeviceConfig = field(default_factory=DeviceConfig)
    # This device's transport (:func:`edge_transport`): credentials (token, or curve +
    # curve_server_key, the master's public key), the data socket's bind_host,
    # register_timeout (seconds to wait for the master's coordinator at join) and timeout
    # (the forward step's deadline, --op-timeout).
    transport: ZmqConfig = field(default_factory=edge_transport)

    def __post_init__(self) -> None:
        if not self.master.startswith("tcp://"):
            raise ConfigError("master", f"must look like tcp://HOST:PORT, got {self.master!r}")
        if self.worker.model_dir is None and self.worker.cache_dir is None:
            # A device on the network serves only the model it was given: the path in a
            # master's assign is checked against it (edge.cluster.worker.served_path), or
            # the one a master started with --ship streams into its cache (edge.cluster.ship).
            raise ConfigError(
                "model_dir",
                "a worker serves only its own model: give --model-dir (the master's path on "
                "this device: the same directory, split dir or GGUF file), or --cache-dir "
                "to take the model from a master started with --ship",
            )


def serve_worker_main(cfg: ServeWorkerConfig) -> int:
    from transport.zmq_comm import connect

    _exit_on_sigterm()
    cfg.device.apply()
    comm = connect(cfg.master, cfg.transport, signature=SIGNATURE)
    host = cfg.master[len("tcp://") :].rsplit(":", 1)[0].strip("[]")
    try:  # the master's star link listens on the same host as its coordinator
        return run_worker(comm, replace(cfg.worker, master_host=host))
    except PeerLost as exc:
        print(f"lowband edge worker: the master is gone ({exc}); exiting", file=sys.stderr)
        return 1
    finally:
        comm.close()


@dataclass(frozen=True, kw_only=True)
class RunConfig:
    """A local cluster of ``serve.cluster.devices`` processes (one per simulated device)."""

    serve: ServeMasterConfig
    pin_cores: bool = False  # pin device i to core i (mod the core count), one thread each


def run_main(cfg: RunConfig) -> int:
    """Start the master here and N-1 worker processes, each in its own process group, and
    stop them all when the master exits."""
    _exit_on_sigterm()
    serve = cfg.serve
    n = serve.cluster.devices
    ncpu = os.cpu_count() or 1
    procs: list[subprocess.Popen] = []
    if cfg.pin_cores:
        serve = replace(serve, device=DeviceConfig(threads=1, cores=(0,)))
    if n > 1 and serve.bind in ("tcp://0.0.0.0:29500", "tcp://127.0.0.1:29500"):
        # the library's default (or the old one): keep a local run local, on a free port
        serve = replace(
            serve,
            bind="tcp://127.0.0.1:0",
            cluster=replace(serve.cluster, link_host="127.0.0.1"),
        )

    def spawn_workers(address: str) -> None:
        # The token goes through the environment, never argv (which every user sees in ps);
        # the public key is no secret.
        env = dict(os.environ)
        if serve.token:
            env["LOWBAND_TOKEN"] = serve.token
        for i in range(1, n):
            args = [sys.executable, "-m", "cli", "edge", "worker", "--master", address]
            args += ["--model-dir", serve.model_dir]  # same machine, same working directory
            if serve.curve is not None:
                args += ["--curve-server-key", serve.curve.public.decode()]
            if cfg.pin_cores:
                args += ["--threads", "1", "--cores", str(i % ncpu)]
            procs.append(
                subprocess.Popen(args, start_new_session=True, preexec_fn=die_with_parent, env=env)
            )

    check_model(serve.model_dir, serve.cluster)  # before any worker process starts
    try:
        if n == 1:
            return serve_main(serve)
        from transport.coordinator import Coordinator

        # Start the coordinator first so the workers have somewhere to connect.
        coord = Coordinator(_coordinator_config(serve)).start()
        spawn_workers(coord.address)
        return serve_main(serve, coord)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)


@dataclass(frozen=True, kw_only=True)
class GenerateConfig:
    model_dir: str
    prompt: str
    sampling: SamplingParams
    dtype: str | None = None
    window: WindowConfig | None = None
    experts: ExpertServeConfig | None = None  # required for a nested MoE directory
    device: DeviceConfig = field(default_factory=DeviceConfig)


def generate_main(cfg: GenerateConfig) -> int:
    cfg.device.apply()
    shard = _load_local(cfg.model_dir, cfg.dtype, cfg.window, cfg.experts)
    engine = Engine(
        LocalRunner(shard.model, shard.close),
        _tokenizer(cfg.model_dir),
        model_name=Path(cfg.model_dir).name,
    )
    try:
        for ev in engine.generate(cfg.prompt, cfg.sampling):
            sys.stdout.write(ev.text)
            sys.stdout.flush()
        sys.stdout.write("\n")
        m = engine.metrics.snapshot()
        store = shard.store_report()
        extra = (
            ""
            if store is None
            else (
                f", experts: hit rate {store['hit_rate']:.2f}, "
                f"{store['mean_bits_per_call']} bits/call, "
                f"{store['bytes_read'] / 1e6:.1f} MB read, {store['stall_s']:.3f} s stalled"
            )
        )
        print(
            f"[{m['completion_tokens_total']} tokens, TTFT {m['ttft_ms_mean']:.1f} ms, "
            f"{m['decode_tokens_per_s'] or 0:.1f} tokens/s{extra}]",
            file=sys.stderr,
        )
    finally:
        engine.close()
        engine.runner.close()
    return 0
