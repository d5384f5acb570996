"""The systems ``step_time.py`` (``SYSTEMS``) and ``eager_step.py`` (``EAGER_SYSTEMS``) compare: each turns a
plain model into (model, what the step calls).

Every builder takes the plain model (same weights on every rank) and returns ``(model, info)``; the
optimizer (plain ``torch.optim.AdamW``) is built on ``model.parameters()`` afterwards by the caller.
"""

from __future__ import annotations

import contextlib
import time
import warnings
from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist
import torch.fx as fx
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy


@dataclass(frozen=True)
class System:
    key: str
    label: str
    distributed: bool = True  # False: one process, no process group (the compute floor)
    inductor: bool = False  # some of its compute runs Inductor-generated kernels
    compiled_fsdp: bool = False  # FSDP is inside compiled graphs: copies are counted on the graphs
    fsdp_pass: dict | None = None  # options for torch.compile(backend="vescale")
    fsdp2_reshard: bool | int = True  # FSDP2's fully_shard(reshard_after_forward=...) for each block
    # fsdp_pass.fully_shard before (or without) any compile: "model" (the model, defaults), "units" (the model,
    # min_bucket_bytes=0: a bucket per module unit) or "blocks" (each block, then the model: FSDP2's recipe)
    fully_shard: str | None = None
    compile_blocks: bool = False  # with fully_shard: each block .compile(backend="vescale"), the rest eager
    # each block in torch's activation-checkpoint wrapper (non-reentrant) before sharding, as torchtitan applies it
    checkpoint_blocks: bool = False

    @property
    def sharded_by_fsdp_pass(self) -> bool:
        return self.fsdp_pass is not None or self.fully_shard is not None


_ACROSS_STEP_OFF = {"overlap_last_reduce": False, "prefetch_next_step": False, "step_reduced_first": False}

SYSTEMS: dict[str, System] = {s.key: s for s in (
    System("single", "single process, no comm (inductor)", distributed=False, inductor=True),
    System("ddp", "DDP (eager)"),
    System("fsdp2", "FSDP2 (eager)"),
    System("fsdp2_compile", "FSDP2 + torch.compile (inductor)", inductor=True),
    System("simplefsdp", "SimpleFSDP (torchtitan, inductor)", inductor=True, compiled_fsdp=True),
    System("fsdp_pass_aot_eager", "fsdp_pass aot_eager, overlap on", compiled_fsdp=True,
           fsdp_pass={"compiler": "aot_eager", "prefetch": 1}),
    System("fsdp_pass_aot_eager_no_overlap", "fsdp_pass aot_eager, overlap off", compiled_fsdp=True,
           fsdp_pass={"compiler": "aot_eager", "prefetch": 0}),
    System("fsdp_pass_inductor", "fsdp_pass inductor, the default", inductor=True, compiled_fsdp=True,
           fsdp_pass={"compiler": "inductor", "prefetch": 1}),
    System("fsdp_pass_inductor_no_overlap", "fsdp_pass inductor, overlap off", inductor=True, compiled_fsdp=True,
           fsdp_pass={"compiler": "inductor", "prefetch": 0}),
    System("fsdp_pass_inductor_reshard_last", "fsdp_pass inductor, overlap on, last bucket resharded too",
           inductor=True, compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1,
                                                         "reshard_last_bucket": True}),
    # The step-boundary settings, each named explicitly (on or off), so that these rows mean the same
    # whatever the defaults are.
    System("fsdp_pass_inductor_plain", "fsdp_pass inductor, nothing across the step", inductor=True,
           compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1, **_ACROSS_STEP_OFF}),
    System("fsdp_pass_inductor_overlap_reduce", "fsdp_pass inductor, last reduce-scatter into the step",
           inductor=True, compiled_fsdp=True,
           fsdp_pass={"compiler": "inductor", "prefetch": 1, **_ACROSS_STEP_OFF, "overlap_last_reduce": True}),
    System("fsdp_pass_inductor_reduced_first", "fsdp_pass inductor, last reduce-scatter into the step, reduced first",
           inductor=True, compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1, **_ACROSS_STEP_OFF,
                                                         "overlap_last_reduce": True, "step_reduced_first": True}),
    System("fsdp_pass_inductor_prefetch_step", "fsdp_pass inductor, first gather at the step",
           inductor=True, compiled_fsdp=True,
           fsdp_pass={"compiler": "inductor", "prefetch": 1, **_ACROSS_STEP_OFF, "prefetch_next_step": True}),
    System("fsdp_pass_inductor_across_step", "fsdp_pass inductor, all three across the step",
           inductor=True, compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1, "overlap_last_reduce": True,
                                                         "prefetch_next_step": True, "step_reduced_first": True}),
    # The multi-node settings (benchmarks/node_link.py): backward's gathers within a node of 2 ranks, int8
    # gradient reduction, FP8 gathers, and FSDP2's own within-node resharding.
    System("fsdp_pass_inductor_reshard2", "fsdp_pass inductor, reshard_after_forward=2", inductor=True,
           compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1, "reshard_after_forward": 2}),
    System("fsdp_pass_inductor_quantized", "fsdp_pass inductor, quantized_reduce", inductor=True,
           compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1, "quantized_reduce": True}),
    System("fsdp_pass_inductor_reshard2_quantized", "fsdp_pass inductor, reshard_after_forward=2 + quantized_reduce",
           inductor=True, compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1,
                                                         "reshard_after_forward": 2, "quantized_reduce": True}),
    System("fsdp_pass_inductor_reshard2_quantized_fp8",
           "fsdp_pass inductor, reshard_after_forward=2 + quantized_reduce + FP8 gathers", inductor=True,
           compiled_fsdp=True, fsdp_pass={"compiler": "inductor", "prefetch": 1, "reshard_after_forward": 2,
                                          "quantized_reduce": True, "fp8_all_gather": True}),
    System("fsdp2_reshard2", "FSDP2 (eager), reshard_after_forward=2", fsdp2_reshard=2),
)}

