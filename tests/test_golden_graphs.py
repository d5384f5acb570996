"""Golden rewritten graph of a small model (two ranks of a fake process group): a review aid for pass changes.

Regenerate after an intended change with ``EXPECTTEST_ACCEPT=1 python -m pytest tests/test_golden_graphs.py``.
"""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_pass  # noqa: F401  (registers the backend)
from fsdp_pass.compile.backend import records
from fsdp_pass.testing.fake_pg import fake_process_group

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(6, 10), nn.Linear(10, 4, bias=False)])

    def forward(self, x):
        return self.layers[1](torch.relu(self.layers[0](x)))


class GoldenGraphs(expecttest.TestCase):
    def test_rewritten_graph(self):
        torch._dynamo.reset()
        with fake_process_group(2):
            before = set(map(id, records()))
            compiled = torch.compile(TwoLayer(), backend="vescale", options={"compiler": "aot_eager", "min_bucket_bytes": 0})
            compiled(torch.randn(3, 6))
            (record,) = [r for r in records() if id(r) not in before]
            code = record.modules["rewritten"].code.strip().replace(repr(dist.group.WORLD.group_name), "GROUP")
            self.assertExpectedInline(code, """\
def forward(self, bucket0_shard, bucket1_shard, L_x_ : torch.Tensor):
    l_x_ = L_x_
    gather_bucket = fsdp_pass_buckets_gather_gather_bucket(bucket0_shard, param_dtype = torch.float32, reduce_dtype = torch.float32, shard_world = 2, shard_group = GROUP, replicate_world = 1, replicate_group = None, grad_divisor = 2, levels = None);  bucket0_shard = None
    split_with_sizes_default = torch.ops.aten.split_with_sizes.default(gather_bucket, [60, 10, 2]);  gather_bucket = None
    getitem = split_with_sizes_default[0]
    view_default = torch.ops.aten.view.default(getitem, [10, 6]);  getitem = None
    getitem_1 = split_with_sizes_default[1];  split_with_sizes_default = None
    view_default_1 = torch.ops.aten.view.default(getitem_1, [10]);  getitem_1 = None
    linear = torch._C._nn.linear(l_x_, view_default, view_default_1);  l_x_ = view_default = view_default_1 = None
    relu = torch.relu(linear);  linear = None
    gather_bucket_1 = fsdp_pass_buckets_gather_gather_bucket(bucket1_shard, param_dtype = torch.float32, reduce_dtype = torch.float32, shard_world = 2, shard_group = GROUP, replicate_world = 1, replicate_group = None, grad_divisor = 2, levels = None);  bucket1_shard = None
    split_with_sizes_default_1 = torch.ops.aten.split_with_sizes.default(gather_bucket_1, [40]);  gather_bucket_1 = None
    getitem_2 = split_with_sizes_default_1[0];  split_with_sizes_default_1 = None
    view_default_2 = torch.ops.aten.view.default(getitem_2, [4, 10]);  getitem_2 = None
    linear_1 = torch._C._nn.linear(relu, view_default_2, None);  relu = view_default_2 = None
    return (linear_1,)""")
