"""Block structures found in the graph, the options and annotations reach the planner."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import fsdp_pass
from fsdp_pass.tensor.ragged_tensor import bucket_of


class Structured(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv = nn.Parameter(torch.randn(24, 8))  # fused q (8 rows), k (8), v (8)
        self.quantized = nn.Parameter(torch.randn(32, 8))  # used through 16-row blocks
        self.plain = nn.Parameter(torch.randn(40, 8))
        self.annotated = nn.Parameter(torch.randn(12, 8))
        fsdp_pass.set_block(self.annotated, rows=6)

    def forward(self, x):
        q, k, v = self.qkv.split([8, 8, 8], dim=0)
        scale = self.quantized.view(2, 16, 8).abs().amax(dim=(1, 2), keepdim=True)
        w = (self.quantized.view(2, 16, 8) / scale).view(32, 8)
        return (x @ q.T).sum() + (x @ k.T).sum() + (x @ v.T).sum() + (x @ w.T).sum() + (x @ self.plain.T).sum() \
            + (x @ self.annotated.T).sum()


def _block(p: torch.Tensor) -> int:
    buf, name = bucket_of(p)
    return buf.layout.spec(name).block


def test_blocks_from_graph_patterns_annotations_and_options(four_fake_ranks):
    model = Structured()
    options = {"compiler": "aot_eager", "block_sizes": {"pla*": {"elements": 20}}}
    torch.compile(model, backend="vescale", options=options)(torch.randn(2, 8)).backward()
    assert _block(model.qkv) == 8 * 8  # split into 8-row pieces
    assert _block(model.quantized) == 16 * 8  # reshaped into 16-row blocks
    assert _block(model.plain) == 20  # options["block_sizes"]
    assert _block(model.annotated) == 6 * 8  # set_block
    for p in model.parameters():
        buf, name = bucket_of(p)
        buf.layout.validate()  # no rank boundary cuts any of these blocks


def test_block_that_cannot_divide_is_refused(four_fake_ranks):
    model = Structured()
    options = {"compiler": "aot_eager", "block_sizes": {"plain": 7}}
    with pytest.raises(Exception, match=r"parameter 'plain' of shape \(40, 8\)"):
        torch.compile(model, backend="vescale", options=options)(torch.randn(2, 8))
    assert not any(isinstance(p, fsdp_pass.RaggedShardTensor) for p in model.parameters())
