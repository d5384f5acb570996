"""Pass 4 (joint graph): reshard after forward.

Without tags the partitioner saves views of every gathered bucket for backward, which keeps all
unsharded parameters alive until backward (ZeRO-2 memory). Tagging the gather chains
``MUST_RECOMPUTE`` makes the forward save only the shards; backward gathers again.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.checkpoint import CheckpointPolicy

__all__ = ["tag_reshard_after_forward", "GATHER_CHAIN_OPS"]

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional

# Ops between an all_gather and the parameter views that compute reads: recomputing them is free.
GATHER_CHAIN_OPS = {
    _c10d.wait_tensor.default,
    _aten.split_with_sizes.default,
    _aten.view.default,
    _aten._unsafe_view.default,
    _aten.reshape.default,
    _aten.t.default,
    _aten.permute.default,
    _aten.transpose.int,
    _aten.expand.default,
    _aten.alias.default,
    _aten.slice.Tensor,
    _aten.unsqueeze.default,
    _aten.squeeze.dim,
}
_CASTS = {_aten._to_copy.default, torch.ops.prims.convert_element_type.default}
_RECOMPUTE_GRAPH_ID = 1_000_003  # any id distinct from user activation-checkpoint regions


def _is_getitem(node: fx.Node) -> bool:
    return node.op == "call_function" and node.target.__name__ == "getitem"


def tag_reshard_after_forward(gm: fx.GraphModule, joint_inputs=None) -> fx.GraphModule:
    """Mark every forward all_gather, the cast feeding it and its view chain MUST_RECOMPUTE."""
    for node in list(gm.graph.find_nodes(op="call_function", target=_c10d.all_gather_into_tensor.default)):
        chain, stack = [node], [node]
        source = node.args[0]
        if isinstance(source, fx.Node) and source.target in _CASTS:
            chain.append(source)
        while stack:
            for user in stack.pop().users:
                if user.target in GATHER_CHAIN_OPS or _is_getitem(user):
                    chain.append(user)
                    stack.append(user)
        for n in chain:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = _RECOMPUTE_GRAPH_ID
    return gm
