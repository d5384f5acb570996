"""Run an optimizer's per-block math where whole blocks live; gather to a root where they are cut.

Muon, Shampoo and 8-bit Adam each compute part of their update on *blocks* of a parameter that
must be seen whole (a whole matrix, a panel of rows, 256 elements). In the RaggedShard format a
rank holds one contiguous flat range of each parameter, so:

* if every rank boundary inside the parameter falls on a block boundary (the planner kept the
  block, e.g. because the optimizer annotated it with ``set_block``), each rank runs the math on
  its own piece: no communication at all;
* otherwise the input is redistributed to one *root* rank (one uneven all-to-all), the root runs
  the math on the whole tensor, and the result is redistributed back (a second all-to-all). Roots
  are chosen to balance the estimated compute over the ranks.
* a tensor/expert-parallel parameter (a DTensor whose local tensor is RaggedShard: [Note: FSDP over
  TP/EP] in sharding/materialize.py) is gathered to
  an FSDP root, whose TP/EP group all-gathers the global tensor and runs the math (Muon); math
  that keeps state per parameter runs on the global tensor on every rank instead (``full_tensor``),
  so every rank keeps its state in one layout.

Either way the math sees exactly the blocks a single process would see, so results match a
single-process run bitwise. Plain (unsharded) tensors are the single-process case.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from torch import Tensor
from torch.distributed.tensor import DTensor

from ..placement import RaggedShard
from ..tensor.ragged_tensor import RaggedShardTensor, RaggedSpec, local_block, over_pieces, ragged_part

__all__ = [
    "BlockJob",
    "BlockwiseOptimizer",
    "flat_piece",
    "gradient_layout",
    "layout_of",
    "respects_blocks",
    "run_on_whole_blocks",
    "warn_gathered",
]

# (parameter, this rank's flat input piece, layout of that piece or None) -> flat output piece
BlockCompute = Callable[[Tensor, Tensor, "RaggedSpec | None"], Tensor]


def flat_piece(t: Tensor) -> Tensor:
    """This rank's flat piece of ``t``: the local piece of a RaggedShardTensor (``to_local``: a gradient
    still being reduced is waited for, [Note: the last reduce-scatter overlaps the optimizer step]), or
    ``t`` flattened (a view)."""
    t = ragged_part(t)
    return t.to_local() if isinstance(t, RaggedShardTensor) else t.detach().view(-1)


def layout_of(t: Tensor) -> RaggedSpec | None:
    """The RaggedShard layout of ``t``; ``None`` for a plain tensor (one process holds it whole)."""
    t = ragged_part(t)
    return t._spec if isinstance(t, RaggedShardTensor) else None


def gradient_layout(param: Tensor) -> RaggedSpec | None:
    """The layout of ``param.grad``, which must be the parameter's own (the math pairs their pieces)."""
    layout, own = layout_of(param.grad), layout_of(param)
    if layout != own:
        describe = lambda spec: "plain" if spec is None else spec.describe()  # noqa: E731
        raise ValueError(
            f"gradient ({describe(layout)}) and parameter ({describe(own)}) have different layouts; "
            f"give the gradient its parameter's placement"
        )
    return layout


def respects_blocks(layout: RaggedSpec | None, block: int) -> bool:
    """Whether every rank boundary inside the tensor falls on a multiple of ``block`` elements.

    The tensor's end also counts as a boundary, so a partial last block is fine.
    """
    if layout is None or layout.world_size == 1:
        return True
    numel = layout.placement.numel
    return all(start % block == 0 or start == numel for start, _ in layout.placement.ranges())


@dataclass
class BlockJob:
    """One parameter's input to a per-block computation.

    Attributes:
        param: the parameter (the key of its optimizer state).
        piece: this rank's flat piece of the input (for a plain tensor: all of it).
        layout: layout of ``piece`` (``None`` for a plain tensor).
        block: elements that must be seen together (counted from the parameter's start).
        cost: estimated compute, used to balance roots.
    """

    param: Tensor
    piece: Tensor
    layout: RaggedSpec | None
    block: int
    cost: float

    @property
    def is_local(self) -> bool:
        return not self.is_composed and respects_blocks(self.layout, self.block)

    @property
    def is_composed(self) -> bool:
        """A tensor/expert-parallel parameter: its blocks are counted in the DTensor's global tensor."""
        return isinstance(self.param, DTensor)


