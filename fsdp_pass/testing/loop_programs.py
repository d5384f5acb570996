"""Differential testing of training loops: generated loop programs, run sharded and as one process.

[Note: the loop-program tester]
Users write training loops in many orders: ``zero_grad`` before the forward or between forward and
backward, micro-batches under ``no_sync``, a frozen layer unfrozen mid-run, ``clip_grad_norm_``, a branch
or an expert a step skips, an eager-only part beside compiled ones. Each order must train as one process
does ([Note: the gradient state of a parameter] in buckets/dbuffer.py). This module draws *loop programs*
(lists of :class:`Event`) from a seed, runs each on every rank of a process group under one way of
sharding (:data:`SHARDINGS`) and, side by side, on an unsharded copy fed the global batch, and compares
after every event that ends a step: every parameter (relative difference ``TOLERANCE``) and which
``.grad`` are None. A failing program is shrunk (events dropped one at a time while it still fails, the
verdict agreed by every rank, so every rank runs the same programs) to the shortest that shows it.

Programs keep to what one process and every rank can both run: a backward only after a forward, an
optimizer step only with no loss held (its backward would read overwritten weights), a step or a clip only
while syncing and with no gradient left unreduced by ``no_sync`` (the user's own error, as in FSDP2), no
``zero_grad(set_to_none=False)`` while a sum is unreduced (refused with an error:
tests/test_loop_programs.py), no freezing before the first forward (a parameter frozen when sharded is
refused once unfrozen), the same branch and experts on every rank.

A skewed forward (``Event.skew``: ranks run different experts, as a router sends their tokens apart) is
for named cases that first compile each graph on every rank: a compile is collective (sharding/agreement.py
refuses graphs over different parameters), and one rank compiling while another runs a cached graph
mismatches the collectives. Compiled, it is not for a rank that skips a whole bucket another rank uses: a
graph gathers only the buckets it reads. Eager units gather every bucket of the unit on every rank, so
there it is.
"""

from __future__ import annotations

import argparse
import copy
import random
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from ..buckets.gradient_sync import set_requires_gradient_sync
from ..sharding.fully_shard import fully_shard
from ..tensor import in_flight

__all__ = ["BranchyModel", "Event", "Experts", "SHARDINGS", "TOLERANCE", "describe", "draw_program", "run_programs", "shrink"]

TOLERANCE = 1e-6  # relative Frobenius difference of each parameter, sharded against one process
DIM = 8  # width of every layer: the smallest that still spreads each bucket over the ranks


class _EagerPart(nn.Module):
    """A layer Dynamo leaves to eager (a graph break around it): its parameters no graph reads."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    @torch._dynamo.disable
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.proj(x))


class Experts(nn.Module):
    """Experts a step may skip, as Mixtral's loop skips experts that get no tokens."""

    def __init__(self, count: int = 2) -> None:
        super().__init__()
        self.experts = nn.ModuleList(nn.Linear(DIM, DIM, bias=False) for _ in range(count))

    def forward(self, x: torch.Tensor, active: tuple[bool, ...]) -> torch.Tensor:
        out = x
        for expert, on in zip(self.experts, active):
            if on:
                out = out + expert(x)
        return out