# ``eager_step.py``'s systems besides ``fsdp2`` and ``fsdp2_compile``: fsdp_pass without torch.compile of the
# whole model (its eager path: [Note: eager calls on sharded parameters] in fsdp_pass/eager/calls.py), and the
# floor of an eager step. Not in SYSTEMS: step_time.py's default run stays what it was.
EAGER_SYSTEMS: dict[str, System] = {s.key: s for s in (
    System("single_eager", "single process, no comm (eager)", distributed=False),
    System("fsdp_pass_eager", "fsdp_pass fully_shard(model), eager", fully_shard="model"),
    System("fsdp_pass_eager_units", "fsdp_pass fully_shard(model, min_bucket_bytes=0), eager", fully_shard="units"),
    System("fsdp_pass_eager_blocks", "fsdp_pass fully_shard per block + root, eager", fully_shard="blocks"),
    System("fsdp_pass_regional", "fsdp_pass fully_shard per block + root, blocks compiled (vescale)", inductor=True,
           fully_shard="blocks", compile_blocks=True),
    System("fsdp2_checkpointed", "FSDP2 per checkpoint-wrapped block + root, eager", checkpoint_blocks=True),
    System("fsdp_pass_eager_checkpointed", "fsdp_pass fully_shard per checkpoint-wrapped block + root, eager",
           fully_shard="blocks", checkpoint_blocks=True),
)}
ALL_SYSTEMS: dict[str, System] = {**SYSTEMS, **EAGER_SYSTEMS}


def simplefsdp_import_error() -> str | None:
    """None when torchtitan's SimpleFSDP imports, else the error text."""
    try:
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel  # noqa: F401
    except Exception as e:  # ImportError, or anything its import chain raises
        return f"{type(e).__name__}: {e}"
    return None


def fsdp_pass_options(requested: dict) -> tuple[dict, list[str]]:
    """The options this checkout's ``fsdp_pass`` accepts, and the names it does not know (dropped)."""
    from fsdp_pass.options import Options

    known = set(Options._NAMES)
    return {k: v for k, v in requested.items() if k in known}, sorted(set(requested) - known)


# ----------------------------------------------------------------------------------------------------
# SimpleFSDP wiring (torchtitan's JIT mode, reproduced: its jit_backend/fsdp_passes modules import
# triton and torchdata, which a CPU machine with ``--no-deps`` does not have).
# ----------------------------------------------------------------------------------------------------

_c10d = torch.ops._c10d_functional


