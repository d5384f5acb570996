"""Pass 2's second half: shard the parameters of the compiled modules that the graph does not read.

[Note: parameters no graph reads]
Dynamo hands the backend only the parameters its graph reads. Code it leaves to eager never reaches
a backend call: the rest of a frame after a graph break (a ``print``, a logging call, a ``.item()``, a
branch on a tensor), a whole frame Dynamo skips because it broke inside a loop (it then compiles the
modules called from that loop, one frame each), and a ``torch.utils.checkpoint`` body Dynamo cannot
trace (Hugging Face's checkpointed decoder layers mutate a context variable inside the checkpoint:
"HOP: Unsafe side effect"); a branch not taken on the first call is not in the graph either.
Measured on torch 2.13 with a tiny ``LlamaForCausalLM`` under gradient checkpointing (transformers
5.25): the backend is called for the embedding's frame (root: the ``Embedding``), the final norm's
(root: the ``LlamaRMSNorm``) and the head after the loop (root: the causal LM), in that order, and
the decoder layers run eagerly before the causal LM is ever a traced root. Sharding only what the
graphs read left every decoder-layer parameter whole on every rank, with gradients nothing averaged.

So the set of parameters comes from the modules being compiled, not from the graph: the module
``torch.compile(module)`` or ``module.compile()`` was applied to (found on this thread's stack, the
innermost such call around the frame being compiled), and the outermost modules the graph's
parameters were reached through (each site's ``ParamSite.root``: for a compiled function, its
closure's or global model). At every backend call, their parameters not sharded yet are
planned into buckets (module order, grouped by module unit, like ``fully_shard``) and swapped in
place; the first backend call of a compiled model comes before any of its code runs eagerly. Those
parameters take the eager path ([Note: eager calls on sharded parameters]): each bucket is gathered
when its parameters are used and their gradients are reduced into the shards. A parameter a later
graph reads (a branch taken later, the frame after a break) is found in its bucket, which that graph
gathers like any other. Parameters ``fully_shard`` was told to ignore stay whole ([Note: ignored
parameters stay whole]). A module only called from a compiled module, but not part of it, stays
outside: the optimizer step's check refuses its unequal gradients ([Note: parameters left out of
sharding]).
"""

from __future__ import annotations

import sys
from typing import Mapping, Sequence

import torch.nn as nn
from torch._dynamo.eval_frame import OptimizedModule

from ...buckets.dbuffer import DBuffer, buffers_of_parameters, is_unsharded
from ...interop.module_apply import keep_shards_on_apply
from ...options import Options
from ...sharding.blocks import block_size
from ...sharding.buckets import ShardingConfig
from ...sharding.fp8_select import plan_fp8
from ...buckets.ignored import is_ignored
from ...sharding.materialize import shard_with_blocks
from ...sharding.mesh_roles import model_mesh_dims, resolve_mesh
from ...tensor.ragged_tensor import is_sharded

__all__ = ["compiled_module", "shard_unread_parameters", "shard_with_options"]

_MODULE_CALLS = frozenset({nn.Module._wrapped_call_impl.__code__, nn.Module._call_impl.__code__})


def compiled_module() -> nn.Module | None:
    """The module whose compiled call is running on this thread: the innermost ``torch.compile(module)``
    (its ``_orig_mod``) or ``module.compile()`` on the stack; None for a compiled function."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _MODULE_CALLS:
            module = frame.f_locals.get("self")
            if isinstance(module, OptimizedModule):
                return module._orig_mod
            if getattr(module, "_compiled_call_impl", None) is not None:
                return module
        frame = frame.f_back
    return None


def shard_with_options(named: Sequence[tuple[str, nn.Parameter]], opts: Options,
                       graph_rows: Mapping[str, list[int]] | None = None) -> list[DBuffer]:
    """Shard ``named`` (those not sharded yet) with the backend's options: mesh roles, blocks (with the rows a
    graph asks of each name, ``graph_rows``), bucket plans and FP8 gathers ([Note: FP8 all-gather]); returns the
    new DBuffers."""
    mesh = resolve_mesh(opts.mesh, opts.shard_dim, replicate_dim=opts.replicate_dim, model_dims=model_mesh_dims(named),
                        two_levels=opts.two_level_collectives)
    rows = graph_rows or {}
    blocks = {name: block_size(name, p, opts.block_sizes, rows.get(name, ())) for name, p in named}
    config = ShardingConfig(opts.bucket_size, opts.align_bytes, opts.param_dtype, opts.min_bucket_bytes)
    fp8 = plan_fp8(named, opts.fp8_all_gather, "options['fp8_all_gather']")
    return shard_with_blocks(named, mesh, config, blocks, fp8)


def shard_unread_parameters(traced: Sequence[nn.Module], opts: Options) -> list[DBuffer]:
    """Shard the parameters of the compiled module and of the ``traced`` roots that are not sharded yet
    ([Note: parameters no graph reads]), and give every bucket of theirs the compile's gradient divide
    factor (also buckets ``fully_shard`` made whose parameters only eager code reads); returns the new DBuffers."""
    roots = list(dict.fromkeys([m for m in (compiled_module(), *traced) if m is not None]))
    seen: set[int] = set()
    rest: list[tuple[str, nn.Parameter]] = []
    for root in roots:
        for name, p in root.named_parameters(remove_duplicate=True):
            if id(p) not in seen and not is_sharded(p) and not is_unsharded(p) and not is_ignored(p):
                seen.add(id(p))
                rest.append((name, p))
    for root in roots:
        keep_shards_on_apply(root)  # [Note: Module._apply on sharded parameters]
    new = shard_with_options(rest, opts) if rest else []
    for buf in new:  # no graph sets it: eager calls compute in the graphs' dtype
        buf.apply_settings(compute_dtype=opts.param_dtype)
    if opts.gradient_divide_factor is not None:  # the eager path divides by the bucket's factor
        for buf in buffers_of_parameters(p for root in roots for p in root.parameters()):
            buf.apply_settings(gradient_divide_factor=float(opts.gradient_divide_factor))
    return new
