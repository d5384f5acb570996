"""The ``"vescale"`` torch.compile backend: run the passes, then Inductor or aot_eager.

    Dynamo graph ─ detect ─ shard ─ rewrite ─ aot_autograd(joint: schedule) ─ Inductor / aot_eager

Sharding happens inside the first backend call: Dynamo builds its guards after the backend returns,
from the live (now sharded) parameters, so the first compile is already the one for sharded
parameters and no recompile follows. The compiled function takes the buckets' shards instead of the
parameters; the shards are autograd leaves whose gradients (reduce-scattered in the graph) become the
parameters' RaggedShard ``.grad`` views.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.fx as fx
from torch._dynamo import register_backend
from torch.distributed.tensor import DTensor
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func

from . import log
from .options import Options
from .passes.detect import ParamSite, block_sizes, find_parameters
from .passes.rewrite import copy_dynamo_graph, rewrite_parameters
from .passes.schedule import schedule_overlap, tag_reshard_after_forward
from .passes.shard import assign_buckets
from .runtime.agreement import check_ranks_agree
from .runtime.dbuffer import DBuffer
from .runtime.mesh import model_mesh_dims, resolve_mesh
from .runtime.sharding import ShardingConfig

__all__ = ["CompiledGraph", "shard_sites", "vescale"]


@dataclass
class CompiledGraph:
    """What one backend call produced; ``explain()`` reads these.

    The record refers to its DBuffers weakly: it must not keep a deleted model's shards alive.
    """

    options: Options
    _buffer_refs: list[weakref.ref] = field(default_factory=list)
    graphs: dict[str, str] = field(default_factory=dict)  # stage name → readable graph
    modules: dict[str, fx.GraphModule] = field(default_factory=dict)  # stage name → graph, for tests and tools

    @property
    def buffers(self) -> list[DBuffer]:
        """The DBuffers this graph gathers (those still alive)."""
        return [b for b in (ref() for ref in self._buffer_refs) if b is not None]

    @buffers.setter
    def buffers(self, buffers: list[DBuffer]) -> None:
        self._buffer_refs = [weakref.ref(b) for b in buffers]

    @property
    def alive(self) -> bool:
        """False once every DBuffer of a graph that had some is gone (its model was deleted)."""
        return not self._buffer_refs or any(ref() is not None for ref in self._buffer_refs)


# The backend calls of this process, for explain(): records of deleted models are dropped, and of
# graphs without parameters only the latest few are kept.
_records: list[CompiledGraph] = []
_KEPT_WITHOUT_PARAMETERS = 16


def _remember(record: CompiledGraph) -> None:
    _records.append(record)
    without = [r for r in _records if not r._buffer_refs]
    stale = set(map(id, without[:-_KEPT_WITHOUT_PARAMETERS]))
    _records[:] = [r for r in _records if r.alive and id(r) not in stale]


def records() -> list[CompiledGraph]:
    """The graphs the backend compiled in this process (for models still alive), oldest first."""
    return [r for r in _records if r.alive]


def _readable(gm: fx.GraphModule) -> str:
    return gm.print_readable(print_output=False, include_stride=False, include_device=False)


def _capture(record: CompiledGraph, stage: str | None = None, compiler: Callable | None = None) -> Callable:
    """A graph compiler that schedules and records the graph it is given, then runs ``compiler`` (default: as is)."""
    opts = record.options

    def compile_stage(gm: fx.GraphModule, example_inputs: Sequence[Any], **kwargs):
        name = stage or ("backward" if kwargs.get("is_backward") else
                         "inference" if kwargs.get("is_inference") else "forward")
        schedule_overlap(gm, opts.prefetch, opts.max_inflight_bytes)
        record.graphs[name] = _readable(gm)
        record.modules[name] = gm
        log.graph(name, record.graphs[name])
        if compiler is None:
            return make_boxed_func(gm.forward)
        compiled = compiler(gm, example_inputs, **kwargs)
        code = getattr(compiled, "source_code", None)  # Inductor's generated code: the final schedule
        if code:
            record.graphs[name + " (inductor code)"] = code
        return compiled

    return compile_stage


def _compile(gm: fx.GraphModule, inputs: list, opts: Options, record: CompiledGraph) -> Callable:
    joint_pass = tag_reshard_after_forward if opts.reshard_after_forward else None
    patch = torch._functorch.config.patch(joint_custom_pass=joint_pass) if joint_pass else contextlib.nullcontext()
    with patch:
        if opts.compiler == "aot_eager":
            backend = aot_autograd(
                fw_compiler=_capture(record, "forward"),
                bw_compiler=_capture(record, "backward"),
                inference_compiler=_capture(record, "inference"),
            )
            return backend(gm, inputs)
        from torch._inductor.compile_fx import compile_fx, compile_fx_inner

        # Our graph order is the communication schedule: keep Inductor's memory-driven reordering
        # from pulling waits up to their collectives.
        patches = {"reorder_for_peak_memory": False} if opts.prefetch else {}
        return compile_fx(gm, inputs, inner_compile=_capture(record, compiler=compile_fx_inner), config_patches=patches)


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


def shard_sites(sites: Sequence[ParamSite], opts: Options) -> tuple[dict[str, tuple[DBuffer, str]], list[DBuffer]]:
    """Pass 2 with the backend's options: block sizes, the mesh's roles, then buckets (sharding new parameters)."""
    named = [(s.name, s.param) for s in sites]
    mesh = resolve_mesh(opts.mesh, opts.shard_dim, replicate_dim=opts.replicate_dim, model_dims=model_mesh_dims(named))
    blocks = block_sizes(sites, opts.block_sizes)
    config = ShardingConfig(opts.bucket_size, opts.align_bytes, opts.param_dtype, opts.min_bucket_bytes)
    return assign_buckets(sites, blocks, mesh, config)


@register_backend
def vescale(gm: fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Shard the parameters of ``gm`` (fully sharded data parallel) and compile it."""
    opts = Options.from_dict(options)
    sites = find_parameters(gm, example_inputs)
    record = CompiledGraph(opts)
    record.graphs["dynamo"] = _readable(gm)
    if not sites:
        _remember(record)
        return _compile(copy_dynamo_graph(gm), list(example_inputs), opts, record)

    _check_static_shapes_with_dtensor_parameters(sites, example_inputs)
    check_ranks_agree([f"{s.name}:{tuple(s.param.shape)}" for s in sites], "the parameters this graph uses")
    buckets, new = shard_sites(sites, opts)
    for buf in new:
        log.plan(buf)

    rewritten = rewrite_parameters(copy_dynamo_graph(gm), sites, buckets, opts.param_dtype, opts.reduce_dtype)
    record.buffers = rewritten.buffers
    record.graphs["rewritten"] = _readable(rewritten.gm)
    record.modules["rewritten"] = rewritten.gm
    log.graph("rewritten", record.graphs["rewritten"])

    fake_mode = torch._guards.TracingContext.get().fake_mode
    dropped = set(rewritten.dropped)
    shard_fakes = [fake_mode.from_tensor(b.shard, static_shapes=True) for b in rewritten.buffers]
    rest = [x for i, x in enumerate(example_inputs) if i not in dropped]
    compiled = _compile(rewritten.gm, shard_fakes + rest, opts, record)
    _remember(record)

    shards = [b.shard for b in rewritten.buffers]
    buffers = rewritten.buffers

    def run(*args):
        for b in buffers:
            b.sync_grad_state()
        return compiled(*shards, *(a for i, a in enumerate(args) if i not in dropped))

    return run