def _is_wait_of_fsdp_all_gather(node: fx.Node) -> bool:
    """torchtitan ``fsdp_passes.is_wait_tensor_from_fsdp``: a wait of an all_gather fed by a
    single-input chain from a graph input."""
    if node.target is not _c10d.wait_tensor.default:
        return False
    ag = node.args[0]
    if not isinstance(ag, fx.Node) or ag.target is not _c10d.all_gather_into_tensor.default:
        return False
    n = ag.all_input_nodes[0] if ag.all_input_nodes else None
    while n is not None:
        if n.op == "placeholder":
            return True
        if len(n.all_input_nodes) != 1:
            return False
        n = n.all_input_nodes[0]
    return False


def simplefsdp_reshard_after_forward(gm: fx.GraphModule, joint_inputs=None) -> fx.GraphModule:
    """torchtitan's (pre-merge) ``reshard_after_forward`` joint pass: tag every FSDP all_gather, its wait,
    the cast before it and the slice after it MUST_RECOMPUTE, so backward gathers again (ZeRO-3)."""
    aten = torch.ops.aten
    for node in list(gm.graph.nodes):
        if not _is_wait_of_fsdp_all_gather(node):
            continue
        ag = node.args[0]
        chain = [ag, node]
        src = ag.args[0]
        if isinstance(src, fx.Node) and src.target in (aten._to_copy.default, torch.ops.prims.convert_element_type.default):
            chain.append(src)
        chain += [u for u in node.users if u.target in (aten.slice.Tensor, aten.view.default)]
        for n in chain:
            n.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            n.meta["ac_graph_id"] = 100000
    return gm


def _patch_cpu_runtime_estimation() -> None:
    """Inductor's overlap passes estimate runtimes with GPU numbers (and import triton for them)."""
    import torch.utils._runtime_estimation as rte

    rte.get_gpu_dram_gbps = lambda: 3350
    rte.get_device_tflops = lambda dtype: 400.0
    try:
        import torch._inductor.utils as iu

        iu.get_gpu_dram_gbps = lambda: 3350
    except Exception:
        pass


def simplefsdp_compile_config(bucket_plans: list, graph_sink: Callable[[str, fx.GraphModule], None]):
    """The compiler settings of torchtitan's JIT ``transformer_block_bucketing`` + inductor, with our graph
    recorder after it: a function returning a context manager that sets them while it is open.

    Scoped, not set for the process: the round-robin run compiles every system in one process, and
    these passes must not touch the other systems' graphs."""
    from torch._inductor.fx_passes.overlap_manual_scheduling import manual_overlap_bucketing

    _patch_cpu_runtime_estimation()
    counter = {"n": 0}

    def post_grad_pass(graph: fx.Graph):
        gm = manual_overlap_bucketing(graph.owning_module, module_bucket_plans=bucket_plans, insert_overlap_deps=True)
        graph_sink(f"graph{counter['n']}", gm)
        counter["n"] += 1
        return gm

    def scope() -> contextlib.ExitStack:
        stack = contextlib.ExitStack()
        stack.enter_context(torch._inductor.config.patch(
            allow_buffer_reuse=False, reorder_for_peak_memory=False, reorder_for_compute_comm_overlap=False,
            post_grad_custom_post_pass=post_grad_pass))
        stack.enter_context(torch._functorch.config.patch(joint_custom_pass=simplefsdp_reshard_after_forward))
        return stack

    return scope


# ----------------------------------------------------------------------------------------------------
# Builders
# ----------------------------------------------------------------------------------------------------


