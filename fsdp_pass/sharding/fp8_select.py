"""Which weights an FP8 all-gather moves, and their blocks ([Note: FP8 all-gather] in buckets/gather.py).

By default: the 2-D weights (and stacked 3-D expert weights) inside the repeated units the bucketing
finds (a name with a numeric index, :func:`~fsdp_pass.sharding.buckets.unit_key`); embeddings, the
output head and other top-level weights stay in ``param_dtype``. ``include`` adds names,
``exclude`` removes them. A weight is kept whole-tile only if its rows (per expert for 3-D) are a
multiple of ``tile``: its block is then ``tile`` rows × its row length.
"""

from __future__ import annotations

import fnmatch
import math
import re
import warnings
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import torch
from torch.distributed.tensor import DTensor

from ..options import Fp8Options
from ..tensor.ragged_tensor import bucket_of, is_sharded

__all__ = ["Fp8Plan", "lcm_blocks", "plan_fp8", "select_fp8_weights"]


def _in_repeated_unit(name: str) -> bool:
    return re.match(r"^((?:.*?\.)?\d+)\.", name) is not None


def select_fp8_weights(
    named: Iterable[tuple[str, torch.Tensor]], opts: Fp8Options
) -> tuple[dict[str, int], dict[str, str]]:
    """``(name → block in elements, name → why it stays in param_dtype)`` for parameters not sharded yet.

    Raises ``ValueError`` for an explicitly included weight whose shape cannot keep tiles whole.
    """
    chosen: dict[str, int] = {}
    skipped: dict[str, str] = {}
    tile = opts.tile
    for name, p in named:
        included = any(fnmatch.fnmatchcase(name, pat) for pat in opts.include)
        excluded = any(fnmatch.fnmatchcase(name, pat) for pat in opts.exclude)
        default = _in_repeated_unit(name) and p.dim() in (2, 3)
        if excluded or not (included or default):
            continue
        why = None
        if not p.requires_grad:
            why = "frozen"
        elif isinstance(p, DTensor):
            why = "tensor/expert-parallel DTensor parameter"
        elif p.dim() not in (2, 3):
            why = f"{p.dim()}-D (FP8 tiles need a 2-D or stacked 3-D weight)"
        elif p.shape[-2] % tile:
            why = f"{p.shape[-2]} rows per matrix are not a multiple of the tile ({tile}), so a rank boundary could cut a tile"
        if why is None:
            chosen[name] = tile * p.shape[-1]
        elif included:
            raise ValueError(
                f"options['fp8_all_gather'] includes {name!r} (shape {tuple(p.shape)}), which cannot be gathered in "
                f"FP8: {why}; remove it from 'include', or change the tile"
            )
        else:
            skipped[name] = why
    return chosen, skipped


def lcm_blocks(blocks: dict[str, int], fp8_blocks: dict[str, int]) -> dict[str, int]:
    """``blocks`` with every FP8 weight's block made a multiple of its tile panel."""
    return {n: math.lcm(b, fp8_blocks[n]) if n in fp8_blocks else b for n, b in blocks.items()}


@dataclass
class Fp8Plan:
    """The FP8 weights among parameters about to be sharded, and the candidates left out."""

    tiles: dict[str, int] = field(default_factory=dict)  # name → tile (its bucket gathers FP8)
    blocks: dict[str, int] = field(default_factory=dict)  # name → block in elements (whole tile panels)
    left_out: dict[str, str] = field(default_factory=dict)  # name → why it stays in param_dtype

    def record_left_out(self, named: Sequence[tuple[str, torch.Tensor]]) -> None:
        """Tell each left-out weight's bucket why, for ``explain()``."""
        for name, p in named:
            if name in self.left_out and is_sharded(p):
                bucket_of(p)[0].fp8_skipped[name] = self.left_out[name]


def plan_fp8(named: Sequence[tuple[str, torch.Tensor]], opts: Fp8Options | None, argument: str) -> Fp8Plan:
    """FP8 weights among the parameters not sharded yet (``argument`` names the option in messages).

    A model with no eligible weight warns and trains with every parameter in ``param_dtype``.
    """
    if opts is None:
        return Fp8Plan()
    todo = [(n, p) for n, p in named if not is_sharded(p)]
    chosen, skipped = select_fp8_weights(todo, opts)
    if todo and not chosen:
        reasons = "; ".join(f"{n}: {why}" for n, why in list(skipped.items())[:3])
        warnings.warn(
            f"{argument} found no eligible weight (2-D or stacked 3-D weights inside repeated units "
            "such as 'layers.3', rows a multiple of the tile, or names given in 'include')"
            + (f" ({reasons})" if reasons else "") + "; training proceeds with every parameter gathered in param_dtype",
            stacklevel=3,
        )
    return Fp8Plan({n: opts.tile for n in chosen}, chosen, skipped)
