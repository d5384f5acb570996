"""RaggedShardTensor: a tensor whose flattened elements are split over the ranks of one mesh dim.

The wrapper carries the *global* shape, dtype and device; each rank stores only its piece, one
contiguous 1-D range of the row-major flattened tensor (``RaggedShard.local_range``). The piece is
often a view into a flat bucket buffer, so nothing here copies it on construction.

Eager ops run through ``__torch_dispatch__`` on the pieces, but only where that is exact
(elementwise ops, optimizer list ops, full reductions; see ``ragged_dispatch``). That is what
``torch.optim`` optimizers and ``clip_grad_norm_`` need (importing this module also lets their
``foreach`` defaults treat RaggedShard tensors like plain ones, as DTensor does). Everything else
raises rather than compute something silently wrong on a piece.

Under ``torch.compile`` the same dispatch runs on fake/functional pieces: elementwise ops trace as
ops on the locals and reductions as functional collectives in the graph.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..placement import RaggedShard, transfer_splits
from . import checkpoint, collectives

__all__ = ["RaggedShardTensor", "RaggedSpec", "distribute_tensor", "local_block", "ragged_part"]


@dataclass(frozen=True)
class RaggedSpec:
    """The layout of a :class:`RaggedShardTensor`: global shape, placement, and where it is split.

    ``mesh=None`` means a single process (world size 1, no communication). On a multi-dim mesh the
    tensor is ragged over ``mesh_dim`` and replicated over the other dims (HSDP), so reductions
    communicate over ``mesh_dim`` only. Hashable: it is the ``__tensor_flatten__`` context.
    """

    shape: torch.Size
    placement: RaggedShard
    mesh: DeviceMesh | None
    mesh_dim: int = 0
    # Inside a tensor/expert-parallel DTensor: ``shape`` is the DTensor's local shape, and this
    # tensor's local block starts at ``global_offset`` of the DTensor's ``global_shape`` (None: not inside one).
    global_shape: torch.Size | None = None
    global_offset: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", torch.Size(self.shape))
        if self.global_shape is not None:
            object.__setattr__(self, "global_shape", torch.Size(self.global_shape))
        if self.mesh is not None and not 0 <= self.mesh_dim < self.mesh.ndim:
            raise ValueError(f"mesh_dim {self.mesh_dim} is outside a {self.mesh.ndim}-dim mesh {self.mesh}")
        self.placement.validate(self.shape, self.world_size, name=f"tensor of shape {tuple(self.shape)}")

    @property
    def world_size(self) -> int:
        return 1 if self.mesh is None else self.mesh.size(self.mesh_dim)

    @property
    def rank(self) -> int:
        """This process's coordinate along ``mesh_dim``."""
        return 0 if self.mesh is None else self.mesh.get_local_rank(self.mesh_dim)

    @property
    def group(self) -> ProcessGroup | None:
        """Process group of ``mesh_dim``; ``None`` without a mesh (the collectives then skip)."""
        return None if self.mesh is None else self.mesh.get_group(self.mesh_dim)

    @property
    def local_range(self) -> tuple[int, int]:
        """``[start, end)`` of this rank's piece in the flattened tensor."""
        return self.placement.local_range(self.rank)

    @property
    def local_numel(self) -> int:
        return self.placement.local_numel(self.rank)

    def describe(self) -> str:
        where = "a single process" if self.mesh is None else f"mesh dim {self.mesh_dim} of {self.mesh}"
        inside = "" if self.global_shape is None else (
            f" (the local block at offset {self.global_offset} of a DTensor of shape {tuple(self.global_shape)})")
        return f"shape {tuple(self.shape)}{inside}, {self.placement} over {where}"


