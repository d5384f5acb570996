"""The ``"vescale"`` torch.compile backend: run the passes, then Inductor or aot_eager.

    Dynamo graph ─ detect ─ shard ─ rewrite ─ aot_autograd(joint: schedule) ─ Inductor / aot_eager

(the pipeline, in order: :mod:`fsdp_pass.compile.passes.pipeline`; this module keeps the records ``explain()``
reads and the function Dynamo calls).

Sharding happens inside the first backend call: Dynamo builds its guards after the backend returns,
from the live (now sharded) parameters, so the first compile is already the one for sharded
parameters and no recompile follows. The compiled function takes the buckets' shards instead of the
parameters; the shards are autograd leaves whose gradients (reduce-scattered in the graph) become the
parameters' RaggedShard ``.grad`` views.

Gradient accumulation without sync ([Note: gradient accumulation without sync], buckets/dbuffer.py)
uses a second variant of the same rewritten graph, compiled by the returned function the first time a
bucket accumulates (never through Dynamo again): switching between syncing and accumulating picks
one of the two compiled functions at call time.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.fx as fx
from torch._dynamo import register_backend

from .. import log
from ..options import Options
from .passes.pipeline import compile_scheduled, run_passes
from .passes.rewrite import Rewritten, accumulating_variant, copy_dynamo_graph, prefetching_variant
from ..step import deferred_reduce, prefetch as step_prefetch
from ..tensor import in_flight
from ..buckets import uninitialized
from ..buckets.dbuffer import DBuffer, pending_leaf
from ..buckets.gather import gather_bucket, hand_over
from .rebind import ShardBinding

__all__ = ["CompiledGraph", "records", "vescale"]


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

    def graph(self, stage: str, gm: fx.GraphModule) -> None:
        """Record a stage's graph (the pipeline's :class:`~fsdp_pass.compile.passes.pipeline.GraphSink`)."""
        self.graphs[stage] = _readable(gm)
        self.modules[stage] = gm
        log.graph(stage, self.graphs[stage])

    def code(self, stage: str, source: str) -> None:
        """Record Inductor's generated code for a stage."""
        self.graphs[stage + " (inductor code)"] = source


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


def _warn_running_eagerly(first_parameter: str) -> None:
    warnings.warn(
        f"Dynamo reuses the graph compiled for {first_parameter!r} and its module for other parameters whose "
        f"buckets are laid out differently, so that call runs eagerly (correct, slower). Give each compiled "
        f"block its own bucket (fsdp_pass.fully_shard(model, min_bucket_bytes=0)) so one graph serves them all",
        stacklevel=3,
    )


