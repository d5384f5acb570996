"""The graph op behind every bucket: all-gather its shard in forward, reduce-scatter its gradient in backward.

The rewrite pass (passes/rewrite.py) calls :func:`gather_bucket` once per bucket; its static
arguments are a :class:`GatherConfig`, written into the graph as keyword arguments so a rewritten
graph reads by itself. Functional collectives trace under aot_autograd and Inductor, and they run
eagerly too (the eager path and ``DBuffer.all_gather``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = ["GatherConfig", "gather_bucket", "reduce_gradient"]

_c10d = torch.ops._c10d_functional


class GatherConfig(NamedTuple):
    """The static arguments of one bucket's :func:`gather_bucket` (constants in the rewritten graph)."""

    param_dtype: torch.dtype  # the shard is cast to this before the all-gather (compute dtype)
    reduce_dtype: torch.dtype  # gradients are reduce-scattered in this dtype
    shard_world: int  # ranks the bucket is sharded over
    shard_group: str | None  # their process group's name (None when shard_world == 1)
    replicate_world: int  # HSDP replicas the gradient is all-reduced over (1: none)
    replicate_group: str | None  # their process group's name (None when replicate_world == 1)
    grad_divisor: int  # the reduced gradient is divided by this: the data-parallel degree


def reduce_gradient(grad: torch.Tensor, config: GatherConfig, master_dtype: torch.dtype) -> torch.Tensor:
    """A bucket's whole gradient (m·S) → this rank's averaged gradient shard (S) in ``master_dtype``:
    ReduceScatter over the shard dim, AllReduce over the HSDP replicate dim, / data-parallel degree."""
    g = grad.to(config.reduce_dtype)
    if config.shard_world > 1:
        g = _c10d.wait_tensor(_c10d.reduce_scatter_tensor(g.contiguous(), "sum", config.shard_world,
                                                          config.shard_group))
    if config.replicate_world > 1:
        g = _c10d.wait_tensor(_c10d.all_reduce(g, "sum", config.replicate_group))
    # Average over data-parallel ranks, like DDP and FSDP2.
    g = g / config.grad_divisor
    return g.to(master_dtype)


def _all_gather(shard: torch.Tensor, config: GatherConfig) -> torch.Tensor:
    x = shard.to(config.param_dtype)
    if config.shard_world == 1:
        return x.clone() if x is shard else x
    return _c10d.wait_tensor(_c10d.all_gather_into_tensor(x, config.shard_world, config.shard_group))


class _GatherBucket(torch.autograd.Function):
    """AllGather the bucket shard (forward); ReduceScatter (+ AllReduce for HSDP) its gradient (backward)."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, config: GatherConfig) -> torch.Tensor:
        ctx.config, ctx.master_dtype = config, shard.dtype
        return _all_gather(shard, config)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return reduce_gradient(grad, ctx.config, ctx.master_dtype), None


class _GatherBucketAccumulate(torch.autograd.Function):
    """AllGather the bucket shard (forward); hand the whole gradient, unreduced, to ``pending``
    (backward). See [Note: gradient accumulation without sync]."""

    @staticmethod
    def forward(ctx, shard: torch.Tensor, pending: torch.Tensor, config: GatherConfig) -> torch.Tensor:
        ctx.config = config
        return _all_gather(shard, config)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return None, grad.to(ctx.config.reduce_dtype), None


def gather_bucket(
    shard: torch.Tensor,
    *,
    param_dtype: torch.dtype,
    reduce_dtype: torch.dtype,
    shard_world: int,
    shard_group: str | None,
    replicate_world: int,
    replicate_group: str | None,
    grad_divisor: int,
    pending: torch.Tensor | None = None,
) -> torch.Tensor:
    """Graph-callable entry point (a plain function, so FX code generation can name it).

    The keyword arguments are the fields of :class:`GatherConfig`; as keywords, a rewritten graph
    reads by itself (``gather_bucket(bucket0_shard, param_dtype=torch.float32, ..., shard_world=2, ...)``).
    With ``pending`` (the graph variant that accumulates, [Note: gradient accumulation without sync])
    the backward hands the whole gradient to ``pending`` instead of reduce-scattering it.
    """
    config = GatherConfig(param_dtype, reduce_dtype, shard_world, shard_group, replicate_world, replicate_group,
                          grad_divisor)
    if pending is not None:
        return _GatherBucketAccumulate.apply(shard, pending, config)
    return _GatherBucket.apply(shard, config)
