"""What a GGUF file's metadata says about its model: the architecture (``general.architecture``)
as a lowband :class:`ModelConfig`, llama.cpp's tensor names as the runtime's HF names, and the
tokenizer with its chat template.

Architectures (llama.cpp's ``gguf-py`` ``MODEL_TENSORS`` give the tensor names of each):

* ``llama`` (Llama 1-3, Mistral, SmolLM...): llama.cpp's converter permutes the rows of
  ``attn_q`` / ``attn_k`` (weights and biases) for its interleaved rotary kernel; Llama 3.1's
  rope scaling is stored as ``rope_freqs.weight``, the (D/2,) divisors of the inverse
  frequencies, applied here as ``ModelConfig.rope_freq_factors``.
* ``qwen2`` (Qwen2 / Qwen2.5): q/k/v biases (``attn_q.bias`` ...), a head of its own unless
  ``output.weight`` is absent (then tied).
* ``qwen3``: per-head RMSNorms ``attn_q_norm`` / ``attn_k_norm`` and a head_dim of its own
  (``qwen3.attention.key_length``).
* ``gemma3`` (Gemma 3 text): sandwich norms (``post_attention_norm``, ``ffn_norm`` before the
  MLP, ``post_ffw_norm``), stored as 1 + w by the converter; q/k norms; the layer pattern,
  local rope base and attention scale that llama.cpp fixes for the architecture.

* ``phi3`` (Phi-3, Phi-4-mini): q/k/v fused in ``attn_qkv`` (rows q | k | v) and gate/up in
  ``ffn_up`` (rows gate | up), split at load into the runtime's projections; no sliding window
  (llama.cpp disables Phi-3's); long-context ``rope_factors_long/short`` files are refused.
* ``smollm3``: the llama layout (q/k permuted), every 4th layer without rope (NoPE), as
  llama.cpp fixes it for the architecture.
* ``qwen3moe`` (Qwen3-MoE): q/k norms, a router ``ffn_gate_inp`` and each layer's experts
  stacked in 3-D ``ffn_{gate,up,down}_exps`` tensors (split into Mixtral's per-expert
  ``w1``/``w3``/``w2`` at load); the top-k routing weights renormalised, as llama.cpp does.

qwen2/qwen3/qwen3moe/gemma3/phi3 use llama.cpp's NEOX rotary kernel, which pairs (i, i + D/2) as
HF does, so their converter writes q/k rows unpermuted. Any other architecture is refused
naming the value.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lowband.errors import ConfigError
from lowband.models.config import ModelConfig
from lowband.models.llama import with_rope_freq_factors

# A GGUF MoE layer's experts are one 3-D tensor per projection (E, rows, K): this prefix + ".w1"
# etc. names the stack, cut into ``block_sparse_moe.experts.{e}.w1.weight`` at load.
EXPERTS = "block_sparse_moe.experts"


@dataclass(frozen=True)
class Arch:
    """How llama.cpp's converter wrote one ``general.architecture``."""

    model_type: str  # the lowband / HF family
    permuted: bool = False  # q/k rows permuted for llama.cpp's interleaved rotary kernel
    norm_shift: float = 0.0  # added to every norm weight (Gemma's (1 + w) norms store w + 1)
    names: tuple[tuple[str, str], ...] = ()  # per-layer names that differ from LAYER_NAMES


ARCHS: dict[str, Arch] = {
    "llama": Arch("llama", permuted=True),
    "qwen2": Arch("qwen2"),
    "qwen3": Arch("qwen3"),
    "gemma3": Arch(
        "gemma3_text",
        norm_shift=1.0,
        names=(
            ("post_attention_norm.weight", "post_attention_layernorm.weight"),
            ("ffn_norm.weight", "pre_feedforward_layernorm.weight"),
            ("post_ffw_norm.weight", "post_feedforward_layernorm.weight"),
        ),
    ),
    "phi3": Arch(
        "phi3",
        names=(
            ("attn_qkv.weight", "self_attn.qkv_proj.weight"),
            ("ffn_up.weight", "mlp.gate_up_proj.weight"),
        ),
    ),
    "smollm3": Arch("smollm3", permuted=True),
    "qwen3moe": Arch(
        "qwen3_moe",
        names=(
            ("ffn_gate_inp.weight", "block_sparse_moe.gate.weight"),
            ("ffn_gate_exps.weight", f"{EXPERTS}.w1"),
            ("ffn_up_exps.weight", f"{EXPERTS}.w3"),
            ("ffn_down_exps.weight", f"{EXPERTS}.w2"),
        ),
    ),
}
# SmolLM3 in llama.cpp: layer i applies no rope when (i + 1) is a multiple of this.
SMOLLM3_NOPE_STEP = 4

