"""A bucket's gradient reduce-scatter moving int8 codes and one scale per block instead of ``reduce_dtype``.

[Note: block-quantized gradient reduction]
ZeRO++'s qgZ (arXiv 2306.10209), for ``options={"quantized_reduce": ...}``: the whole gradient of a
bucket (``m·S`` elements, rank r's part ``[r·S, (r+1)·S)``) is cut, per destination rank, into blocks
of ``block`` consecutive elements starting at that rank's part (the last block of a part is padded
with zeros), so no block is ever cut by a rank boundary. Each block is quantized to int8 with one
float32 scale (``absmax / 127``, symmetric), the codes and scales for rank r are packed into one
``uint8`` row, and ONE ``all_to_all_single`` delivers every rank the m rows meant for it (gloo has no
int8 reduce-scatter; the all-to-all is ZeRO++'s form too). Each rank dequantizes the m rows and sums
them in float32: its shard of the reduced gradient. Bytes each rank sends: ``(m-1)·(S' + 4·S'/block)``
with ``S'`` the part padded to whole blocks, against ``(m-1)·4·S`` for an fp32 reduce-scatter
(0.258x for ``block=128``).

Choices, measured in docs/benchmarks.md (block-quantized gradient reduction):

* rounding: round to nearest by default; stochastic rounding (``rounding="stochastic"``) is
  unbiased but has the larger error per step, and it is offered for comparison. Its random numbers
  come from a stream of its own ([Note: a rounding stream per rank]).
* no error feedback: it would keep, per rank and bucket, the unsent quantization error of the whole
  ``m·S`` gradient, a full unsharded gradient buffer on every rank, which is the memory FSDP exists to
  avoid.
* HSDP: the replicas' all-reduce of the (already reduced) shard stays exact in ``reduce_dtype``.
* ``no_sync``: micro-batches accumulate the whole gradient unreduced in full precision; only the last
  reduction is quantized (it goes through the same :func:`~fsdp_pass.buckets.gather.reduce_gradient`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..options import QuantizedReduce
from .node_collectives import NodeLevels, within_node_sums

__all__ = ["ROUNDING_STREAM", "RoundingStream", "quantized_reduce_scatter", "sent_bytes"]

_c10d = torch.ops._c10d_functional
INT8_MAX = 127


class RoundingStream:
    """The random numbers of stochastic rounding: one generator per device, seeded by this process's rank.

    [Note: a rounding stream per rank]
    Stochastic rounding adds ``u ~ U[0, 1)`` before the floor. Drawn from torch's global generator
    (``rand_like``), two things went wrong: every rank is seeded alike (as training recipes seed them,
    for the same initial model), so every rank rounded each element with the same ``u``, and the errors
    of the m ranks' contributions to a sum were correlated instead of averaging out (measured on 4 ranks:
    2.23x round-to-nearest's error with the same seed on every rank, 1.44x with independent seeds); and
    it moved the user's random stream, so dropout masks changed when the option was switched on. So the
    draws come from generators of their own, seeded with ``SEED + global rank`` when first used:
    independent across ranks, reproducible from run to run, and the global generator is never touched.
    The op that draws (``quantize_for_reduce``) is opaque to the compiler and runs eagerly, so it reads the
    stream at run time; the stream is process-wide, like torch's own default generator.
    """

    SEED = 0x5EED_0000  # base of the per-rank seeds

    def __init__(self) -> None:
        self._generators: dict[torch.device, torch.Generator] = {}  # device -> its generator, seeded on first use

    def generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
            self._generators[device] = torch.Generator(device=device).manual_seed(self.SEED + rank)
        return self._generators[device]

    def reset(self) -> None:
        """Seed anew at the next draw (a test restarting a run in the same process)."""
        self._generators.clear()


ROUNDING_STREAM = RoundingStream()  # the process's stream ([Note: a rounding stream per rank])


def _blocks(shard_size: int, block: int) -> int:
    return -(-shard_size // block)


def _row_bytes(shard_size: int, block: int) -> int:
    """One destination's packed row: the int8 codes of its part padded to whole blocks, then the scales."""
    blocks = _blocks(shard_size, block)
    return blocks * block + 4 * blocks


