"""Bytes each rank receives from ranks inside its node and from other nodes, per training step, and
memory after forward, by ``reshard_after_forward`` (True, False, k).

``--world-size`` gloo ranks (default 4) stand for nodes of ``--node-size`` consecutive ranks (default
2: two "nodes" of 2). A llama (``--dim``, ``--layers``) is compiled with the vescale backend (aot_eager,
one bucket per layer: ``min_bucket_bytes=0``) for each setting; after ``--warmup`` steps one step is
profiled (``record_shapes``, ``profile_memory``). Every functional collective that ran in it is
counted from the profiler's records (its input's shape and dtype, its group size), and what a rank
receives is split by where the sending peer lives:

* all_gather of an input of b bytes over a group of g ranks: b from each of the g - 1 peers;
* reduce_scatter of an input of b bytes over g ranks: b / g from each of the g - 1 peers.

Groups are consecutive ranks (the shard dim, or a node group of ``reshard_after_forward=k``), so a
group of g <= node-size ranks lies inside a node and a larger one holds node-size - 1 peers inside the
rank's node. This is the data each rank must receive, not what a ring or tree algorithm forwards.

Memory (the profiler's CPU allocation records, per rank): "after forward" is what is allocated at the
end of the forward above the level at the start of the step (activations saved for backward, and the
gathered parameters kept); "step peak" is the step's highest level above that start. "kept, expected"
is what the setting promises per rank for the resharded buckets: nothing for True, each bucket / k
for k, each whole bucket for False (the last bucket of the graph stays gathered in every setting:
[Note: the last bucket stays gathered into backward]).

Run: ``python benchmarks/node_traffic.py [--world-size 4] [--node-size 2]``; prints a table, writes
``benchmarks/results/node_traffic.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import fsdp_pass  # noqa: E402
from fsdp_pass.buckets.dbuffer import buffers_of  # noqa: E402
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss  # noqa: E402
from fsdp_pass.testing.spawn import run_distributed  # noqa: E402
from _measure import scope_ns  # noqa: E402

STEP, FORWARD, BACKWARD = "node_traffic::step", "node_traffic::forward", "node_traffic::backward"
COLLECTIVES = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce")


def _received(name: str, nbytes: int, group: int, node: int) -> tuple[float, float]:
    """(bytes from peers inside this rank's node, bytes from other nodes) of one collective."""
    inside_peers = group - 1 if group <= node else node - 1
    across_peers = group - 1 - inside_peers
    per_peer = nbytes if name == "all_gather_into_tensor" else nbytes / group
    return inside_peers * per_peer, across_peers * per_peer


def _allocation_levels(prof) -> list[tuple[int, int]]:
    """(time ns, bytes allocated and not yet freed) after each CPU allocation or free while profiling."""
    from torch._C._profiler import _EventType

    levels, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            levels.append((e.start_time_ns, e.extra_fields.total_allocated))
    return sorted(levels)


def _under(event, scope: str) -> bool:
    """Whether the profiler event ran inside the record_function ``scope``."""
    while event is not None:
        if event.name == scope:
            return True
        event = event.cpu_parent
    return False


def _level_at(levels: list[tuple[int, int]], t: int) -> int:
    before = [total for when, total in levels if when <= t]
    return before[-1] if before else 0


def _measure(rank: int, world: int, cfg: dict) -> list[dict]:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))
    model_cfg = LlamaConfig(vocab=cfg["vocab"], dim=cfg["dim"], ffn=cfg["ffn"], layers=cfg["layers"],
                            heads=cfg["heads"], kv_heads=cfg["heads"], seq=cfg["seq"])
    rows = []
    for setting in cfg["settings"]:
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = init_std(Llama(model_cfg))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        compiled = torch.compile(model, backend="vescale", options={
            "mesh": mesh, "compiler": "aot_eager", "min_bucket_bytes": 0, "reshard_after_forward": setting})
        tokens = torch.randint(0, model_cfg.vocab, (cfg["batch"], model_cfg.seq),
                               generator=torch.Generator().manual_seed(rank))

        def step():
            with torch.profiler.record_function(FORWARD):
                loss = lm_loss(compiled(tokens), tokens)
            with torch.profiler.record_function(BACKWARD):
                loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)

        for _ in range(cfg["warmup"]):
            step()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], record_shapes=True,
                                    profile_memory=True) as prof:
            with torch.profiler.record_function(STEP):
                step()
        inside = {c: 0.0 for c in COLLECTIVES}
        across = {c: 0.0 for c in COLLECTIVES}
        backward_gather_across = 0.0
        forward_end = scope_ns(prof, FORWARD)[1]
        for e in prof.events():
            namespace, _, name = e.name.partition("::")
            if namespace != "_c10d_functional" or name not in COLLECTIVES:
                continue
            numel = 1
            for d in e.input_shapes[0]:
                numel *= d
            nbytes = numel * _element_size(e.input_dtypes[0])
            # (input, group_size, name) / (input, op, group_size, name); all_reduce: the HSDP replicas (none here)
            group = {"all_gather_into_tensor": e.concrete_inputs[1], "reduce_scatter_tensor": e.concrete_inputs[2]
                     }.get(name, world)
            i, a = _received(name, nbytes, group, cfg["node_size"])
            inside[name] += i
            across[name] += a
            if name == "all_gather_into_tensor" and _under(e, BACKWARD):
                backward_gather_across += a
        levels = _allocation_levels(prof)
        step_start, step_end = scope_ns(prof, STEP)
        start = _level_at(levels, step_start)
        peak = max([total for when, total in levels if step_start <= when <= step_end], default=start)
        buckets = buffers_of(model)
        bucket_bytes = [b.layout.shard_size * world * b.shard.element_size() for b in buckets]
        resharded = sum(bucket_bytes) - bucket_bytes[-1]  # the graph keeps its last bucket gathered
        kept = 0 if setting is True else resharded if setting is False else resharded / setting
        rows.append({"setting": str(setting), "all_gather_inside": inside["all_gather_into_tensor"],
                     "all_gather_across": across["all_gather_into_tensor"],
                     "backward_all_gather_across": backward_gather_across,
                     "reduce_scatter_inside": inside["reduce_scatter_tensor"],
                     "reduce_scatter_across": across["reduce_scatter_tensor"],
                     "after_forward": _level_at(levels, forward_end) - start, "step_peak": peak - start,
                     "kept_expected": kept, "buckets": len(buckets), "bucket_bytes": bucket_bytes})
    return rows


