"""Two nodes over a real, slow link: step time and the bytes that cross between the nodes, per system and
link rate, beside the cost model's prediction.

A node lab ([Note: a node lab] in fsdp_pass/testing/node_lab.py; needs root and iproute2) makes 2 nodes
(network namespaces) of ``--ranks-per-node`` gloo ranks each, joined by veth links shaped with ``tc``'s
token bucket to each ``--rates`` Mbit/s in turn (both directions, per node; no added delay: this kernel
has no ``netem``). Inside a node the ranks talk over its loopback. Every system is built once in the same
ranks and measured round robin ([Note: round robin in the same processes] in _round_robin.py), all rates
in the same processes: for each rate, ``--rounds`` rounds of ``--steps`` timed steps per system.

Per system and rate: the step time (per round the fastest step, its slowest rank; the median over
rounds), and the bytes that crossed between the nodes per step, from the kernel's counters of each node's
veth (``tx_bytes`` of both nodes over a slice's timed steps, frames with their TCP/IP headers; the slice's
barriers add a few hundred bytes). The prediction is the cost model's
(``PlanSummary.bytes_between_nodes``, [Note: ring collectives across nodes] in fsdp_pass/plan/report.py),
for the same setting and node size, with gloo's reduce-scatter as an all-reduce, on the buckets each
system gathers: the ones fsdp_pass's compile made (rank 0's, after warm-up), FSDP2's groups (a block
each, the root's kept from forward into backward), the planner's for SimpleFSDP.

Run (root): ``python benchmarks/node_link.py [--rates 100 400 1600] [--systems a,b,...]``; prints a
table, writes ``benchmarks/results/node_link.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import torch  # noqa: E402

import _round_robin as RR  # noqa: E402
from _systems import SYSTEMS, barrier, simplefsdp_import_error  # noqa: E402
from fsdp_pass.buckets.dbuffer import buffers_of  # noqa: E402
from fsdp_pass.plan.report import BucketStats, PlanSummary, bucket_stats, plan_model  # noqa: E402
from fsdp_pass.testing.models import Llama, LlamaConfig  # noqa: E402
from fsdp_pass.testing.node_lab import NodeLab, unavailable  # noqa: E402
from fsdp_pass.testing.spawn import run_distributed  # noqa: E402

# Link-bound at 100 Mbit/s (about 20 MB cross per step with the default), compute-bound near 1600.
MODEL = LlamaConfig(vocab=2048, dim=128, layers=2, heads=4, kv_heads=2, ffn=352, seq=128, tie_embeddings=False)
SYSTEM_KEYS = ["fsdp_pass_inductor", "fsdp_pass_inductor_reshard2", "fsdp_pass_inductor_quantized",
               "fsdp_pass_inductor_reshard2_quantized", "fsdp_pass_inductor_reshard2_quantized_fp8",
               "fsdp2", "fsdp2_reshard2", "fsdp2_compile", "simplefsdp"]
QUANTIZED_BLOCK = 128  # options["quantized_reduce"]=True's block


def _setting(key: str) -> dict:
    """The cost model's view of a system's options: its resharding, int8 reduction, FP8 gathers and levels."""
    system = SYSTEMS[key]
    options = system.fsdp_pass or {}
    return {"reshard_after_forward": options.get("reshard_after_forward", system.fsdp2_reshard),
            "fp8": bool(options.get("fp8_all_gather")),
            "quantized_reduce_block": QUANTIZED_BLOCK if options.get("quantized_reduce") else None,
            # fsdp_pass gathers and reduces in two levels across the nodes; the others in one ring
            "two_level": system.fsdp_pass is not None}


def _fsdp2_groups(world: int) -> tuple[BucketStats, ...]:
    """FSDP2's parameter groups as buckets: one per block, then the root's (embeddings, final norm, output),
    which FSDP2 keeps gathered from forward into backward (the cost model keeps the last bucket)."""
    model = Llama(MODEL)
    groups = [[(n, p) for n, p in block.named_parameters()] for block in model.layers]
    in_blocks = {id(p) for g in groups for _, p in g}
    groups.append([(n, p) for n, p in model.named_parameters() if id(p) not in in_blocks])
    # fully_shard pads each parameter's dim 0 to a multiple of the ranks
    shard = [sum(-(-p.shape[0] // world) * p[0].numel() for _, p in g) for g in groups]
    return tuple(BucketStats((g[0][0],), len(g), sum(p.numel() for _, p in g), s, world, 4, True)
                 for g, s in zip(groups, shard))


def predicted_bytes(key: str, world: int, node_size: int, buckets: list[BucketStats] | None) -> int:
    """The cost model's bytes between the nodes per step for system ``key`` (fp32 parameters and gradients):
    on the buckets the system's compile made (fsdp_pass), FSDP2's groups, or the planner's buckets."""
    setting = _setting(key)
    if buckets is None and key.startswith("fsdp2"):
        buckets = _fsdp2_groups(world)
    if buckets is None:  # SimpleFSDP: the planner's buckets (one per module unit, as its bucket plans)
        plan = plan_model(Llama(MODEL), (world,), name="benchmark llama", param_dtype=torch.float32,
                          node_size=node_size, **setting)
    else:
        plan = PlanSummary("benchmark llama", (world,), torch.float32, torch.float32, "adamw", 0, None,
                           setting["reshard_after_forward"], tuple(buckets), 0, 0.0, fp8=setting["fp8"],
                           node_size=node_size, quantized_reduce_block=setting["quantized_reduce_block"],
                           two_level=setting["two_level"])
    return plan.bytes_between_nodes(reduce_scatter_as_all_reduce=True)["total"]


