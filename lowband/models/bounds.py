"""A checkpoint's ``config.json`` checked against its safetensors headers before the model is
built (issue 25).

``config.json`` is a list of claims; built on trust, one claiming 2^20 layers keeps
``load_pretrained`` busy for good building a million meta-device layers before it finds the
weights missing. The safetensors library already bounds each file's header and keeps every
tensor's data inside its file; here the config's widths and layer count are bounded by the
tensors those headers list (shapes only: no tensor data is read). A violation is a
:class:`ConfigError` naming the field or tensor.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

from safetensors import SafetensorError, safe_open

from lowband.errors import ConfigError
from lowband.models.config import ModelConfig


def tensor_shapes(files: Sequence[Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape in ``files``, from their headers."""
    shapes: dict[str, tuple[int, ...]] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                for name in sf.keys():
                    shapes[name] = tuple(sf.get_slice(name).get_shape())
        except (OSError, SafetensorError) as exc:
            raise ConfigError("weights", f"{f} is not a readable safetensors file: {exc}") from None
    return shapes


def check_checkpoint(cfg: ModelConfig, files: Sequence[Path]) -> None:
    """Bound ``cfg`` by the tensors of ``files``: the embedding is (vocab_size, hidden_size),
    there are no more layers than tensors, and every layer's input norm is (hidden_size,)."""
    shapes = tensor_shapes(files)
    embd = shapes.get("model.embed_tokens.weight")
    if embd is None or len(embd) != 2:
        raise ConfigError("model.embed_tokens.weight", "the checkpoint has no 2-D embedding")
    if embd[1] != cfg.hidden_size:
        raise ConfigError(
            "hidden_size", f"{cfg.hidden_size}, but model.embed_tokens.weight is {embd}"
        )
    if embd[0] != cfg.vocab_size:
        raise ConfigError(
            "vocab_size", f"{cfg.vocab_size}, but model.embed_tokens.weight is {embd}"
        )
    layers = cfg.num_hidden_layers
    if layers > len(shapes):
        raise ConfigError(
            "num_hidden_layers", f"{layers} layers, but the checkpoint holds {len(shapes)} tensors"
        )
    for i in range(layers):
        name = f"model.layers.{i}.input_layernorm.weight"
        got = shapes.get(name)
        if got is None:
            raise ConfigError(name, f"missing (num_hidden_layers says {layers} layers)")
        if got != (cfg.hidden_size,):
            raise ConfigError(name, f"shape {got}, expected ({cfg.hidden_size},)")


__all__ = ["check_checkpoint", "tensor_shapes"]
