"""Worker state as (named tensors, JSON metadata): checkpoints, and state handed to newcomers.

Tensors go to safetensors, everything else to JSON: loading never runs ``torch.load``/pickle on
files or messages that might come from someone else. The same flat form travels on the wire
(``Communicator.send`` of tensors + msgpack metadata) when a joining worker is brought up to date.

Every file is written durably (:func:`durable_write`: a temp file in the same directory, fsync,
rename, fsync of the directory), so a crash leaves the old file or the new one, never a torn
one. A checkpoint of two files is complete only when its manifest (``stem.manifest.json``,
written last) names both: the safetensors header carries the manifest's random id and the JSON
its SHA-256, so a crash between the two files (or between them and the manifest) leaves a stem
that :func:`is_complete` rejects, and :func:`latest_state` resumes from the newest complete one.
Exports (:func:`export_model`) are built in a temp directory and renamed into place: complete
or absent.

A multi-rank site checkpoints with ``torch.distributed.checkpoint`` (DCP) instead
(:func:`save_sharded`/:func:`load_sharded`): one directory per site, every rank writing its own
shard in parallel, the metadata as JSON beside it. DCP's own ``.metadata`` index is a pickle
written by torch, so resume a site only from checkpoints your own run wrote.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable, cast

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from lowband.errors import ConfigError

logger = logging.getLogger(__name__)

State = tuple[dict[str, torch.Tensor], dict[str, Any]]


def optimizer_state(opt: torch.optim.Optimizer, prefix: str) -> State:
    """Flatten ``opt.state_dict()``: tensors under ``{prefix}.{param}.{key}``, the rest as JSON."""
    sd = opt.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for pid, entry in sd["state"].items():
        for key, value in entry.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{prefix}.{pid}.{key}"] = value.detach().to("cpu", copy=True).contiguous()
            else:
                scalars.setdefault(str(pid), {})[key] = value
    groups = [
        {k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "scalars": scalars}


def load_optimizer_state(
    opt: torch.optim.Optimizer, prefix: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]
) -> None:
    """Inverse of :func:`optimizer_state`."""
    state: dict[int, dict[str, Any]] = {}
    head = prefix + "."
    for name, value in tensors.items():
        if name.startswith(head):
            pid, key = name[len(head) :].split(".", 1)
            state.setdefault(int(pid), {})[key] = value.clone()
    for pid, entry in meta.get("scalars", {}).items():
        state.setdefault(int(pid), {}).update(entry)
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g and isinstance(g["betas"], list):
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    opt.load_state_dict({"state": state, "param_groups": groups})


def _fsync(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk (both open read-only on Linux)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def durable_write(path: Path, write: Callable[[Path], object]) -> None:
    """``write(tmp)`` a temp file beside ``path``, fsync it, rename it over ``path``, fsync the
    directory: after a crash ``path`` is the old file or the new one (the rename is atomic, and
    the fsyncs order the data before the name on disk)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
    try:
        write(tmp)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _fsync(path.parent)


def _files(stem: Path) -> tuple[Path, Path, Path]:
    """A checkpoint's tensors, metadata and manifest."""
    name = stem.name
    return (
        stem.with_name(name + ".safetensors"),
        stem.with_name(name + ".json"),
        stem.with_name(name + ".manifest.json"),
    )


def save_state(stem: Path, state: State) -> None:
    """Write ``stem.safetensors`` + ``stem.json`` durably, then the manifest naming them."""
    tensors, meta = state
    stem.parent.mkdir(parents=True, exist_ok=True)
    t, j, m = _files(stem)
    cid = secrets.token_hex(16)  # this checkpoint's id, in the safetensors header and manifest
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    durable_write(t, lambda tmp: save_file(tensors, str(tmp), metadata={"checkpoint": cid}))
    body = json.dumps(meta, sort_keys=True).encode()
    durable_write(j, lambda tmp: tmp.write_bytes(body))
    manifest = {
        "format": 1,
        "checkpoint": cid,
        "tensors": t.name,
        "meta": j.name,
        "meta_sha256": hashlib.sha256(body).hexdigest(),
        "written_ns": time.time_ns(),
    }
    durable_write(m, lambda tmp: tmp.write_text(json.dumps(manifest, sort_keys=True)))


def _manifest(stem: Path) -> dict[str, Any] | None:
    """The manifest of a complete checkpoint at ``stem``, else None (missing, torn, or naming
    files from another save)."""
    t, j, m = _files(stem)
    try:
        doc = json.loads(m.read_text())
        if not isinstance(doc, dict) or doc.get("format") != 1:
            return None
        if hashlib.sha256(j.read_bytes()).hexdigest() != doc.get("meta_sha256"):
            return None
        with safe_open(str(t), framework="pt") as sf:
            if (sf.metadata() or {}).get("checkpoint") != doc.get("checkpoint"):
                return None
    except (OSError, ValueError, SafetensorError):
        return None
    return doc


def is_complete(stem: Path) -> bool:
    """Whether ``stem``'s manifest names the ``.safetensors`` and ``.json`` beside it."""
    return _manifest(stem) is not None