class BranchyModel(nn.Module):
    """Trunk, a branch some steps skip, experts some steps skip, an eager-only part, head."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(DIM, DIM)
        self.branch = nn.Linear(DIM, DIM)
        self.moe = Experts()
        self.eager = _EagerPart()
        self.head = nn.Linear(DIM, 2)

    def forward(self, x: torch.Tensor, branch: bool = True, experts: tuple[bool, ...] = (True, True),
                eager: bool = True) -> torch.Tensor:
        h = F.relu(self.trunk(x))
        if branch:
            h = h + self.branch(h)
        h = self.moe(h, experts)
        if eager:
            h = self.eager(h)
        return self.head(h)


def _units(model: BranchyModel) -> list[nn.Module]:
    return [model.moe, model.eager]  # the branch shares the root bucket with trunk and head


def _eager(model: nn.Module, options: dict) -> Callable:
    mesh = options.get("mesh")
    for unit in _units(model):
        fully_shard(unit, mesh)
    fully_shard(model, mesh)
    return model


def _whole_compile(model: nn.Module, options: dict) -> Callable:
    return torch.compile(model, backend="vescale", options=options)


def _shard_then_compile(model: nn.Module, options: dict) -> Callable:
    return torch.compile(_eager(model, options), backend="vescale", options=options)


def _per_block(model: nn.Module, options: dict) -> Callable:
    _eager(model, options)
    for unit in (model.branch, model.moe):
        unit.compile(backend="vescale", options=options)
    return model


# name → (unsharded model, backend options) → what the loop calls
SHARDINGS: dict[str, Callable[[nn.Module, dict], Callable]] = {
    "eager fully_shard": _eager,
    "whole-model compile": _whole_compile,
    "fully_shard then compile": _shard_then_compile,
    "per-block compile": _per_block,
}


@dataclass(frozen=True)
class Event:
    """One statement of a training loop. ``kind`` and what it reads:

    * ``forward``: ``branch``, ``experts`` (which run; with ``skew``, ranks after the first run the others, as a
      router sends one rank's tokens elsewhere), ``eager`` (whether the eager part runs); the loss is held;
    * ``backward``: of the held loss;
    * ``zero_grad``: ``set_to_none``;
    * ``sync``: ``on`` (``fsdp_pass.set_requires_gradient_sync``);
    * ``freeze``: ``on`` (True freezes, False unfreezes) the parameters of ``target``;
    * ``clip``: ``clip_grad_norm_`` to 0.5;
    * ``step``: the optimizer's step.
    """

    kind: str
    branch: bool = True
    experts: tuple[bool, ...] = (True, True)
    skew: bool = False
    eager: bool = True
    set_to_none: bool = True
    on: bool = True
    target: str = "branch"

    def __str__(self) -> str:
        if self.kind == "forward":
            skew = ", skew" if self.skew else ""
            return f"forward(branch={self.branch}, experts={self.experts}{skew}, eager={self.eager})"
        if self.kind == "zero_grad":
            return f"zero_grad(set_to_none={self.set_to_none})"
        if self.kind == "sync":
            return f"set_requires_gradient_sync({self.on})"
        if self.kind == "freeze":
            return f"{'freeze' if self.on else 'unfreeze'}({self.target})"
        return f"{self.kind}()"


def describe(program: Sequence[Event]) -> str:
    return "; ".join(str(e) for e in program)


_FREEZABLE = ("branch", "moe.experts.1", "head")


def draw_program(seed: int, length: int = 14) -> list[Event]:
    """A random loop program of about ``length`` events that keeps the rules in the module's Note."""
    rng = random.Random(seed)
    program: list[Event] = []
    loss_held, syncing = False, True
    unsynced_grad = False  # a backward ran without sync since the last synced backward
    while len(program) < length:
        choice = rng.choices(
            ["forward", "backward", "zero_grad", "sync", "freeze", "clip", "step"],
            weights=[4, 4, 2, 1, 1, 1, 3])[0]
        if choice == "forward":
            program.append(Event("forward", branch=rng.random() < 0.6,
                                 experts=(rng.random() < 0.7, rng.random() < 0.5), eager=rng.random() < 0.7))
            loss_held = True
        elif choice == "backward":
            if not loss_held:
                continue
            program.append(Event("backward"))
            loss_held = False
            unsynced_grad = not syncing
        elif choice == "zero_grad":
            program.append(Event("zero_grad", set_to_none=unsynced_grad or rng.random() < 0.7))
        elif choice == "sync":
            syncing = not syncing
            program.append(Event("sync", on=syncing))
        elif choice == "freeze":
            if any(e.kind == "forward" for e in program):  # frozen when sharded: refused once unfrozen
                program.append(Event("freeze", on=rng.random() < 0.5, target=rng.choice(_FREEZABLE)))
        elif choice == "clip":
            if syncing and not unsynced_grad:
                program.append(Event("clip"))
        elif syncing and not unsynced_grad and not loss_held:
            program.append(Event("step"))
    return program


def _well_formed(program: Sequence[Event]) -> bool:
    """Whether a (shrunk) program still keeps the rules :func:`draw_program` keeps."""
    loss_held, syncing, unsynced_grad, forwarded = False, True, False, False
    for e in program:
        if e.kind == "forward":
            loss_held = True
        elif e.kind == "backward":
            if not loss_held:
                return False
            loss_held, unsynced_grad = False, not syncing
        elif e.kind == "sync":
            syncing = e.on
        elif e.kind in ("clip", "step") and (not syncing or unsynced_grad):
            return False
        elif e.kind == "zero_grad" and not e.set_to_none and unsynced_grad:
            return False
        elif e.kind == "step" and loss_held:
            return False
        elif e.kind == "freeze" and not forwarded:
            return False
        forwarded = forwarded or e.kind == "forward"
    return True


def _batch(index: int, global_batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(global_batch, DIM, generator=g), torch.randn(global_batch, 2, generator=g)


def _experts_of(e: Event, rank: int) -> tuple[bool, ...]:
    return tuple(not on for on in e.experts) if e.skew and rank > 0 else e.experts


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


class _Mismatch(AssertionError):
    pass


def _compare(where: str, model: nn.Module, reference: nn.Module) -> None:
    ref = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        q = ref[name]
        if (p.grad is None) != (q.grad is None):
            raise _Mismatch(f"{where}: {name}.grad is {'None' if p.grad is None else 'set'} sharded, "
                            f"{'None' if q.grad is None else 'set'} in one process")
        a, b = _full(p.detach()), q.detach()
        diff = ((a - b).norm() / b.norm().clamp_min(1e-12)).item()
        if diff > TOLERANCE:
            raise _Mismatch(f"{where}: {name} differs from one process by {diff:.3g} (relative)")


def run_program(program: Sequence[Event], sharding: str, rank: int, world: int, mesh=None) -> str | None:
    """Run ``program`` sharded with ``SHARDINGS[sharding]`` and as one process; the first difference, or None."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = BranchyModel()
    reference = copy.deepcopy(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    options = {"compiler": "aot_eager"} if mesh is None else {"compiler": "aot_eager", "mesh": mesh}
    sharded = SHARDINGS[sharding](model, options)
    global_batch = 2 * world
    per_rank = global_batch // world
    losses: tuple[torch.Tensor, torch.Tensor] | None = None
    forwards = 0
    try:
        for i, e in enumerate(program):
            where = f"event {i} ({e})"
            if e.kind == "forward":
                x, y = _batch(forwards, global_batch)
                forwards += 1
                lo, hi = rank * per_rank, (rank + 1) * per_rank
                loss = F.mse_loss(sharded(x[lo:hi], e.branch, _experts_of(e, rank), e.eager), y[lo:hi])
                if e.skew:  # the mean over the global batch, each rank's slice through its own experts
                    ref_loss = sum(F.mse_loss(reference(x[r * per_rank:(r + 1) * per_rank], e.branch,
                                                        _experts_of(e, r), e.eager), y[r * per_rank:(r + 1) * per_rank])
                                   for r in range(world)) / world
                else:
                    ref_loss = F.mse_loss(reference(x, e.branch, e.experts, e.eager), y)
                losses = (loss, ref_loss)
            elif e.kind == "backward":
                assert losses is not None
                losses[0].backward()
                losses[1].backward()
                losses = None
            elif e.kind == "zero_grad":
                opt.zero_grad(set_to_none=e.set_to_none)
                ref_opt.zero_grad(set_to_none=e.set_to_none)
            elif e.kind == "sync":
                set_requires_gradient_sync(model, e.on)
            elif e.kind == "freeze":
                for m in (model, reference):
                    for p in m.get_submodule(e.target).parameters():
                        p.requires_grad_(not e.on)
            elif e.kind == "clip":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
                _compare(where, model, reference)
            elif e.kind == "step":
                opt.step()
                ref_opt.step()
                _compare(where, model, reference)
    except _Mismatch as error:
        return str(error)
    finally:
        in_flight.settle_all()  # a reduce-scatter the program left in flight ends with it, on every rank
    return None


def _agreed_failure(failure: str | None) -> bool:
    """Whether any rank saw a difference (every rank then shrinks the same way)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return failure is not None
    flag = torch.tensor([failure is not None], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def shrink(program: list[Event], fails: Callable[[list[Event]], bool]) -> list[Event]:
    """The shortest program found by dropping events one at a time from ``program`` while ``fails`` holds."""
    changed = True
    while changed:
        changed = False
        for i in range(len(program)):
            candidate = program[:i] + program[i + 1:]
            if _well_formed(candidate) and fails(candidate):
                program, changed = candidate, True
                break
    return program


def run_programs(programs: Sequence[list[Event]], shardings: Sequence[str], rank: int, world: int,
                 mesh=None) -> list[str]:
    """Run every program under every sharding on this rank; for each failing one, a line with the shortest
    program that still fails and what differed (empty when all match one process)."""
    found = []
    for sharding in shardings:
        for program in programs:
            failure = run_program(program, sharding, rank, world, mesh)
            if not _agreed_failure(failure):
                continue

            def fails(candidate: list[Event]) -> bool:
                return _agreed_failure(run_program(candidate, sharding, rank, world, mesh))

            short = shrink(list(program), fails)
            found.append(f"[{sharding}] {describe(short)} -> {run_program(short, sharding, rank, world, mesh)}")
    return found


def _soak(rank: int, world: int, first: int, count: int, shardings: list[str], hsdp: bool) -> dict:
    mesh = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    found = []
    for sharding in shardings:
        for seed in range(first, first + count):
            if rank == 0:
                print(f"[{sharding}] seed {seed}", flush=True)  # where a crash or a hang happened
            found += run_programs([draw_program(seed)], [sharding], rank, world, mesh)
    return {"found": found, "ran": count * len(shardings)}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--first", type=int, default=0, help="seed of the first program")
    parser.add_argument("--sharding", action="append", choices=sorted(SHARDINGS), help="default: all")
    parser.add_argument("--hsdp", action="store_true", help="4 ranks, a (2, 2) replicate × shard mesh")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m fsdp_pass.testing.loop_programs --programs N``: run N generated loop programs (seeds
    ``--first`` on) under every sharding on 2 gloo ranks (``--hsdp``: 4 ranks as a 2×2 mesh), print what differs."""
    from .spawn import run_distributed

    args = build_parser().parse_args(argv)
    world = 4 if args.hsdp else 2
    started = time.perf_counter()
    result = run_distributed(_soak, world, args.first, args.programs, args.sharding or list(SHARDINGS), args.hsdp,
                             timeout=24 * 3600)[0]
    for line in result["found"]:
        print(line)
    print(f"{result['ran']} program runs ({args.programs} programs, seeds {args.first}-{args.first + args.programs - 1}, "
          f"{world} ranks{', 2x2 HSDP' if args.hsdp else ''}): {len(result['found'])} differ from one process, "
          f"{time.perf_counter() - started:.0f} s")
    return 1 if result["found"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
