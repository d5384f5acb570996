"""Ablation of the structure-aware planner for block optimizers (the analog of veScale-FSDP's Table 2).

The model is examples/train.py's default llama (0.8 M parameters), sharded with ``fully_shard`` into one
bucket per transformer layer plus one for the rest (``min_bucket_bytes=0``: the usual FSDP wrapping);
the optimizers are the ones ``examples/train.py --optimizer muon|adamw8bit`` builds. Per optimizer and
world size, three layouts of the same parameters:

* ``planned``: the optimizer is built **before** sharding: its ``set_block`` annotations reach the
  planner, every rank holds whole blocks (Muon: whole matrices; AdamW8bit: whole 256-element
  quantization blocks) and the step runs on each rank's own piece;
* ``element``: the planner is blind to the optimizer: ``fully_shard(..., block_sizes={"*": {"elements":
  1}})`` first, then the optimizer; a parameter whose blocks a rank boundary cuts is gathered to a
  root rank every step and the result scattered back (``fsdp_pass.optim.blockwise``);
* ``even`` (no planner at all): every parameter split evenly over the ranks by rows, the per-parameter
  layout of FSDP2's ``Shard(0)``, built directly as RaggedShard parameters; every matrix is cut.

Each step gets fresh seeded random full gradients, distributed into the parameters' layouts (the
optimizer step does not depend on where gradients came from). Measured per optimizer step:

* collectives issued by the step (count, and bytes: the inputs of the collectives summed over ranks,
  and the part of them that leaves the rank), counted with a ``TorchDispatchMode`` over
  ``torch.ops._c10d_functional`` / ``c10d`` ops in one step that is not timed; next to it, the bytes
  the same gathers would send if every root were the rank holding most of its tensor;
* step time: median over ``--steps`` steps (after ``--warmup``) of barrier-to-barrier wall time of
  ``opt.step()`` (the slowest rank decides), each rank pinned to its own core (``os.sched_setaffinity``;
  with more ranks than cores, ranks share cores round-robin);
* optimizer state bytes per rank (max, min), and the bitwise agreement of the parameters after the run
  with the planned layout's.

    python benchmarks/ablation.py                 # 2 ranks   -> benchmarks/results/ablation.json
    python benchmarks/ablation.py --worlds 2 4
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = Path(__file__).resolve().parent.parent
try:
    import fsdp_pass  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(0, str(ROOT))

from fsdp_pass.testing.spawn import RankFailed, run_distributed  # noqa: E402

EXAMPLE = ROOT / "examples" / "train.py"
RESULTS = ROOT / "benchmarks" / "results"
LAYOUTS = ("planned", "element", "even")
OPTIMIZERS = ("muon", "adamw8bit")


def load_example():
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


class CollectiveCounter(TorchDispatchMode):
    """Counts collective ops, the bytes of their inputs and the bytes that leave this rank."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank
        self.calls: dict[str, int] = {}
        self.input_bytes = 0
        self.sent_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace in ("_c10d_functional", "c10d") and "wait" not in func.__name__:
            name = func.overloadpacket.__name__
            self.calls[name] = self.calls.get(name, 0) + 1
            tensors = [a for a in args if isinstance(a, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in tensors)
            self.input_bytes += nbytes
            if name == "all_to_all_single":  # (input, output_split_sizes, input_split_sizes, group)
                inp, send = args[0], args[2]
                self.sent_bytes += (sum(send) - send[self.rank]) * inp.element_size()
            else:
                self.sent_bytes += nbytes
        return func(*args, **(kwargs or {}))


def _structured(opt) -> bool:
    return type(opt).__module__.startswith("fsdp_pass.optim")


def _block_of(opt, p) -> int:
    """Elements the structure-aware optimizer needs whole for ``p``."""
    if type(opt).__name__ == "Muon":
        return p.numel()
    group = opt.param_groups[0]
    return group["block_size"] if p.numel() >= group["min_8bit_size"] else 1


def _state_bytes(opt) -> int:
    from fsdp_pass.optim.blockwise import flat_piece

    total = 0
    for state in opt.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                piece = flat_piece(value)
                total += piece.numel() * piece.element_size()
            elif isinstance(value, dict):  # Shampoo's per-block state
                for block in value.values():
                    total += sum(t.numel() * t.element_size() for t in block.values())
    return total


def build(train, optimizer: str, layout: str, mesh, world: int):
    """The model's parameters in ``layout`` and the optimizers of ``--optimizer optimizer``."""
    import torch.nn as nn

    from fsdp_pass.sharding.fully_shard import fully_shard
    from fsdp_pass.placement import RaggedShard
    from fsdp_pass.tensor.ragged_tensor import distribute_tensor

    args = train.parse_args(["--optimizer", optimizer])
    torch.manual_seed(0)
    model = train.Llama(train.ModelConfig(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                                          ffn=args.ffn, seq=args.seq_len))
    if layout == "planned":
        opts = train.build_optimizers(model, args)
        fully_shard(model, mesh, min_bucket_bytes=0)
    elif layout == "element":
        fully_shard(model, mesh, min_bucket_bytes=0, block_sizes={"*": {"elements": 1}})
        opts = train.build_optimizers(model, args)
    else:  # FSDP2's per-parameter Shard(0): rows split evenly over every rank
        for module in model.modules():
            for name, p in list(module._parameters.items()):
                if p is None:
                    continue
                row = p[0].numel() if p.ndim > 1 else 1
                placement = RaggedShard.even(p.numel(), world, block=row)
                module._parameters[name] = nn.Parameter(distribute_tensor(p.detach(), mesh, placement))
        opts = train.build_optimizers(model, args)
    return model, opts


def _set_grads(params, step: int) -> None:
    from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor, distribute_tensor

    for i, p in enumerate(params):
        full = torch.randn(p.shape, generator=torch.Generator().manual_seed(1000 * step + i)) * 1e-2
        p.grad = distribute_tensor(full, p.mesh, p.placement) if isinstance(p, RaggedShardTensor) else full


def measure(train, optimizer: str, layout: str, mesh, rank: int, world: int, warmup: int, steps: int) -> dict:
    from fsdp_pass.optim.blockwise import respects_blocks

    model, opts = build(train, optimizer, layout, mesh, world)
    params = list(model.parameters())
    structured = [o for o in opts if _structured(o)][0]
    block_params = [p for g in structured.param_groups for p in g["params"]]
    cut = [p for p in block_params if not respects_blocks(p._spec, _block_of(structured, p))]
    names = {id(p): n for n, p in model.named_parameters()}

    times, totals = [], []
    counted: dict[str, CollectiveCounter] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the gather-to-root warning: expected in the element/even layouts
        for step in range(warmup + 1 + steps):
            _set_grads(params, step)
            dist.barrier()
            if step == warmup:  # one counted step, not timed (the dispatch mode slows every op)
                for o in opts:
                    with CollectiveCounter(rank) as counter:
                        o.step()
                    counted[type(o).__name__] = counter
            else:
                t0 = time.perf_counter()
                structured.step()
                dist.barrier()
                t1 = time.perf_counter()
                for o in opts:
                    if o is not structured:
                        o.step()
                dist.barrier()
                t2 = time.perf_counter()
                if step > warmup:
                    times.append(t1 - t0)
                    totals.append(t2 - t0)
            for o in opts:
                o.zero_grad()

    c = counted[type(structured).__name__]
    per_rank = torch.tensor([sum(c.calls.values()), c.input_bytes, c.sent_bytes, _state_bytes(structured)],
                            dtype=torch.float64)
    gathered = [torch.zeros_like(per_rank) for _ in range(world)]
    dist.all_gather(gathered, per_rank)
    final = torch.cat([p.full_tensor().reshape(-1) for p in params])
    padding = sum(b.layout.padding for b in _buffers(model))
    return {
        "optimizer": optimizer, "layout": layout, "world": world,
        "structured_optimizer": type(structured).__name__,
        "block_params": len(block_params),
        "cut_params": len(cut),
        "cut_names": [names.get(id(p), "?") for p in cut],
        "collectives_per_step": {k: v for k, v in c.calls.items()},  # rank 0's
        "collectives_per_step_all_ranks": int(sum(g[0] for g in gathered).item()),
        "collective_input_bytes_all_ranks": int(sum(g[1] for g in gathered).item()),
        "bytes_sent_all_ranks": int(sum(g[2] for g in gathered).item()),
        # What the same gathers would send (fp32 both ways here) with every root on the rank holding most of it.
        "bytes_sent_largest_holder_roots": sum(
            2 * (p.numel() - max(p.placement.local_numel(r) for r in range(world))) * 4 for p in cut),
        "other_optimizer_collectives": {k: dict(v.calls) for k, v in counted.items() if k != type(structured).__name__},
        "step_time_median_s": statistics.median(times),
        "step_time_min_s": min(times),
        "total_step_time_median_s": statistics.median(totals),
        "steps_timed": len(times),
        "state_bytes_per_rank": [int(g[3].item()) for g in gathered],
        "padding_elements": padding,
        "_final": final,
    }


def _buffers(model):
    from fsdp_pass.tensor.ragged_tensor import bucket_of, is_sharded

    seen = {}
    for p in model.parameters():
        if is_sharded(p):
            try:
                buf, _ = bucket_of(p)
            except Exception:  # the "even" layout has no DBuffer
                continue
            seen.setdefault(id(buf), buf)
    return list(seen.values())


def _worker(rank: int, world: int, cfg: dict) -> list[dict]:
    """One rank's measurements of every optimizer and layout in ``cfg`` (its process group up)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("shard",))
    train = load_example()
    rows = []
    for optimizer in cfg["optimizers"]:
        reference = None
        for layout in cfg["layouts"]:
            row = measure(train, optimizer, layout, mesh, rank, world, cfg["warmup"], cfg["steps"])
            final = row.pop("_final")
            if reference is None:
                reference = final
            row["params_equal_to_first_layout"] = bool(torch.equal(final, reference))
            row["max_abs_param_diff_to_first_layout"] = float((final - reference).abs().max())
            rows.append(row)
    return rows


def run_world(world: int, cfg: dict, timeout: float) -> list[dict]:
    """Rank 0's rows of ``world`` ranks; exits with the failing rank's traceback or at the timeout."""
    try:
        return run_distributed(_worker, world, cfg, timeout=timeout, pg_timeout=300, pin_cores=True)[0]
    except RankFailed as error:
        raise SystemExit(f"rank {error.rank}:\n{error.details}") from None
    except TimeoutError as error:
        raise SystemExit(f"{world} ranks: {error}") from None


def kib(b: float) -> str:
    return f"{b / 1024:,.1f} KiB" if b else "0"


def print_table(rows: list[dict]) -> str:
    header = ("optimizer", "ranks", "layout", "cut/blocked", "collectives", "bytes sent", "(largest-holder roots)",
              "step ms", "× planned", "state/rank max:min", "bitwise")
    lines = []
    base = {}
    for r in rows:
        key = (r["optimizer"], r["world"])
        if r["layout"] == "planned":
            base[key] = r["step_time_median_s"]
        ratio = r["step_time_median_s"] / base[key] if key in base else float("nan")
        states = r["state_bytes_per_rank"]
        lines.append((
            r["optimizer"], str(r["world"]), r["layout"], f"{r['cut_params']}/{r['block_params']}",
            str(r["collectives_per_step_all_ranks"]), kib(r["bytes_sent_all_ranks"]),
            kib(r["bytes_sent_largest_holder_roots"]),
            f"{r['step_time_median_s'] * 1000:.1f}", f"{ratio:.2f}",
            f"{max(states) / 1024:,.0f}:{min(states) / 1024:,.0f} KiB",
            "yes" if r["params_equal_to_first_layout"] else f"no ({r['max_abs_param_diff_to_first_layout']:.1e})",
        ))
    widths = [max(len(h), *(len(l[i]) for l in lines)) for i, h in enumerate(header)]
    fmt = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"  # noqa: E731
    out = [fmt(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [fmt(l) for l in lines]
    text = "\n".join(out)
    print(text)
    return text


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[2])
    p.add_argument("--optimizers", nargs="+", default=list(OPTIMIZERS), choices=OPTIMIZERS)
    p.add_argument("--layouts", nargs="+", default=list(LAYOUTS), choices=LAYOUTS)
    p.add_argument("--warmup", type=int, default=2, help="untimed steps before the counted step")
    p.add_argument("--steps", type=int, default=15, help="timed steps (median)")
    p.add_argument("--timeout", type=float, default=900, help="seconds per world size")
    p.add_argument("--out", type=Path, default=RESULTS / "ablation.json")
    return p


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if args.layouts[0] != "planned":
        args.layouts = ["planned"] + [l for l in args.layouts if l != "planned"]
    cfg = {"optimizers": args.optimizers, "layouts": args.layouts, "warmup": args.warmup, "steps": args.steps}
    rows = []
    load_before = os.getloadavg()
    start = time.monotonic()
    for world in args.worlds:
        rows += run_world(world, cfg, args.timeout)
    load = os.getloadavg()
    table = print_table(rows)
    meta = {"cpus": len(os.sched_getaffinity(0)), "load_average_before": load_before, "load_average_after": load, "wall_s": time.monotonic() - start,
            "torch": torch.__version__, **cfg}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"settings": meta, "rows": rows, "table": table}, indent=1))
    print(f"load average (1/5/15 min) before: {' '.join(f'{x:.1f}' for x in load_before)}, after: "
          f"{' '.join(f'{x:.1f}' for x in load)}; wrote {args.out}")


if __name__ == "__main__":
    main()
