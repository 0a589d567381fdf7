"""Nested checkpoint directories: the converter, opening with checks, and reference loaders.

``lowband edge quantize MODEL_DIR --nested --out DIR`` writes (``quantize_nested_checkpoint``)::

    DIR/config.json, tokenizer files     copied
    DIR/model.safetensors                every non-expert tensor, unchanged
    DIR/experts/L{l:03d}_E{e:03d}.lbn    one file per expert (``edge.moe.planes`` format)
    DIR/nested.json                      manifest: format, group size, e, model shape, and per
                                         expert its file, bytes at every width and squared
                                         weight errors (nested and natively quantized)

``NestedCheckpoint`` opens such a directory (or a subset of its experts, for a tensor-parallel
rank or a placement) and refuses it, before anything is served, when it does not match.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping, Sequence

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from edge.moe.planes import (
    VERSION,
    ExpertFile,
    is_expert_key,
    iter_expert_keys,
    planes_to_codes,
    write_expert_file,
)
from edge.moe.quant import (
    WIDTHS,
    NestedQuantConfig,
    dequantize_nested,
    quantize_independent,
    quantize_int8,
    slice_codes,
)
from lowband.errors import ConfigError, CorruptWeights
from lowband.models.config import ModelConfig
from lowband.models.llama import LlamaForCausalLM, rope_inv_freq
from lowband.models.weights import is_renamed, split_fused, weight_files

MANIFEST = "nested.json"
_COPIED = (
    "config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "lowband_tokenizer.json",
)


def _err2(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float((w.float() - w_hat).pow(2).sum())


def _runtime_names(cfg: ModelConfig, handle) -> dict[str, str]:
    """The runtime's name of every tensor of an open safetensors file -> its key there. A
    family that names its experts otherwise (Qwen3-MoE: ``mlp.experts.E.gate_proj``,
    ``mlp.gate``) is renamed one to one (shapes only: nothing is read)."""
    out: dict[str, str] = {}
    for key in handle.keys():
        if not is_renamed(cfg, key):
            out[key] = key
            continue
        shape = handle.get_slice(key).get_shape()
        parts = list(split_fused(cfg, key, torch.empty(shape, device="meta")))
        if len(parts) != 1:  # a fused tensor (Phi-3) is no MoE's
            raise ConfigError("model_dir", f"{key}: a fused tensor in a mixture-of-experts model")
        out[parts[0][0]] = key
    return out


def quantize_nested_checkpoint(
    model_dir: str | Path, out_dir: str | Path, cfg: NestedQuantConfig | None = None
) -> Path:
    """Convert a Mixtral-style checkpoint: experts to nested plane files, the rest copied as is.

    ``out_dir`` gets ``config.json`` (and tokenizer files), ``model.safetensors`` with every
    non-expert tensor unchanged, ``experts/L{l}_E{e}.lbn`` and the manifest ``nested.json``,
    which also records each expert's squared weight error at every width, nested and
    independently quantized, for the quality report.
    """
    cfg = cfg or NestedQuantConfig()
    src, out = Path(model_dir), Path(out_dir)
    mcfg = ModelConfig.from_json(src)
    if not mcfg.is_moe:
        raise ConfigError(
            "model_dir", f"{src} is not a mixture-of-experts model (no num_local_experts)"
        )
    (out / "experts").mkdir(parents=True, exist_ok=True)
    handles = [safe_open(str(f), framework="pt") for f in weight_files(src)]
    where: dict[tuple[int, int], dict[str, tuple[int, str]]] = {}
    rest: dict[str, torch.Tensor] = {}
    for i, h in enumerate(handles):
        stored = _runtime_names(mcfg, h)  # runtime (Mixtral) name -> the file's key
        expert_keys = set()
        for layer, expert, name, key in iter_expert_keys(list(stored)):
            where.setdefault((layer, expert), {})[name] = (i, stored[key])
            expert_keys.add(key)
        rest.update({k: h.get_tensor(v) for k, v in stored.items() if k not in expert_keys})
    wanted = {(i, e) for i in range(mcfg.num_hidden_layers) for e in range(mcfg.num_local_experts)}
    bad = sorted(k for k in wanted if len(where.get(k, {})) != 3) or sorted(set(where) - wanted)
    if bad:
        raise ConfigError(
            "model_dir",
            f"{src}: expert tensors do not match config.json, e.g. layer/expert {bad[0]}",
        )
    entries = []
    for layer, expert in sorted(wanted):
        ws = {
            n: handles[i].get_tensor(k).float()
            for n, (i, k) in sorted(where[(layer, expert)].items())
        }
        qs = {n: quantize_int8(w, cfg.group_size, cfg.range_ext) for n, w in ws.items()}
        rel = f"experts/L{layer:03d}_E{expert:03d}.lbn"
        write_expert_file(out / rel, layer=layer, expert=expert, tensors=qs, layout=cfg.layout)
        nested = {
            b: sum(
                _err2(ws[n], dequantize_nested(slice_codes(q.codes, b), q.lo, q.step, b))
                for n, q in qs.items()
            )
            for b in WIDTHS
        }
        indep = {
            b: sum(_err2(w, quantize_independent(w, b, cfg.group_size)) for w in ws.values())
            for b in WIDTHS
        }
        with ExpertFile(out / rel) as ef:
            sizes = {b: ef.nbytes(b) for b in ef.widths}
        entries.append(
            {
                "layer": layer,
                "expert": expert,
                "file": rel,
                "bytes": {str(b): n for b, n in sizes.items()},
                "norm2": sum(float(w.pow(2).sum()) for w in ws.values()),
                "err2": {
                    "nested": {str(b): v for b, v in nested.items()},
                    "independent": {str(b): v for b, v in indep.items()},
                },
            }
        )
    save_file(
        {k: v.contiguous() for k, v in rest.items()},
        str(out / "model.safetensors"),
        metadata={"format": "pt"},
    )
    for name in _COPIED:
        if (src / name).exists():
            shutil.copyfile(src / name, out / name)
    manifest = {
        "format": "lowband-nested",
        "version": VERSION,
        "group_size": cfg.group_size,
        "range_ext": cfg.range_ext,
        "layout": cfg.layout,
        "model": _shape_signature(mcfg),
        "experts": entries,
    }
    (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
    return out


def _shape_signature(mcfg: ModelConfig) -> dict[str, int]:
    return {
        "num_hidden_layers": mcfg.num_hidden_layers,
        "num_local_experts": mcfg.num_local_experts,
        "hidden_size": mcfg.hidden_size,
        "intermediate_size": mcfg.intermediate_size,
    }


ExpertKey = tuple[int, int]  # (layer, expert)


class NestedCheckpoint:
    """An opened nested checkpoint directory, restricted to ``experts`` (default: all).

    Opening checks, before anything is served: the manifest format, that its shapes match
    ``config.json``, that every file exists with the size and tensor shapes its header promises
    and, with ``verify=True``, every checksum. Tensor-parallel or placed serving opens only its
    own subset of experts.
    """

    def __init__(
        self, root: str | Path, *, experts: Sequence[ExpertKey] | None = None, verify: bool = True
    ) -> None:
        self.root = Path(root)
        try:
            manifest = json.loads((self.root / MANIFEST).read_text())
        except FileNotFoundError:
            raise ConfigError(
                "model_dir",
                f"{self.root} has no {MANIFEST}: convert it with "
                "`lowband edge quantize MODEL_DIR --nested --out DIR`",
            ) from None
        except json.JSONDecodeError as exc:
            raise CorruptWeights(f"{self.root / MANIFEST}: not valid JSON ({exc})") from None
        if manifest.get("format") != "lowband-nested" or manifest.get("version") != VERSION:
            raise CorruptWeights(
                f"{self.root / MANIFEST}: unknown format/version "
                f"{manifest.get('format')!r}/{manifest.get('version')!r}"
            )
        self.config = ModelConfig.from_json(self.root)
        if manifest.get("model") != _shape_signature(self.config):
            raise CorruptWeights(
                f"{self.root}: config.json {_shape_signature(self.config)} does not "
                f"match the expert planes {manifest.get('model')}"
            )
        self.group_size = int(manifest["group_size"])
        self.entries = {(int(e["layer"]), int(e["expert"])): e for e in manifest["experts"]}
        keys = sorted(self.entries) if experts is None else list(experts)
        missing = [k for k in keys if k not in self.entries]
        if missing:
            raise ConfigError("experts", f"{self.root} has no expert (layer, expert) {missing[0]}")
        self.files: dict[ExpertKey, ExpertFile] = {}
        try:
            for k in keys:
                self.files[k] = self._open(k, verify)
        except BaseException:
            self.close()
            raise

    def _open(self, key: ExpertKey, verify: bool) -> ExpertFile:
        ef = ExpertFile(self.root / self.entries[key]["file"])
        h, i = self.config.hidden_size, self.config.intermediate_size
        want = {"w1": (i, h), "w2": (h, i), "w3": (i, h)}
        got = {t.name: t.shape for t in ef.tensors}
        if (ef.layer, ef.expert) != key or got != want or ef.group_size != self.group_size:
            ef.close()
            raise CorruptWeights(
                f"{ef.path}: holds layer/expert {(ef.layer, ef.expert)} shapes {got} "
                f"g={ef.group_size}; config.json expects {key} {want} g={self.group_size}"
            )
        if verify:
            try:
                ef.verify()
            except CorruptWeights:
                ef.close()
                raise
        return ef

    @property
    def keys(self) -> list[ExpertKey]:
        return list(self.files)

    def sizes(self) -> dict[ExpertKey, dict[int, int]]:
        """{expert: {bits: bytes resident at that width}} for every width its file serves."""
        return {k: {b: f.nbytes(b) for b in f.widths} for k, f in self.files.items()}

    def read_matrices(self, key: ExpertKey, bits: int) -> dict[str, torch.Tensor]:
        """Float32 weights of one expert served at ``bits`` (reads the top ``bits`` planes)."""
        f = self.files[key]
        f.nbytes(bits)  # raises for a width the file cannot serve
        block, groups = f.read_scale_block(), f.n_groups
        codes = f.read_codes() if f.layout == "bytes" else planes_to_codes(f.read_planes(0, bits))
        weights = dequantize_nested(codes, block[:groups], block[groups:], bits)
        return {name: w.clone() for name, w in f.split(weights).items()}

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        self.files = {}


def load_backbone(root: str | Path, *, dtype: torch.dtype = torch.float32) -> LlamaForCausalLM:
    """The model with every non-expert weight loaded and the experts left on the ``meta`` device
    (no memory): serving routes them through an expert store via ``SparseMoE.expert_fn``."""
    root = Path(root)
    cfg = ModelConfig.from_json(root)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    expected = {
        k
        for k in model.state_dict()
        if not is_expert_key(k) and not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    with safe_open(str(root / "model.safetensors"), framework="pt") as sf:
        got = {k: sf.get_tensor(k).to(dtype) for k in sf.keys() if k in expected}
    if expected - got.keys():
        raise CorruptWeights(f"{root}/model.safetensors lacks {sorted(expected - got.keys())[:3]}")
    model.load_state_dict(got, strict=False, assign=True)
    model.inv_freq = rope_inv_freq(cfg)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def load_dense(root: str | Path, bits: int | Mapping[ExpertKey, int] = 8) -> LlamaForCausalLM:
    """The model with every expert dequantized to float32 at ``bits`` (one width or per expert):
    the reference that serving through the store must reproduce, and the quality evaluation."""
    model = load_backbone(root)
    ckpt = NestedCheckpoint(root, verify=False)
    try:
        for layer, e in ckpt.keys:
            b = bits if isinstance(bits, int) else bits[(layer, e)]
            mats = ckpt.read_matrices((layer, e), b)
            expert = model.model.layers[layer].block_sparse_moe.experts[e]
            for name, w in mats.items():
                getattr(expert, name).weight = torch.nn.Parameter(w, requires_grad=False)
    finally:
        ckpt.close()
    return model
