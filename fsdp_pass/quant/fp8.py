"""Block-wise weight quantization (DeepSeek-V3 style): FP8 e4m3 or INT8, one float32 scale per 128×128 tile.

A 2-D weight ``W[R, C]`` is cut into ``tile × tile`` tiles (edge tiles are partial, as if zero-padded).
Tile ``(i, j)`` stores ``scale_inv[i, j] = amax(|tile|) / qmax`` (``weight_scale_inv`` in DeepSeek-V3
checkpoints; ``qmax`` is 448 for e4m3, 127 for int8) and the quantized values ``W / scale_inv``;
dequantization is ``q * scale_inv``. An all-zero tile gets ``scale_inv = 1``.

The quantize and dequantize functions are registered custom ops (``torch.ops.fsdp_pass.*``) with fake
implementations, so they trace under ``torch.compile`` as single graph nodes; the detect pass can
recognize them and give the weight blocks of ``tile`` rows (:data:`BLOCK_QUANTIZE_OPS`).

Sharding: in row-major memory the smallest contiguous run of whole tiles is a *panel* of ``tile``
rows. When every rank boundary of a RaggedShard weight falls on a panel boundary, each rank quantizes
its own panels (:func:`quantize_sharded`) and gets exactly its slice of the full quantization.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from ..placement import RaggedShard
from ..tensor.ragged_tensor import RaggedShardTensor

__all__ = [
    "BLOCK_QUANTIZE_OPS",
    "fp8_block_dequantize",
    "fp8_block_linear",
    "fp8_block_quantize",
    "int8_block_dequantize",
    "int8_block_linear",
    "int8_block_quantize",
    "quantize_sharded",
]

TILE = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
INT8_MAX = 127


def _tile_grid(rows: int, cols: int, tile: int) -> tuple[int, int]:
    return -(-rows // tile), -(-cols // tile)


def _tile_scale_inv(weight: Tensor, tile: int, qmax: float) -> Tensor:
    """``amax / qmax`` of every tile (float32, ``(ceil(R/tile), ceil(C/tile))``); 1 for all-zero tiles."""
    rows, cols = weight.shape
    tr, tc = _tile_grid(rows, cols, tile)
    padded = F.pad(weight.float(), (0, tc * tile - cols, 0, tr * tile - rows))
    amax = padded.abs().view(tr, tile, tc, tile).amax(dim=(1, 3))
    return torch.where(amax > 0, amax / qmax, torch.ones_like(amax))


def _per_element(scale_inv: Tensor, rows: int, cols: int, tile: int) -> Tensor:
    """Each tile's scale repeated over its elements, cropped to ``(rows, cols)``."""
    return scale_inv.repeat_interleave(tile, 0).repeat_interleave(tile, 1)[:rows, :cols]


def _check_weight(weight: Tensor, tile: int) -> None:
    if weight.dim() != 2 or tile < 1:
        raise ValueError(
            f"block quantization takes a 2-D weight and a tile >= 1, got shape {tuple(weight.shape)}, tile {tile}"
        )


@torch.library.custom_op("fsdp_pass::fp8_block_quantize", mutates_args=())
def fp8_block_quantize(weight: Tensor, tile: int = TILE) -> tuple[Tensor, Tensor]:
    """``(float8_e4m3fn weight, float32 scale_inv per tile)`` of a 2-D weight."""
    _check_weight(weight, tile)
    scale_inv = _tile_scale_inv(weight, tile, FP8_MAX)
    scaled = weight.float() / _per_element(scale_inv, *weight.shape, tile)
    return scaled.to(FP8), scale_inv


@torch.library.custom_op("fsdp_pass::int8_block_quantize", mutates_args=())
def int8_block_quantize(weight: Tensor, tile: int = TILE) -> tuple[Tensor, Tensor]:
    """``(int8 weight, float32 scale_inv per tile)`` of a 2-D weight (round to nearest, symmetric ±127)."""
    _check_weight(weight, tile)
    scale_inv = _tile_scale_inv(weight, tile, INT8_MAX)
    scaled = weight.float() / _per_element(scale_inv, *weight.shape, tile)
    return scaled.round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8), scale_inv


