"""Muon on RaggedShard parameters: each matrix orthogonalized whole, by one rank.

The math is ``torch.optim.Muon``'s (same Newton–Schulz quintic, coefficients, normalisation, lerp
momentum, decoupled weight decay and learning-rate adjustment), written out here so the sharded
path can run it on a rank's piece. With the default ``ns_dtype=torch.bfloat16`` a single-process
run equals ``torch.optim.Muon`` bitwise.

Construction annotates every matrix that is not sharded yet with ``set_block(p, elements=p.numel())``
so the planner puts each whole matrix on one rank (balancing matrices over ranks); the owner then
orthogonalizes its local piece viewed as the matrix, and no step communicates. A matrix whose
layout spreads it over several ranks (sharded before the optimizer existed) is gathered to a
root rank per step instead (see :mod:`fsdp_pass.optim.blockwise`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

import torch
import torch.nn as nn
from torch import Tensor

from ..sharding.blocks import annotate_block
from .blockwise import BlockJob, BlockwiseOptimizer, flat_piece, gradient_layout

__all__ = ["Muon", "muon_param_groups", "zeropower_via_newtonschulz"]

NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # Keller Jordan's quintic, as torch.optim.Muon
ADJUST_LR_FNS = ("original", "match_rms_adamw")


def zeropower_via_newtonschulz(
    matrix: Tensor,
    steps: int = 5,
    coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
    eps: float = 1e-7,
    dtype: torch.dtype = torch.bfloat16,
) -> Tensor:
    """Approximately orthogonalize a 2-D ``matrix`` (``U S' Vᵀ`` with ``S'`` near 1), in ``dtype``.

    Same operations in the same order as ``torch.optim.Muon``: work on the wide orientation,
    divide by the Frobenius norm (clamped at ``eps``), then ``steps`` quintic iterations.
    """
    a, b, c = coefficients
    x = matrix.to(dtype)
    tall = matrix.size(0) > matrix.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)  # spectral norm <= 1; out of place: x may alias the caller's input
    for _ in range(steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def adjusted_lr(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    """``lr`` scaled for an ``A × B`` matrix: "original" ``sqrt(max(1, A/B))``, else ``0.2 sqrt(max(A, B))``."""
    rows, cols = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, rows / cols))
    return lr * 0.2 * math.sqrt(max(rows, cols))


def muon_param_groups(
    model: nn.Module, exclude: Iterable[str] = ("embed", "lm_head")
) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[str, nn.Parameter]]]:
    """Split trainable parameters into ``(matrices for Muon, the rest for AdamW)``, as ``(name, param)``.

    Muon is for hidden-layer matrices: 2-D parameters whose name contains none of ``exclude``
    (embeddings and the output head belong with AdamW). Named pairs let both optimizers name
    parameters in messages.
    """
    excluded = tuple(exclude)
    matrices, rest = [], []
    for name, p in model.named_parameters():
        if p.requires_grad:
            (matrices if p.ndim == 2 and not any(e in name for e in excluded) else rest).append((name, p))
    return matrices, rest


class Muon(BlockwiseOptimizer):
    """Muon (momentum + Newton–Schulz orthogonalization) for 2-D parameters, plain or RaggedShard.

    Args:
        params: 2-D parameters (or named pairs / groups); give everything else to AdamW
            (:func:`muon_param_groups`).
        lr, weight_decay, momentum, nesterov, ns_coefficients, eps, ns_steps, adjust_lr_fn: as
            ``torch.optim.Muon`` (``lr`` must be a float).
        ns_dtype: dtype of the Newton–Schulz iteration (a ``torch.dtype`` or its name).
            ``torch.bfloat16`` (default) is what ``torch.optim.Muon`` uses; ``torch.float32`` is ~25x
            faster on CPUs without bf16 matmul. Param groups hold it by name (``"bfloat16"``): an
            optimizer state dict then holds plain values only, which torch's state-dict utilities
            (``get_optimizer_state_dict(..., full_state_dict=True)``) require.
    """

    blocks_needed = "whole matrices (Muon orthogonalizes each one whole)"
    stateless_block_math = True  # momentum is elementwise (in _job); Newton–Schulz keeps nothing

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        ns_dtype: torch.dtype | str = torch.bfloat16,
    ) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"Muon needs lr, momentum, weight_decay >= 0; got {lr}, {momentum}, {weight_decay}")
        if adjust_lr_fn is not None and adjust_lr_fn not in ADJUST_LR_FNS:
            raise ValueError(f"adjust_lr_fn must be None or one of {ADJUST_LR_FNS}, got {adjust_lr_fn!r}")
        defaults = dict(
            lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov, ns_coefficients=ns_coefficients,
            eps=eps, ns_steps=ns_steps, adjust_lr_fn=adjust_lr_fn, ns_dtype=_dtype_name(ns_dtype),
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if p.ndim != 2:
                    raise ValueError(
                        f"Muon only optimizes 2-D parameters, got shape {tuple(p.shape)}; give it to AdamW "
                        f"(fsdp_pass.optim.muon_param_groups splits a model's parameters)"
                    )
                annotate_block(p, elements=p.numel())

    def add_param_group(self, param_group: dict) -> None:
        if "ns_dtype" in param_group:
            param_group = {**param_group, "ns_dtype": _dtype_name(param_group["ns_dtype"])}
        super().add_param_group(param_group)

    def _job(self, p: Tensor, group: dict) -> BlockJob:
        update = self._momentum_update(p, group)
        return BlockJob(p, update.to(_dtype(group["ns_dtype"])), gradient_layout(p), p.numel(), _ns_cost(p.shape))

    def _block_math(self, p: Tensor, piece: Tensor, layout, group: dict) -> Tensor:
        return _orthogonalize(piece, p.shape, group)

    def _apply(self, p: Tensor, ortho: Tensor, group: dict) -> None:
        self._decoupled_step(p, ortho, adjusted_lr(group["lr"], group["adjust_lr_fn"], p.shape), group)

    def _momentum_update(self, p: Tensor, group: dict) -> Tensor:
        """Momentum (a buffer in the parameter's layout) and the Nesterov update, elementwise on the pieces."""
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p.grad)
        grad, buf = flat_piece(p.grad), flat_piece(state["momentum_buffer"])
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf


def _orthogonalize(piece: Tensor, shape: torch.Size, group: dict) -> Tensor:
    """Newton–Schulz on a piece holding the whole matrix; an empty piece (another rank's matrix) stays empty."""
    if piece.numel() == 0:
        return piece
    ortho = zeropower_via_newtonschulz(
        piece.view(shape), group["ns_steps"], group["ns_coefficients"], group["eps"], _dtype(group["ns_dtype"])
    )
    return ortho.reshape(-1)


def _dtype(value: torch.dtype | str) -> torch.dtype:
    """A dtype given as a ``torch.dtype`` or its name (``"bfloat16"``, ``"torch.float32"``)."""
    dtype = value if isinstance(value, torch.dtype) else getattr(torch, str(value).removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(
            f"Muon's ns_dtype must be a floating-point torch.dtype or its name (e.g. 'bfloat16'), got {value!r}"
        )
    return dtype


def _dtype_name(value: torch.dtype | str) -> str:
    return str(_dtype(value)).removeprefix("torch.")


def _ns_cost(shape: torch.Size) -> float:
    """Newton–Schulz flops up to a constant: ``min(A, B)^2 * max(A, B)`` per iteration."""
    small, large = sorted(shape[:2])
    return float(small * small * large)