@register_backend
def vescale(gm: fx.GraphModule, example_inputs: list, options: dict | None = None) -> Callable:
    """Shard the parameters of ``gm`` (fully sharded data parallel) and compile it."""
    opts = Options.from_dict(options)
    record = CompiledGraph(opts)
    record.graphs["dynamo"] = _readable(gm)
    result = run_passes(gm, example_inputs, opts)
    if result is None:  # no parameters: nothing to shard
        _remember(record)
        return compile_scheduled(copy_dynamo_graph(gm), list(example_inputs), opts, record)

    for buf in result.sharded.new:
        log.plan(buf)
    rewritten = result.rewritten
    for buf, config in zip(rewritten.buffers, rewritten.configs):
        buf.compute_dtype = config.param_dtype  # eager calls compute as the compiled graph does
    record.buffers = rewritten.buffers
    record.graph("rewritten", rewritten.gm)

    fake_mode = torch._guards.TracingContext.get().fake_mode
    dropped = set(rewritten.dropped)
    shard_fakes = [fake_mode.from_tensor(b.shard, static_shapes=True) for b in rewritten.buffers]
    rest = [x for i, x in enumerate(example_inputs) if i not in dropped]
    fakes = lambda tensors: [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]  # noqa: E731
    accumulating_gm, accumulating_configs = accumulating_variant(rewritten)
    accumulating_inputs = shard_fakes + fakes(pending_leaf(rewritten.buffers[i], c)
                                              for i, c in accumulating_configs.items()) + rest
    accumulating = _LazyVariant(accumulating_gm, opts, _Suffixed(record, " (accumulate)"), fake_mode, rewritten.buffers,
                                accumulating_inputs)
    gathered_first = _gathered_buckets(rewritten)
    deferred = _deferred_bucket(rewritten, gathered_first) if opts.overlap_last_reduce else None
    main_gm, main_leaves = rewritten.gm, []
    if deferred is not None:  # [Note: the last reduce-scatter overlaps the optimizer step]
        main_gm, deferred_configs = accumulating_variant(rewritten, only={deferred})
        deferred_config = deferred_configs[deferred]
        main_leaves = fakes([pending_leaf(rewritten.buffers[deferred], deferred_config)])
    compiled = compile_scheduled(main_gm, shard_fakes + main_leaves + rest, opts, record, rewritten.buffers)
    prefetched = accumulating_prefetched = None
    taken = _prefetched_buckets(rewritten, gathered_first, opts.prefetch) if opts.prefetch_next_step else []
    if taken:  # [Note: the next step's first gather starts at the optimizer step]
        taken_configs = {i: rewritten.configs[i] for i in taken}
        prefetched = _LazyVariant(prefetching_variant(main_gm, taken), opts, _Suffixed(record, " (prefetched)"),
                                  fake_mode, rewritten.buffers, shard_fakes + main_leaves + rest, taken_configs)
        accumulating_prefetched = _LazyVariant(prefetching_variant(accumulating_gm, taken), opts,
                                               _Suffixed(record, " (accumulate, prefetched)"), fake_mode,
                                               rewritten.buffers, accumulating_inputs, taken_configs)
        step_prefetch.enable()
    _remember(record)

    binding = ShardBinding(rewritten.dropped, [s.param for s in result.sites], rewritten.buffers, rewritten.configs)
    eager_graph = gm  # Dynamo's own graph: parameters as inputs, run through the eager path

    def run(*args):
        buffers = binding.buffers_for(args)  # [Note: one graph for identical blocks]
        if buffers is None:
            _warn_running_eagerly(result.sites[0].name)
            return eager_graph(*args)
        if uninitialized.any_pending():  # [Note: uninitialized shards]
            uninitialized.check_buckets(buffers)
        if in_flight.any_in_flight():  # nobody read last step's gradient: finish its reduce-scatter
            in_flight.settle_all()
        _check_divide_factors(buffers, rewritten.configs)
        shards = [b.shard for b in buffers]
        rest_args = [a for i, a in enumerate(args) if i not in dropped]
        trainable = [(buffers[i], config) for i, config in accumulating_configs.items()]
        if trainable and torch.is_grad_enabled() and any(b.accumulating for b, _ in trainable):
            pending = [b.pending_input(config) for b, config in trainable]
            if taken and _take_prefetched(buffers):
                return accumulating_prefetched.compiled()(*shards, *pending, *rest_args)
            step_prefetch.discard(buffers)
            return accumulating.compiled()(*shards, *pending, *rest_args)
        leaves = [] if deferred is None else [deferred_reduce.deferred_input(buffers[deferred], deferred_config)]
        if taken and _take_prefetched(buffers):
            return prefetched.compiled()(*shards, *leaves, *rest_args)
        step_prefetch.discard(buffers)
        return compiled(*shards, *leaves, *rest_args)

    def _take_prefetched(buffers: list[DBuffer]) -> bool:
        """Name this call's first buckets for the next step, and hand the graph the gathers the last step
        issued for them, if they are good to take ([Note: the next step's first gather starts at the
        optimizer step])."""
        targets = [step_prefetch.Target(buffers[i], rewritten.configs[i]) for i in taken]
        step_prefetch.note_first(targets)
        gathered = step_prefetch.take(targets)
        if gathered is None:
            return False
        for i, buffer in zip(taken, gathered):
            hand_over(i, buffer)
        return True  # the graph frees each buffer after its last use: nothing else holds them

    return run