# GGUF tensor name <-> HF name (per layer ``blk.{i}.`` <-> ``model.layers.{i}.``).
LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
}
TOP_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
ROPE_FREQS = "rope_freqs.weight"
MAGIC = b"GGUF"
# A split of a GGUF file keeps the file's tokenizer metadata in this GGUF without tensors.
TOKENIZER_GGUF = "tokenizer.gguf"


def is_gguf(path: str | Path) -> bool:
    """Whether ``path`` is a GGUF file, by its magic bytes (not by its name)."""
    p = Path(path)
    if not p.is_file():
        return False
    with p.open("rb") as f:
        return f.read(4) == MAGIC


def field(reader: Any, key: str, default: Any = None) -> Any:
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def architecture(reader: Any) -> tuple[str, Arch]:
    """The file's ``general.architecture`` and how its converter wrote it."""
    arch = field(reader, "general.architecture")
    if arch not in ARCHS:
        raise ConfigError(
            "general.architecture",
            f"GGUF architecture {arch!r} is not supported (supported: {', '.join(ARCHS)})",
        )
    return arch, ARCHS[arch]


def hf_names(num_layers: int, arch: Arch = ARCHS["llama"]) -> dict[str, str]:
    """Every GGUF tensor name the runtime knows -> its HF name."""
    out = dict(TOP_NAMES)
    layer = {**LAYER_NAMES, **dict(arch.names)}
    for i in range(num_layers):
        out.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in layer.items()})
    return out


def _need(reader: Any, key: str) -> int:
    v = field(reader, key)
    if v is None:
        raise ConfigError("model", f"GGUF lacks {key}")
    return int(v)


def _rope_scaling(reader: Any, pre: str) -> dict[str, Any] | None:
    kind = field(reader, pre + "rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": float(field(reader, pre + "rope.scaling.factor"))}
    raise ConfigError(pre + "rope.scaling.type", f"GGUF rope scaling {kind!r} is not supported")


