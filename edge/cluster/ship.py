"""Shipping a worker its weights from the master: the worker needs no copy of the model.

The master serves a :class:`Manifest`, the files a worker needs (a GGUF file, or one rank's
files of a split directory), each with its size and SHA-256. The worker pulls them into a cache
directory in bounded pieces, one :class:`Want` answered by one :class:`Chunk`
(``MAX_CHUNK`` bytes at most), verifies every file's hash and keeps it there, so a second start
transfers nothing. A transfer broken off (the link down, the master restarted) resumes where it
stopped: a part file's bytes on disk are not asked for again, and the hash covers them too.

The worker drives (pull): it asks only for what it is missing and bounds everything before it
writes a byte (file count, name, total size against its disk budget). The master answers any
``Want`` inside a manifest file and nothing else. The transport is injected: ``ask`` is any
function from a ``Want`` to its ``Chunk`` (:class:`CommChannel` carries them over a
:class:`lowband.comm.Communicator`, the bytes as a uint8 tensor beside the meta, and
:func:`offer` / :func:`receive` are the two sides of a whole shipment over one; tests also call
:meth:`ShipServer.answer` directly).

Cache layout: ``cache_dir/<manifest digest[:16]>/<name>``; a file being fetched is
``<name>.part`` until its hash is checked, then renamed; a part whose hash is wrong is deleted
(:class:`lowband.errors.CorruptWeights`), so the next start fetches it afresh.
"""

from __future__ import annotations

import hashlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import torch

from lowband.comm import Communicator
from lowband.errors import ConfigError, CorruptWeights, ProtocolError

logger = logging.getLogger(__name__)

MAX_CHUNK = 4 << 20  # bytes in one Chunk: bounds a message and the worker's buffer
MAX_FILES = 4096  # files of a manifest (a split directory has a few per layer)
MAX_NAME = 255
WANT = "edge.ship.want"  # worker -> master
CHUNK = "edge.ship.chunk"  # master -> worker


def _check_name(name: object) -> str:
    """A relative file name that stays inside the cache directory."""
    if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME:
        raise ProtocolError(f"a shipped file's name must be 1-{MAX_NAME} characters: {name!r:.80}")
    parts = name.split("/")
    if (
        name.startswith("/")
        or "\\" in name
        or "\0" in name
        or any(p in ("", ".", "..") for p in parts)
    ):
        raise ProtocolError(f"shipped file name {name!r} leaves the cache directory")
    return name


@dataclass(frozen=True, kw_only=True)
class ShipFile:
    name: str
    """Relative path inside the model (``/`` separated, no ``..``)."""
    size: int
    sha256: str
    """Hex digest of the whole file."""

    def __post_init__(self) -> None:
        _check_name(self.name)
        if not isinstance(self.size, int) or self.size < 0:
            raise ProtocolError(f"{self.name}: size must be a non-negative int, got {self.size!r}")
        if not (isinstance(self.sha256, str) and len(self.sha256) == 64):
            raise ProtocolError(f"{self.name}: sha256 must be 64 hex digits")
        int(self.sha256, 16)


@dataclass(frozen=True, kw_only=True)
class Manifest:
    files: tuple[ShipFile, ...]

    def __post_init__(self) -> None:
        if not 0 < len(self.files) <= MAX_FILES:
            raise ProtocolError(f"a manifest lists 1-{MAX_FILES} files, got {len(self.files)}")
        names = [f.name for f in self.files]
        if len(set(names)) != len(names):
            raise ProtocolError("a manifest names a file twice")

    @property
    def total(self) -> int:
        return sum(f.size for f in self.files)

    @property
    def digest(self) -> str:
        """Names the cache entry: the same files with the same contents, the same digest."""
        h = hashlib.sha256()
        for f in sorted(self.files, key=lambda f: f.name):
            h.update(f"{f.name}\0{f.size}\0{f.sha256}\n".encode())
        return h.hexdigest()

    def encode(self) -> dict[str, Any]:
        return {"files": [[f.name, f.size, f.sha256] for f in self.files]}

    @classmethod
    def decode(cls, meta: Mapping[str, Any]) -> "Manifest":
        rows = meta.get("files")
        if not isinstance(rows, list) or len(rows) > MAX_FILES:
            raise ProtocolError(f"a manifest must be a list of at most {MAX_FILES} files")
        out = []
        for row in rows:
            if not (isinstance(row, (list, tuple)) and len(row) == 3):
                raise ProtocolError(f"a manifest row must be [name, size, sha256]: {row!r:.80}")
            out.append(ShipFile(name=row[0], size=row[1], sha256=row[2]))
        return cls(files=tuple(out))