_ELEMENT_SIZES = {"float": 4, "c10::BFloat16": 2, "c10::Half": 2, "double": 8, "signed char": 1,
                  "unsigned char": 1, "int": 4, "long int": 8}


def _element_size(dtype_name: str) -> int:
    """Bytes per element of a profiler dtype name (its C++ scalar type)."""
    return _ELEMENT_SIZES[dtype_name]


def _mib(b: float) -> str:
    return f"{b / 2**20:8.3f}"


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=4)
    parser.add_argument("--node-size", type=int, default=2)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--ffn", type=int, default=768)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4, help="sequences per rank")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--out", default=str(HERE / "results" / "node_traffic.json"))
    return parser


def main() -> None:
    args = build_parser().parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    cfg = {k: getattr(args, k) for k in ("dim", "ffn", "layers", "heads", "vocab", "seq", "batch", "warmup")}
    cfg.update(node_size=args.node_size, settings=[True, args.node_size, False])
    per_rank = run_distributed(_measure, args.world_size, cfg, timeout=1800)
    print(f"gloo, {args.world_size} ranks in nodes of {args.node_size}; llama dim={args.dim} layers={args.layers}; "
          f"one step, rank 0 (MiB received; memory above the step's start)")
    header = (f"{'reshard_after_forward':>21} | {'AG inside':>9} | {'AG across':>9} | {'of it bwd':>9} | {'RS inside':>9} | "
              f"{'RS across':>9} | {'after fwd':>9} | {'kept, expected':>14} | {'step peak':>9}")
    print(header)
    print("-" * len(header))
    for row in per_rank[0]:
        print(f"{row['setting']:>21} | {_mib(row['all_gather_inside']):>9} | {_mib(row['all_gather_across']):>9} | "
              f"{_mib(row['backward_all_gather_across']):>9} | "
              f"{_mib(row['reduce_scatter_inside']):>9} | {_mib(row['reduce_scatter_across']):>9} | "
              f"{_mib(row['after_forward']):>9} | {_mib(row['kept_expected']):>14} | {_mib(row['step_peak']):>9}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"backend": "gloo", "world_size": args.world_size, "node_size": args.node_size,
                                          "config": {k: v for k, v in cfg.items() if k != "settings"},
                                          "date": time.strftime("%Y-%m-%d %H:%M:%S"), "per_rank": per_rank}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