def sent_bytes(world: int, shard_size: int, block: int) -> int:
    """Bytes one rank sends to the others in one quantized reduce-scatter of a bucket."""
    return (world - 1) * _row_bytes(shard_size, block)


@torch.library.custom_op("fsdp_pass::quantize_for_reduce", mutates_args=())
def quantize_for_reduce(grad: torch.Tensor, world: int, block: int, stochastic: bool) -> torch.Tensor:
    """A bucket's whole gradient (``world × S``) → ``world`` packed uint8 rows (codes, then float32 scales)."""
    shard_size = grad.numel() // world
    blocks = _blocks(shard_size, block)
    parts = torch.zeros(world, blocks * block, dtype=torch.float32, device=grad.device)
    parts[:, :shard_size] = grad.view(world, shard_size)
    tiles = parts.view(world * blocks, block)
    scale = tiles.abs().amax(dim=1, keepdim=True) / INT8_MAX
    scaled = tiles / torch.where(scale > 0, scale, torch.ones_like(scale))
    if stochastic:  # floor(x + u), u ~ U[0, 1): unbiased; u from [Note: a rounding stream per rank]
        noise = torch.rand(scaled.shape, generator=ROUNDING_STREAM.generator(scaled.device), device=scaled.device)
        scaled = torch.floor(scaled + noise)
    else:
        scaled = scaled.round()
    codes = scaled.clamp(-INT8_MAX, INT8_MAX).to(torch.int8).view(torch.uint8).view(world, blocks * block)
    return torch.cat([codes, scale.view(world, blocks).view(torch.uint8)], dim=1).contiguous()


@quantize_for_reduce.register_fake
def _(grad, world, block, stochastic):
    return grad.new_empty(world, _row_bytes(grad.numel() // world, block), dtype=torch.uint8)


@torch.library.custom_op("fsdp_pass::dequantize_and_sum", mutates_args=())
def dequantize_and_sum(rows: torch.Tensor, shard_size: int, block: int) -> torch.Tensor:
    """The ``world`` packed rows a rank received → the float32 sum of what they stand for (``shard_size``)."""
    world = rows.shape[0]
    blocks = _blocks(shard_size, block)
    codes = rows[:, :blocks * block].contiguous().view(torch.int8).view(world, blocks, block)
    scales = rows[:, blocks * block:].contiguous().view(torch.float32).view(world, blocks, 1)
    return (codes.float() * scales).sum(dim=0).view(-1)[:shard_size].contiguous()


@dequantize_and_sum.register_fake
def _(rows, shard_size, block):
    return rows.new_empty(shard_size, dtype=torch.float32)


def quantized_reduce_scatter(grad: torch.Tensor, world: int, group: str, quantized: QuantizedReduce,
                             levels: NodeLevels | None = None) -> torch.Tensor:
    """The sum over the ``world`` ranks of ``group`` of their ``grad`` (``world × S``), this rank's ``S``
    part, exchanged block-quantized ([Note: block-quantized gradient reduction]); in ``grad``'s dtype.
    Over two levels (``levels``), the node's ranks first sum exactly and only the sums cross between
    nodes quantized ([Note: collectives in two levels across nodes] in buckets/node_collectives.py)."""
    if levels is not None:
        grad = within_node_sums(grad, levels)
        world, group = levels.nodes, levels.across
    shard_size = grad.numel() // world
    rows = quantize_for_reduce(grad.contiguous(), world, quantized.block, quantized.stochastic)
    row = rows.shape[1]
    received = _c10d.wait_tensor(_c10d.all_to_all_single(rows.view(-1), [row] * world, [row] * world, group))
    return dequantize_and_sum(received.view(world, row), shard_size, quantized.block).to(grad.dtype)
