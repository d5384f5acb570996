"""Runtime pieces that talk to ``torch.distributed``: the RaggedShard tensor and its collectives."""

from .ragged_tensor import RaggedShardTensor, RaggedSpec, distribute_tensor

__all__ = ["RaggedShardTensor", "RaggedSpec", "distribute_tensor"]
