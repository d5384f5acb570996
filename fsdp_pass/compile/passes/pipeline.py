"""The pass pipeline, in data order: the backend and the scale benchmark both run it from here.

    Dynamo graph ─ detect ─ shard ─ rewrite ─ outline repeated blocks ─┐      (run_passes: passes 1-3b)
                                             ┌─────────────────────────┘
                                             └ aot_autograd ─ joint graph: replay saved parameter views,
                                                                           tag reshard-after-forward
                                                          ─ forward / backward graphs: schedule overlap
                                                          ─ backward graphs: gradients written into buckets
                                                          ─ Inductor or aot_eager  (compile_scheduled: pass 4)
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import torch
import torch.fx as fx
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func
from torch.distributed.tensor import DTensor

from ... import log
from ...options import Options, check_cudagraphs_off
from ...buckets.dbuffer import DBuffer
from ...buckets.gather import GatherConfig
from ...sharding.agreement import check_ranks_agree
from ...buckets.ignored import is_ignored
from ..shared_cache import cache_compiled_graphs, compile_in_turn
from .detect import ParamSite, find_parameters
from .grad_into_bucket import write_gradients_into_buckets
from .outline import Outlined, outline_repeated_blocks, rematerialize_parameter_views, shared_backward_subgraphs
from .reshard_within_groups import node_groups, reshard_setting, reshard_within_groups
from .rewrite import Rewritten, copy_dynamo_graph, rewrite_parameters
from .schedule import gather_chains, gather_taken_again, schedule_overlap, tag_reshard_after_forward
from .shard import Sharded, shard_sites
from .unread import shard_unread_parameters

__all__ = ["GraphSink", "PassResult", "compile_scheduled", "run_passes"]

class GraphSink(Protocol):
    """Told every graph the pipeline produces (the backend records them for ``explain()``)."""

    def graph(self, stage: str, gm: fx.GraphModule) -> None:
        """``gm`` as scheduled, before code generation."""

    def code(self, stage: str, source: str) -> None:
        """Inductor's generated code for the stage: the final schedule."""

    def loaded(self, stage: str) -> None:
        """The graph's compiled stages came from torch's compile cache: no stage ran here ([Note:
        AOTAutograd's output cached with the backend's settings in its key])."""


@dataclass
class PassResult:
    """Passes 1-3b on one Dynamo graph."""

    sites: list[ParamSite]  # the graph's parameters, in first-use order
    sharded: Sharded  # their buckets, and the DBuffers made by this call
    rewritten: Rewritten  # the graph that takes bucket shards instead of parameters
    outlined: Outlined  # which blocks became calls of a shared subgraph, and which stayed flat
    seconds: dict[str, float]  # wall time of each pass: "detect", "shard", "rewrite", "outline"


def run_passes(gm: fx.GraphModule, example_inputs: Sequence[Any], opts: Options,
               names: Mapping[int, str] | None = None) -> PassResult | None:
    """Detect → shard → rewrite → outline on Dynamo's graph (left untouched: the rewrite works on a copy).

    None when the graph uses no parameter. Pass 4 runs inside aot_autograd (:func:`compile_scheduled`).
    ``names`` (placeholder position → parameter name): for a graph run outside Dynamo's call, where the
    parameters' modules cannot be resolved ([Note: parameters known by identity] in passes/detect.py).
    """
    t0 = time.perf_counter()
    sites = [s for s in find_parameters(gm, example_inputs, names) if not is_ignored(s.param)]  # [Note: ignored parameters stay whole]
    if not sites:  # the compiled module's parameters are sharded before code left to eager uses them
        for buf in shard_unread_parameters([], opts):  # [Note: parameters no graph reads]
            log.plan(buf)
        return None
    _check_static_shapes_with_dtensor_parameters(sites, example_inputs)
    check_ranks_agree([f"{s.name}:{tuple(s.param.shape)}" for s in sites], "the parameters this graph uses", opts.mesh)
    t1 = time.perf_counter()
    sharded = shard_sites(sites, opts)
    t2 = time.perf_counter()
    rewritten = rewrite_parameters(copy_dynamo_graph(gm), sites, sharded.buckets, opts.param_dtype, opts.reduce_dtype,
                                   opts.quantized_reduce)
    t3 = time.perf_counter()
    outlined = outline_repeated_blocks(rewritten.gm) if opts.compile_blocks_once else Outlined()
    t4 = time.perf_counter()
    return PassResult(sites, sharded, rewritten, outlined,
                      {"detect": t1 - t0, "shard": t2 - t1, "rewrite": t3 - t2, "outline": t4 - t3})


