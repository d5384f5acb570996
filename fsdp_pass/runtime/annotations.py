"""Annotations users and optimizers put on parameters before sharding (read by the detect pass)."""

from __future__ import annotations

import math

import torch

__all__ = ["annotated_block", "set_block"]

_BLOCK_ATTR = "_fsdp_pass_block"


def set_block(param: torch.Tensor, *, rows: int | None = None, elements: int | None = None) -> torch.Tensor:
    """Annotate ``param`` so no rank boundary cuts a block of ``rows`` rows (or ``elements`` elements)."""
    if (rows is None) == (elements is None):
        raise ValueError("set_block needs exactly one of rows= or elements=")
    row = math.prod(param.shape[1:]) if param.dim() > 1 else 1
    block = elements if elements is not None else rows * row
    if block < 1 or param.numel() % block:
        raise ValueError(
            f"block of {block} elements does not divide parameter of shape {tuple(param.shape)}; "
            f"choose rows dividing {param.shape[0] if param.dim() else 1} or elements dividing {param.numel()}"
        )
    setattr(param, _BLOCK_ATTR, math.lcm(getattr(param, _BLOCK_ATTR, 1), block))
    return param


def annotated_block(param: torch.Tensor) -> int:
    """The block (elements) annotations asked for on ``param``; 1 when none."""
    return getattr(param, _BLOCK_ATTR, 1)
