"""The token lookup of a tied embedding, training on the CPU: its gradient added in place.

A tied model (Gemma 3, Llama 3.2, Qwen2.5: the LM head is the embedding matrix E, (V, H)) gets
two gradients for E in every backward pass: the head's, a dense (V, H) product, and the
lookup's, which autograd also makes dense ((V, H) zeros with the looked-up rows added), and
then sums them into a third. For Gemma 3 270M, whose E is 63 % of the parameters, that is
8 bytes per element of E held at once on top of the gradient itself: 5 B/param of a worker's
peak, more than the global copy θ_g that Streaming DiLoCo adds.

Here the lookup's backward keeps only the rows it touched (B·T of them) and adds them into
E's gradient once the head's has been accumulated there (a post-accumulate-grad hook on E:
autograd accumulates a leaf only after every node that feeds it ran, the lookup's backward
included, so the rows are always pending by then). E's gradient is the same sum as before,
the repeated tokens' rows added one by one (rounding may differ from the dense path's in the
last bit).

Used only where it is safe and pays: E trains, gradients are on, the CPU (CUDA's ``index_add_``
is non-deterministic), and eager mode (a compiled graph cannot keep the rows aside).
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

# The rows each tied weight's lookups left for its hook, by ``id(weight)`` (a tensor cannot be
# a dictionary key: ``==`` compares elements); an entry goes with its weight.
_PENDING: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}


def trained_tied_weight(embed: torch.nn.Module, head: torch.nn.Module) -> torch.Tensor | None:
    """E when :func:`tied_lookup` should replace ``embed``'s lookup: the head's weight is E
    (tied), E trains, gradients are on, on the CPU, eager. Else None (also for edge's packed
    embeddings, which have no ``weight``)."""
    weight: torch.Tensor | None = getattr(embed, "weight", None)
    tied = weight is not None and getattr(head, "weight", None) is weight
    if weight is None or not tied:
        return None
    if not (weight.requires_grad and torch.is_grad_enabled() and weight.device.type == "cpu"):
        return None
    return None if torch.compiler.is_compiling() else weight


def _add_rows(weight: torch.Tensor) -> None:
    """The post-accumulate-grad hook: the lookups' rows into E's (now accumulated) gradient."""
    pending = _PENDING.get(id(weight))
    if not pending or weight.grad is None:
        return
    grad = weight.grad
    while pending:
        ids, rows = pending.pop(0)
        grad.index_add_(0, ids, rows.to(grad.dtype))


class _TiedLookup(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[None, None]:
        (ids,) = ctx.saved_tensors
        weight = ctx.weight
        # (B·T,) ids and their (B·T, H) rows; E's gradient itself comes from the head alone.
        _PENDING[id(weight)].append((ids.reshape(-1), grad.reshape(-1, grad.shape[-1])))
        return None, None


def tied_lookup(ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``F.embedding(ids, weight)`` whose gradient for ``weight`` is added into the gradient the
    head gives the same (tied) weight, in place. ``weight`` must also be used by the head in the
    same backward pass (the model checks the tie), or the rows would never be added."""
    key = id(weight)
    if key not in _PENDING:
        _PENDING[key] = []
        weight.register_post_accumulate_grad_hook(_add_rows)
        weakref.finalize(weight, _PENDING.pop, key, None)
    out: torch.Tensor = _TiedLookup.apply(ids, weight)
    return out