def run_on_whole_blocks(
    jobs: Sequence[BlockJob], compute: BlockCompute, stateless: bool = False
) -> tuple[list[Tensor], list[BlockJob]]:
    """Run ``compute`` on whole blocks of every job; return each output in the job's layout.

    ``compute(param, piece, layout)`` gets a flat piece made of whole blocks and the layout it
    belongs to (``layout.local_range`` says where it starts), and returns a flat tensor of the same
    numel. Every rank calls it for every job, with an empty piece where it holds nothing, so
    optimizer state can be created symmetrically. Returns ``(outputs, gathered_jobs)``.

    ``stateless``: ``compute`` keeps no state per parameter (Muon's orthogonalization), so a TP/EP
    parameter can be gathered to an FSDP root and computed there (:func:`_on_fsdp_root`) instead of
    on every rank, where state would otherwise be created in different layouts on different ranks.
    """
    outputs: list[Tensor | None] = [None] * len(jobs)
    for i, job in enumerate(jobs):
        if job.is_local:
            outputs[i] = compute(job.param, job.piece, job.layout)
        elif job.is_composed and not (stateless and _even_model_split(job.param)):
            outputs[i] = _on_whole_global_tensor(job, compute)
    roots = _balanced_roots([None if job.is_composed and outputs[i] is not None else job for i, job in enumerate(jobs)])
    gathered = []
    for i, root in roots.items():
        job = jobs[i]
        layout = job.layout
        numel = layout.placement.numel
        on_root = RaggedShard.on_root(numel, layout.world_size, root)
        whole = _wrap(job.piece, layout, layout.placement).redistribute(on_root)
        if job.is_composed:
            result = _on_fsdp_root(job, whole, root, compute)
        else:
            result = compute(job.param, whole.piece, whole._spec)
        outputs[i] = _wrap(result, layout, on_root).redistribute(layout.placement).piece
        gathered.append(job)
    return outputs, gathered


def _even_model_split(param: DTensor) -> bool:
    """Every TP/EP rank holds a local block of the same shape, so all plan the same buckets and roots."""
    spec = param._spec
    return all(spec.shape[pl.dim] % spec.mesh.size(d) == 0 for d, pl in enumerate(spec.placements))


def _on_fsdp_root(job: BlockJob, whole: RaggedShardTensor, root: int, compute: BlockCompute) -> Tensor:
    """A TP/EP parameter gathered to FSDP rank ``root``: there its TP/EP group (the ranks of the same
    FSDP coordinate) all-gathers the global tensor, computes, and keeps its own block."""
    if whole._spec.rank != root:
        return compute(job.param, whole.piece, whole._spec)  # nothing held here: an empty piece
    spec = job.param._spec
    local = DTensor.from_local(whole.piece.view(whole._spec.shape), spec.mesh, spec.placements, run_check=False,
                               shape=spec.shape, stride=spec.stride)
    result = compute(job.param, local.full_tensor().reshape(-1), None).view(spec.shape)
    return local_block(result, spec).reshape(-1)


def _on_whole_global_tensor(job: BlockJob, compute: BlockCompute) -> Tensor:
    """A TP/EP parameter's math on the whole global tensor: gathered over FSDP and TP/EP ranks
    (``full_tensor``), computed on every rank (no second collective to scatter), sliced back."""
    spec, layout = job.param._spec, job.layout
    ragged = RaggedShardTensor.from_local(job.piece, layout.mesh, layout.placement, layout.shape, layout.mesh_dim)
    whole = over_pieces(ragged, spec).full_tensor()
    result = compute(job.param, whole.reshape(-1), None).view(spec.shape)
    start, end = layout.local_range
    return local_block(result, spec).reshape(-1)[start:end]


def _wrap(piece: Tensor, layout: RaggedSpec, placement: RaggedShard) -> RaggedShardTensor:
    return RaggedShardTensor.from_local(piece, layout.mesh, placement, layout.shape, layout.mesh_dim)


