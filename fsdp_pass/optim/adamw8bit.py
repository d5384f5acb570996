"""AdamW with 8-bit block-quantized moments, on plain or RaggedShard parameters.

Both moments are stored as uint8 codes of the dynamic code (:mod:`fsdp_pass.optim.dynamic_code`;
signed for the first moment, unsigned for the second) plus one float32 absmax per block of
``block_size`` elements, counted from the parameter's start. Each step dequantizes, runs the AdamW
math in float32 and requantizes.

Whether a parameter gets 8-bit states depends on its *global* element count (``>= min_8bit_size``),
never on the size of a rank's piece, so sharding never changes the algorithm. Construction annotates
unsharded 8-bit parameters whose size is a multiple of ``block_size`` with
``set_block(p, elements=block_size)``: every rank then holds whole quantization blocks, quantizes
its own piece, and its codes and absmax are exactly the corresponding slices of the unsharded
quantization. A layout that cuts a block instead gathers that parameter's gradient to a root rank,
which keeps the parameter's whole 8-bit state (see :mod:`fsdp_pass.optim.blockwise`).

States are RaggedShardTensors: codes in the layout they were computed in (the parameter's, or the
whole tensor on its root), absmax over ``(blocks,)`` with whole blocks per rank; ``full_tensor()``
gives the unsharded quantization. States loaded from a state dict (whole tensors from
``get_optimizer_state_dict(..., full_state_dict=True)``, or pieces cut to the parameter's layout)
are moved into the layout the step computes in at the next step, so a run resumed at another
world size continues bit-exactly.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from torch.distributed.tensor import DTensor

from ..placement import RaggedShard
from ..tensor.ragged_tensor import RaggedShardTensor, RaggedSpec, whole_tensor
from ..sharding.blocks import annotate_block
from .blockwise import BlockJob, BlockwiseOptimizer, flat_piece, gradient_layout
from .dynamic_code import block_count, dequantize_blockwise, dynamic_code, quantize_blockwise

__all__ = ["AdamW8bit"]

MOMENTS = (("exp_avg", True), ("exp_avg_sq", False))  # (state name, signed code)


class AdamW8bit(BlockwiseOptimizer):
    """AdamW whose moments are 8-bit block-quantized (fp32 for parameters under ``min_8bit_size`` elements).

    Args:
        params: parameters or groups.
        lr, betas, eps, weight_decay: as ``torch.optim.AdamW``.
        block_size: elements per quantization block (one absmax each).
        min_8bit_size: parameters with fewer elements (globally) keep float32 moments.
    """

    blocks_needed = "8-bit quantization blocks"

    def __init__(
        self,
        params: Any,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        block_size: int = 256,
        min_8bit_size: int = 4096,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(
                f"AdamW8bit needs lr, eps, weight_decay >= 0, 0 <= betas < 1; got {lr}, {eps}, {weight_decay}, {betas}"
            )
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, block_size=block_size,
                        min_8bit_size=min_8bit_size)  # fmt: skip
        super().__init__(params, defaults)
        for group in self.param_groups:
            for p in group["params"]:
                if _is_8bit(p, group) and p.numel() % block_size == 0:
                    annotate_block(p, elements=block_size)

    def load_state_dict(self, state_dict: dict) -> None:
        """As ``torch.optim.Optimizer.load_state_dict``, keeping the 8-bit codes ``uint8``.

        The base class casts every loaded state tensor to its parameter's dtype, which would turn
        the codes into float32 (same values, four times the memory, saved as float32 next time).
        Codes are integers in ``[0, 255]``, so casting them back is exact.
        """
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for name, _ in MOMENTS:
                if name + "_absmax" in state and state[name].dtype != torch.uint8:
                    state[name] = state[name].to(torch.uint8)

    def _job(self, p: Tensor, group: dict) -> BlockJob:
        state = self.state[p]
        state["step"] = state.get("step", 0) + 1
        # fp32 moments are elementwise: any layout works (block of one element).
        block = group["block_size"] if _is_8bit(p, group) else 1
        return BlockJob(p, flat_piece(p.grad), gradient_layout(p), block, float(p.numel()))

    def _apply(self, p: Tensor, update: Tensor, group: dict) -> None:
        self._decoupled_step(p, update, group["lr"] / (1 - group["betas"][0] ** self.state[p]["step"]), group)

    def _block_math(self, p: Tensor, grad: Tensor, layout: RaggedSpec | None, group: dict) -> Tensor:
        """Update the moments of the elements in ``grad`` and return ``m / (sqrt(v / bc2) + eps)``."""
        state, (beta1, beta2) = self.state[p], group["betas"]
        quantized = _is_8bit(p, group)
        if "exp_avg" not in state:
            _init_moments(state, p.shape, grad, layout, group["block_size"], quantized)
        else:
            _relayout_moments(state, p.shape, layout, group["block_size"], quantized)
        if quantized:
            exp_avg, exp_avg_sq = (_load_quantized(state, n, signed, group["block_size"]) for n, signed in MOMENTS)
        else:
            exp_avg, exp_avg_sq = flat_piece(state["exp_avg"]), flat_piece(state["exp_avg_sq"])
        exp_avg.lerp_(grad, 1 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
        denom = (exp_avg_sq.sqrt() / (1 - beta2 ** state["step"]) ** 0.5).add_(group["eps"])
        if quantized:
            for (name, signed), value in zip(MOMENTS, (exp_avg, exp_avg_sq)):
                codes, absmax = quantize_blockwise(value, dynamic_code(signed), group["block_size"])
                flat_piece(state[name]).copy_(codes)
                flat_piece(state[name + "_absmax"]).copy_(absmax)
        return exp_avg / denom


def _is_8bit(p: Tensor, group: dict) -> bool:
    return p.numel() >= group["min_8bit_size"]  # global size: the same decision on every rank


def _init_moments(
    state: dict, shape: torch.Size, grad: Tensor, layout: RaggedSpec | None, block_size: int, quantized: bool
) -> None:
    """Zero moments in ``layout`` (the layout the step computes in): fp32, or 8-bit codes plus absmax."""
    zeros = torch.zeros_like(grad, dtype=torch.float32)
    blocks = (block_count(math.prod(shape), block_size),)
    for name, signed in MOMENTS:
        if not quantized:
            state[name] = _as_state(zeros.clone(), layout, shape)
            continue
        codes, absmax = quantize_blockwise(zeros, dynamic_code(signed), block_size)
        state[name] = _as_state(codes, layout, shape)
        state[name + "_absmax"] = _as_state(absmax, layout, blocks, _block_placement(layout, block_size))


def _relayout_moments(state: dict, shape: torch.Size, layout: RaggedSpec | None, block_size: int,
                      quantized: bool) -> None:
    """Moments in the layout this step computes in (a no-op for the states a step made).

    A loaded state may be whole (plain), a piece in the parameter's layout while the step computes
    on a root, or pieces of a tensor-parallel parameter whose math runs on the whole global tensor.
    Every rank takes the same branch (layouts are global), so the collectives pair up.
    """
    blocks = (block_count(math.prod(shape), block_size),)
    for name, _ in MOMENTS:
        state[name] = _in_layout(state[name], layout, shape)
        if quantized:
            absmax = name + "_absmax"
            state[absmax] = _in_layout(state[absmax], layout, blocks, _block_placement(layout, block_size))


def _in_layout(value: Tensor, layout: RaggedSpec | None, shape: tuple[int, ...],
               placement: RaggedShard | None = None) -> Tensor:
    """``value`` as a state of ``shape`` in ``layout`` (``placement`` over its mesh dim; default the layout's)."""
    if layout is None:
        if isinstance(value, (RaggedShardTensor, DTensor)):
            value = whole_tensor(value)
        return value if tuple(value.shape) == tuple(shape) else value.reshape(shape)
    placement = placement or layout.placement
    if isinstance(value, RaggedShardTensor):
        spec = value._spec
        same_group = (spec.mesh, spec.mesh_dim, tuple(spec.shape)) == (layout.mesh, layout.mesh_dim, tuple(shape))
        if same_group and spec.placement == placement:
            return value
        if same_group:
            return value.redistribute(placement)
    if isinstance(value, (RaggedShardTensor, DTensor)):
        value = whole_tensor(value)
    start, end = placement.local_range(layout.rank)
    return _as_state(value.reshape(-1)[start:end].clone(), layout, shape, placement)


def _load_quantized(state: dict, name: str, signed: bool, block_size: int) -> Tensor:
    codes, absmax = flat_piece(state[name]), flat_piece(state[name + "_absmax"])
    return dequantize_blockwise(codes, absmax, dynamic_code(signed), block_size)


def _block_placement(layout: RaggedSpec | None, block_size: int) -> RaggedShard | None:
    """Placement of a per-block vector when every rank holds whole blocks of ``layout``."""
    if layout is None:
        return None
    units = [block_count(end, block_size) - start // block_size if end > start else 0
             for start, end in layout.placement.ranges()]  # fmt: skip
    return RaggedShard(1, tuple(units))


def _as_state(
    piece: Tensor, layout: RaggedSpec | None, shape: tuple[int, ...], placement: RaggedShard | None = None
) -> Tensor:
    """A state tensor: plain (shaped ``shape``) for one process, else a RaggedShardTensor of ``piece``."""
    if layout is None:
        return piece.view(shape)
    return RaggedShardTensor.from_local(
        piece, layout.mesh, placement or layout.placement, shape, layout.mesh_dim
    )
