"""RaggedShardTensor: a tensor whose flattened elements are split over the ranks of one mesh dim.

The wrapper carries the *global* shape, dtype and device; each rank stores only its piece, one
contiguous 1-D range of the row-major flattened tensor (``RaggedShard.local_range``). The piece is
often a view into a flat bucket buffer, so nothing here copies it on construction.

Eager ops run through ``__torch_dispatch__`` on the pieces, but only where that is exact
(elementwise ops, optimizer list ops, full reductions; see ``dispatch``). That is what
``torch.optim`` optimizers and ``clip_grad_norm_`` need (sharding a tensor also lets their
``foreach`` defaults treat RaggedShard tensors like plain ones, as DTensor does:
:func:`register_for_foreach_defaults`). Everything else
raises rather than compute something silently wrong on a piece.

Under ``torch.compile`` the same dispatch runs on fake/functional pieces: elementwise ops trace as
ops on the locals and reductions as functional collectives in the graph.

[Note: DTensors over RaggedShard local tensors]
FSDP over TP/EP keeps a parameter a DTensor whose local tensor is a RaggedShardTensor ([Note: FSDP
over TP/EP] in sharding/materialize.py). torch's ``DTensor.full_tensor()`` and ``redistribute()``
read the DTensor's placements only: for a ``Replicate()`` parameter (a RowwiseParallel bias, a
sequence-parallel norm) they issue no collective and would hand back this rank's piece; for
``Shard`` they gather over the TP/EP dims only. So such a DTensor is a :class:`RaggedLocalDTensor`,
a DTensor subclass (sharding swaps the parameter's class in place; its gradient, optimizer states
and what ops on it return are built as one too) whose two methods, on real pieces, first gather the
local tensor whole over FSDP's ranks (one collective; not differentiable), then run as DTensor's.
So ``p.full_tensor()`` and ``p.redistribute(mesh, [Replicate(), ...])`` (what torch's state-dict
utilities, Hugging Face and checkpointers call) give the whole tensor on every rank. Ops run through
DTensor's own dispatch (its documented way back for subclasses), and tracing sees a plain DTensor
(``__tensor_unflatten__``), so graphs are unchanged; ``p.to_local()`` stays the RaggedShard local
tensor. A plain RaggedShardTensor answers ``redistribute(mesh, [Replicate()])`` the same way (a
replicated DTensor of the whole tensor).

[Note: storage of a sharded tensor]
A RaggedShardTensor is a wrapper without storage: its data is the piece. Storage-based savers
(Hugging Face ``save_pretrained`` through ``id_tensor_storage``, ``safetensors.torch.save_model``,
accelerate's ``save_model``, torchtitan's checkpointer) call ``untyped_storage()`` to find tensors
that share memory, then save each tensor's data. The piece's storage would be the wrong answer:
every parameter of a bucket would look like one shared tensor (the savers keep one of them) and the
data written would be a piece. torch's own answer fails later with "invalid python storage", which
names no fix. So ``untyped_storage()`` (and ``storage()``, built on it) on a real piece raises a
``RuntimeError`` naming the parameter (``state_dict()``'s detached values carry its name), its shape
and the ways to save whole tensors; the savers let it through, so nothing is written. Tracing keeps
torch's answer, and ``data_ptr()`` stays torch's (0: no data of its own), which ``copy.deepcopy``
and pickling test for wrapper subclasses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.utils._pytree as pytree
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed import ProcessGroup
from torch.distributed.tensor import DTensor, Placement, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from ..placement import RaggedShard, transfer_splits
from . import checkpoint, collectives, in_flight

__all__ = ["BUCKET_ATTR", "RaggedLocalDTensor", "RaggedShardTensor", "RaggedSpec", "bucket_of", "distribute_tensor",
           "holds_pieces", "is_sharded", "local_block", "over_pieces", "ragged_part", "register_for_foreach_defaults", "whole_tensor"]


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

    @property
    def piece(self) -> torch.Tensor:
        """This rank's flat piece as stored, read without side effects: no wait for a reduce-scatter still
        writing it (:meth:`to_local` waits first). For layout, identity and bookkeeping; values that ops
        read go through dispatch, which waits."""
        return self._local

    def to_local(self) -> torch.Tensor:
        """This rank's flat piece (the stored tensor itself, not a copy)."""
        in_flight.settle_tensor(self._local)
        return self._local

    def full_tensor(self) -> torch.Tensor:
        """The whole tensor, on every rank of ``mesh_dim`` (one padded all-gather; not differentiable)."""
        spec = self._spec
        sizes = [spec.placement.local_numel(r) for r in range(spec.world_size)]
        in_flight.settle_tensor(self._local)
        return collectives.all_gather_padded(self._local, sizes, spec.group).view(spec.shape)

    def redistribute(
        self,
        device_mesh: "DeviceMesh | RaggedShard | None" = None,
        placements: "Sequence[Placement] | RaggedShard | None" = None,
        *,
        async_op: bool = False,
        forward_dtype: torch.dtype | None = None,
        backward_dtype: torch.dtype | None = None,
    ) -> torch.Tensor:
        """The same tensor in another layout (not differentiable). Two forms:

        * ``redistribute(RaggedShard(...))``: another RaggedShard layout over the same mesh dim. One
          uneven ``all_to_all_single`` moves every element straight to its new owner; ``self`` when
          the layout does not change.
        * ``DTensor.redistribute``'s form, ``redistribute(mesh, [Replicate(), ...])`` (what torch's
          state-dict utilities and checkpointers call): the whole tensor is gathered and returned as a
          DTensor with those placements on ``mesh`` (default: this tensor's mesh), so ``.to_local()``
          of a ``[Replicate(), ...]`` result is the whole tensor on every rank. Without a mesh (one
          process) the whole tensor itself. ``async_op`` and ``backward_dtype`` change nothing here.
        """
        if isinstance(device_mesh, RaggedShard) or isinstance(placements, RaggedShard):
            return self._reshard(device_mesh if isinstance(device_mesh, RaggedShard) else placements)
        whole = self.full_tensor()
        if forward_dtype is not None:
            whole = whole.to(forward_dtype)
        mesh = device_mesh if device_mesh is not None else self._spec.mesh
        if mesh is None:
            return whole
        replicated = DTensor.from_local(whole, mesh, [Replicate()] * mesh.ndim, run_check=False)
        return replicated if placements is None else replicated.redistribute(mesh, placements)

    def _reshard(self, placement: RaggedShard) -> "RaggedShardTensor":
        spec = self._spec
        if placement == spec.placement:
            return self
        target = RaggedSpec(spec.shape, placement, spec.mesh, spec.mesh_dim)
        send, recv = transfer_splits(spec.placement, placement, spec.rank)
        in_flight.settle_tensor(self._local)
        local = collectives.all_to_all_uneven(self._local, send, recv, spec.group)
        return RaggedShardTensor(local, target)

    def untyped_storage(self) -> torch.UntypedStorage:
        """Refused on real pieces: a sharded tensor has no storage of its own ([Note: storage of a
        sharded tensor]). Tracing (fake pieces) keeps torch's answer."""
        if _is_traced(self._local):
            return super().untyped_storage()
        raise RuntimeError(
            f"{_what(self)} is sharded ({self._spec.describe()}): it has no storage of its own, this rank holds "
            f"only a flat piece of it, so a storage-based saver (save_pretrained, accelerate's save_model, "
            f"safetensors) cannot save it whole. Give it whole tensors: call fsdp_pass.set_state_dict_type(model, "
            f"'full') first (state_dict() then gathers whole tensors; every rank calls it), or pass state_dict="
            f"get_model_state_dict(model, options=StateDictOptions(full_state_dict=True)), or save inside "
            f"`with fsdp_pass.unshard(model):`"
        )

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
        in_flight.settle_tensor(self._local)
        return checkpoint.get_tensor_shard(self, index)

    def __tensor_flatten__(self) -> tuple[list[str], RaggedSpec]:
        in_flight.settle_tensor(self._local)  # [Note: the last reduce-scatter overlaps the optimizer step]
        return ["_local"], self._spec

    @staticmethod
    def __tensor_unflatten__(
        inner_tensors: dict[str, torch.Tensor], spec: RaggedSpec, outer_size: Any, outer_stride: Any
    ) -> "RaggedShardTensor":
        local = inner_tensors["_local"]
        return RaggedShardTensor(local, spec, requires_grad=local.requires_grad)

    def __repr__(self) -> str:
        in_flight.settle_tensor(self._local)
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
    @torch._disable_dynamo  # eager ops inside a compiled region's eager code: run, never traced (as DTensor's)
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return ragged_dispatch.dispatch(func, args, kwargs)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """The global value of a sharded tensor (a RaggedShardTensor, or a DTensor whose local tensor is
    one): FSDP's pieces gathered first, then the TP/EP blocks. A collective; not differentiable."""
    if isinstance(t, DTensor) and holds_pieces(t):
        t = _with_whole_local(t)
    return t.full_tensor()