def read_config(reader: Any) -> ModelConfig:
    """The model of a GGUF file's metadata (``{arch}.*`` keys) and tensor list."""
    arch, spec = architecture(reader)
    pre = arch + "."
    tensors = {t.name: t for t in reader.tensors}
    embd = tensors.get("token_embd.weight")
    if embd is None:
        raise ConfigError("model", "GGUF lacks token_embd.weight")
    heads = _need(reader, pre + "attention.head_count")
    kw: dict[str, Any] = dict(
        hidden_size=_need(reader, pre + "embedding_length"),
        num_hidden_layers=_need(reader, pre + "block_count"),
        intermediate_size=_need(reader, pre + "feed_forward_length"),
        num_attention_heads=heads,
        num_key_value_heads=int(field(reader, pre + "attention.head_count_kv", heads)),
        vocab_size=int(embd.shape[1]),  # GGUF shapes are (K, N): innermost first
        max_position_embeddings=int(field(reader, pre + "context_length", 2048)),
        rope_theta=float(field(reader, pre + "rope.freq_base", 10000.0)),
        rms_norm_eps=float(field(reader, pre + "attention.layer_norm_rms_epsilon", 1e-6)),
        rope_scaling=_rope_scaling(reader, pre),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        qk_norm="blk.0.attn_q_norm.weight" in tensors,
    )
    hd, vd = (
        field(reader, pre + "attention.key_length"),
        field(reader, pre + "attention.value_length"),
    )
    if hd is not None:
        kw["head_dim"] = int(hd)
    if vd is not None and hd is not None and int(vd) != int(hd):
        raise ConfigError(pre + "attention.value_length", f"{vd} != key_length {hd}")
    bos, eos = (
        field(reader, "tokenizer.ggml.bos_token_id"),
        field(reader, "tokenizer.ggml.eos_token_id"),
    )
    rot = field(reader, pre + "rope.dimension_count")
    if rot is not None and int(rot) != (kw.get("head_dim") or kw["hidden_size"] // heads):
        raise ConfigError(pre + "rope.dimension_count", f"{rot}: partial rotary is not implemented")
    if spec.model_type == "gemma3_text":
        kw.update(_gemma3(reader, pre, kw))
    elif spec.model_type == "smollm3":
        n = kw["num_hidden_layers"]
        kw["no_rope_layers"] = tuple(int((i + 1) % SMOLLM3_NOPE_STEP != 0) for i in range(n))
    elif spec.model_type == "qwen3_moe":
        kw.update(
            num_local_experts=_need(reader, pre + "expert_count"),
            num_experts_per_tok=_need(reader, pre + "expert_used_count"),
            intermediate_size=int(
                field(reader, pre + "expert_feed_forward_length", kw["intermediate_size"])
            ),
            norm_topk_prob=True,  # llama.cpp's qwen3moe graph always renormalises
        )
    cfg = ModelConfig(
        model_type=spec.model_type,
        bos_token_id=None if bos is None else int(bos),
        eos_token_id=None if eos is None else int(eos),
        **kw,
    )
    if ROPE_FREQS in tensors:  # llama.cpp's Llama 3.1 rope: divisors of the inverse frequencies
        t = tensors[ROPE_FREQS]
        if t.tensor_type.name != "F32":
            raise ConfigError("model", f"GGUF {ROPE_FREQS} must be F32, got {t.tensor_type.name}")
        cfg = with_rope_freq_factors(cfg, torch.from_numpy(np.array(t.data, dtype=np.float32)))
    return cfg


def _gemma3(reader: Any, pre: str, kw: dict[str, Any]) -> dict[str, Any]:
    """Gemma 3's fields as llama.cpp (``llama-model.cpp``, LLM_ARCH_GEMMA3) sets them: every
    6th layer global, the others sliding with a rope base of 10000 (``rope.freq_base_swa`` when
    the file has it); attention scaled by 1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the
    62-layer 27B; embeddings times sqrt(hidden); GeGLU; (1 + w) sandwich norms."""
    if field(reader, pre + "attn_logit_softcapping") is not None:
        raise ConfigError(
            pre + "attn_logit_softcapping", "attention softcapping is not implemented"
        )
    n, hd = (
        kw["num_hidden_layers"],
        kw.get("head_dim") or kw["hidden_size"] // kw["num_attention_heads"],
    )
    cap = field(reader, pre + "final_logit_softcapping")
    return dict(
        norm_unit_offset=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hidden_act="gelu_pytorch_tanh",
        sliding_window=int(field(reader, pre + "attention.sliding_window", 4096)),
        layer_types=tuple(
            "sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n)
        ),
        rope_local_theta=float(field(reader, pre + "rope.freq_base_swa", 10000.0)),
        query_pre_attn_scalar=float(
            kw["hidden_size"] // kw["num_attention_heads"] if n == 62 else hd
        ),
        final_logit_softcapping=None if cap is None else float(cap),
    )


def read_tokenizer(reader: Any):
    """The file's tokenizer (``tokenizer.ggml.*``) with its chat template
    (``tokenizer.chat_template``) attached, as ``load_tokenizer`` does for a directory."""
    from edge.formats.gguf_tokenizer import tokenizer_from_gguf
    from lowband.models.chat_template import template_from_gguf_metadata

    tok = tokenizer_from_gguf(reader)
    source = field(reader, "tokenizer.chat_template")
    if source is not None:
        tokens = tok.vocab.tokens

        def text(i: int | None) -> str | None:
            return tokens[i] if i is not None and 0 <= i < len(tokens) else None

        tok.chat_template = template_from_gguf_metadata(
            source,
            bos_token=text(tok.bos_token_id),
            eos_token=text(tok.eos_token_id),
            vocabulary=tok.special_tokens,
            eos_token_ids=[] if tok.eos_token_id is None else [tok.eos_token_id],
        )
    return tok


__all__ = [
    "EXPERTS",
    "is_gguf",
    "TOKENIZER_GGUF",
    "ARCHS",
    "architecture",
    "read_config",
    "read_tokenizer",
    "hf_names",
    "field",
]
