"""Worker state as (named tensors, JSON metadata): checkpoints, and state handed to newcomers.

Tensors go to safetensors, everything else to JSON: loading never runs ``torch.load``/pickle on
files or messages that might come from someone else. The same flat form travels on the wire
(``Communicator.send`` of tensors + msgpack metadata) when a joining worker is brought up to date.

A multi-rank site checkpoints with ``torch.distributed.checkpoint`` (DCP) instead
(:func:`save_sharded`/:func:`load_sharded`): one directory per site, every rank writing its own
shard in parallel, the metadata as JSON beside it. DCP's own ``.metadata`` index is a pickle
written by torch, so resume a site only from checkpoints your own run wrote.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from lowband.errors import ConfigError

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


def save_state(stem: Path, state: State) -> None:
    """Write ``stem.safetensors`` + ``stem.json`` atomically (temp files, then rename)."""
    tensors, meta = state
    stem.parent.mkdir(parents=True, exist_ok=True)
    tmp_t = stem.with_name(stem.name + ".safetensors.tmp")
    tmp_j = stem.with_name(stem.name + ".json.tmp")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp_t))
    tmp_j.write_text(json.dumps(meta, sort_keys=True))
    os.replace(tmp_t, stem.with_name(stem.name + ".safetensors"))
    os.replace(tmp_j, stem.with_name(stem.name + ".json"))


def load_state(stem: Path) -> State:
    t = stem.with_name(stem.name + ".safetensors")
    j = stem.with_name(stem.name + ".json")
    if not t.exists() or not j.exists():
        raise ConfigError("resume", f"no checkpoint at {stem} (.safetensors + .json)")
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
    path = _site_meta(directory, key)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "tensors": specs}, sort_keys=True))
    os.replace(tmp, path)


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
    safetensors file otherwise."""
    from lowband.models.llama import LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "save_pretrained"):  # a Hugging Face model: its own format
        from diloco.hf import export_hf

        return export_hf(model, out_dir)
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
