"""Model configuration: the subset of a Hugging Face ``config.json`` a Llama-family decoder needs."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from lowband.errors import ConfigError

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "mistral", "mixtral")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """Shape of a Llama-family decoder (Llama, Mistral, Qwen2, Mixtral)."""

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
    # Mixture of experts (Mixtral): 0 experts means a dense SwiGLU MLP.
    num_local_experts: int = 0
    num_experts_per_tok: int = 2
    # Mistral-style sliding-window attention: position i attends to keys j with i - j < W
    # (None: full causal attention).
    sliding_window: int | None = None
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
        if self.num_local_experts and not 1 <= self.num_experts_per_tok <= self.num_local_experts:
            raise ConfigError(
                "num_experts_per_tok",
                f"must be in [1, {self.num_local_experts}], got {self.num_experts_per_tok}",
            )

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
        if d.get("model_type") == "qwen2" or d.get("use_sliding_window") is False:
            # Qwen2 configs carry a sliding_window that only applies with use_sliding_window
            # (refused above when true).
            kwargs.pop("sliding_window", None)
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
        d["hidden_act"] = "silu"
        arch = {
            "llama": "LlamaForCausalLM",
            "qwen2": "Qwen2ForCausalLM",
            "mistral": "MistralForCausalLM",
            "mixtral": "MixtralForCausalLM",
        }[self.model_type]
        d["architectures"] = [arch]
        if not self.is_moe:
            d.pop("num_local_experts")
            d.pop("num_experts_per_tok")
        return {**self.extra, **d}


def _refuse_unimplemented(d: dict[str, Any]) -> None:
    """Config fields that change the maths and this implementation does not do: refuse them
    instead of silently diverging from transformers. Each entry: field -> the values that are
    harmless (what the implementation does anyway)."""
    harmless: dict[str, tuple[Any, ...]] = {
        "hidden_act": ("silu", "swish"),
        "mlp_bias": (False,),
        "use_sliding_window": (False,),  # Qwen2: per-layer windows (max_window_layers)
        "attn_logit_softcapping": (None,),
        "final_logit_softcapping": (None,),
        "partial_rotary_factor": (None, 1, 1.0),
        "use_qk_norm": (False,),
        "qk_layernorm": (False,),
        "no_rope_layers": (None,),
    }
    types = set(d.get("layer_types") or ())
    if types - {"full_attention", "sliding_attention"} or len(types) > 1:
        raise ConfigError(
            "layer_types",
            f"{sorted(types)}: per-layer attention types are not "
            "implemented (all layers must be alike)",
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
