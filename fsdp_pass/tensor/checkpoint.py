"""Distributed-checkpoint (DCP) protocol for RaggedShard tensors.

A rank's piece is one flat range of the row-major tensor, which is at most ``2·ndim − 1`` boxes
(``placement.flat_range_boxes``).

**Loading** fills those boxes in place: each box is one contiguous run of the piece, so DCP reads
into views of the local piece, whatever layout the checkpoint was written in (another world size,
HSDP, one process).

**Saving** writes exactly one box per rank and tensor: the whole leading-dim slices (rows of a
matrix, experts of a 3-d weight) whose first element the rank holds. Several boxes per rank would
be correct for storage that keeps every write item apart (``FileSystemWriter``), but the
safetensors formats keep one entry per tensor name and file: torch's safetensors writer puts a
rank's items in a dict keyed by the tensor's name (``filesystem._write_files_from_queue``), so all
but the last box of a piece would be dropped, and the ``HuggingFaceStorageWriter`` consolidation
and reader then fill the gaps with other values. One box per rank is valid for every writer. When
a rank boundary cuts a slice, the rank that writes the slice receives its tail from the next
rank(s) in one uneven all-to-all while the save is planned (at most one partial slice per rank
boundary moves; nothing moves when every boundary falls between slices).
"""

from __future__ import annotations

import math
import sys

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..placement import flat_range_boxes
from . import collectives

__all__ = ["create_chunk_list", "create_write_items", "get_tensor_shard", "save_rows"]

# Attribute of a state-dict tensor holding its planned save box between planning and writing.
_SAVE_BOX = "_dcp_save_box"


def _shift(tensor) -> tuple[int, ...]:
    spec = tensor._spec
    return tuple(spec.global_offset or (0,) * len(spec.shape))


def _boxes(tensor) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """``(offsets, sizes, start in the local piece)`` of every box of this rank's piece, in global coordinates.

    Inside a tensor/expert-parallel DTensor the boxes are found in its local block and shifted by
    the block's offset, so a checkpoint holds the logical tensor whatever the parallelism.
    """
    spec = tensor._spec
    shape = tuple(spec.shape)
    start, end = spec.local_range
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    shift = _shift(tensor)
    return [
        (tuple(o + s for o, s in zip(offsets, shift)), sizes, sum(o * s for o, s in zip(offsets, strides)) - start)
        for offsets, sizes in flat_range_boxes(shape, start, end)
    ]


