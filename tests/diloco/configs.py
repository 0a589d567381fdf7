"""The small language-model run the DiLoCo tests share.

``diloco.config.tiny()`` made smaller still: a 32-wide model with 2 heads on 16-token batches of
4, so a run of a few dozen steps takes seconds on a CPU. Tests change what they test through
``small_lm``'s keyword arguments, which replace fields of the :class:`TrainConfig`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from diloco.config import DilocoConfig, TrainConfig, tiny
from lowband.models.config import ModelConfig


def small_model() -> ModelConfig:
    """``tiny()``'s model at hidden size 32 (2 heads) and 32 positions."""
    return dataclasses.replace(
        tiny().model,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        max_position_embeddings=32,
    )


def small_lm(**over: Any) -> TrainConfig:
    """Two workers, 18 steps of Streaming DiLoCo (H=6, P=2 fragments, tau=1, int8 with error
    feedback), no evaluation; ``over`` replaces any of these fields."""
    base = tiny()
    kw: dict[str, Any] = dict(
        mode=DilocoConfig(
            inner_steps=6, n_fragments=2, tau=1, alpha=0.5, codec="int8", error_feedback=True
        ),
        workers=2,
        steps=18,
        eval_every=0,
        model=small_model(),
        data=dataclasses.replace(base.data, seq_len=16, batch_size=4, eval_batches=2),
    )
    return dataclasses.replace(base, **{**kw, **over})
