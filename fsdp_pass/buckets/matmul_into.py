"""``fsdp_pass::matmul_into``: a weight gradient's matmul writes straight into its slice of the bucket
gradient (see [Note: gradients written into the bucket] in compile/passes/grad_into_bucket.py)."""

from __future__ import annotations

import torch

__all__ = ["matmul_into"]


@torch.library.custom_op("fsdp_pass::matmul_into", mutates_args=("out",))
def matmul_into(out: torch.Tensor, offset: int, a: torch.Tensor, b: torch.Tensor, stored: list[int],
                dims: list[int]) -> None:
    """Write ``a @ b`` (``mm`` for 2-D operands, ``bmm`` for 3-D) into ``out[offset:]``: row-major, or
    when ``dims`` is given, as the product viewed as ``stored`` after a ``permute(dims)`` (a transposed
    weight gradient). The same ``mm`` / ``bmm`` kernel runs with ``out=`` a strided view of the slice:
    no scratch buffer, bitwise the values of the product."""
    batched = a.dim() == 3
    shape = [a.shape[0], a.shape[1], b.shape[2]] if batched else [a.shape[0], b.shape[1]]
    numel = shape[0] * shape[1] * (shape[2] if batched else 1)
    target = out[offset:offset + numel]
    if dims:
        target = target.view(stored).permute([dims.index(d) for d in range(len(dims))])
    (torch.bmm if batched else torch.mm)(a, b, out=target.view(shape))


@matmul_into.register_fake
def _(out, offset, a, b, stored, dims):
    return None
