"""The ``"vescale"`` torch.compile backend: run the passes, then Inductor or aot_eager.

    Dynamo graph ─ detect ─ shard ─ rewrite ─ aot_autograd(joint: schedule) ─ Inductor / aot_eager

(the pipeline, in order: :mod:`fsdp_pass.compile.passes.pipeline`; this module keeps the records ``explain()``
reads and the function Dynamo calls).

Sharding happens inside the first backend call: Dynamo builds its guards after the backend returns,
from the live (now sharded) parameters, so the first compile is already the one for sharded
parameters and no recompile follows. The compiled function takes the buckets' shards instead of the
parameters; the shards are autograd leaves whose gradients (reduce-scattered in the graph) become the
parameters' RaggedShard ``.grad`` views.

Which graph runs for a call: the rewritten graph compiles into up to four variants, one table keyed
by :class:`VariantKey`. Each call computes its key and runs that variant; each variant is the
rewritten graph with the transforms of compile/passes/rewrite.py its key names, applied in sequence::

    field       its value for this call                                  graph transform
    unreduced   every trainable bucket, while one of them accumulates    hand_out_gradients: their
                (grad enabled) [Note: gradient accumulation without      gradients go to ``bucketN_pending``
                sync] (buckets/dbuffer.py); else, with                   inputs (pending_input, or the
                ``overlap_last_reduce``, the trainable bucket gathered   deferred reduce's deferred_input)
                first [Note: the last reduce-scatter overlaps the        instead of a reduce-scatter
                optimizer step] (step/deferred_reduce.py); else none
    prefetched  ``prefetch_next_step``, and the gathers the last         take_prefetched: the graph's first
                optimizer step issued for the graph's first buckets      buckets' ``gather_bucket`` take
                are good to take [Note: the next step's first gather     the handed-over buffers
                starts at the optimizer step] (step/prefetch.py)

A plain call's variant (no bucket accumulating, nothing prefetched) compiles inside Dynamo's call;
the others compile the first time a call needs them (never through Dynamo again), so switching
between them is one lookup. ``explain()`` files each variant's stages under its name: ``forward``,
``forward (accumulate)``, ``forward (prefetched)``, ``forward (accumulate, prefetched)``.
"""

from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, NamedTuple

import torch
import torch.fx as fx
from torch._dynamo import register_backend

from .. import log
from ..options import Options, check_cudagraphs_off
from .passes.outline import Outlined
from .passes.pipeline import compile_scheduled, run_passes
from .passes.reshard_within_groups import GraphReshard, reshard_setting
from .passes.rewrite import Rewritten, copy_dynamo_graph, hand_out_gradients, take_prefetched
from ..step import deferred_reduce, prefetch as step_prefetch, reduced_first
from ..tensor import in_flight
from ..buckets import uninitialized
from ..buckets.dbuffer import DBuffer, note_reached, pending_leaf
from ..buckets.gather import gather_bucket, hand_over
from .rebind import ShardBinding

__all__ = ["CompiledGraph", "VariantKey", "records", "vescale"]