def _worker(rank: int, world: int, tags: list[str], args: dict) -> dict:
    lab: NodeLab = args["lab"]
    per_node = world // lab.nodes
    node = rank // per_node

    def sent() -> float:  # this node's link, read by its first rank (the others count nothing: no double count)
        return float(lab.sent_from_here(node)) if rank % per_node == 0 else 0.0

    runs, out = RR.build(rank, world, tags, args)
    buckets = {tag: [bucket_stats(b, (b.names[0],)) for b in buffers_of(run.model)]
               for tag, run in runs.items() if run.system.fsdp_pass is not None}
    index, per_rate = args["warmup"], {}
    for rate in args["rates"]:
        if rank == 0:
            lab.set_rate(rate)
        barrier()
        for tag in tags:
            out[tag]["rounds"], out[tag]["metered"] = [], []
        index = RR.rounds(runs, out, args, index, meter=sent)
        per_rate[rate] = {tag: {"rounds": out[tag]["rounds"], "metered": out[tag]["metered"]} for tag in tags}
    return {"per_rate": per_rate, "buckets": buckets, "compile_s": {t: out[t]["compile_s"] for t in tags},
            "notes": {t: out[t]["notes"] for t in tags}, "losses": {t: r.losses for t, r in runs.items()}}


def summarize(ranks: list[dict], tags: list[str], rates: list[float], steps: int, predictions: dict) -> list[dict]:
    rows = []
    for rate in rates:
        per_tag = [{tag: r["per_rate"][rate][tag] for tag in tags} for r in ranks]
        for tag in tags:
            round_s = RR.round_times(per_tag, tag)
            crossed = [sum(r[tag]["metered"][i] for r in per_tag) / steps for i in range(len(round_s))]
            rows.append({"rate_mbit": rate, "tag": tag, "label": SYSTEMS[tag].label, "round_s": round_s,
                         "median_s": statistics.median(round_s), "bytes_per_step": statistics.median(crossed),
                         "bytes_per_round": crossed, "predicted_bytes": predictions[tag]})
    return rows


def table(rows: list[dict], reference: str, best_of: list[str]) -> str:
    lines = [f"| link Mbit/s | system | step ms (median of rounds) | x {reference} | x best FSDP2 | MB across/step "
             f"| predicted MB | measured / predicted |", "|---|---|---|---|---|---|---|---|"]
    for rate in sorted({r["rate_mbit"] for r in rows}):
        at = {r["tag"]: r for r in rows if r["rate_mbit"] == rate}
        best = min((at[t] for t in best_of if t in at), key=lambda r: r["median_s"], default=None)
        for tag, r in at.items():
            ref = at[reference]
            vs_best = "-" if best is None else f"{r['median_s'] / best['median_s']:.2f}"
            lines.append(
                f"| {rate:g} | {r['label']} | {1e3 * r['median_s']:.0f} | "
                f"{r['median_s'] / ref['median_s']:.2f} | {vs_best} | "
                f"{r['bytes_per_step'] / 1e6:.2f} | {r['predicted_bytes'] / 1e6:.2f} | "
                f"{r['bytes_per_step'] / r['predicted_bytes']:.3f} |")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rates", type=float, nargs="+", default=[100, 400, 1600], help="link rates, Mbit/s")
    ap.add_argument("--systems", default=",".join(SYSTEM_KEYS), help="comma-separated keys of _systems.SYSTEMS")
    ap.add_argument("--ranks-per-node", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4, help="sequences per rank")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="timed steps per system per round")
    ap.add_argument("--timeout", type=float, default=3600)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "node_link.json")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"node_link: {reason}")
        return 1
    tags = [t for t in a.systems.split(",") if t]
    if "simplefsdp" in tags and simplefsdp_import_error():
        print(f"skipping SimpleFSDP: {simplefsdp_import_error()}")
        tags.remove("simplefsdp")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    world = 2 * a.ranks_per_node
    load_before, t0 = os.getloadavg(), time.time()
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=HERE).stdout.strip()
    args = {"cfg": MODEL, "batch": a.batch, "warmup": a.warmup, "rounds": a.rounds, "steps": a.steps,
            "rates": a.rates}
    with NodeLab(2, a.rates[0]) as lab:
        ranks = run_distributed(_worker, world, tags, {**args, "lab": lab}, timeout=a.timeout, pg_timeout=600,
                                pin_cores=True, lab=lab)
    predictions = {t: predicted_bytes(t, world, a.ranks_per_node, ranks[0]["buckets"].get(t)) for t in tags}
    rows = summarize(ranks, tags, a.rates, a.steps, predictions)
    best_fsdp2 = [t for t in ("fsdp2", "fsdp2_reshard2") if t in tags]
    print(table(rows, tags[0], best_fsdp2))
    meta = {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "commit": commit, "loadavg_before": load_before,
            "loadavg_after": os.getloadavg(), "total_s": time.time() - t0, "cpus": os.cpu_count(),
            "world_size": world, "ranks_per_node": a.ranks_per_node, "model": MODEL.__dict__, "batch": a.batch,
            "rounds": a.rounds, "steps": a.steps, "torch": torch.__version__,
            "compile_s": ranks[0]["compile_s"], "notes": ranks[0]["notes"], "losses_rank0": ranks[0]["losses"]}
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps({**meta, "rows": rows}, indent=1, default=str))
    print(f"load average {load_before[0]:.1f} before, {os.getloadavg()[0]:.1f} after; {time.time() - t0:.0f} s; "
          f"wrote {a.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
