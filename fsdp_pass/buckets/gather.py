"""The graph op behind every bucket: all-gather its shard in forward, reduce-scatter its gradient in backward.

The rewrite pass (compile/passes/rewrite.py) calls :func:`gather_bucket` once per bucket; its static
arguments are a :class:`GatherConfig`, written into the graph as keyword arguments so a rewritten
graph reads by itself. Functional collectives trace under aot_autograd and Inductor, and they run
eagerly too (the eager path and ``DBuffer.all_gather``).

[Note: FP8 all-gather]
With ``options={"fp8_all_gather": ...}`` the 2-D (and stacked 3-D expert) weights inside repeated
units (``layers.3``) travel as FP8 e4m3 codes with one float32 scale per ``tile × tile`` tile
(the 128×128 block quantization of :mod:`fsdp_pass.quant.fp8`), half the bytes of bf16:

* planning (compile/passes/shard.py, sharding/fp8_select.py): every such weight gets a block of ``tile``
  rows × its row length (leading dims flattened), so no rank boundary cuts a *panel* of tiles, and
  FP8 weights are planned into buckets of their own (never with norms or biases: those stay exact).
  A weight whose rows are not a multiple of ``tile`` is left out (``explain()`` names it).
* forward (:class:`Fp8Gather`, the ``fp8=`` argument of :func:`gather_bucket`): each rank quantizes
  its own panels from the fp32 master shard (``fsdp_pass::fp8_pack_shard``: no communication, bitwise
  the whole weight's quantization), packs codes (1 byte per element, as ``uint8``: gloo has no float8
  collectives) and then its scales (``scale_slots`` float32 per rank, the most any rank needs; unused
  ones are 1) into one flat ``uint8`` buffer, and ONE all-gather per bucket moves it. Each rank then
  dequantizes every piece (a rank's panels of one weight) into one ``param_dtype`` buffer of the
  bucket's gathered layout (``fsdp_pass::fp8_unpack``), and parameters are views of that buffer
  as in the non-FP8 path; the dequantization is the only copy.
* backward is straight-through: the gradient w.r.t. the dequantized weights is reduce-scattered in
  ``reduce_dtype`` as for any bucket (:func:`reduce_gradient`), into the fp32 master shard.

Eager gathers (``DBuffer.all_gather``, ``fsdp_pass.unshard``, eager calls) stay exact.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..options import QuantizedReduce
from ..quant.fp8 import FP8, fp8_block_quantize
from .node_collectives import NodeLevels, all_gather_in_two_levels, reduce_scatter_in_two_levels
from .quantized_reduce import quantized_reduce_scatter

__all__ = ["Fp8Gather", "GatherConfig", "gather_bucket", "gather_input", "hand_over", "reduce_gradient",
           "unpack_gathered"]

_c10d = torch.ops._c10d_functional


class Fp8Gather(NamedTuple):
    """How one bucket's all-gather moves FP8 codes and scales ([Note: FP8 all-gather]).

    ``pieces`` lists, for every rank, every weight with panels there, as
    ``(rank, offset in the rank's shard, panels, columns, offset in the rank's scales)``: a piece is
    ``panels × tile`` rows of ``columns`` elements with ``panels × ceil(columns / tile)`` scales.
    """

    tile: int  # a tile is tile x tile elements; a panel is tile whole rows
    rank: int  # this rank in the shard group: it quantizes the pieces of this rank
    scale_slots: int  # float32 scales each rank packs after its codes (the most any rank needs)
    pieces: tuple[tuple[int, int, int, int, int], ...]

    def pack_arguments(self) -> list[int]:
        """``fp8_pack_shard``'s flat ``pieces``: this rank's pieces, without the rank."""
        return [v for rank, *piece in self.pieces if rank == self.rank for v in piece]

    def unpack_arguments(self) -> list[int]:
        """``fp8_unpack``'s flat ``pieces``: every rank's pieces."""
        return [v for piece in self.pieces for v in piece]


def _code_bytes(shard_size: int) -> int:
    return -(-shard_size // 4) * 4  # scales after the codes start 4-byte aligned


@torch.library.custom_op("fsdp_pass::fp8_pack_shard", mutates_args=())
def fp8_pack_shard(shard: torch.Tensor, tile: int, scale_slots: int, pieces: list[int]) -> torch.Tensor:
    """This rank's panels of a bucket shard → ``uint8`` codes (one per element) then float32 scales.

    ``pieces`` is flat ``(offset, panels, columns, scale offset)`` quadruples of this rank's pieces.
    """
    codes = torch.zeros(_code_bytes(shard.numel()), dtype=torch.uint8, device=shard.device)
    scales = torch.ones(scale_slots, dtype=torch.float32, device=shard.device)
    for i in range(0, len(pieces), 4):
        offset, panels, cols, scale_offset = pieces[i:i + 4]
        n = panels * tile * cols
        q, s = fp8_block_quantize(shard[offset:offset + n].view(panels * tile, cols), tile)
        codes[offset:offset + n] = q.view(torch.uint8).view(-1)
        scales[scale_offset:scale_offset + s.numel()] = s.view(-1)
    return torch.cat([codes, scales.view(torch.uint8)])


@fp8_pack_shard.register_fake
def _(shard, tile, scale_slots, pieces):
    return shard.new_empty(_code_bytes(shard.numel()) + 4 * scale_slots, dtype=torch.uint8)


@torch.library.custom_op("fsdp_pass::fp8_unpack", mutates_args=())
def fp8_unpack(gathered: torch.Tensor, world: int, shard_size: int, tile: int, scale_slots: int,
               pieces: list[int], dtype: torch.dtype) -> torch.Tensor:
    """All ranks' packed buffers (``world`` × (codes + scales) bytes) → the bucket's gathered
    ``world × shard_size`` buffer in ``dtype``, every piece dequantized in place (padding is 0).

    ``pieces`` is flat ``(rank, offset, panels, columns, scale offset)`` quintuples.
    """
    code_bytes = _code_bytes(shard_size)
    packed = gathered.view(world, code_bytes + 4 * scale_slots)
    scales = packed[:, code_bytes:].contiguous().view(torch.float32)
    out = torch.zeros(world * shard_size, dtype=dtype, device=gathered.device)
    for i in range(0, len(pieces), 5):
        rank, offset, panels, cols, scale_offset = pieces[i:i + 5]
        n = panels * tile * cols
        codes = packed[rank, offset:offset + n].view(FP8).view(panels, tile, cols)
        col_tiles = -(-cols // tile)
        s = scales[rank, scale_offset:scale_offset + panels * col_tiles].view(panels, col_tiles)
        per_element = s.repeat_interleave(tile, 1)[:, :cols].unsqueeze(1)  # as fsdp_pass.quant's dequantize
        start = rank * shard_size + offset
        out[start:start + n] = (codes.float() * per_element).to(dtype).view(-1)
    return out


@fp8_unpack.register_fake
def _(gathered, world, shard_size, tile, scale_slots, pieces, dtype):
    return gathered.new_empty(world * shard_size, dtype=dtype)


class GatherConfig(NamedTuple):
    """The static arguments of one bucket's :func:`gather_bucket` (constants in the rewritten graph)."""

    param_dtype: torch.dtype  # the shard is cast to this before the all-gather (compute dtype)
    reduce_dtype: torch.dtype  # gradients are reduce-scattered in this dtype
    shard_world: int  # ranks the bucket is sharded over
    shard_group: str | None  # their process group's name (None when shard_world == 1)
    replicate_world: int  # HSDP replicas the gradient is all-reduced over (1: none)
    replicate_group: str | None  # their process group's name (None when replicate_world == 1)
    grad_divisor: float  # the reduced gradient is divided by this: the data-parallel degree, or the divide factor
    fp8: Fp8Gather | None = None  # gather as FP8 codes + scales ([Note: FP8 all-gather]); None: param_dtype
    # reduce-scatter as int8 codes + block scales ([Note: block-quantized gradient reduction]); None: reduce_dtype
    quantized_reduce: QuantizedReduce | None = None
    # the shard group spans nodes: all-gather across then within them, reduce-scatter within then across
    # ([Note: collectives in two levels across nodes]); None: one step on shard_group
    levels: NodeLevels | None = None

    @property
    def gather_group(self) -> str | None:
        """The group of the bucket's (first) all-gather: the across-node step's, or the shard group's."""
        return self.levels.across if self.levels is not None else self.shard_group


