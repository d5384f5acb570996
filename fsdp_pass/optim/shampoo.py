"""Blocked Shampoo on RaggedShard parameters: each preconditioner block computed by the rank holding it.

The parameter is viewed as a matrix ``(rows, cols)`` (trailing dims merged: ``(out, in, kh, kw)`` →
``(out, in*kh*kw)``; a vector of ``n`` is ``(n, 1)``), cut into panels of ``b`` rows, and each panel
into column chunks of at most ``max_preconditioner_dim``. Every such block ``G`` (``b × c``) has its own
Kronecker factors and Adam-grafting state::

    L ← β₂ L + (1-β₂) G Gᵀ        R ← β₂ R + (1-β₂) Gᵀ G        (every step)
    L⁻¹ᐟ⁴, R⁻¹ᐟ⁴ from eigh(L), eigh(R) in float64, eigenvalues clamped at 0, plus eps
                                   (every ``precondition_frequency`` steps, from the first)
    v ← β₂ v + (1-β₂) G²           adam = G / (sqrt(v / (1-β₂ᵗ)) + eps)
    direction = P · ‖adam‖ / ‖P‖, P = L⁻¹ᐟ⁴ G R⁻¹ᐟ⁴   (Adam grafting: Shampoo's direction, Adam's size)

then, elementwise on the parameter's pieces: ``m ← β₁ m + (1-β₁) direction`` (a buffer in the
parameter's layout), ``p ← p (1 - lr·wd) - lr·m``.

``b`` is the largest divisor of ``rows`` that is at most ``max_preconditioner_dim`` (so panels tile
the rows exactly; ``b = rows`` when ``rows <= max_preconditioner_dim``). Construction annotates
unsharded parameters with ``set_block(p, rows=b)``, so the planner never cuts a panel: each rank
preconditions its own panels and a step needs no communication. A layout that cuts a panel falls
back to gathering the gradient to a root rank (see :mod:`fsdp_pass.optim.blockwise`).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from ..tensor.ragged_tensor import RaggedSpec
from ..sharding.blocks import annotate_block
from .blockwise import BlockJob, BlockwiseOptimizer, flat_piece, gradient_layout

__all__ = ["Shampoo", "matrix_shape", "panel_rows"]


def matrix_shape(shape: torch.Size) -> tuple[int, int]:
    """The 2-D view Shampoo preconditions: ``(shape[0], prod(shape[1:]))``; ``(1, 1)`` for a scalar."""
    rows = shape[0] if len(shape) else 1
    return rows, math.prod(shape[1:])


def panel_rows(shape: torch.Size, max_preconditioner_dim: int) -> int:
    """Rows per preconditioner panel: the largest divisor of the row count that is at most the limit."""
    rows = matrix_shape(shape)[0]
    return max((d for d in range(1, min(rows, max_preconditioner_dim) + 1) if rows % d == 0), default=1)


def inverse_fourth_root(factor: Tensor, eps: float) -> Tensor:
    """``(factor + eps I)^(-1/4)`` of a symmetric PSD factor, via ``eigh`` in float64 (deterministic on CPU)."""
    eigenvalues, eigenvectors = torch.linalg.eigh(factor.double())
    scale = (eigenvalues.clamp(min=0) + eps) ** -0.25
    return ((eigenvectors * scale) @ eigenvectors.T).to(factor.dtype)


class Shampoo(BlockwiseOptimizer):
    """Blocked Shampoo with Adam grafting and decoupled weight decay, for plain or RaggedShard parameters.

    Args:
        params: parameters or groups (any shape).
        lr: learning rate.
        betas: ``(β₁, β₂)``: momentum of the grafted direction, and EMA of the factors and grafting state.
        eps: added to the factors' eigenvalues and to the grafting denominator.
        weight_decay: decoupled (AdamW-style) weight decay.
        max_preconditioner_dim: most rows (and columns) of one preconditioner block.
        precondition_frequency: steps between recomputing the inverse roots (from the first step).
    """

    blocks_needed = "Shampoo's row panels"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-2,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        max_preconditioner_dim: int = 1024,
        precondition_frequency: int = 1,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"Shampoo needs lr, eps, weight_decay >= 0 and 0 <= betas < 1; got {lr}, {eps}, {weight_decay}, {betas}"
            )
        if max_preconditioner_dim < 1 or precondition_frequency < 1:
            raise ValueError("max_preconditioner_dim and precondition_frequency must be >= 1")
        defaults = dict(
            lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
            max_preconditioner_dim=max_preconditioner_dim, precondition_frequency=precondition_frequency,
        )
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                annotate_block(p, rows=panel_rows(p.shape, max_preconditioner_dim))

    def _job(self, p: Tensor, group: dict) -> BlockJob:
        state = self.state[p]
        state["step"] = state.get("step", 0) + 1
        rows = panel_rows(p.shape, group["max_preconditioner_dim"])
        panel = rows * matrix_shape(p.shape)[1]
        return BlockJob(p, flat_piece(p.grad), gradient_layout(p), panel, float(p.numel() * rows))

    def _apply(self, p: Tensor, direction: Tensor, group: dict) -> None:
        state = self.state[p]
        if "momentum" not in state:
            state["momentum"] = torch.zeros_like(p.grad)
        momentum = flat_piece(state["momentum"])
        momentum.lerp_(direction, 1 - group["betas"][0])
        self._decoupled_step(p, momentum, group["lr"], group)

    def _block_math(self, p: Tensor, piece: Tensor, layout: RaggedSpec | None, group: dict) -> Tensor:
        """The grafted Shampoo direction of the whole panels in ``piece`` (their state lives on this rank)."""
        state = self.state[p]
        step, (_, beta2), eps = state["step"], group["betas"], group["eps"]
        limit = group["max_preconditioner_dim"]
        cols = matrix_shape(p.shape)[1]
        rows = panel_rows(p.shape, limit)
        start = 0 if layout is None else layout.local_range[0]
        grad = piece.view(-1, cols)
        out = torch.empty_like(grad)
        blocks = state.setdefault("blocks", {})
        refresh = (step - 1) % group["precondition_frequency"] == 0
        for r0 in range(0, grad.shape[0], rows):
            panel = start // (rows * cols) + r0 // rows
            for c0 in range(0, cols, limit):
                c1 = min(c0 + limit, cols)
                # A fresh contiguous copy: BLAS/LAPACK see the same input whatever offset the piece had.
                g = grad[r0 : r0 + rows, c0:c1].clone()
                block = blocks.get((panel, c0))
                if block is None:
                    block = blocks[(panel, c0)] = _new_block_state(g)
                out[r0 : r0 + rows, c0:c1] = _grafted_direction(block, g, step, beta2, eps, refresh)
        return out.view(-1)


def _new_block_state(g: Tensor) -> dict[str, Tensor]:
    b, c = g.shape
    return {
        "left": g.new_zeros(b, b), "right": g.new_zeros(c, c),
        "left_root": g.new_zeros(b, b), "right_root": g.new_zeros(c, c),
        "graft_sq": torch.zeros_like(g),
    }  # fmt: skip


def _grafted_direction(
    block: dict[str, Tensor], g: Tensor, step: int, beta2: float, eps: float, refresh: bool
) -> Tensor:
    block["left"].mul_(beta2).add_(g @ g.T, alpha=1 - beta2)
    block["right"].mul_(beta2).add_(g.T @ g, alpha=1 - beta2)
    if refresh:
        block["left_root"] = inverse_fourth_root(block["left"], eps)
        block["right_root"] = inverse_fourth_root(block["right"], eps)
    block["graft_sq"].mul_(beta2).addcmul_(g, g, value=1 - beta2)
    adam = g / (block["graft_sq"] / (1 - beta2**step)).sqrt().add_(eps)
    shampoo = block["left_root"] @ g @ block["right_root"]
    return shampoo * (adam.norm() / shampoo.norm().clamp(min=torch.finfo(g.dtype).tiny))
