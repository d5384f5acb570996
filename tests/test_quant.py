"""Block-wise FP8 / INT8 weight quantization: the math, the custom ops under compile, sharded panels.

The multi-rank check (one spawn per world size) shards weights with 128-row blocks and checks that
each rank's quantization of its own panels is exactly its slice of the full weight's quantization.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.sharding.fully_shard import fully_shard
from fsdp_pass.quant import BLOCK_QUANTIZE_OPS, fp8_block_dequantize, fp8_block_linear, fp8_block_quantize, int8_block_dequantize, int8_block_linear, int8_block_quantize, quantize_sharded

QUANTIZERS = {"fp8": fp8_block_quantize, "int8": int8_block_quantize}
DEQUANTIZERS = {"fp8": fp8_block_dequantize, "int8": int8_block_dequantize}
# Rows: whole panels, a partial last panel (300 = 2*128 + 44), fewer rows than a panel; odd columns.
SHAPES = [(512, 64), (300, 200), (100, 130), (256, 384)]


def _weight(shape, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=gen) * torch.logspace(-2, 1, shape[1])  # tiles of very different ranges


class Weights(nn.Module):
    def __init__(self, shapes) -> None:
        super().__init__()
        for i, shape in enumerate(shapes):
            setattr(self, f"w{i}", nn.Parameter(_weight(shape, i)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    """A bit-exact view for comparing float8 tensors (and plain ones)."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


# ---------------------------------------------------------------------------------------------
# multi-rank
# ---------------------------------------------------------------------------------------------


def _check_sharded_quantization_equals_full(mesh, world: int) -> None:
    model = Weights(SHAPES + [(1024, 64)])  # the largest weight cannot fit on one rank
    full = {name: p.detach().clone() for name, p in model.named_parameters()}
    # 128-row blocks where 128 divides the rows; a whole-tensor block otherwise (what detect should pick).
    blocks = {name: (128 if p.shape[0] % 128 == 0 else p.shape[0]) for name, p in model.named_parameters()}
    fully_shard(model, mesh, block_sizes=blocks)
    rank = mesh.get_local_rank()
    spread = 0
    for name, p in model.named_parameters():
        spread += sum(1 for n in p.placement.local_units if n) > 1
        for fmt, quantize in QUANTIZERS.items():
            quantized, scale_inv = quantize_sharded(p, fmt)
            expected_q, expected_s = quantize(full[name])
            start, end = p._spec.local_range
            assert torch.equal(_bits(quantized.to_local()), _bits(expected_q).view(-1)[start:end]), (name, fmt)
            assert quantized._spec == p._spec
            cols = expected_s.shape[1]
            s0, s1 = scale_inv.placement.local_range(rank)
            assert torch.equal(scale_inv.to_local(), expected_s.view(-1)[s0:s1]), (name, fmt)
            assert s0 == -(-start // (128 * p.shape[1])) * cols  # panels before this rank's piece
            assert torch.equal(scale_inv.full_tensor(), expected_s), (name, fmt)
            if fmt == "int8":  # gloo has no float8 collectives ("Invalid scalar type")
                assert torch.equal(quantized.full_tensor(), expected_q), (name, fmt)
    assert spread, "every weight landed on one rank: no panel boundary was tested"

    # An element-block layout cuts panels: refuse rather than quantize part of a tile.
    cut = Weights([(384, 64)])  # split evenly: boundaries at 192 (2 ranks) or 96 (4 ranks) rows
    fully_shard(cut, mesh, block_sizes={"*": {"elements": 8}})
    with pytest.raises(ValueError, match="cuts a panel of 128 rows"):
        quantize_sharded(cut.w0)


def _all_checks(rank: int, world: int) -> None:
    _check_sharded_quantization_equals_full(init_device_mesh("cpu", (world,)), world)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_sharded_block_quantization_equals_full_bitwise(world: int) -> None:
    run_distributed(_all_checks, world)


# ---------------------------------------------------------------------------------------------
# single process
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["fp8", "int8"])
@pytest.mark.parametrize("shape", SHAPES)
def test_round_trip_error_is_within_half_a_step_of_each_tile(fmt: str, shape) -> None:
    w = _weight(shape)
    quantized, scale_inv = QUANTIZERS[fmt](w)
    assert quantized.shape == w.shape and scale_inv.shape == (-(-shape[0] // 128), -(-shape[1] // 128))
    assert quantized.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[fmt]
    scale = scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)[: shape[0], : shape[1]]
    error = (DEQUANTIZERS[fmt](quantized, scale_inv) - w).abs()
    if fmt == "int8":
        assert (error <= 0.5 * scale * (1 + 1e-6)).all()
    else:  # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus subnormal steps near zero
        assert (error <= w.abs() / 16 + scale * 2.0**-9).all()
    # The largest element of each tile maps to the format's largest value.
    qmax = {"fp8": 448.0, "int8": 127.0}[fmt]
    assert torch.isclose(quantized.float().abs().amax(), torch.tensor(qmax))


def test_tile_scales_are_deepseek_v3_weight_scale_inv() -> None:
    w = torch.zeros(256, 256)
    w[:128, :128] = 2.0
    w[200, 130] = -4.48
    _, scale_inv = fp8_block_quantize(w)
    expected = torch.tensor([[2.0 / 448, 1.0], [1.0, 4.48 / 448]])  # all-zero tiles: scale 1
    assert torch.equal(scale_inv, expected)


@pytest.mark.parametrize("linear,fmt", [(fp8_block_linear, "fp8"), (int8_block_linear, "int8")])
def test_block_linear_uses_the_dequantized_weight_and_passes_gradients_through(linear, fmt: str) -> None:
    w = nn.Parameter(_weight((200, 160)))
    bias = nn.Parameter(torch.randn(200))
    x = torch.randn(3, 160, requires_grad=True)
    y = linear(x, w, bias)
    dequantized = DEQUANTIZERS[fmt](*QUANTIZERS[fmt](w.detach()))
    assert torch.equal(y, torch.nn.functional.linear(x, dequantized, bias))
    y.square().sum().backward()
    assert torch.equal(w.grad, (2 * y).detach().T @ x.detach())  # straight through: d(x Wᵀ)/dW

    compiled = torch.compile(lambda a, b: linear(a, b, bias), backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x, w), y)


def test_quantize_ops_appear_in_dynamo_graphs_with_the_weight_as_argument_0() -> None:
    """What the detect pass matches: the op overload, weight placeholder first, tile (default 128) second."""
    seen = []

    def backend(gm, example_inputs):
        seen.extend(n for n in gm.graph.nodes if n.op == "call_function" and n.target in BLOCK_QUANTIZE_OPS)
        return gm

    layer = nn.Linear(256, 128)
    torch.compile(lambda x: fp8_block_linear(x, layer.weight), backend=backend, fullgraph=True)(torch.randn(2, 256))
    (node,) = seen
    assert node.target is torch.ops.fsdp_pass.fp8_block_quantize.default
    assert node.args[0].op == "placeholder" and node.args[1:] == ()