def compile_scheduled(gm: fx.GraphModule, inputs: list, opts: Options, sink: GraphSink,
                      buffers: Sequence[DBuffer] = (), taken: Mapping[int, GatherConfig] | None = None) -> Callable:
    """Passes 4-5 and code generation: aot_autograd with the reshard tags on the joint graph, the
    overlap schedule on the forward and backward graphs, gradients written into the bucket gradients
    of ``buffers`` (the graph's buckets) in backward graphs, then Inductor or aot_eager (``opts.compiler``).
    ``taken``: the buckets (slot → gather arguments) the graph takes already gathered in forward, which
    backward gathers again ([Note: the next step's first gather starts at the optimizer step])."""
    reshard = reshard_setting(opts.reshard_after_forward, buffers)
    group_of = None if isinstance(reshard.after, bool) else node_groups(reshard.after, buffers, taken)  # k: node groups
    joint_pass = functools.partial(_reshard_after_forward, keep_last=not opts.reshard_last_bucket, group_of=group_of,
                                   kept=reshard.kept) if reshard.after else None
    patch = torch._functorch.config.patch(joint_custom_pass=joint_pass) if joint_pass else contextlib.nullcontext()
    shared = opts.shared_compile_cache and opts.compiler == "inductor"
    with patch, compile_in_turn(shared), cache_compiled_graphs(shared, gm, opts, buffers):
        if opts.compiler == "aot_eager":
            backend = aot_autograd(
                fw_compiler=_scheduled(opts, sink, buffers, taken, "forward"),
                bw_compiler=_scheduled(opts, sink, buffers, taken, "backward"),
                inference_compiler=_scheduled(opts, sink, buffers, taken, "inference"),
            )
            return backend(gm, inputs)
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        check_cudagraphs_off(opts, gm.meta)  # Inductor's config now: a variant may compile long after the first
        # Our graph order is the communication schedule: keep Inductor's memory-driven reordering
        # from pulling waits up to their collectives (unless the user's Inductor settings say otherwise).
        patches = {**({"reorder_for_peak_memory": False} if opts.prefetch else {}), **opts.inductor}
        ran: list[str] = []  # the stages compiled here; none when AOTAutograd loaded the graph from its cache
        compiled = compile_fx(gm, inputs, config_patches=patches,
                              inner_compile=_scheduled(opts, sink, buffers, taken, compiler=compile_fx_inner, ran=ran))
        if not ran:
            sink.loaded("compiled stages")
        return compiled


def _reshard_after_forward(gm: fx.GraphModule, joint_inputs: Any, keep_last: bool,
                           group_of: Callable | None, kept: frozenset[int]) -> fx.GraphModule:
    """The joint-graph pass: parameter views saved by a shared block's subgraph replayed from the gather
    chains ([Note: repeated blocks compiled once]), then the gather chains tagged for recomputation, or
    with ``group_of`` resharded within node groups ([Note: reshard within a node after forward])."""
    rematerialize_parameter_views(gm, gather_chains(gm).__contains__)
    if group_of is not None:
        return reshard_within_groups(gm, group_of, keep_last=keep_last)
    return tag_reshard_after_forward(gm, joint_inputs, keep_last=keep_last, kept=kept)


def _scheduled(opts: Options, sink: GraphSink, buffers: Sequence[DBuffer], taken: Mapping[int, GatherConfig] | None,
               stage: str | None = None, compiler: Callable | None = None, ran: list[str] | None = None) -> Callable:
    """A graph compiler for aot_autograd: schedule the graph (and write a backward graph's gradients
    into its buckets), tell ``sink`` (and append the stage's name to ``ran``), then run ``compiler``
    (default: as is)."""

    def compile_stage(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs):
        name = stage or ("backward" if kwargs.get("is_backward") else
                         "inference" if kwargs.get("is_inference") else "forward")
        if name == "backward" and taken:
            gather_taken_again(gm, dict(taken))
        schedule_overlap(gm, opts.prefetch, opts.max_inflight_bytes)
        if name == "backward" and buffers:  # after the schedule, which reads data edges only
            for graph in [gm, *shared_backward_subgraphs(gm)]:  # [Note: repeated blocks compiled once]
                write_gradients_into_buckets(graph, buffers, inductor=compiler is not None)
        sink.graph(name, gm)
        if ran is not None:
            ran.append(name)
        if compiler is None:
            return make_boxed_func(gm.forward)
        compiled = compiler(gm, example_inputs, **kwargs)
        source = getattr(compiled, "source_code", None)
        if source:
            sink.code(name, source)
        return compiled

    return compile_stage


def _check_static_shapes_with_dtensor_parameters(sites: Sequence[ParamSite], example_inputs: Sequence[Any]) -> None:
    """Tracing the backward of rebuilt TP/EP DTensors with symbolic shapes overflows the recursion
    limit (torch 2.13): refuse it up front, with the fix, rather than fail deep inside the trace."""
    dtensors = [s.name for s in sites if isinstance(s.param, DTensor)]
    symbolic = any(isinstance(x, torch.SymInt) or (isinstance(x, torch.Tensor) and any(
        isinstance(d, torch.SymInt) for d in x.shape)) for x in example_inputs)
    if dtensors and symbolic:
        raise ValueError(
            f"the graph has tensor/expert-parallel DTensor parameters ({dtensors[0]}, ...) and dynamic shapes; "
            f"compile with torch.compile(model, backend='vescale', dynamic=False, ...): a new input shape then "
            f"recompiles with static shapes"
        )
