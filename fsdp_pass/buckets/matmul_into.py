"""``fsdp_pass::matmul_into``: a weight gradient's matmul writes straight into its slice of the bucket
gradient (see [Note: gradients written into the bucket] in compile/passes/grad_into_bucket.py).

[Note: products written through a transposed target]
Into a row-major target, ``mm(a, b, out=...)`` runs the kernel ``mm(a, b)`` runs: the values are bitwise
the product's. Into a transposed target (a stacked expert weight's gradient, stored transposed), BLAS
may pick another kernel for the same product, and its sums may differ in the last bit: MKL's AVX-512
kernels do on every input (measured on torch 2.13), its AVX2 kernels agree (``MKL_ENABLE_INSTRUCTIONS=AVX2``).
So a transposed write is the product up to rounding, and tests compare it with a tolerance, never bitwise.
"""

from __future__ import annotations

import torch

__all__ = ["matmul_into"]


@torch.library.custom_op("fsdp_pass::matmul_into", mutates_args=("out",))
def matmul_into(out: torch.Tensor, offset: int, a: torch.Tensor, b: torch.Tensor, stored: list[int],
                dims: list[int]) -> None:
    """Write ``a @ b`` (``mm`` for 2-D operands, ``bmm`` for 3-D) into ``out[offset:]``: row-major, or
    when ``dims`` is given, as the product viewed as ``stored`` after a ``permute(dims)`` (a transposed
    weight gradient). ``mm`` / ``bmm`` run with ``out=`` a strided view of the slice: no scratch buffer;
    the values are the product's, bitwise for a row-major target and up to rounding for a transposed one
    ([Note: products written through a transposed target])."""
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
