"""What a *block* of a parameter is: the elements no rank boundary may cut.

A parameter's block is the LCM, in elements, of what each source asks for:

* an annotation on the parameter (:func:`set_block`; optimizers built before sharding annotate
  through :func:`annotate_block`);
* ``options["block_sizes"]``: ``{fnmatch pattern on the FQN: rows}``, ``{pattern: {"rows": n}}``
  or ``{pattern: {"elements": n}}``;
* the graph: block-quantize ops, reshapes that split dim 0, split/chunk of a parameter (found by
  the detect pass, :func:`fsdp_pass.compile.passes.detect.graph_block_rows`, and given here in rows);
* a tensor-parallel placement ``Shard(d)`` with ``d > 0``: whole local rows (:func:`block_for_placements`).

The planning CLI's what-if block policies (``--block-policy 16row``) are :func:`block_elements`.
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any, Iterable, Mapping, Sequence

import torch
from torch.distributed.tensor import DTensor, Shard

from ..tensor.ragged_tensor import RaggedShardTensor

__all__ = ["annotate_block", "annotated_block", "block_elements", "block_for_placements", "block_size", "set_block"]

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


def annotate_block(param: torch.Tensor, *, rows: int | None = None, elements: int | None = None) -> None:
    """``set_block`` on a parameter that is not sharded yet, so a later shard keeps the block whole.

    An already sharded parameter keeps its layout (blocks cut by it are handled by gathering), and
    so does a tensor/expert-parallel one: its blocks are counted in the global tensor, which its
    DTensor placement already cuts.
    """
    if param.numel() and not isinstance(param, (RaggedShardTensor, DTensor)):
        set_block(param, rows=rows, elements=elements)


def block_size(
    name: str, param: torch.Tensor, options_blocks: Mapping[str, Any] | None = None, graph_rows: Iterable[int] = ()
) -> int:
    """The LCM of the blocks the annotation, the options and the graph (``graph_rows``, in rows) ask for."""
    shape = tuple(param.shape)
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    block = annotated_block(param)
    for pattern, value in (options_blocks or {}).items():
        if fnmatch.fnmatchcase(name, pattern):
            block = math.lcm(block, _override_elements(name, shape, row, value))
    for rows in graph_rows:
        block = math.lcm(block, rows * row)
    if param.numel() and param.numel() % block:
        raise ValueError(
            f"parameter {name!r} of shape {shape}: its block structures combine to {block} elements, "
            f"which does not divide its {param.numel()} elements; fix options['block_sizes'] or the annotation"
        )
    return block


def _override_elements(name: str, shape: tuple[int, ...], row: int, value: Any) -> int:
    if isinstance(value, Mapping) and set(value) == {"elements"}:
        return int(value["elements"])
    if isinstance(value, Mapping) and set(value) == {"rows"}:
        return int(value["rows"]) * row
    if isinstance(value, int):
        return value * row
    raise ValueError(
        f"options['block_sizes'] entry for {name!r} is {value!r}; give rows as an int, "
        f"{{'rows': n}} or {{'elements': n}}"
    )


def block_for_placements(p: torch.Tensor, block: int) -> int:
    """Under ``Shard(d)`` with ``d > 0`` a rank boundary must not cut dims ``d:`` of the local tensor.

    Then every rank's piece is whole rows of the local block: a rectangle of the global tensor.
    """
    if not isinstance(p, DTensor):
        return block
    local = p._local_tensor
    for placement in p.placements:
        if isinstance(placement, Shard) and placement.dim > 0:
            block = math.lcm(block, math.prod(local.shape[placement.dim:]))
    return block


def block_elements(shape: Sequence[int], rows: int) -> int:
    """A block of ``k`` rows of ``shape``, ``k`` the largest divisor of the row count that is ``<= rows``.

    A row is the last dimension (leading dims flattened, as in ``docs/padding.md``): for a matrix this
    is ``set_block(rows=k)``; a 1-D tensor is one row, so it is never cut. ``rows=0``: one element.
    """
    if rows == 0 or not shape:
        return 1
    row = shape[-1]
    count = math.prod(shape) // row if row else 0
    if count == 0:
        return 1
    return max(d for d in range(1, min(rows, count) + 1) if count % d == 0) * row
