"""8-bit block-wise *dynamic* quantization of optimizer states (the 8-bit Adam data type).

The code book is the "dynamic tree" type of 8-bit optimizers (Dettmers et al.): 256 sorted values
in [-1, 1] (signed, for Adam's first moment) or [0, 1] (unsigned, for the second), spaced
logarithmically over seven decades (more values near zero), plus 0 and 1. A flat tensor is cut into
blocks of ``block_size`` elements counted from its start (the last block may be shorter); each block
stores its absolute maximum in float32 and every element the index of the nearest code value of
``x / absmax``.

Every block is quantized on its own, so quantizing a piece made of whole blocks gives exactly the
codes and absmax of those blocks in the whole tensor (what sharded 8-bit states rely on).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["dequantize_blockwise", "dynamic_code", "quantize_blockwise"]

DECADES = 7  # the smallest non-zero magnitude is about 1e-7 * absmax


@functools.lru_cache(maxsize=None)
def dynamic_code(signed: bool) -> Tensor:
    """The 256 sorted values of the dynamic code (float32, CPU)."""
    values = [0.0, 1.0]
    for decade in range(DECADES):
        # Within decade d (magnitudes 10^(d-6) * [0.1, 1]) the midpoints of an even split;
        # each decade gets twice the values of the one below: 2^d per sign, 2^(d+1) unsigned.
        count = 2**decade if signed else 2 ** (decade + 1)
        edges = torch.linspace(0.1, 1, count + 1, dtype=torch.float32)
        middles = (edges[:-1] + edges[1:]) / 2.0 * 10.0 ** (decade - (DECADES - 1))
        values += middles.tolist()
        if signed:
            values += (-middles).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def block_count(numel: int, block_size: int) -> int:
    """Blocks of a flat tensor of ``numel`` elements (the last one may be partial)."""
    return -(-numel // block_size)


def quantize_blockwise(x: Tensor, code: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """``(uint8 codes shaped like flat x, float32 absmax per block)`` of a flat float tensor ``x``."""
    blocks = block_count(x.numel(), block_size)
    padded = F.pad(x.float(), (0, blocks * block_size - x.numel())).view(blocks, block_size)
    absmax = padded.abs().amax(dim=1) if blocks else padded.new_zeros(0)
    # An all-zero block keeps absmax 0 (it dequantizes to 0 whatever its codes); divide by tiny instead.
    scaled = (padded / absmax.clamp(min=torch.finfo(torch.float32).tiny)[:, None]).clamp_(-1, 1)
    code = code.to(x.device)
    midpoints = (code[:-1] + code[1:]) / 2
    codes = torch.bucketize(scaled.view(-1)[: x.numel()], midpoints).to(torch.uint8)
    return codes, absmax


def dequantize_blockwise(codes: Tensor, absmax: Tensor, code: Tensor, block_size: int) -> Tensor:
    """The float32 flat tensor that ``codes`` and ``absmax`` stand for."""
    values = code.to(codes.device)[codes.long()]
    scale = absmax.repeat_interleave(block_size)[: codes.numel()]
    return values * scale