def _gathered_buckets(rewritten: Rewritten) -> list[int]:
    """The buckets the graph gathers, in the order it first gathers them (positions in ``rewritten.buffers``)."""
    graph = rewritten.gm.graph
    shard_inputs = list(graph.find_nodes(op="placeholder"))[:len(rewritten.buffers)]
    position = {node: i for i, node in enumerate(shard_inputs)}
    gathered = [position[node.args[0]] for node in graph.find_nodes(op="call_function", target=gather_bucket)
                if node.args and node.args[0] in position]
    return list(dict.fromkeys(gathered))


def _prefetched_buckets(rewritten: Rewritten, gathered: list[int], prefetch: int) -> list[int]:
    """The buckets whose gathers the optimizer step issues for the graph's next call ([Note: the next
    step's first gather starts at the optimizer step]): those in flight before its first compute
    (``prefetch`` + 1), at most all but the last, and only while they share the first one's shard
    group (one agreement covers them); none for a graph of one bucket or of one rank."""
    first = gathered[:min(prefetch + 1, len(gathered) - 1)]
    taken = []
    for i in first:
        config = rewritten.configs[i]
        if config.shard_world == 1 or config.shard_group != rewritten.configs[first[0]].shard_group:
            break
        taken.append(i)
    return taken


def _deferred_bucket(rewritten: Rewritten, gathered: list[int]) -> int | None:
    """The trainable bucket the graph gathers first, whose reduce-scatter is backward's last: its
    position in ``rewritten.buffers``; None for a graph of fewer than two trainable buckets ([Note: the
    last reduce-scatter overlaps the optimizer step]: a block compiled on its own keeps its reduce-scatter)."""
    trainable = [i for i in gathered if rewritten.buffers[i].shard.requires_grad]
    return trainable[0] if len(trainable) > 1 else None


def _check_divide_factors(buffers: list[DBuffer], configs: list) -> None:
    """A compiled graph divides gradients by a constant: refuse to run once the bucket's factor changed."""
    for buf, config in zip(buffers, configs):
        if buf.grad_divisor != config.grad_divisor:
            raise RuntimeError(
                f"bucket {buf.index} ({buf.names[0]!r}, ...) now divides gradients by {buf.grad_divisor}, but its "
                f"compiled graph divides by {config.grad_divisor}; call fsdp_pass.set_gradient_divide_factor before "
                f"the first compiled call (or torch._dynamo.reset() to compile again)"
            )


class _LazyVariant:
    """A graph variant compiled on first use (never through Dynamo): the accumulating one ([Note:
    gradient accumulation without sync]) or the prefetched one ([Note: the next step's first gather
    starts at the optimizer step]). It compiles under a fresh tracing context on Dynamo's fake mode,
    with the fakes Dynamo's own compile used, so it sees the same (possibly symbolic) shapes."""

    def __init__(self, gm: fx.GraphModule, opts: Options, sink: "_Suffixed", fake_mode, buffers: list[DBuffer],
                 inputs: list, taken: dict | None = None):
        self.gm, self._opts, self._sink, self._fake_mode, self._buffers = gm, opts, sink, fake_mode, buffers
        self._taken = taken  # slot → gather arguments of the buckets it takes gathered (compile_scheduled's ``taken``)
        self._inputs = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not
                        isinstance(x, torch._subclasses.FakeTensor) else x for x in inputs]
        self._compiled: Callable | None = None

    def compiled(self) -> Callable:
        if self._compiled is None:
            with torch._guards.tracing(torch._guards.TracingContext(self._fake_mode)):
                self._compiled = compile_scheduled(self.gm, self._inputs, self._opts, self._sink, self._buffers,
                                                   self._taken)
            self._inputs = []
        return self._compiled


class _Suffixed:
    """A graph sink that files a variant's stages under suffixed names."""

    def __init__(self, sink: CompiledGraph, suffix: str):
        self.sink, self.suffix = sink, suffix

    def graph(self, stage: str, gm: fx.GraphModule) -> None:
        self.sink.graph(stage + self.suffix, gm)

    def code(self, stage: str, source: str) -> None:
        self.sink.code(stage + self.suffix, source)