def reduce_gradient(grad: torch.Tensor, config: GatherConfig, master_dtype: torch.dtype) -> torch.Tensor:
    """A bucket's whole gradient (m·S) → this rank's averaged gradient shard (S) in ``master_dtype``:
    ReduceScatter over the shard dim (block-quantized with ``config.quantized_reduce``), AllReduce over the
    HSDP replicate dim, / data-parallel degree."""
    g = grad.to(config.reduce_dtype)
    if config.shard_world > 1 and config.quantized_reduce is not None:
        g = quantized_reduce_scatter(g, config.shard_world, config.shard_group, config.quantized_reduce,
                                     config.levels)
    elif config.levels is not None:
        g = reduce_scatter_in_two_levels(g.contiguous(), config.levels)
    elif config.shard_world > 1:
        g = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(g.contiguous(), "sum", config.shard_world,
                                                          config.shard_group))
    if config.replicate_world > 1:
        g = _c10d.wait_tensor(_c10d.all_reduce(g, "sum", config.replicate_group))
    # Average over data-parallel ranks, like DDP and FSDP2 (or FSDP2's set_gradient_divide_factor;
    # gloo has no PREMUL_SUM, so the division follows the sum on every backend).
    g = g / config.grad_divisor
    return g.to(master_dtype)


def _all_gather(shard: torch.Tensor, config: GatherConfig) -> torch.Tensor:
    x = gather_input(shard, config)
    if config.shard_world == 1:
        gathered = x.clone() if x is shard else x
    elif config.levels is not None:
        gathered = all_gather_in_two_levels(x, config.levels)
    else:
        gathered = _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, config.shard_world, config.shard_group))
    return unpack_gathered(gathered, shard.numel(), config)