class RaggedShardTensor(torch.Tensor):
    """A traceable wrapper subclass: global metadata outside, this rank's flat piece inside.

    Build one with :meth:`from_local` (wraps an existing piece, no copy) or
    :func:`distribute_tensor` (slices a full tensor every rank holds).
    """

    _local: torch.Tensor
    _spec: RaggedSpec

    # Ops go straight to __torch_dispatch__ (no torch-function layer), as torch.compile expects.
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, local: torch.Tensor, spec: RaggedSpec, requires_grad: bool = False) -> "RaggedShardTensor":
        return torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=_contiguous_strides(spec.shape),
            dtype=local.dtype,
            device=local.device,
            layout=local.layout,
            requires_grad=requires_grad,
        )

    def __init__(self, local: torch.Tensor, spec: RaggedSpec, requires_grad: bool = False) -> None:
        self._local = local
        self._spec = spec

    # -- construction and conversion ---------------------------------------------------------
    @staticmethod
    def from_local(
        local: torch.Tensor,
        mesh: DeviceMesh | None,
        placement: RaggedShard,
        shape: Sequence[int],
        mesh_dim: int = 0,
        requires_grad: bool = False,
        global_shape: Sequence[int] | None = None,
        global_offset: Sequence[int] | None = None,
    ) -> "RaggedShardTensor":
        """Wrap this rank's contiguous 1-D piece (kept as is, typically a view into a buffer).

        Not differentiable: gradients are tracked on the wrapper, never through ``local``.
        ``global_shape``/``global_offset``: when this is the local tensor of a tensor- or
        expert-parallel DTensor, where its block lies in the DTensor (checkpoints save global boxes).
        """
        spec = RaggedSpec(torch.Size(shape), placement, mesh, mesh_dim,
                          None if global_shape is None else torch.Size(global_shape),
                          None if global_offset is None else tuple(global_offset))
        if local.dim() != 1 or local.numel() != spec.local_numel or not local.is_contiguous():
            raise ValueError(
                f"from_local: rank {spec.rank} must pass a contiguous 1-D piece of {spec.local_numel} "
                f"elements for {spec.describe()}, got shape {tuple(local.shape)} with strides {local.stride()}"
            )
        # detach() aliases the same memory; it only keeps the piece out of autograd.
        return RaggedShardTensor(local.detach() if local.requires_grad else local, spec, requires_grad)

    def to_local(self) -> torch.Tensor:
        """This rank's flat piece (the stored tensor itself, not a copy)."""
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, on every rank of ``mesh_dim`` (one padded all-gather; not differentiable)."""
        spec = self._spec
        sizes = [spec.placement.local_numel(r) for r in range(spec.world_size)]
        return collectives.all_gather_padded(self._local, sizes, spec.group).view(spec.shape)

    def redistribute(self, placement: RaggedShard) -> "RaggedShardTensor":
        """The same tensor in another RaggedShard layout over the same mesh dim (not differentiable).

        One uneven ``all_to_all_single`` moves every element straight to its new owner. Returns
        ``self`` when the layout does not change.
        """
        spec = self._spec
        if placement == spec.placement:
            return self
        target = RaggedSpec(spec.shape, placement, spec.mesh, spec.mesh_dim)
        send, recv = transfer_splits(spec.placement, placement, spec.rank)
        local = collectives.all_to_all_uneven(self._local, send, recv, spec.group)
        return RaggedShardTensor(local, target)

    @property
    def placement(self) -> RaggedShard:
        return self._spec.placement

    @property
    def mesh(self) -> DeviceMesh | None:
        return self._spec.mesh

    # -- traceable wrapper subclass protocol -------------------------------------------------
    # -- distributed checkpoint (torch.distributed.checkpoint saves and loads local pieces) ------
    def __create_write_items__(self, fqn: str, obj: torch.Tensor):
        # obj is self, or the tensor-parallel DTensor whose local tensor this is.
        return checkpoint.create_write_items(fqn, self)

    def __create_chunk_list__(self):
        return checkpoint.create_chunk_list(self)

    def __get_tensor_shard__(self, index):
        return checkpoint.get_tensor_shard(self, index)

    def __tensor_flatten__(self) -> tuple[list[str], RaggedSpec]:
        return ["_local"], self._spec

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], spec: RaggedSpec, outer_size: Any, outer_stride: Any
    ) -> "RaggedShardTensor":
        local = inner_tensors["_local"]
        return RaggedShardTensor(local, spec, requires_grad=local.requires_grad)

    def __repr__(self) -> str:
        return f"RaggedShardTensor({self._spec.describe()}, local={self._local!r})"

    def __reduce_ex__(self, protocol):
        # torch.save / pickle would write this rank's piece alone: frameworks that save on rank 0
        # (optimizer.pt, a "full" checkpoint) would write files that silently lose the other pieces.
        if self._spec.world_size > 1:
            raise RuntimeError(
                f"cannot pickle (torch.save) a RaggedShardTensor sharded over {self._spec.world_size} ranks "
                f"({self._spec.describe()}): the file would hold this rank's piece only. Save sharded state with "
                f"torch.distributed.checkpoint (dcp.save on every rank), or whole tensors: "
                f"fsdp_pass.get_full_state_dict(model), or torch's get_state_dict(model, optimizer, "
                f"options=StateDictOptions(full_state_dict=True)); docs/integrations.md has each framework's recipe"
            )
        return super().__reduce_ex__(protocol)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return ragged_dispatch.dispatch(func, args, kwargs)


def ragged_part(t: torch.Tensor) -> torch.Tensor:
    """What FSDP shards of ``t``: a tensor/expert-parallel DTensor's local tensor, else ``t`` itself
    (see [Note: FSDP over TP/EP] in sharding/materialize.py)."""
    return t._local_tensor if isinstance(t, DTensor) else t


def local_block(full: torch.Tensor, spec) -> torch.Tensor:
    """This rank's block of the global tensor ``full`` under a DTensor ``spec`` (a view, no copy)."""
    shape, offset = compute_local_shape_and_global_offset(spec.shape, spec.mesh, spec.placements)
    return full[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def distribute_tensor(
    full: torch.Tensor, mesh: DeviceMesh | None, placement: RaggedShard, mesh_dim: int = 0
) -> RaggedShardTensor:
    """Shard a tensor every rank already holds: keep (a copy of) this rank's slice, no communication."""
    spec = RaggedSpec(full.shape, placement, mesh, mesh_dim)
    start, end = spec.local_range
    local = full.detach().reshape(-1)[start:end].clone()
    return RaggedShardTensor(local, spec, requires_grad=full.requires_grad)


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def _register_for_foreach_defaults() -> None:
    """Let optimizers and clip_grad_norm_ pick their foreach paths by default, as for plain tensors."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        if RaggedShardTensor not in supported:
            supported.append(RaggedShardTensor)


_register_for_foreach_defaults()

# Imported last: ragged_dispatch imports the classes above (the reverse edge is only used at call time).
from . import ragged_dispatch  # noqa: E402
