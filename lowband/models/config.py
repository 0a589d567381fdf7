"""Model configuration: the subset of a Hugging Face ``config.json`` a Llama-family decoder
needs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lowband.errors import ConfigError

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "mistral",
    "mixtral",
    "qwen3",
    "gemma3_text",
    "phi3",
    "smollm3",
    "qwen3_moe",
)
# Feed-forward activations the MLP implements (HF ``hidden_act`` / Gemma's ``hidden_activation``).
ACTIVATIONS = ("silu", "swish", "gelu_pytorch_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")
ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "mistral": "MistralForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "smollm3": "SmolLM3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, Mixtral, Qwen3, Gemma 3 text,
    Phi-3, SmolLM3). The family-specific fields below default to plain Llama maths."""

    model_type: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int | None = None  # None: multi-head attention (= num_attention_heads)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    tie_word_embeddings: bool = False
    # Mixture of experts (Mixtral, Qwen3-MoE): 0 experts means a dense SwiGLU MLP. With
    # experts, intermediate_size is each expert's width (Qwen3-MoE's moe_intermediate_size).
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    norm_topk_prob: bool = True  # renormalise the top-k routing weights (Qwen3-MoE: optional)
    # Mistral-style sliding-window attention: position i attends to keys j with i - j < W
    # (None: full causal attention).
    sliding_window: int | None = None
    # Per-layer attention kind ("full_attention" | "sliding_attention"; Gemma 3 interleaves them).
    # None: every layer uses ``sliding_window`` (None: full attention).
    layer_types: tuple[str, ...] | None = None
    # Rope base of the sliding layers (Gemma 3 ``rope_local_base_freq``; no scaling there).
    # None: the sliding layers use ``rope_theta`` and ``rope_scaling`` like the others.
    rope_local_theta: float | None = None
    # SmolLM3 NoPE: no_rope_layers[i] == 0 means layer i applies no rotary embedding.
    no_rope_layers: tuple[int, ...] | None = None
    # Precomputed per-frequency divisors of the rope inverse frequencies (D/2 values; GGUF's
    # ``rope_freqs.weight``, llama.cpp's form of Llama 3.1 scaling). None: none.
    rope_freq_factors: tuple[float, ...] | None = None
    hidden_act: str = "silu"  # SwiGLU's gate activation; Gemma: gelu_pytorch_tanh (GeGLU)
    qk_norm: bool = False  # Qwen3 / Gemma 3: RMSNorm over each head of q and k before rope
    # Gemma: norms multiply by (1 + weight), the checkpoint stores weight - 1.
    norm_unit_offset: bool = False
    # Gemma 2/3 sandwich: a norm after attention and around the MLP (pre and post).
    sandwich_norms: bool = False
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size)
    # Attention scores scaled by query_pre_attn_scalar**-0.5 (Gemma); None: head_dim**-0.5.
    query_pre_attn_scalar: float | None = None
    # Gemma: logits = cap * tanh(logits / cap). None: no capping.
    final_logit_softcapping: float | None = None
    torch_dtype: str = "float32"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    extra: dict[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ConfigError(
                "model_type", f"{self.model_type!r} is not one of {SUPPORTED_MODEL_TYPES}"
            )
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)}")
        if self.num_attention_heads % self.n_kv_heads:
            raise ConfigError(
                "num_key_value_heads",
                f"{self.n_kv_heads} does not divide num_attention_heads {self.num_attention_heads}",
            )
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            raise ConfigError(
                "hidden_size",
                f"{self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}; set head_dim",
            )
        if self.dim_per_head % 2:
            raise ConfigError(
                "head_dim", f"must be even for rotary embeddings, got {self.dim_per_head}"
            )
        if self.sliding_window is not None and self.sliding_window < 1:
            raise ConfigError("sliding_window", f"must be >= 1 or None, got {self.sliding_window}")
        kind = (self.rope_scaling or {}).get(
            "rope_type", (self.rope_scaling or {}).get("type", "default")
        )
        if kind not in ("default", "linear", "llama3"):
            raise ConfigError(
                "rope_scaling",
                f"rope type {kind!r} is not implemented (default, linear, llama3 are)",
            )
        self._check_families()
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError(
                "num_experts_per_tok",
                f"must be in [1, {self.num_local_experts}], got {self.num_experts_per_tok}",
            )

    def _check_families(self) -> None:
        """The per-layer and family fields: lengths match the layer count, values known."""
        n = self.num_hidden_layers
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(
                "hidden_act", f"{self.hidden_act!r} is not implemented (supported: {ACTIVATIONS})"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != n or set(self.layer_types) - set(LAYER_TYPES):
                raise ConfigError(
                    "layer_types",
                    f"need {n} entries of {LAYER_TYPES}, got {list(self.layer_types)}",
                )
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ConfigError("sliding_window", "layer_types has sliding layers but no window")
        if self.no_rope_layers is not None and (
            len(self.no_rope_layers) != n or set(self.no_rope_layers) - {0, 1}
        ):
            raise ConfigError(
                "no_rope_layers", f"need {n} entries of 0/1, got {list(self.no_rope_layers)}"
            )
        if self.rope_freq_factors is not None:
            if len(self.rope_freq_factors) != self.dim_per_head // 2:
                raise ConfigError(
                    "rope_freq_factors",
                    f"need head_dim/2 = {self.dim_per_head // 2} values, "
                    f"got {len(self.rope_freq_factors)}",
                )
            if self.rope_scaling:
                raise ConfigError(
                    "rope_freq_factors", "precomputed factors replace rope_scaling: set only one"
                )
        for name in ("query_pre_attn_scalar", "final_logit_softcapping", "rope_local_theta"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ConfigError(name, f"must be > 0 or None, got {v}")

    def layer_window(self, i: int) -> int | None:
        """The attention window W of layer i (None: full causal attention)."""
        if self.layer_types is None:
            return self.sliding_window
        return self.sliding_window if self.layer_types[i] == "sliding_attention" else None

    @property
    def cache_window(self) -> int | None:
        """The window a shared KV cache may drop positions by: only when every layer has the
        same one (a full-attention layer needs every position)."""
        ws = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return ws.pop() if len(ws) == 1 else None

    def layer_rope(self, i: int) -> str | None:
        """Which rotary table layer i uses: "global", "local" (sliding layers with their own
        base) or None (NoPE)."""
        if self.no_rope_layers is not None and not self.no_rope_layers[i]:
            return None
        if self.rope_local_theta is not None and self.layer_window(i) is not None:
            return "local"
        return "global"

    @property
    def n_kv_heads(self) -> int:
        return self.num_key_value_heads or self.num_attention_heads

    @property
    def dim_per_head(self) -> int:
        return self.head_dim or self.hidden_size // self.num_attention_heads

    @property
    def is_moe(self) -> bool:
        return self.num_local_experts > 0

    # ---- HF config.json ------------------------------------------------------------------------
    @classmethod
    def from_hf_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        known = {f.name for f in fields(cls)} - {"extra"}
        kwargs = {k: v for k, v in d.items() if k in known}
        # Mistral/Mixtral/Qwen2 name a few things differently or leave them implicit.
        if d.get("model_type") == "qwen2" and "attention_bias" not in d:
            kwargs["attention_bias"] = True
        if "dtype" in d and "torch_dtype" not in d:
            kwargs["torch_dtype"] = d["dtype"]
        rp = d.get("rope_parameters")  # transformers >= 5 nests theta and scaling here
        if isinstance(rp, dict):
            if "rope_theta" in rp:
                kwargs["rope_theta"] = rp["rope_theta"]
            if rp.get("rope_type", "default") != "default":
                kwargs["rope_scaling"] = {k: v for k, v in rp.items() if k != "rope_theta"}
        if kwargs.get("torch_dtype") is None:
            kwargs["torch_dtype"] = "float32"
        for k in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
        ):
            if k not in kwargs:
                raise ConfigError(k, "missing from config.json")
        _refuse_unimplemented(d)
        if d.get("model_type") in ("qwen2", "qwen3", "qwen3_moe", "smollm3") or (
            d.get("use_sliding_window") is False
        ):
            # Qwen2/3 and SmolLM3 configs carry a sliding_window that only applies with
            # use_sliding_window (refused above when true).
            kwargs.pop("sliding_window", None)
            kwargs.pop("layer_types", None)
        for k in ("layer_types", "no_rope_layers", "rope_freq_factors"):
            if kwargs.get(k) is not None:
                kwargs[k] = tuple(kwargs[k])
        if kwargs.get("layer_types") and len(set(kwargs["layer_types"])) == 1:
            kwargs["layer_types"] = None  # all alike: ``sliding_window`` says it (as before)
        kwargs.update(_family_fields(d))
        extra = {k: v for k, v in d.items() if k not in known}
        return cls(**kwargs, extra=extra)

    @classmethod
    def from_json(cls, path: str | Path) -> "ModelConfig":
        p = Path(path)
        if p.is_dir():
            p = p / "config.json"
        try:
            data = json.loads(p.read_text())
        except FileNotFoundError:
            raise ConfigError("config", f"no config.json at {p}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError("config", f"{p} is not valid JSON: {exc}") from None
        return cls.from_hf_dict(data)

    def to_hf_dict(self) -> dict[str, Any]:
        d = {k: v for k, v in asdict(self).items() if k != "extra"}
        d["num_key_value_heads"] = self.n_kv_heads
        d["head_dim"] = self.dim_per_head
        d["architectures"] = [ARCHITECTURES[self.model_type]]
        if not self.is_moe:
            d.pop("num_local_experts")
            d.pop("num_experts_per_tok")
        for k in ("layer_types", "no_rope_layers", "rope_freq_factors"):
            if d[k] is None:
                d.pop(k)
            else:
                d[k] = list(d[k])
        if self.model_type == "gemma3_text":
            d["hidden_activation"] = d["hidden_act"]
            d["rope_local_base_freq"] = self.rope_local_theta or self.rope_theta
            if self.layer_types is None:  # Gemma's config would otherwise interleave its own
                kind = "sliding_attention" if self.sliding_window else "full_attention"
                d["layer_types"] = [kind] * self.num_hidden_layers
        for k in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            if d[k] is None:
                d.pop(k)
        d.pop("rope_local_theta", None)
        if self.model_type == "qwen3_moe":
            d["moe_intermediate_size"] = self.intermediate_size
            d["num_experts"] = self.num_local_experts
        elif self.norm_topk_prob:  # the only routing Mixtral knows
            d.pop("norm_topk_prob")
        for f in fields(self):  # family switches left at Llama's value need not be written
            if f.name in _FAMILY_SWITCHES and d.get(f.name) == f.default:
                d.pop(f.name)
        return {**self.extra, **d}


# Fields ``from_hf_dict`` derives from model_type (written to config.json only when set).
_FAMILY_SWITCHES = ("qk_norm", "norm_unit_offset", "sandwich_norms", "scale_embeddings")


def _family_fields(d: dict[str, Any]) -> dict[str, Any]:
    """The fields a family implies (HF leaves them implicit in the model code)."""
    mt = d.get("model_type")
    out: dict[str, Any] = {}
    if mt in ("qwen3", "gemma3_text", "qwen3_moe"):
        out["qk_norm"] = True
    if mt == "qwen3_moe":  # every layer routed (refused otherwise): the dense width is unused
        out["intermediate_size"] = d.get("moe_intermediate_size", d["intermediate_size"])
        out["num_local_experts"] = d.get("num_experts", d.get("num_local_experts", 0))
        out["norm_topk_prob"] = bool(d.get("norm_topk_prob", False))
    if mt != "gemma3_text":
        return out
    out.update(
        norm_unit_offset=True,
        sandwich_norms=True,
        scale_embeddings=True,
        hidden_act=d.get("hidden_activation", d.get("hidden_act", "gelu_pytorch_tanh")),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        head_dim=d.get("head_dim", 256),
        tie_word_embeddings=d.get("tie_word_embeddings", True),
    )
    types = d.get("layer_types")
    if types is None:  # older configs: every `sliding_window_pattern`-th layer is global
        pattern = int(d.get("sliding_window_pattern", 6))
        n = int(d["num_hidden_layers"])
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    out["layer_types"] = tuple(types)
    out["sliding_window"] = d.get("sliding_window", 4096)
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        # transformers >= 5: one rope dict per layer type
        full, local = rp["full_attention"], rp.get("sliding_attention") or {}
        out["rope_theta"] = full.get("rope_theta", 1_000_000.0)
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
        out["rope_scaling"] = scaling if scaling.get("rope_type", "default") != "default" else None
        if local.get("rope_type", "default") != "default":
            raise ConfigError(
                "rope_parameters", "scaled rope on the sliding layers is not implemented"
            )
        out["rope_local_theta"] = local.get("rope_theta", 10_000.0)
    else:
        out["rope_theta"] = d.get("rope_theta", 1_000_000.0)
        out["rope_local_theta"] = d.get("rope_local_base_freq", 10_000.0)
    return out


def _refuse_unimplemented(d: dict[str, Any]) -> None:
    """Config fields that change the maths and this implementation does not do: refuse them
    instead of silently diverging from transformers. Each entry: field -> the values that are
    harmless (what the implementation does anyway)."""
    harmless: dict[str, tuple[Any, ...]] = {
        "mlp_bias": (False,),
        "use_sliding_window": (False,),  # Qwen2/3: per-layer windows (max_window_layers)
        "attn_logit_softcapping": (None,),
        "partial_rotary_factor": (None, 1, 1.0),
        "use_qk_norm": (False,),
        "qk_layernorm": (False,),
        "use_bidirectional_attention": (None, False),  # Gemma 3 embedding models
        "decoder_sparse_step": (1,),  # Qwen3-MoE: dense layers between routed ones
        "mlp_only_layers": ([],),
        "shared_expert_intermediate_size": (None, 0),  # Qwen2-MoE style shared expert
    }
    if d.get("model_type") != "gemma3_text" and (d.get("hidden_activation") or "silu") not in (
        "silu",
        "swish",
    ):
        raise ConfigError("hidden_activation", f"{d['hidden_activation']!r} is not implemented")
    rp = d.get("rope_parameters")
    if isinstance(rp, dict) and rp.get("partial_rotary_factor", 1.0) != 1.0:
        raise ConfigError(
            "partial_rotary_factor",
            f"{rp['partial_rotary_factor']!r}: rotary on part of each head is not implemented",
        )
    types = set(d.get("layer_types") or ())
    mixed_ok = d.get("model_type") == "gemma3_text"  # the family whose layers interleave
    if types - {"full_attention", "sliding_attention"} or (len(types) > 1 and not mixed_ok):
        raise ConfigError(
            "layer_types",
            f"{sorted(types)}: per-layer attention types are not "
            f"implemented for {d.get('model_type')!r} (all layers must be alike)",
        )
    if types == {"sliding_attention"} and not d.get("sliding_window"):
        raise ConfigError("sliding_window", "layer_types says sliding_attention but no window")
    for name, ok in harmless.items():
        if name in d and d[name] not in ok:
            raise ConfigError(
                name,
                f"{d[name]!r} changes the model's maths and is not "
                f"implemented by lowband (supported: {ok[0]!r})",
            )
