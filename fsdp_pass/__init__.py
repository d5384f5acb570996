"""fsdp_pass: fully sharded data parallel training as ``torch.compile`` passes.

``import fsdp_pass`` registers the ``"vescale"`` backend::

    model = torch.compile(model, backend="vescale", options={"mesh": mesh})
"""

from .compile import backend as _backend  # registers the "vescale" backend
from .sharding.blocks import set_block
from .compile.explain import explain
from .sharding.fully_shard import fully_shard
from .buckets.gradient_sync import no_sync, reduce_gradients, set_gradient_divide_factor, set_requires_gradient_sync
from .placement import RaggedShard
from .planner import Layout, TensorSpec, plan, plan_buckets
from .tensor.ragged_tensor import RaggedShardTensor, distribute_tensor
from .interop.state_dict import get_full_state_dict, set_full_state_dict, set_state_dict_type
from .eager.unshard import unshard

__all__ = [
    "Layout",
    "RaggedShard",
    "RaggedShardTensor",
    "TensorSpec",
    "distribute_tensor",
    "explain",
    "fully_shard",
    "get_full_state_dict",
    "no_sync",
    "plan",
    "plan_buckets",
    "reduce_gradients",
    "set_block",
    "set_full_state_dict",
    "set_gradient_divide_factor",
    "set_requires_gradient_sync",
    "set_state_dict_type",
    "unshard",
]
__version__ = "0.1.0"
