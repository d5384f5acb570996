"""fsdp_pass: fully sharded data parallel training as ``torch.compile`` passes.

``import fsdp_pass`` registers the ``"vescale"`` backend::

    model = torch.compile(model, backend="vescale", options={"mesh": mesh})
"""

from .placement import RaggedShard
from .planner import Layout, TensorSpec, plan, plan_buckets

__all__ = ["Layout", "RaggedShard", "TensorSpec", "plan", "plan_buckets"]
__version__ = "0.1.0"