def save_rows(shape, ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Leading-dim slices ``[lo, hi)`` each rank writes when its flat piece is ``ranges[rank]``.

    Slice ``k`` goes to the rank holding its first element, so every slice is written once and
    each rank's slices are consecutive: one box per rank. A 0-d or 1-d tensor is written as its
    pieces (each already one box); this returns ``[]`` for it.
    """
    if len(shape) < 2:
        return []
    inner = math.prod(shape[1:])
    if inner == 0:
        return []
    return [(-(-start // inner), -(-end // inner)) for start, end in ranges]


def _overlap(a: tuple[int, int], b: tuple[int, int]) -> int:
    return max(0, min(a[1], b[1]) - max(a[0], b[0]))


def _plan_save_box(tensor):
    """``(offsets, sizes, head, tail)`` of the one box this rank writes, or ``None`` when it writes none.

    ``head`` is where the box starts in the local piece and ``tail`` the elements of the box past
    the end of the piece, received from the next ranks. A collective over the tensor's mesh dim
    when a rank boundary cuts a leading-dim slice (every rank computes the same decision).
    """
    spec = tensor._spec
    shape = tuple(spec.shape)
    start, end = spec.local_range
    rows = save_rows(shape, spec.placement.ranges()) if len(shape) >= 2 else []
    if not rows:  # 0-d / 1-d / empty: the piece is one box (or nothing)
        boxes = _boxes(tensor)
        if not boxes:
            return None
        (offsets, sizes, _), = boxes
        return offsets, sizes, 0, tensor.piece.new_empty(0)
    inner = math.prod(shape[1:])
    ranges = spec.placement.ranges()
    tails = [(end_r, hi * inner) if hi > lo else (0, 0) for (_, end_r), (lo, hi) in zip(ranges, rows)]
    tail = tensor.piece.new_empty(0)
    if any(b > a for a, b in tails):
        me = spec.rank
        send = [_overlap(ranges[me], t) for t in tails]
        recv = [_overlap(r, tails[me]) for r in ranges]
        # A rank sends at most the start of its piece, to the one rank writing the slice it starts in.
        tail = collectives.all_to_all_uneven(tensor.piece[: sum(send)], send, recv, spec.group)
    lo, hi = rows[spec.rank]
    if hi <= lo:
        return None
    offsets = tuple(o + s for o, s in zip((lo,) + (0,) * (len(shape) - 1), _shift(tensor)))
    return offsets, (hi - lo, *shape[1:]), lo * inner - start, tail


def _global_shape(tensor) -> torch.Size:
    return tensor._spec.global_shape or tensor.shape


def _save_call():
    """``(storage_writer, no_dist)`` of the ``torch.distributed.checkpoint.save`` being planned, if found."""
    frame = sys._getframe(1)
    for _ in range(24):
        if frame is None:
            break
        if frame.f_code.co_name == "_save_state_dict" and "storage_writer" in frame.f_locals:
            return frame.f_locals["storage_writer"], bool(frame.f_locals.get("no_dist", False))
        frame = frame.f_back
    return None, False


def _refuse_unsupported_save(fqn: str, tensor) -> None:
    """Raise for the saves of a sharded tensor that could only write an incomplete checkpoint."""
    if tensor._spec.world_size <= 1:
        return
    writer, no_dist = _save_call()
    if no_dist:
        raise ValueError(
            f"{fqn} is sharded over {tensor._spec.world_size} ranks and cannot be saved with no_dist=True, "
            "which saves this process's piece alone; call dcp.save on every rank, or save "
            "fsdp_pass.get_full_state_dict(model) on rank 0 with no_dist=True"
        )
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    if isinstance(writer, HuggingFaceStorageWriter) and not writer.save_distributed:
        raise ValueError(
            f"{fqn} is sharded over {tensor._spec.world_size} ranks, but HuggingFaceStorageWriter("
            "save_distributed=False) has every rank write the same file, which keeps only parts of the "
            "model; pass save_distributed=True (with enable_consolidation=True for one Hugging Face "
            "checkpoint), or save fsdp_pass.get_full_state_dict(model) on rank 0 with no_dist=True"
        )


def create_write_items(fqn: str, tensor) -> list[WriteItem]:
    """The one box this rank writes (see the module docstring); remembered for :func:`get_tensor_shard`."""
    _refuse_unsupported_save(fqn, tensor)
    box = _plan_save_box(tensor)
    setattr(tensor, _SAVE_BOX, box)
    if box is None:
        return []
    offsets, sizes, _, _ = box
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=TensorProperties.create_from_tensor(tensor.piece),
                size=_global_shape(tensor),
            ),
        )
    ]


def create_chunk_list(tensor) -> list[ChunkStorageMetadata]:
    """The boxes of this rank's piece, which a load fills in place."""
    if hasattr(tensor, _SAVE_BOX):  # a load is being planned: serve the piece's boxes from now on
        delattr(tensor, _SAVE_BOX)
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in _boxes(tensor)]


def get_tensor_shard(tensor, index: MetadataIndex) -> torch.Tensor:
    """The box at ``index.offset``: the planned save box while saving, else a view of the local piece."""
    box = getattr(tensor, _SAVE_BOX, None)
    if box is not None and torch.Size(box[0]) == index.offset:
        _, sizes, head, tail = box
        piece = tensor.piece[head:]
        data = torch.cat([piece, tail]) if tail.numel() else piece
        return data.view(sizes)
    for offsets, sizes, start in _boxes(tensor):
        if torch.Size(offsets) == index.offset:
            return tensor.piece[start:start + math.prod(sizes)].view(sizes)
    raise ValueError(f"{index.fqn}: this rank holds no box at offset {tuple(index.offset)}")