def build_system(system: System, model: nn.Module, world: int, graph_sink: Callable[[str, fx.GraphModule], None]):
    """Wrap ``model`` for ``system``; returns (callable model, notes). ``notes["compile_config"]``, where
    present, makes the context its steps must run in (the compiler settings its compiles need)."""
    notes: dict = {}
    if system.key == "single":
        return torch.compile(model), notes
    if system.key == "single_eager":
        return model, notes
    if system.key == "ddp":
        # broadcast_buffers=False: the only buffer (rotary table) is a constant.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # broadcast_buffers: deprecated name, same meaning
            return nn.parallel.DistributedDataParallel(model, broadcast_buffers=False), notes
    if system.checkpoint_blocks:
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

        model.layers = nn.ModuleList(checkpoint_wrapper(block, preserve_rng_state=False) for block in model.layers)
    if system.key in ("fsdp2", "fsdp2_compile", "fsdp2_reshard2", "fsdp2_checkpointed"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (world,))
        for block in model.layers:
            if system.key == "fsdp2_compile":
                block.compile()  # per-block compile: FSDP's hooks are dynamo-disabled and run eagerly
            fully_shard(block, mesh=mesh, reshard_after_forward=system.fsdp2_reshard)
        fully_shard(model, mesh=mesh)
        return model, notes
    if system.key == "simplefsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torchtitan.experiments.graph_trainer.simple_fsdp import data_parallel

        mesh = init_device_mesh("cpu", (world,))
        model = data_parallel(model, mesh, mode="fully_shard")
        plans = ["tok_embeddings", *[f"layers.{i}" for i in range(len(model.layers))], ["norm", "output"]]
        notes["bucket_plans"] = plans
        notes["compile_config"] = simplefsdp_compile_config(plans, graph_sink)
        return torch.compile(model, backend="inductor", fullgraph=True), notes
    if system.fully_shard is not None:
        return _fsdp_pass_fully_shard(system, model), notes
    if system.fsdp_pass is not None:
        import fsdp_pass  # noqa: F401  (registers the "vescale" backend)

        options, dropped = fsdp_pass_options(system.fsdp_pass)
        notes["options"] = {k: v for k, v in options.items()}
        if dropped:
            notes["options_not_supported"] = dropped
        return torch.compile(model, backend="vescale", options=options), notes
    raise KeyError(system.key)


def _fsdp_pass_fully_shard(system: System, model: nn.Module) -> nn.Module:
    """``fsdp_pass.fully_shard`` as ``system.fully_shard`` says, then (``compile_blocks``) each block compiled."""
    import fsdp_pass

    if system.fully_shard == "blocks":
        for block in model.layers:
            fsdp_pass.fully_shard(block)
        fsdp_pass.fully_shard(model)
    else:
        fsdp_pass.fully_shard(model, **({"min_bucket_bytes": 0} if system.fully_shard == "units" else {}))
    if system.compile_blocks:
        for block in model.layers:
            block.compile(backend="vescale")
    return model


class Training:
    """One system training on one rank: its model, a plain AdamW, and ``step(i)``, which trains on batch
    ``i`` (this rank's slice of a seeded global batch: every system sees the same data in the same order)."""

    def __init__(self, system: System, model: nn.Module, world: int, rank: int, batch: int,
                 graph_sink: Callable[[str, fx.GraphModule], None]):
        self.system, self.rank, self.batch = system, rank, batch
        self.cfg = model.cfg
        self.model, self.notes = build_system(system, model, world, graph_sink)
        self.compile_config = self.notes.pop("compile_config", contextlib.nullcontext)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.losses: list[float] = []

    def step(self, i: int) -> tuple[float, float, float]:
        """Forward, backward, optimizer step and ``zero_grad`` on batch ``i``: the seconds of each phase."""
        from torch.profiler import record_function

        from _measure import PHASES
        from fsdp_pass.testing.models import lm_loss, random_tokens

        tokens = random_tokens(self.cfg, self.batch, seed=1000 * i + self.rank)
        with self.compile_config():
            t0 = time.perf_counter()
            with record_function(PHASES[0]):
                loss = lm_loss(self.model(tokens), tokens)
            t1 = time.perf_counter()
            with record_function(PHASES[1]):
                loss.backward()
            t2 = time.perf_counter()
            with record_function(PHASES[2]):
                self.opt.step()
                self.opt.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
        self.losses.append(loss.item())
        return t1 - t0, t2 - t1, t3 - t2

    def quiesce(self) -> None:
        """Leave nothing of this system in flight (the next step's gathers an fsdp_pass step issued), so
        the next system's collectives start on an idle process group."""
        if self.system.sharded_by_fsdp_pass:
            from fsdp_pass.buckets.dbuffer import buffers_of
            from fsdp_pass.step import prefetch

            prefetch.discard(buffers_of(self.model))


def fsdp_pass_graphs() -> dict[str, fx.GraphModule]:
    """The forward/backward graphs fsdp_pass handed to its compiler (what runs, for aot_eager)."""
    from fsdp_pass.compile.backend import records

    out = {}
    for i, rec in enumerate(records()):
        for stage in ("forward", "backward"):
            if stage in rec.modules:
                out[f"{i}.{stage}"] = rec.modules[stage]
    return out


def barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