@dataclass
class CompiledGraph:
    """What one backend call produced; ``explain()`` reads these.

    The record refers to its DBuffers weakly: it must not keep a deleted model's shards alive.
    """

    options: Options
    _buffer_refs: list[weakref.ref] = field(default_factory=list)
    graphs: dict[str, str] = field(default_factory=dict)  # stage name → readable graph
    across_step: list[str] = field(default_factory=list)  # what of its communication crosses the step boundary
    modules: dict[str, fx.GraphModule] = field(default_factory=dict)  # stage name → graph, for tests and tools
    outlined: Outlined = field(default_factory=Outlined)  # blocks compiled once, and blocks left flat with why
    seconds: dict[str, float] = field(default_factory=dict)  # wall time of each pass before aot_autograd
    graph_break: str | None = None  # why Dynamo ended this graph early (its graph-break reason), else None

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

    def loaded(self, stage: str) -> None:
        """Record that a stage was loaded from torch's compile cache (its graph was not made here)."""
        self.graphs[stage] = ("loaded from torch's compile cache (options['shared_compile_cache']): not traced "
                              "here, so there is no graph to show; a fresh TORCHINDUCTOR_CACHE_DIR shows it")


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
def vescale(gm: fx.GraphModule, example_inputs: list, options: dict | None = None, mode: str | None = None) -> Callable:
    """Shard the parameters of ``gm`` (fully sharded data parallel) and compile it.

    ``options``: fsdp_pass's options and Inductor config keys (docs/options.md); ``mode``: torch.compile's
    mode, with Inductor's meaning (torch.compile passes it alone, never with ``options``).
    """
    opts = Options.from_dict(options, mode)
    check_cudagraphs_off(opts, gm.meta)  # before anything is sharded; compile_scheduled checks each compile again
    record = CompiledGraph(opts)
    record.graphs["dynamo"] = _readable(gm)
    reason = getattr(gm, "compile_subgraph_reason", None)  # Dynamo's GraphCompileReason
    if reason is not None and reason.graph_break:
        record.graph_break = str(reason.reason)
    result = run_passes(gm, example_inputs, opts)
    if result is None:  # no parameters: nothing to shard
        _remember(record)
        return compile_scheduled(copy_dynamo_graph(gm), list(example_inputs), opts, record)

    for buf in result.sharded.new:
        log.plan(buf)
    rewritten = result.rewritten
    for buf, config in zip(rewritten.buffers, rewritten.configs):
        buf.apply_settings(compute_dtype=config.param_dtype)  # eager calls compute as the compiled graph does
    record.buffers = rewritten.buffers
    record.outlined, record.seconds = result.outlined, result.seconds
    record.graph("rewritten", rewritten.gm)

    dropped = set(rewritten.dropped)
    rest = [x for i, x in enumerate(example_inputs) if i not in dropped]
    configs = rewritten.configs
    gathered_first = _gathered_buckets(rewritten)
    trainable = frozenset(i for i, b in enumerate(rewritten.buffers) if b.shard.requires_grad)
    deferred = _deferred_bucket(rewritten, gathered_first) if opts.overlap_last_reduce else None
    plain = frozenset() if deferred is None else frozenset({deferred})
    taken = _prefetched_buckets(rewritten, gathered_first, opts.prefetch) if opts.prefetch_next_step else []
    record.across_step = _across_step_lines(rewritten, deferred, taken, opts)
    variants = _Variants(rewritten, opts, record, torch._guards.TracingContext.get().fake_mode, rest, trainable, taken)
    # Inside Dynamo's call: what this compile adds to the shape environment is in the guards Dynamo
    # builds once the backend returns.
    variants.compile_in_dynamo(VariantKey(plain, prefetched=False), rest)
    if taken:
        step_prefetch.enable()
    _remember(record)

    compiled_reshard = reshard_setting(opts.reshard_after_forward, rewritten.buffers)
    binding = ShardBinding(rewritten.dropped, [s.param for s in result.sites], rewritten.buffers, rewritten.configs)
    eager_graph = gm  # Dynamo's own graph: parameters as inputs, run through the eager path

    def run(*args):
        bound = binding.bind(args)  # [Note: one graph for identical blocks]
        if bound is None:
            _warn_running_eagerly(result.sites[0].name)
            return eager_graph(*args)
        buffers, reads = bound
        if uninitialized.any_pending():  # [Note: uninitialized shards]
            uninitialized.check_buckets(buffers)
        if in_flight.any_in_flight():  # nobody read last step's gradient: finish its reduce-scatter
            in_flight.settle_all()
        _check_divide_factors(buffers, rewritten.configs)
        if torch.is_grad_enabled():  # an inference graph has no backward, for which the setting is
            _check_reshard_after_forward(buffers, opts.reshard_after_forward, compiled_reshard)
        shards = [b.shard for b in buffers]
        rest_args = [a for i, a in enumerate(args) if i not in dropped]
        if trainable and torch.is_grad_enabled() and any(buffers[i].accumulating for i in trainable):
            unreduced = trainable
            leaves = [buffers[i].pending_input(configs[i]) for i in sorted(unreduced)]
        else:
            unreduced = plain
            leaves = [deferred_reduce.deferred_input(buffers[i], configs[i]) for i in sorted(unreduced)]
            if opts.step_reduced_first:  # [Note: the reduced gradients are stepped first]
                for i in plain:
                    reduced_first.enable(buffers[i])
        prefetched = bool(taken) and _take_prefetched(buffers)
        if not prefetched:
            step_prefetch.discard(buffers)
        # [Note: the gradient state of a parameter]: backward tells each bucket what this graph read
        shards = [note_reached(shard, buf, names) for shard, buf, names in zip(shards, buffers, reads)]
        leaves = [note_reached(leaf, buffers[i], reads[i], whole=True) for leaf, i in zip(leaves, sorted(unreduced))]
        return variants[VariantKey(unreduced, prefetched)](*shards, *leaves, *rest_args)

    def _take_prefetched(buffers: list[DBuffer]) -> bool:
        """Name this call's first buckets for the next step, and hand the graph the gathers the last step
        issued for them, if they are good to take ([Note: the next step's first gather starts at the
        optimizer step])."""
        targets = [step_prefetch.Target(buffers[i], configs[i]) for i in taken]
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


def _across_step_lines(rewritten: Rewritten, deferred: int | None, taken: list[int], opts: Options) -> list[str]:
    """What ``explain()`` says of the graph's communication across the step boundary."""
    lines = []
    if deferred is not None:
        lines.append(f"bucket {rewritten.buffers[deferred].index}'s reduce-scatter leaves backward in flight, waited "
                     f"where its gradient is first read (overlap_last_reduce)"
                     + ("; optimizer steps run over the other buckets first (step_reduced_first)"
                        if opts.step_reduced_first else ""))
    if taken:
        names = ", ".join(str(rewritten.buffers[i].index) for i in taken)
        lines.append(f"the optimizer step issues the all-gathers of buckets {names} for the next forward "
                     f"(prefetch_next_step)")
    return lines