@dataclass(frozen=True, kw_only=True)
class Want:
    """Worker -> master: ``length`` bytes of file ``name`` from ``offset``."""

    name: str
    offset: int
    length: int

    def __post_init__(self) -> None:
        _check_name(self.name)
        ok = isinstance(self.offset, int) and isinstance(self.length, int)
        if not ok or self.offset < 0 or not 0 < self.length <= MAX_CHUNK:
            raise ProtocolError(f"want {self.name}: offset >= 0 and 1-{MAX_CHUNK} bytes")


@dataclass(frozen=True)
class Chunk:
    """Master -> worker: the bytes of a ``Want`` (exactly its length; the file is not shorter)."""

    name: str
    offset: int
    data: bytes


def hash_file(path: Path, block: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(block):
            h.update(b)
    return h.hexdigest()


class ShipServer:
    """The master's side: the manifest of ``files`` (name -> path) and the answers to wants."""

    def __init__(self, files: Mapping[str, Path | str]) -> None:
        self.paths = {_check_name(n): Path(p) for n, p in files.items()}
        self.manifest = Manifest(
            files=tuple(
                ShipFile(name=n, size=p.stat().st_size, sha256=hash_file(p))
                for n, p in sorted(self.paths.items())
            )
        )
        self._size = {f.name: f.size for f in self.manifest.files}

    @classmethod
    def of(cls, model: Path | str) -> "ShipServer":
        """A GGUF file (shipped under its own name) or every file under a directory."""
        p = Path(model)
        if p.is_file():
            return cls({p.name: p})
        files = {q.relative_to(p).as_posix(): q for q in sorted(p.rglob("*")) if q.is_file()}
        if not files:
            raise ConfigError("model", f"{p} holds no files to ship")
        return cls(files)

    def answer(self, want: Want) -> Chunk:
        size = self._size.get(want.name)
        if size is None or want.offset + want.length > size:
            raise ProtocolError(f"want {want.name} [{want.offset}, +{want.length}) is not shipped")
        with open(self.paths[want.name], "rb") as f:
            f.seek(want.offset)
            data = f.read(want.length)
        if len(data) != want.length:  # the file shrank under us: not what the manifest says
            raise CorruptWeights(f"{self.paths[want.name]} changed while it was being shipped")
        return Chunk(want.name, want.offset, data)


@dataclass(frozen=True, kw_only=True)
class FetchConfig:
    cache_dir: Path
    """Where shipped models are kept (one subdirectory per manifest)."""
    budget_mb: float = 0.0
    """Refuse a manifest larger than this (MB, 1e6 bytes) before writing; 0: no bound."""
    chunk_bytes: int = 1 << 20
    """Bytes asked for per Want (at most ``MAX_CHUNK``)."""
    depth: int = 4
    """Wants in flight at once (with a batch ``ask_many``): one round trip per ``depth``
    chunks instead of per chunk; the worker buffers at most ``depth * chunk_bytes``."""

    def __post_init__(self) -> None:
        if not 1 <= self.depth <= 64:
            raise ConfigError("depth", f"must be in [1, 64], got {self.depth}")
        if not 0 < self.chunk_bytes <= MAX_CHUNK:
            raise ConfigError("chunk_bytes", f"must be in (0, {MAX_CHUNK}], got {self.chunk_bytes}")
        if self.budget_mb < 0:
            raise ConfigError("budget_mb", f"must be >= 0, got {self.budget_mb}")


@dataclass
class FetchReport:
    path: Path
    """The cache entry: the model's files under their manifest names."""
    fetched_bytes: int = 0
    """Bytes transferred by this call (0: everything was cached)."""
    resumed_bytes: int = 0
    """Bytes of part files a broken transfer left, kept and not asked for again."""
    model: Path | None = None
    """What to load (:func:`model_path`; set by :func:`receive`)."""


def fetch(
    manifest: Manifest,
    ask: Callable[[Want], Chunk],
    cfg: FetchConfig,
    *,
    ask_many: Callable[[list[Want]], list[Chunk]] | None = None,
) -> FetchReport:
    """Every file of ``manifest`` in the cache, fetched through ``ask`` where missing
    (``ask_many``, where given: ``cfg.depth`` wants at a time, answered in order).

    Raises :class:`ConfigError` (over the budget), :class:`ProtocolError` (a chunk that is not
    what was asked for) and :class:`CorruptWeights` (a file whose hash is wrong; its part is
    deleted). Whatever ``ask`` raises (e.g. ``PeerLost``) leaves the part files to resume from."""
    if cfg.budget_mb and manifest.total > cfg.budget_mb * 1e6:
        raise ConfigError(
            "budget_mb",
            f"the model is {manifest.total / 1e6:.1f} MB, over this worker's "
            f"{cfg.budget_mb:g} MB budget: raise the budget or give it fewer layers",
        )
    root = Path(cfg.cache_dir) / manifest.digest[:16]
    report = FetchReport(path=root)
    for f in manifest.files:
        dest = root / f.name
        if dest.exists() and dest.stat().st_size == f.size:
            continue  # verified when it was renamed into place
        dest.parent.mkdir(parents=True, exist_ok=True)
        part = dest.with_name(dest.name + ".part")
        have = part.stat().st_size if part.exists() else 0
        if have > f.size:
            part.unlink()
            have = 0
        report.resumed_bytes += have
        with open(part, "ab") as out:
            while have < f.size:
                wants: list[Want] = []
                at = have
                while at < f.size and len(wants) < (cfg.depth if ask_many else 1):
                    n = min(cfg.chunk_bytes, f.size - at)
                    wants.append(Want(name=f.name, offset=at, length=n))
                    at += n
                chunks = ask_many(wants) if ask_many else [ask(wants[0])]
                if len(chunks) != len(wants):
                    raise ProtocolError(f"asked {len(wants)} chunks, got {len(chunks)}")
                for w, chunk in zip(wants, chunks):
                    ok = chunk.name == w.name and chunk.offset == w.offset
                    if not ok or len(chunk.data) != w.length:
                        raise ProtocolError(
                            f"asked {w.name} [{w.offset}, +{w.length}), got another"
                        )
                    out.write(chunk.data)
                    have += w.length
                    report.fetched_bytes += w.length
            out.flush()
            os.fsync(out.fileno())
        if hash_file(part) != f.sha256:
            part.unlink()
            raise CorruptWeights(f"{f.name}: the shipped bytes do not match its sha256; refetch")
        os.replace(part, dest)
    logger.info(
        "model %s: %d bytes fetched, %d resumed", root, report.fetched_bytes, report.resumed_bytes
    )
    return report


class CommChannel:
    """Wants and chunks over a :class:`Communicator`: ``ask`` on the worker, ``serve_one`` on
    the master (one answer per call, so the master's own loop decides when)."""

    def __init__(self, comm: Communicator, peer: int, *, timeout: float | None = 60.0) -> None:
        self.comm, self.peer, self.timeout = comm, peer, timeout

    def ask(self, want: Want) -> Chunk:
        return self.ask_many([want])[0]

    def ask_many(self, wants: list[Want]) -> list[Chunk]:
        """All of ``wants`` sent, then their chunks received (one peer's messages on one tag
        arrive in order)."""
        for want in wants:
            meta = {"name": want.name, "offset": want.offset, "length": want.length}
            self.comm.send(self.peer, [], meta, tag=WANT, timeout=self.timeout)
        return [self._chunk(w) for w in wants]

    def _chunk(self, want: Want) -> Chunk:
        tensors, got = self.comm.recv(self.peer, tag=CHUNK, timeout=self.timeout)
        if got.get("error"):
            raise ProtocolError(f"the master refused {want.name}: {got['error']}")
        if len(tensors) != 1 or tensors[0].dtype != torch.uint8 or tensors[0].numel() > MAX_CHUNK:
            raise ProtocolError("a chunk carries one uint8 tensor of at most MAX_CHUNK bytes")
        name, offset = got.get("name"), got.get("offset")
        if not isinstance(name, str) or not isinstance(offset, int):
            raise ProtocolError("a chunk's meta must name its file and offset")
        return Chunk(name, offset, tensors[0].numpy().tobytes())

    def serve_one(self, server: ShipServer, *, count: bool = False) -> Want | bool | None:
        """Answer one want from ``peer``: the want, or None when it was refused (the worker is
        told why); with ``count``, True for an answered or refused want and False when the
        worker said it is done."""
        _, meta = self.comm.recv(self.peer, tag=WANT, timeout=self.timeout)
        if meta.get("done"):
            return False
        try:
            want = Want(
                name=meta.get("name", ""),
                offset=meta.get("offset", -1),
                length=meta.get("length", 0),
            )
            chunk = server.answer(want)
        except ProtocolError as e:
            self.comm.send(self.peer, [], {"error": str(e)}, tag=CHUNK, timeout=self.timeout)
            return True if count else None
        data = torch.frombuffer(bytearray(chunk.data), dtype=torch.uint8)
        meta_out = {"name": chunk.name, "offset": chunk.offset}
        self.comm.send(self.peer, [data], meta_out, tag=CHUNK, timeout=self.timeout)
        return True if count else want


MANIFEST = "edge.ship.manifest"  # master -> worker: what it will get


def offer(comm: Communicator, worker: int, server: ShipServer, *, timeout: float = 60.0) -> int:
    """The master's whole side for one worker: send it the manifest, answer its wants until it
    says it is done (or gives up), and return how many wants were answered. A worker silent
    for ``timeout`` ends it with the communicator's timeout error."""
    comm.send(worker, [], server.manifest.encode(), tag=MANIFEST, timeout=timeout)
    channel = CommChannel(comm, worker, timeout=timeout)
    served = 0
    while channel.serve_one(server, count=True):
        served += 1
    return served


def receive(
    comm: Communicator, master: int, cfg: FetchConfig, *, timeout: float = 60.0
) -> FetchReport:
    """The worker's whole side: take the manifest, fetch what is missing, tell the master it
    is done (also when the fetch failed, so it does not wait for wants that never come)."""
    _, meta = comm.recv(master, tag=MANIFEST, timeout=timeout)
    manifest = Manifest.decode(meta)
    channel = CommChannel(comm, master, timeout=timeout)
    try:
        report = fetch(manifest, channel.ask, cfg, ask_many=channel.ask_many)
        report.model = model_path(report, [f.name for f in manifest.files])
        return report
    finally:
        comm.send(master, [], {"done": True}, tag=WANT, timeout=timeout)


def decline(comm: Communicator, master: int, *, timeout: float = 60.0) -> None:
    """A worker that cannot take a shipment (no cache directory): the manifest consumed, the
    master told it is done, so neither side waits on the other."""
    comm.recv(master, tag=MANIFEST, timeout=timeout)
    comm.send(master, [], {"done": True}, tag=WANT, timeout=timeout)


def model_path(report: FetchReport, manifest_names: Sequence[str]) -> Path:
    """What a worker loads from its cache entry: a single shipped file itself (a GGUF file),
    else the entry as a directory."""
    return report.path / manifest_names[0] if len(manifest_names) == 1 else report.path


def wants_needed(manifest: Manifest, chunk_bytes: int, have: Sequence[int] = ()) -> int:
    """How many wants a fresh fetch of ``manifest`` sends (``have``: bytes already held per
    file, in manifest order)."""
    held = list(have) + [0] * (len(manifest.files) - len(have))
    return sum(-(-(f.size - h) // chunk_bytes) for f, h in zip(manifest.files, held))