def gather_input(shard: torch.Tensor, config: GatherConfig) -> torch.Tensor:
    """What a bucket's all-gather sends: the shard cast to ``param_dtype``, or (``config.fp8``, [Note:
    FP8 all-gather]) this rank's panels quantized and packed."""
    if config.fp8 is None:
        return shard.to(config.param_dtype)
    fp8 = config.fp8
    return fp8_pack_shard(shard, fp8.tile, fp8.scale_slots, fp8.pack_arguments())


def unpack_gathered(gathered: torch.Tensor, shard_size: int, config: GatherConfig) -> torch.Tensor:
    """The all-gather's output as the bucket's gathered buffer (``m·S`` in ``param_dtype``): as is, or
    every FP8 piece dequantized."""
    if config.fp8 is None:
        return gathered
    fp8 = config.fp8
    return fp8_unpack(gathered, config.shard_world, shard_size, fp8.tile, fp8.scale_slots, fp8.unpack_arguments(),
                      config.param_dtype)


# slot (a bucket's position among a graph's shard inputs) → the gathered buffer handed to the next graph
# call, which takes it at once: a hand-off between the backend and the op, which knows its slot, not its bucket
_handed: dict[int, torch.Tensor] = {}


def hand_over(slot: int, gathered: torch.Tensor) -> None:
    """Give the next compiled call's ``gather_bucket(..., gathered=slot)`` its gathered buffer."""
    _handed[slot] = gathered


@torch.library.custom_op("fsdp_pass::take_gathered", mutates_args=())
def take_gathered(shard: torch.Tensor, slot: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """The buffer handed over for ``slot`` (``numel`` elements of ``dtype``), gathered before the graph
    ran. An op inside the graph, not a graph input: the graph frees it after its last use, as it frees
    an all-gather's output. ``shard`` orders it where the gather was."""
    gathered = _handed.pop(slot, None)
    if gathered is None or gathered.numel() != numel or gathered.dtype != dtype:
        raise RuntimeError(f"no gathered buffer of {numel} {dtype} elements was handed over for bucket slot {slot}; "
                           f"this graph variant runs only through the backend's call")
    return gathered


@take_gathered.register_fake
def _(shard, slot, numel, dtype):
    return shard.new_empty(numel, dtype=dtype)


class _GatherBucket(torch.autograd.Function):
    """AllGather the bucket shard, or take the buffer handed over for slot ``gathered`` (the same
    all-gather, issued before the graph ran: [Note: the next step's first gather starts at the
    optimizer step]) in forward. Backward: ReduceScatter (+ AllReduce for HSDP) the gradient into the
    shard, or with ``pending`` hand it whole, unreduced, to that leaf ([Note: gradient accumulation
    without sync])."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, pending: torch.Tensor | None, gathered: int | None,
                config: GatherConfig) -> torch.Tensor:
        ctx.config, ctx.master_dtype, ctx.accumulates = config, shard.dtype, pending is not None
        if gathered is not None:
            return take_gathered(shard, gathered, shard.numel() * config.shard_world, config.param_dtype)
        return _all_gather(shard, config)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.accumulates:
            return None, grad.to(ctx.config.reduce_dtype), None, None
        return reduce_gradient(grad, ctx.config, ctx.master_dtype), None, None, None


def gather_bucket(
    shard: torch.Tensor,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    shard_world: int,
    shard_group: str | None,
    replicate_world: int,
    replicate_group: str | None,
    grad_divisor: float,
    fp8: Fp8Gather | None = None,
    quantized_reduce: QuantizedReduce | None = None,
    levels: NodeLevels | None = None,
    pending: torch.Tensor | None = None,
    gathered: int | None = None,
) -> torch.Tensor:
    """Graph-callable entry point (a plain function, so FX code generation can name it).

    The keyword arguments are the fields of :class:`GatherConfig`; as keywords, a rewritten graph
    reads by itself (``gather_bucket(bucket0_shard, param_dtype=torch.float32, ..., shard_world=2, ...)``).
    With ``pending`` (the graph variant that accumulates, [Note: gradient accumulation without sync])
    the backward hands the whole gradient to ``pending`` instead of reduce-scattering it.
    With ``gathered`` (a slot: the graph variant that takes the all-gather issued after the optimizer
    step, [Note: the next step's first gather starts at the optimizer step]) the forward gathers
    nothing and takes the buffer :func:`hand_over` left for that slot.
    With ``fp8`` the forward moves FP8 codes and scales instead ([Note: FP8 all-gather]); with
    ``quantized_reduce`` the backward's reduce-scatter moves int8 codes and block scales ([Note:
    block-quantized gradient reduction]); with ``levels`` both run in two steps, across and within the
    nodes ([Note: collectives in two levels across nodes]).
    """
    config = GatherConfig(param_dtype, reduce_dtype, shard_world, shard_group, replicate_world, replicate_group,
                          grad_divisor, fp8, quantized_reduce, levels)
    return _GatherBucket.apply(shard, pending, gathered, config)
