"""Distributed-checkpoint (DCP) protocol for RaggedShard tensors: save and load local pieces, no gather.

A rank's piece is one flat range of the row-major tensor, which is at most ``2·ndim − 1`` boxes
(``placement.flat_range_boxes``). Each box is itself one contiguous run of the piece, so DCP writes
and reads views of the local piece directly: saving moves no data between ranks, and loading into a
different layout (another world size, HSDP, one process) fills each rank's piece in place.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from ..placement import flat_range_boxes

__all__ = ["create_chunk_list", "create_write_items", "get_tensor_shard"]


def _boxes(tensor) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """``(offsets, sizes, start in the local piece)`` of every box of this rank's piece, in global coordinates.

    Inside a tensor/expert-parallel DTensor the boxes are found in its local block and shifted by
    the block's offset, so a checkpoint holds the logical tensor whatever the parallelism.
    """
    spec = tensor._spec
    shape = tuple(spec.shape)
    start, end = spec.local_range
    strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
    shift = spec.global_offset or (0,) * len(shape)
    return [
        (tuple(o + s for o, s in zip(offsets, shift)), sizes, sum(o * s for o, s in zip(offsets, strides)) - start)
        for offsets, sizes in flat_range_boxes(shape, start, end)
    ]


def _global_shape(tensor) -> torch.Size:
    return tensor._spec.global_shape or tensor.shape


def create_write_items(fqn: str, tensor) -> list[WriteItem]:
    properties = TensorProperties.create_from_tensor(tensor._local)
    return [
        WriteItem(
            index=MetadataIndex(fqn, torch.Size(offsets)),
            type=WriteItemType.SHARD,
            tensor_data=TensorWriteData(
                chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)),
                properties=properties,
                size=_global_shape(tensor),
            ),
        )
        for offsets, sizes, _ in _boxes(tensor)
    ]


def create_chunk_list(tensor) -> list[ChunkStorageMetadata]:
    return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in _boxes(tensor)]


def get_tensor_shard(tensor, index: MetadataIndex) -> torch.Tensor:
    """The box at ``index.offset`` as a view of the local piece (DCP reads into it in place)."""
    for offsets, sizes, start in _boxes(tensor):
        if torch.Size(offsets) == index.offset:
            return tensor._local[start:start + math.prod(sizes)].view(sizes)
    raise ValueError(f"{index.fqn}: this rank holds no box at offset {tuple(index.offset)}")