def _check_divide_factors(buffers: list[DBuffer], configs: list) -> None:
    """A compiled graph divides gradients by a constant: refuse to run once the bucket's factor changed."""
    for buf, config in zip(buffers, configs):
        if buf.grad_divisor != config.grad_divisor:
            raise RuntimeError(
                f"bucket {buf.index} ({buf.names[0]!r}, ...) now divides gradients by {buf.grad_divisor}, but its "
                f"compiled graph divides by {config.grad_divisor}; call fsdp_pass.set_gradient_divide_factor before "
                f"the first compiled call (or torch._dynamo.reset() to compile again)"
            )


def _check_reshard_after_forward(buffers: list[DBuffer], option: bool | int, compiled: GraphReshard) -> None:
    """A compiled graph reshards after forward as its buckets said when it compiled: refuse to train once
    they say otherwise (``FSDPModule.set_reshard_after_forward`` after the first compiled call)."""
    now = reshard_setting(option, buffers)
    if now != compiled:
        raise RuntimeError(
            f"bucket {buffers[0].index} ({buffers[0].names[0]!r}, ...) now has reshard_after_forward="
            f"{_reshard_text(now)}, but its compiled graph was made with {_reshard_text(compiled)}; call "
            f"set_reshard_after_forward before the first compiled call (or torch._dynamo.reset() to compile again)"
        )


def _reshard_text(setting: GraphReshard) -> str:
    kept = f" (False for the buckets at {sorted(setting.kept)})" if setting.kept else ""
    return f"{setting.after!r}{kept}"


class VariantKey(NamedTuple):
    """What tells one compiled variant of a graph from another (the table in the module docstring)."""

    unreduced: frozenset[int]  # buckets (positions in the rewritten buffers) whose gradient is handed out unreduced
    prefetched: bool  # the first buckets are taken from the gathers the last optimizer step issued


class _Variants:
    """The compiled variants of one rewritten graph, by :class:`VariantKey`: each one is the rewritten
    graph with the transforms its key names, compiled the first time a call needs it."""

    def __init__(self, rewritten: Rewritten, opts: Options, record: CompiledGraph, fake_mode, rest: list,
                 trainable: frozenset[int], taken: list[int]):
        self._rewritten, self._opts, self._record, self._fake_mode = rewritten, opts, record, fake_mode
        self._trainable, self._taken = trainable, taken
        self._shards = [fake_mode.from_tensor(b.shard, static_shapes=True) for b in rewritten.buffers]
        # Fakes of Dynamo's other inputs, made now: a later compile sees the (possibly symbolic) shapes
        # Dynamo's own compile saw, and keeps no real input alive.
        self._rest = [fake_mode.from_tensor(x) if isinstance(x, torch.Tensor) and not
                      isinstance(x, torch._subclasses.FakeTensor) else x for x in rest]
        self._compiled: dict[VariantKey, Callable] = {}

    def compile_in_dynamo(self, key: VariantKey, rest: list) -> None:
        """Compile ``key``'s variant now, inside Dynamo's backend call, with Dynamo's own inputs ``rest``."""
        self._compiled[key] = self._compile(key, rest)

    def __getitem__(self, key: VariantKey) -> Callable:
        compiled = self._compiled.get(key)
        if compiled is None:  # never through Dynamo: under a fresh tracing context on its fake mode
            with torch._guards.tracing(torch._guards.TracingContext(self._fake_mode)):
                compiled = self._compiled[key] = self._compile(key, self._rest)
        return compiled

    def _compile(self, key: VariantKey, rest: list) -> Callable:
        rewritten = self._rewritten
        if key.unreduced:
            rewritten = hand_out_gradients(rewritten, key.unreduced)
        if key.prefetched:
            rewritten = take_prefetched(rewritten, self._taken)
        leaves = [self._fake_mode.from_tensor(pending_leaf(rewritten.buffers[i], rewritten.configs[i]),
                                              static_shapes=True) for i in sorted(key.unreduced)]
        # slot → gather arguments of the buckets taken gathered, which backward gathers again
        taken = {i: rewritten.configs[i] for i in self._taken} if key.prefetched else None
        return compile_scheduled(rewritten.gm, self._shards + leaves + rest, self._opts,
                                 _Suffixed(self._record, self._suffix(key)), rewritten.buffers, taken)

    def _suffix(self, key: VariantKey) -> str:
        """What ``explain()`` adds to the variant's stage names: what it does beside a plain call's graph."""
        accumulating = bool(key.unreduced) and key.unreduced == self._trainable
        does = [word for word, yes in (("accumulate", accumulating), ("prefetched", key.prefetched)) if yes]
        return f" ({', '.join(does)})" if does else ""


class _Suffixed:
    """A graph sink that files a variant's stages under suffixed names."""

    def __init__(self, sink: CompiledGraph, suffix: str):
        self.sink, self.suffix = sink, suffix

    def graph(self, stage: str, gm: fx.GraphModule) -> None:
        self.sink.graph(stage + self.suffix, gm)

    def code(self, stage: str, source: str) -> None:
        self.sink.code(stage + self.suffix, source)

    def loaded(self, stage: str) -> None:
        self.sink.loaded(stage + self.suffix)