@torch.library.custom_op("fsdp_pass::fp8_block_dequantize", mutates_args=())
def fp8_block_dequantize(
    quantized: Tensor, scale_inv: Tensor, tile: int = TILE, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The ``dtype`` weight that a float8 weight and its per-tile ``scale_inv`` stand for."""
    return (quantized.float() * _per_element(scale_inv, *quantized.shape, tile)).to(dtype)


@torch.library.custom_op("fsdp_pass::int8_block_dequantize", mutates_args=())
def int8_block_dequantize(
    quantized: Tensor, scale_inv: Tensor, tile: int = TILE, dtype: torch.dtype = torch.float32
) -> Tensor:
    """The ``dtype`` weight that an int8 weight and its per-tile ``scale_inv`` stand for."""
    return (quantized.float() * _per_element(scale_inv, *quantized.shape, tile)).to(dtype)


def _fake_quantize(qdtype: torch.dtype):
    def fake(weight: Tensor, tile: int = TILE) -> tuple[Tensor, Tensor]:
        _check_weight(weight, tile)
        grid = _tile_grid(*weight.shape, tile)
        return weight.new_empty(weight.shape, dtype=qdtype), weight.new_empty(grid, dtype=torch.float32)

    return fake


def _fake_dequantize(
    quantized: Tensor, scale_inv: Tensor, tile: int = TILE, dtype: torch.dtype = torch.float32
) -> Tensor:
    return quantized.new_empty(quantized.shape, dtype=dtype)


fp8_block_quantize.register_fake(_fake_quantize(FP8))
int8_block_quantize.register_fake(_fake_quantize(torch.int8))
fp8_block_dequantize.register_fake(_fake_dequantize)
int8_block_dequantize.register_fake(_fake_dequantize)

#: The quantize ops that need whole ``tile``-row panels of their weight (argument 0); ``tile`` is argument 1.
BLOCK_QUANTIZE_OPS = (torch.ops.fsdp_pass.fp8_block_quantize.default, torch.ops.fsdp_pass.int8_block_quantize.default)


def _block_linear(x: Tensor, weight: Tensor, bias: Tensor | None, quantize, dequantize) -> Tensor:
    quantized, scale_inv = quantize(weight)
    dequantized = dequantize(quantized, scale_inv, TILE, x.dtype)
    # Straight-through estimator: the forward uses exactly the dequantized weight (adding an exact
    # zero), the gradient flows to ``weight`` unchanged.
    effective = dequantized.detach() + (weight - weight.detach())
    return F.linear(x, effective, bias)


def fp8_block_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with ``weight`` block-quantized to FP8 (128×128 tiles); gradients pass straight through.

    Dequantizes, then multiplies in ``x.dtype`` (CPUs have no block-scaled FP8 matmul).
    """
    return _block_linear(x, weight, bias, fp8_block_quantize, fp8_block_dequantize)


def int8_block_linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``F.linear`` with ``weight`` block-quantized to INT8 (128×128 tiles); gradients pass straight through."""
    return _block_linear(x, weight, bias, int8_block_quantize, int8_block_dequantize)


def quantize_sharded(
    weight: RaggedShardTensor, fmt: str = "fp8", tile: int = TILE
) -> tuple[RaggedShardTensor, RaggedShardTensor]:
    """Block-quantize a sharded 2-D weight without communication: each rank quantizes its own panels.

    Returns ``(quantized, scale_inv)`` as RaggedShardTensors: the quantized weight in the weight's
    layout, ``scale_inv`` of shape ``(ceil(R/tile), ceil(C/tile))`` with each rank holding its panels'
    rows. Both equal the full weight's quantization (bitwise). Raises ``ValueError`` if a rank
    boundary cuts a panel of ``tile`` rows: shard with ``set_block(weight, rows=tile)`` (or
    ``block_sizes={name: tile}``), or quantize ``weight.full_tensor()``.
    """
    quantize = {"fp8": fp8_block_quantize, "int8": int8_block_quantize}.get(fmt)
    if quantize is None:
        raise ValueError(f"fmt must be 'fp8' or 'int8', got {fmt!r}")
    spec = weight._spec
    rows, cols = spec.shape
    panel = tile * cols
    numel = rows * cols
    ranges = spec.placement.ranges()
    if any(start % panel and start != numel for start, _ in ranges):
        raise ValueError(
            f"quantize_sharded: the layout {spec.placement} of a {rows}x{cols} weight cuts a panel of {tile} rows "
            f"({panel} elements), so a rank would quantize part of a tile; shard it with set_block(weight, "
            f"rows={tile}) or block_sizes={{name: {tile}}}, or quantize weight.full_tensor()"
        )
    local = weight.piece.view(-1, cols)
    quantized, scale_inv = quantize(local, tile)
    grid = _tile_grid(rows, cols, tile)
    # One block of the scale grid is one row of tile scales, i.e. one panel.
    panels = tuple(-(-end // panel) - start // panel if end > start else 0 for start, end in ranges)
    return (
        RaggedShardTensor.from_local(quantized.view(-1), spec.mesh, spec.placement, spec.shape, spec.mesh_dim),
        RaggedShardTensor.from_local(scale_inv.view(-1), spec.mesh, RaggedShard(grid[1], panels), grid, spec.mesh_dim),
    )