def latest_state(directory: Path, name: str) -> Path | None:
    """The newest complete checkpoint ``name`` in ``directory`` itself or in one of its
    subdirectories (``checkpoints/step-*``, ``checkpoints/final``), by when its manifest was
    written; None when there is none."""
    candidates = [directory / name]
    if directory.is_dir():
        candidates += [d / name for d in sorted(directory.iterdir()) if d.is_dir()]
    found = [(doc["written_ns"], stem) for stem in candidates if (doc := _manifest(stem))]
    return max(found, key=lambda f: f[0])[1] if found else None


def load_state(stem: Path) -> State:
    t, j, m = _files(stem)
    if not t.exists() or not j.exists():
        raise ConfigError("resume", f"no checkpoint at {stem} (.safetensors + .json)")
    if m.exists() and not is_complete(stem):
        raise ConfigError(
            "resume",
            f"the checkpoint at {stem} is incomplete (its files do not match {m.name}: a save "
            "was interrupted); resume from an earlier one",
        )
    return load_file(str(t)), json.loads(j.read_text())


def _spec_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ConfigError("resume", f"unknown tensor dtype {name!r} in a site checkpoint")
    return dtype


def _site_meta(directory: Path, key: str) -> Path:
    return directory / f"site-{key}.json"


def has_sharded(directory: Path, key: str) -> bool:
    return _site_meta(directory, key).exists()


def save_sharded(directory: Path, state: State, *, key: str, process_group: Any = None) -> None:
    """One site rank's ``state`` into the DCP checkpoint ``directory`` (a collective of the
    site's process group: every rank calls it at the same step). ``key`` (the rank's worker id)
    prefixes its tensors, which are this rank's alone: DCP would de-duplicate equal keys of
    plain tensors as if they were replicas. The tensor list (names, shapes, dtypes) and the
    JSON metadata go to ``site-{key}.json``, written last (temp file, then rename): a
    checkpoint without it is incomplete."""
    import torch.distributed.checkpoint as dcp

    tensors, meta = state
    directory.mkdir(parents=True, exist_ok=True)
    dcp.save(
        {f"{key}/{k}": v.contiguous() for k, v in tensors.items()},
        checkpoint_id=str(directory),
        process_group=process_group,
    )
    specs = {k: [list(v.shape), str(v.dtype).removeprefix("torch.")] for k, v in tensors.items()}
    body = json.dumps({"meta": meta, "tensors": specs}, sort_keys=True)
    durable_write(_site_meta(directory, key), lambda tmp: tmp.write_text(body))


def load_sharded(directory: Path, *, key: str, process_group: Any = None) -> State:
    """Inverse of :func:`save_sharded` for the same rank (a collective, like the save)."""
    import torch.distributed.checkpoint as dcp

    path = _site_meta(directory, key)
    if not path.exists():
        raise ConfigError("resume", f"no site checkpoint of {key} in {directory} ({path.name})")
    doc = json.loads(path.read_text())
    state = {
        f"{key}/{k}": torch.empty(shape, dtype=_spec_dtype(dt))
        for k, (shape, dt) in doc["tensors"].items()
    }
    import torch.distributed as dist

    # Outside a site (a test, a conversion script) the shard is read by this process alone.
    dcp.load(
        state,
        checkpoint_id=str(directory),
        process_group=process_group,
        no_dist=not dist.is_initialized(),
    )
    head = len(key) + 1
    return {k[head:]: v for k, v in state.items()}, doc["meta"]


def export_model(model: torch.nn.Module, out_dir: Path, *, byte_tokenizer: bool) -> Path:
    """Save the model in the format ``edge`` loads: HF ``config.json`` + ``model.safetensors``
    (+ the byte-tokenizer marker when the run trained on bytes) for the Llama family, a bare
    safetensors file otherwise. Complete or absent: written into a temp directory beside
    ``out_dir``, every file fsynced, then renamed into place (a previous export is replaced
    only once the new one is whole)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = out_dir.with_name(f".{out_dir.name}.{secrets.token_hex(4)}.tmp")
    old = out_dir.with_name(f".{out_dir.name}.{secrets.token_hex(4)}.old")
    try:
        tmp.mkdir()
        _write_export(model, tmp, byte_tokenizer=byte_tokenizer)
        for f in tmp.rglob("*"):
            if f.is_file():
                _fsync(f)
        if out_dir.is_dir():  # keep what else lives there (a Flower checkpoint's outer.*)
            for f in out_dir.iterdir():
                if f.is_file() and not (tmp / f.name).exists():
                    os.link(f, tmp / f.name)
        _fsync(tmp)
        if out_dir.exists():
            os.replace(out_dir, old)
        os.replace(tmp, out_dir)
        _fsync(out_dir.parent)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
    return out_dir


def _write_export(model: torch.nn.Module, out_dir: Path, *, byte_tokenizer: bool) -> Path:
    from lowband.models.llama import LlamaForCausalLM

    if hasattr(model, "save_pretrained"):  # a Hugging Face model: its own format
        from diloco.hf import SavesPretrained, export_hf

        # cast: checked just above; nn.Module's __getattr__ types the method as Tensor | Module
        return export_hf(cast(SavesPretrained, model), out_dir)
    if isinstance(model, LlamaForCausalLM):
        from lowband.models.tokenizer import ByteTokenizer
        from lowband.models.weights import save_pretrained

        save_pretrained(model, out_dir)
        if byte_tokenizer:
            ByteTokenizer().save(out_dir)
    else:
        save_file(
            {k: v.detach().contiguous() for k, v in model.state_dict().items()},
            str(out_dir / "model.safetensors"),
        )
    return out_dir