def _balanced_roots(jobs: Sequence[BlockJob | None]) -> dict[int, int]:
    """A root rank for every job whose layout cuts its blocks, balancing compute per process group.

    Greedy longest-processing-time: the costliest job first, onto the rank with the least work so
    far (work a rank already does on its own blocks counts), ties to the rank holding the most of
    the tensor (fewer bytes move), then the lowest rank. Every rank computes the same answer from
    global layouts alone.
    """
    by_group: dict[tuple, list[int]] = {}
    for i, job in enumerate(jobs):
        if job is not None and job.layout is not None:
            by_group.setdefault((job.layout.mesh, job.layout.mesh_dim), []).append(i)
    roots: dict[int, int] = {}
    for indices in by_group.values():
        world = jobs[indices[0]].layout.world_size
        load = [0.0] * world
        for i in indices:
            if jobs[i].is_local:
                _add_held_work(load, jobs[i])
        for i in sorted((i for i in indices if not jobs[i].is_local), key=lambda i: -jobs[i].cost):
            held = [jobs[i].layout.placement.local_numel(r) for r in range(world)]
            root = min(range(world), key=lambda r: (load[r], -held[r], r))
            load[root] += jobs[i].cost
            roots[i] = root
    return dict(sorted(roots.items()))


def _add_held_work(load: list[float], job: BlockJob) -> None:
    placement = job.layout.placement
    if placement.numel:
        for r in range(len(load)):
            load[r] += job.cost * placement.local_numel(r) / placement.numel


def warn_gathered(optimizer: torch.optim.Optimizer, jobs: Iterable[BlockJob], needed: str, warned: set[int]) -> None:
    """Warn once per parameter that its layout cuts the blocks the optimizer needs (``needed``)."""
    new = [job.param for job in jobs if id(job.param) not in warned]
    if not new:
        return
    warned.update(id(p) for p in new)
    names = ", ".join(_describe(optimizer, p) for p in new)
    warnings.warn(
        f"{type(optimizer).__name__}: the sharded layout of {names} cuts {needed}, so every step gathers "
        f"each of them to one rank and scatters the result back (two all-to-alls per parameter). Build "
        f"the optimizer before sharding (fully_shard / torch.compile) so its block annotation shapes the "
        f"layout and the step needs no communication",
        stacklevel=3,
    )


def _describe(optimizer: torch.optim.Optimizer, param: Tensor) -> str:
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            if p is param:
                names = group.get("param_names")
                where = repr(names[i]) if names else f"param_groups[{g}]['params'][{i}]"
                return f"{where} (shape {tuple(p.shape)})"
    return f"a parameter of shape {tuple(param.shape)}"


class BlockwiseOptimizer(torch.optim.Optimizer):
    """The step every block-structured optimizer here shares.

    For each parameter with a gradient a subclass describes one :class:`BlockJob` (``_job``), runs its
    block math (``_block_math``) on whole blocks — locally, or gathered to a root when the layout cuts
    them — and applies the result (``_apply``). ``blocks_needed`` names the blocks in the warning.
    """

    blocks_needed = "whole blocks"
    stateless_block_math = False  # True: _block_math keeps no per-parameter state (see run_on_whole_blocks)

    def __init__(self, params: Any, defaults: dict) -> None:
        super().__init__(params, defaults)
        self._warned: set[int] = set()  # parameters already named in a gather warning

    def _decoupled_step(self, p: Tensor, update: Tensor, step_size: float, group: dict) -> None:
        """``p ← p·(1 − lr·weight_decay) − step_size·update`` on this rank's piece (AdamW-style decay)."""
        piece = flat_piece(p)
        piece.mul_(1 - group["lr"] * group["weight_decay"])
        piece.add_(update, alpha=-step_size)

    def _job(self, p: Tensor, group: dict) -> BlockJob:
        raise NotImplementedError

    def _block_math(self, p: Tensor, piece: Tensor, layout: RaggedSpec | None, group: dict) -> Tensor:
        raise NotImplementedError

    def _apply(self, p: Tensor, result: Tensor, group: dict) -> None:
        raise NotImplementedError

    @torch.no_grad()
    def step(self, closure=None):
        """One step for every parameter with a gradient."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        jobs, groups = [], {}
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    jobs.append(self._job(p, group))
                    groups[p] = group
        compute = lambda p, piece, layout: self._block_math(p, piece, layout, groups[p])  # noqa: E731
        outputs, gathered = run_on_whole_blocks(jobs, compute, self.stateless_block_math)
        # A TP/EP split always cuts the blocks: no layout could avoid that gather, so no warning.
        warn_gathered(self, [job for job in gathered if not job.is_composed], self.blocks_needed, self._warned)
        for job, result in zip(jobs, outputs):
            self._apply(job.param, result, groups[job.param])
        return loss