def _with_whole_local(t: DTensor) -> DTensor:
    """``t`` with its RaggedShard local tensor gathered whole over FSDP's ranks (plain DTensor again)."""
    return DTensor.from_local(t._local_tensor.full_tensor(), t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


class RaggedLocalDTensor(DTensor):
    """A DTensor whose local tensor is a RaggedShardTensor: ``full_tensor`` and ``redistribute`` gather
    FSDP's pieces first ([Note: DTensors over RaggedShard local tensors])."""

    __slots__ = ()  # DTensor's layout, so a parameter's class can be swapped in place

    def full_tensor(self, *, grad_placements: Sequence[Placement] | None = None) -> torch.Tensor:
        if holds_pieces(self, real=True):
            return _with_whole_local(self).full_tensor(grad_placements=grad_placements)
        return super().full_tensor(grad_placements=grad_placements)

    def redistribute(self, device_mesh: DeviceMesh | None = None, placements: Sequence[Placement] | None = None, *,
                     async_op: bool = False, forward_dtype: torch.dtype | None = None,
                     backward_dtype: torch.dtype | None = None) -> DTensor:
        source = _with_whole_local(self) if holds_pieces(self, real=True) else self
        return DTensor.redistribute(source, device_mesh, placements, async_op=async_op, forward_dtype=forward_dtype,
                                    backward_dtype=backward_dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        # DTensor's dispatch on plain DTensors; results over RaggedShard pieces come back as this class
        # (a detached state-dict value, an optimizer state, ``p * 2`` gather whole as before), and an
        # in-place op gives back the tensor it was called on.
        originals: dict[int, tuple[DTensor, DTensor]] = {}

        def unwrap(t):
            if isinstance(t, RaggedLocalDTensor):
                plain = DTensor(t._local_tensor, t._spec, requires_grad=t.requires_grad)
                originals[id(plain)] = (plain, t)
                return plain
            return t

        def rewrap(t):
            if isinstance(t, DTensor):
                known = originals.get(id(t))
                if known is not None and known[0] is t:
                    return known[1]
                if type(t) is DTensor and isinstance(t._local_tensor, RaggedShardTensor):
                    t.__class__ = RaggedLocalDTensor
            return t

        out = func(*pytree.tree_map(unwrap, args), **pytree.tree_map(unwrap, kwargs or {}))
        return pytree.tree_map(rewrap, out)


def over_pieces(local: torch.Tensor, spec) -> DTensor:
    """A DTensor with DTensor spec ``spec`` around ``local``: a :class:`RaggedLocalDTensor` when
    ``local`` is a RaggedShard piece."""
    cls = RaggedLocalDTensor if isinstance(local, RaggedShardTensor) else DTensor
    return cls(local, spec, requires_grad=False)


def _is_traced(piece: torch.Tensor) -> bool:
    """Whether ``piece`` stands in for data (fake, functional, meta, or under Dynamo) rather than holding it."""
    return type(piece) is not torch.Tensor or piece.is_meta or torch.compiler.is_compiling()


def _what(t: RaggedShardTensor) -> str:
    """``parameter 'name'`` when ``t`` is a sharded parameter or a detached alias of one."""
    name = bucket_of(t)[1] if is_sharded(t) else t.__dict__.get(PARAMETER_NAME)
    return "a RaggedShardTensor" if name is None else f"parameter {name!r}"


# On a detached alias of a sharded parameter (``state_dict()`` values): the parameter's name, for messages.
PARAMETER_NAME = "_fsdp_pass_parameter_name"


def holds_pieces(t: torch.Tensor, *, real: bool = False) -> bool:
    """Whether ``t`` is a RaggedShard tensor or a DTensor whose local tensor is one (the one question
    every "is this sharded by fsdp_pass" check asks). ``real``: and the piece holds data; the one real
    difference, since tracing (fake or functional pieces, Dynamo) runs torch's own methods unchanged."""
    part = t._local_tensor if isinstance(t, DTensor) else t
    if not isinstance(part, RaggedShardTensor):
        return False
    return not real or not _is_traced(part._local)


# On a sharded parameter (and the local piece of a sharded TP/EP DTensor parameter): (the bucket holding
# it, its name there). The bucket is a DBuffer (buckets/dbuffer.py); this room only follows the link.
BUCKET_ATTR = "_fsdp_pass_bucket"


def is_sharded(p: torch.Tensor) -> bool:
    """Whether ``p`` is a parameter held by a bucket (a DBuffer)."""
    return holds_pieces(p) and hasattr(p, BUCKET_ATTR)


def bucket_of(p: torch.Tensor) -> tuple[Any, str]:
    """The bucket (DBuffer) holding a sharded parameter, and the parameter's name in it."""
    return getattr(p, BUCKET_ATTR)


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
    register_for_foreach_defaults()
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


def register_for_foreach_defaults() -> None:
    """Let optimizers and clip_grad_norm_ pick their foreach paths by default, as for plain tensors.

    Appends to torch's ``_foreach_supported_types`` lists (registries, listed in docs/torch_changes.md);
    called when a model or tensor is sharded, not at import."""
    from torch.optim import optimizer
    from torch.utils import _foreach_utils

    for supported in (optimizer._foreach_supported_types, _foreach_utils._foreach_supported_types):
        for cls in (RaggedShardTensor, RaggedLocalDTensor):  # the latter as torch registers DTensor
            if cls not in supported:
                supported.append(cls)


# Imported last: dispatch imports the classes above (the reverse edge is only used at call time).
from . import dispatch as ragged_dispatch  # noqa: E402
