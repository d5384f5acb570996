"""What runs every step: the RaggedShard tensor (``ragged_tensor``) and its ops (``ragged_dispatch``), the
bucket op in graphs (``gather``),
the DBuffers (``dbuffer``) and the mesh their collectives use (``mesh``), eager calls on sharded
parameters (``eager``), binding a compiled graph to its buckets (``rebind``), the gradient check
for parameters left out of sharding (``sync_check``), collectives and DCP hooks."""

from .ragged_tensor import RaggedShardTensor, RaggedSpec, distribute_tensor

__all__ = ["RaggedShardTensor", "RaggedSpec", "distribute_tensor"]
