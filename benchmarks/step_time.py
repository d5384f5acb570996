"""Step time, memory, FSDP copies and communication overlap: fsdp_pass against its peers, on CPU/gloo.

One invocation runs, on the same model, data and per-rank batch, every system in ``_systems.SYSTEMS``:

* ``single``       one process, no communication, ``torch.compile`` (inductor), plain AdamW: the compute
                   floor for one rank's batch (it also steps the optimizer over all parameters);
* ``ddp``          DistributedDataParallel (eager);
* ``fsdp2``        ``fully_shard`` per transformer block + root on ``init_device_mesh("cpu", (world,))``;
* ``fsdp2_compile`` the same, each block ``.compile()``d (inductor; FSDP2's hooks stay eager);
* ``simplefsdp``   torchtitan's SimpleFSDP ``data_parallel(mode="fully_shard")``, compiled fullgraph with
                   inductor and torchtitan's JIT ``transformer_block_bucketing`` pass, reshard after forward
                   (skipped, with the reason printed, when torchtitan does not import);
* ``fsdp_pass_*``  ``torch.compile(model, backend="vescale")`` with ``compiler`` aot_eager / inductor,
                   overlap on (``prefetch=1``) / off (``prefetch=0``), and the step-boundary settings.

By default every system runs round robin in the same two rank processes: all built and warmed up
(compile time is reported, not counted), then ``--rounds`` rounds in which each system runs one untimed
and ``--steps`` timed steps in turn; systems are compared by the ratio of their times within each round
([Note: round robin in the same processes] in ``_round_robin.py``). Ranks are pinned to their own cores
(round robin) with one thread; ``--nice -10`` (as root) puts them ahead of other work.

With ``--sequential`` each system runs in fresh processes (``fsdp_pass.testing.spawn``: spawn, gloo,
``file://`` init, 120 s process-group timeout): warm-up steps, then measured steps (forward + backward
+ AdamW step + zero_grad), then one profiled step (memory, copies, overlap).

    python benchmarks/step_time.py [--model llama|moe] [--world-size 2] [--rounds 15] [--steps 3] [--warmup 3]
                                   [--systems single,fsdp2,fsdp_pass_inductor] [--twin KEY] [--nice -10] [--quick]
    python benchmarks/step_time.py --sequential [--repeat 2] [--steps 10]
    python benchmarks/step_time.py --bucket-sweep [--model llama]

Writes ``benchmarks/results/step_time[_<model>].json`` and ``.md`` (and, with ``--sequential``, a ``.png``
chart: matplotlib, the ``bench`` extra). With ``--sequential`` it also prints every collective of the
profiled fsdp_pass step: transfer, hidden and exposed time, wait. ``--bucket-sweep`` runs only fsdp_pass
(Inductor, overlap on) at bucket granularities from the whole model to quarter units and reports exposed
communication per setting (``benchmarks/results/bucket_sweep[_<model>].json``). How each number is
measured: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pools (children inherit it)

import argparse
import dataclasses
import fnmatch
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import fsdp_pass  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

from _measure import add_peer_lateness, first_and_last  # noqa: E402
import _round_robin as RR  # noqa: E402
from _systems import SYSTEMS, simplefsdp_import_error  # noqa: E402
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std  # noqa: E402
from fsdp_pass.testing.spawn import RankFailed, run_distributed  # noqa: E402

# The MoE keeps its experts as three stacked 3-D parameters, computed by batched products.
_MOE = dict(stacked_experts=True, batched_experts=True)
# Sizes chosen so that one run of every system (compile included) fits in about 10 minutes on two
# loaded cores; ``--quick`` is for checking that everything runs.
CONFIGS = {
    "llama": LlamaConfig(vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, ffn=704, seq=128, tie_embeddings=False),
    "moe": LlamaConfig(vocab=4096, dim=256, layers=4, heads=8, kv_heads=4, ffn=256, seq=128, experts=4, top_k=2,
                       tie_embeddings=False, **_MOE),
}
QUICK_CONFIGS = {
    "llama": LlamaConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=176, seq=32, tie_embeddings=False),
    "moe": LlamaConfig(vocab=512, dim=64, layers=2, heads=4, kv_heads=2, ffn=64, seq=32, experts=4, top_k=2,
                       tie_embeddings=False, **_MOE),
}

PER_RANK_BATCH = {"llama": 4, "moe": 4}
QUICK_BATCH = 2
SIMPLEFSDP_INSTALL = "pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 && pip install tyro"

# Project goals for fsdp_pass's default (Inductor); step-time ratios are medians of per-round ratios in a
# round-robin run.
GOALS = {
    "step_vs_fsdp2": 0.80,
    "step_vs_simplefsdp": 0.90,
    "copy_bytes": 0,
    "memory_vs_fsdp2": 0.80,
    "step_vs_floor": 1.25,
}
OURS = "fsdp_pass_inductor"


# ----------------------------------------------------------------------------------------------------
# Worker (one rank of one system)
# ----------------------------------------------------------------------------------------------------


def _compiler_warmup() -> None:
    """Compile and run a tiny function with inductor (forward + backward) in every process, before the
    memory baseline, so the compiler's one-time memory (imports, caches, C++ toolchain state) is not
    charged to the systems that compile."""
    lin = torch.nn.Linear(8, 8)
    f = torch.compile(lambda x: torch.nn.functional.silu(lin(x)).sum())
    f(torch.randn(4, 8)).backward()
    torch._dynamo.reset()


def _worker(rank: int, world: int, key: str, args: dict) -> dict:
    """One rank of system ``key`` (in a spawned process, its process group up): its measurements."""
    import _measure as M
    from _systems import Training, barrier, fsdp_pass_graphs

    system = SYSTEMS[key]
    if args.get("options"):  # --bucket-sweep: this run's fsdp_pass options over the system's own
        system = dataclasses.replace(system, fsdp_pass={**system.fsdp_pass, **args["options"]})
    if system.inductor:
        torch._inductor.config.cpp.enable_kernel_profile = True  # kernels show up in the profiler
    _compiler_warmup()
    M.trim()
    rss0 = M.rss_bytes()

    cfg = (QUICK_CONFIGS if args["quick"] else CONFIGS)[args["model"]]
    model = init_std(Llama(cfg))
    n_params = sum(p.numel() for p in model.parameters())
    graphs: dict = {}
    training = Training(system, model, world, rank, args["batch"], lambda name, gm: graphs.__setitem__(name, gm))
    model, notes, losses = training.model, training.notes, training.losses
    phases: list[tuple[float, float, float]] = []

    def step(i: int) -> None:
        phases.append(training.step(i))

    t0 = time.perf_counter()
    step(0)
    compile_s = time.perf_counter() - t0
    warm_times = []
    for i in range(1, args["warmup"]):
        t0 = time.perf_counter()
        step(i)
        warm_times.append(time.perf_counter() - t0)

    M.trim()
    barrier()
    M.reset_peak_rss()
    times = []
    del phases[:]
    for i in range(args["steps"]):
        t0 = time.perf_counter()
        step(args["warmup"] + i)
        times.append(time.perf_counter() - t0)
    peak_rss = M.peak_rss_bytes() - rss0
    timed_phases = list(phases)

    # Two profiled steps; the second is analysed (memory, copies, overlap). Profiling from one step
    # earlier means tensors that step leaves behind (gradients freed lazily, ...) are tracked by
    # the allocator records, so their release during the analysed step is seen too.
    from torch.profiler import ProfilerActivity, profile, record_function

    M.trim()
    barrier()
    n = args["warmup"] + args["steps"]
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        step(n)
        persistent = M.live_tensor_bytes()
        if key == "ddp":  # the reducer's flat gradient buckets live in C++, out of the Python walk
            persistent += sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
        barrier()
        with record_function(M.STEP_SCOPE):
            t0 = time.perf_counter()
            step(n + 1)
            profiled_s = time.perf_counter() - t0
    events = prof.events()
    window = M.step_window(events)
    main_tid = next(e.thread for e in events if e.name == M.STEP_SCOPE)
    prof_stats = M.analyze_profile(events, main_tid, window)
    transient = M.in_step_peak_bytes(prof)

    graph_copies = {"bytes": 0, "ops": {}}
    if system.compiled_fsdp:
        if system.fsdp_pass is not None:
            graphs.update(fsdp_pass_graphs())
            from fsdp_pass.compile.backend import records

            notes["buckets"] = [repr(b) for rec in records() for b in rec.buffers]
        for name, gm in graphs.items():
            g = M.graph_copy_bytes(gm, inductor=system.inductor)
            graph_copies["bytes"] += g["bytes"]
            for k, v in g["ops"].items():
                graph_copies["ops"][k] = graph_copies["ops"].get(k, 0) + v
        graph_copies["graphs"] = sorted(graphs)
        if args.get("dump") and rank == 0:
            os.makedirs(args["dump"], exist_ok=True)
            for name, gm in graphs.items():
                Path(args["dump"], f"{key}_{name}.txt").write_text(
                    gm.print_readable(print_output=False, include_stride=False, include_device=False))

    return {
        "rank": rank,
        "params": n_params,
        "compile_s": compile_s,
        "warmup_s": warm_times,
        "times_s": times,
        "phases_s": timed_phases,
        "profiled_step_s": profiled_s,
        "losses": losses,
        "peak_rss_bytes": peak_rss,
        "rss_baseline_bytes": rss0,
        "persistent_tensor_bytes": persistent,
        "in_step_peak_bytes": transient,
        "graph_copies": graph_copies,
        "notes": notes,
        **prof_stats,
    }


def run_system(key: str, args: dict, timeout_s: float) -> dict:
    system = SYSTEMS[key]
    world = args["world_size"] if system.distributed else 1
    t0 = time.time()
    try:
        results = run_distributed(_worker, world, key, args, timeout=timeout_s, pg_timeout=120,
                                  backend="gloo" if system.distributed else None, pin_cores=True, nice=args["nice"])
    except (RankFailed, TimeoutError) as error:
        msg = error.details if isinstance(error, RankFailed) else str(error)
        return {"key": key, "label": system.label, "error": msg.strip().splitlines()[-1] if msg else "failed",
                "traceback": msg, "wall_s": time.time() - t0}
    return summarize(key, results, time.time() - t0)


def summarize(key: str, ranks: list[dict], wall: float) -> dict:
    system = SYSTEMS[key]
    # Step i's time is the slowest rank's (ranks wait for each other in the collectives anyway).
    times = [max(r["times_s"][i] for r in ranks) for i in range(len(ranks[0]["times_s"]))]
    q = statistics.quantiles(times, n=10, method="inclusive") if len(times) >= 2 else [times[0]] * 9
    r0 = ranks[0]
    phase_ms = {name: 1e3 * statistics.median(max(r["phases_s"][i][j] for r in ranks) for i in range(len(times)))
                for j, name in enumerate(("forward", "backward", "optimizer"))}
    copy_bytes = max(r["runtime_copy_bytes"] + r["graph_copies"]["bytes"] for r in ranks)
    add_peer_lateness([r["collectives"] for r in ranks])
    comm = max(r["comm_ms"] for r in ranks)
    hidden = min(r["comm_hidden_ms"] for r in ranks)
    return {
        "key": key,
        "label": system.label,
        "ranks": len(ranks),
        "params": r0["params"],
        "median_s": statistics.median(times),
        "p10_s": q[0],
        "p90_s": q[-1],
        "min_s": min(times),
        "max_s": max(times),
        "times_s": times,
        "compile_s": max(r["compile_s"] for r in ranks),
        "profiled_step_s": max(r["profiled_step_s"] for r in ranks),
        "peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
        "persistent_tensor_bytes": max(r["persistent_tensor_bytes"] for r in ranks),
        "in_step_peak_bytes": max(r["in_step_peak_bytes"] for r in ranks),
        "peak_tensor_bytes": max(r["persistent_tensor_bytes"] + r["in_step_peak_bytes"] for r in ranks),
        "copy_bytes": copy_bytes,
        "runtime_copy_bytes": max(r["runtime_copy_bytes"] for r in ranks),
        "runtime_copy_ms": max(r["runtime_copy_ms"] for r in ranks),
        "runtime_copy_ops": r0["runtime_copy_ops"],
        "graph_copy_bytes": max(r["graph_copies"]["bytes"] for r in ranks),
        "graph_copy_ops": r0["graph_copies"]["ops"],
        "comm_internal_copy_bytes": max(r["comm_internal_copy_bytes"] for r in ranks),
        "comm_ms": comm,
        "comm_hidden_ms": hidden,
        "hidden_fraction": (hidden / comm) if comm > 0 else None,
        "compute_ms": max(r["compute_ms"] for r in ranks),
        "collectives": [r["collectives"] for r in ranks],  # per rank, in issue order
        "phase_ms": phase_ms,  # timed steps: median over steps of the slowest rank
        "profiled_phase_ms": {k: max(r["phase_ms"][k] for r in ranks) for k in r0["phase_ms"]},
        "losses_rank0": r0["losses"],
        "notes": r0["notes"],
        "wall_s": wall,
    }


def merge_repeats(rows: list[dict]) -> dict:
    """One row from ``--repeat`` runs of a system: step times pooled, everything else from the first run."""
    ok = [r for r in rows if "error" not in r]
    if not ok:
        return rows[0]
    merged = dict(ok[0])
    if len(ok) > 1:
        times = [t for r in ok for t in r["times_s"]]
        q = statistics.quantiles(times, n=10, method="inclusive")
        merged.update(times_s=times, median_s=statistics.median(times), p10_s=q[0], p90_s=q[-1],
                      min_s=min(times), max_s=max(times), repeat_medians_s=[r["median_s"] for r in ok],
                      wall_s=sum(r["wall_s"] for r in ok))
        merged["phase_ms"] = {k: statistics.median(r["phase_ms"][k] for r in ok) for k in ok[0]["phase_ms"]}
    merged["repeats"] = len(ok)
    return merged


# ----------------------------------------------------------------------------------------------------
# Report
# ----------------------------------------------------------------------------------------------------


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def table(rows: list[dict]) -> str:
    ref = next((r for r in rows if r["key"] == "fsdp2" and "error" not in r), None)
    head = ("system", "median ms", "p10-p90 ms", "x FSDP2", "peak tensor MiB", "peak RSS MiB",
            "FSDP copy MiB/step", "comm ms", "hidden", "compile s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['label']} | failed: {r['error'][:80]} |" + " |" * (len(head) - 2))
            continue
        ratio = f"{r['median_s'] / ref['median_s']:.2f}" if ref else "-"
        hid = f"{100 * r['hidden_fraction']:.0f}%" if r["hidden_fraction"] is not None else "-"
        lines.append(
            f"| {r['label']} | {1e3 * r['median_s']:.0f} | {1e3 * r['p10_s']:.0f}-{1e3 * r['p90_s']:.0f} | {ratio} "
            f"| {_mib(r['peak_tensor_bytes'])} | {_mib(r['peak_rss_bytes'])} | {_mib(r['copy_bytes'])} "
            f"| {r['comm_ms']:.1f} | {hid} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


def goals(rows: list[dict], step_ratio: Callable[[dict, dict], float]) -> list[dict]:
    """The project goals for OURS's row; ``step_ratio(a, b)``: row a's step time over row b's (a median of
    per-round ratios in a round-robin run). Memory and copies where the rows measured them (sequential runs)."""
    by = {r["key"]: r for r in rows if "error" not in r and "#" not in r.get("tag", "")}
    ours = by.get(OURS)
    out = []

    def add(goal: str, key: str, value, detail=""):
        """``goal`` names its target ``{t}``: ``GOALS[key]``, met when ``value`` is at most that."""
        target = GOALS[key]
        status = "n/a" if value is None else ("PASS" if value <= target else "MISS")
        out.append({"goal": goal.format(t=target), "measured": value, "target": target, "status": status,
                    "detail": detail})

    if ours is None:
        return [{"goal": "all", "status": "n/a", "detail": f"{OURS} did not run"}]
    f2, sf, floor = by.get("fsdp2"), by.get("simplefsdp"), by.get("single")
    add("step time <= {t}x FSDP2 eager", "step_vs_fsdp2", step_ratio(ours, f2) if f2 else None)
    add("step time <= {t}x SimpleFSDP", "step_vs_simplefsdp", step_ratio(ours, sf) if sf else None,
        "" if sf else "SimpleFSDP did not run")
    if "copy_bytes" in ours:
        add("FSDP copy bytes per step = {t}", "copy_bytes", ours["copy_bytes"])
        add("peak per-rank memory <= {t}x FSDP2 (tensor)", "memory_vs_fsdp2",
            ours["peak_tensor_bytes"] / f2["peak_tensor_bytes"] if f2 else None)
        add("peak per-rank memory <= {t}x FSDP2 (RSS)", "memory_vs_fsdp2",
            ours["peak_rss_bytes"] / f2["peak_rss_bytes"] if f2 else None)
    add("step time <= {t}x single-process floor", "step_vs_floor", step_ratio(ours, floor) if floor else None)
    return out


def goal_lines(g: list[dict]) -> str:
    """The goals, one line each, for the terminal."""
    lines = []
    for item in g:
        m = item.get("measured")
        ms = f"{m:.3f}" if isinstance(m, float) else str(m)
        lines.append(f"  {item['status']:4s}  {item['goal']}: measured {ms} (target {item.get('target')}) "
                     f"{item.get('detail', '')}")
    return "\n".join(lines)


def goal_table(g: list[dict]) -> str:
    """The goals as a markdown table."""
    lines = ["| goal (fsdp_pass default, Inductor) | measured | target | status |", "|---|---|---|---|"]
    for item in g:
        m = item.get("measured")
        ms = f"{m:.3f}" if isinstance(m, float) else (f"{m / 2**20:.2f} MiB" if isinstance(m, int) else "-")
        lines.append(f"| {item['goal']} | {ms} | {item.get('target', '-')} | {item['status']} {item.get('detail', '')} |")
    return "\n".join(lines)


def breakdown(r: dict, floor: dict | None) -> dict:
    """Where a system's step goes, as far as measured.

    From the timed steps: the step and the compute floor (the single-process step). From the profiled
    step (slower, the profiler's overhead): forward / backward / optimizer phases, communication
    exposed (not overlapped with an operator on the training thread) and the time of the data-parallel
    copies the profiler sees. ``rest`` = step - floor - exposed comm - copies: Python and dispatch
    overhead, the optimizer's difference, waiting for the other rank, ..."""
    step = r["median_s"] * 1e3
    compute = floor["median_s"] * 1e3 if floor else None
    exposed = r["comm_ms"] - r["comm_hidden_ms"]
    copies = r["runtime_copy_ms"]
    rest = step - compute - exposed - copies if compute is not None else None
    return {"step_ms": step, "compute_floor_ms": compute, "exposed_comm_ms": exposed,
            "runtime_copy_ms": copies, "rest_ms": rest, "profiled_step_ms": 1e3 * r["profiled_step_s"],
            "phase_ms": r["phase_ms"], "profiled_phase_ms": r["profiled_phase_ms"]}


def breakdown_table(bd: dict, rows: list[dict]) -> str:
    head = ("system", "step ms", "floor ms", "exposed comm ms", "DP copies ms", "rest ms",
            "fwd / bwd / optim ms", "comm ms (hidden)", "comm-internal copies MiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    by = {r["key"]: r for r in rows}
    for k, b in bd.items():
        r = by[k]
        ph = b["phase_ms"]
        rest = f"{b['rest_ms']:.0f}" if b["rest_ms"] is not None else "-"
        floor = f"{b['compute_floor_ms']:.0f}" if b["compute_floor_ms"] is not None else "-"
        hid = f"{100 * r['hidden_fraction']:.0f}%" if r["hidden_fraction"] is not None else "-"
        lines.append(f"| {r['label']} | {b['step_ms']:.0f} | {floor} | {b['exposed_comm_ms']:.0f} "
                     f"| {b['runtime_copy_ms']:.1f} | {rest} "
                     f"| {ph['forward']:.0f} / {ph['backward']:.0f} / {ph['optimizer']:.0f} "
                     f"| {r['comm_ms']:.0f} ({hid}) | {_mib(r['comm_internal_copy_bytes'])} |")
    return "\n".join(lines)


def _ms(v) -> str:
    return "-" if v is None else f"{v:.1f}"


def collectives_table(collectives: list[dict]) -> str:
    """One rank's collectives in issue order (``_measure.per_collective``), then the first all-gather of
    the forward and the last reduce-scatter of the backward."""
    head = ("collective", "phase", "MiB", "issued at ms", "issue call ms", "issue-to-wait ms", "transfer ms",
            "hidden ms", "exposed ms", "hidden", "wait ms", "peer late ms")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for c in collectives:
        share = f"{100 * c['hidden_ms'] / c['transfer_ms']:.0f}%" if c["transfer_ms"] else "-"
        lines.append(f"| {c['name']} | {c['phase'] or '-'} | {_mib(c['bytes'])} | {c['issue_ms']:.1f} "
                     f"| {c['call_ms']:.1f} | {_ms(c['window_ms'])} | {_ms(c['transfer_ms'])} | {_ms(c['hidden_ms'])} "
                     f"| {_ms(c['exposed_ms'])} | {share} | {_ms(c['wait_ms'])} | {_ms(c.get('peer_late_ms'))} |")
    ends = first_and_last(collectives)
    lines.append(f"\nfirst all-gather of the forward ({ends['first_ag']}): {_ms(ends['first_ag_exposed_ms'])} ms "
                 f"exposed; last reduce-scatter of the backward ({ends['last_rs']}): "
                 f"{_ms(ends['last_rs_exposed_ms'])} ms exposed")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed (pip install -e '.[bench]'): no chart")
        return False
    ok = [r for r in rows if "error" not in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 5.5))
    labels = [r["label"].replace(", ", "\n").replace(" (", "\n(") for r in ok]
    colors = ["#1f77b4" if r["key"].startswith("fsdp_pass") else "#7f7f7f" for r in ok]
    med = [1e3 * r["median_s"] for r in ok]
    lo = [1e3 * (r["median_s"] - r["p10_s"]) for r in ok]
    hi = [1e3 * (r["p90_s"] - r["median_s"]) for r in ok]
    ax = axes[0]
    ax.barh(range(len(ok)), med, xerr=[lo, hi], color=colors, capsize=3)
    ax.set_yticks(range(len(ok)), labels, fontsize=7)
    ax.invert_yaxis()
    ref = next((r for r in ok if r["key"] == "fsdp2"), None)
    if ref:
        ax.axvline(1e3 * ref["median_s"], color="k", ls="--", lw=0.8, label="FSDP2 eager")
        goal = GOALS["step_vs_fsdp2"]
        ax.axvline(goal * 1e3 * ref["median_s"], color="g", ls=":", lw=0.8, label=f"{goal}x FSDP2 (goal)")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.11), ncol=2, frameon=False)
    ax.set_xlabel("step time, ms (median, p10-p90)")
    ax = axes[1]
    ax.barh(range(len(ok)), [r["peak_tensor_bytes"] / 2**20 for r in ok], color=colors, label="tensor")
    ax.scatter([r["peak_rss_bytes"] / 2**20 for r in ok], range(len(ok)), color="k", marker="x", label="RSS", zorder=3)
    ax.set_yticks(range(len(ok)), [""] * len(ok))
    ax.invert_yaxis()
    ax.set_xlabel("peak per-rank memory, MiB (bar: tensors, x: RSS)")
    ax.legend(fontsize=7)
    ax = axes[2]
    ax.barh(range(len(ok)), [r["copy_bytes"] / 2**20 for r in ok], color=colors)
    ax.set_yticks(range(len(ok)), [""] * len(ok))
    ax.invert_yaxis()
    ax.set_xlabel("FSDP/DDP copy bytes per step, MiB")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def select(spec: str | None) -> list[str]:
    if not spec:
        return list(SYSTEMS)
    keys = []
    for pat in spec.split(","):
        hits = [k for k in SYSTEMS if fnmatch.fnmatch(k, pat.strip())]
        if not hits:
            raise SystemExit(f"unknown system {pat!r}; choose from {', '.join(SYSTEMS)}")
        keys += [k for k in hits if k not in keys]
    return keys


def report_run(tag: str, row: dict, t0: float) -> None:
    """One progress line for a finished run (``t0``: when it started), or its error and traceback."""
    if "error" in row:
        print(f"  {tag:32s} FAILED after {time.time() - t0:.0f} s: {row['error']}")
        print("    " + row["traceback"].strip().replace("\n", "\n    ")[-3000:])
    else:
        print(f"  {tag:32s} median {1e3 * row['median_s']:7.1f} ms  (p10 {1e3 * row['p10_s']:.1f}, "
              f"p90 {1e3 * row['p90_s']:.1f})  compile {row['compile_s']:.0f} s  wall {row['wall_s']:.0f} s  "
              f"load {os.getloadavg()[0]:.2f}  loss {row['losses_rank0'][0]:.4f} -> {row['losses_rank0'][-1]:.4f}")


def run_rounds(jobs: dict[str, tuple[str, dict]], repeat: int, timeout: float) -> dict[str, list[dict]]:
    """Every job (tag: (system key, args)) ``repeat`` times, round robin, a progress line per run: tag: its runs."""
    runs: dict[str, list[dict]] = {tag: [] for tag in jobs}
    for rep in range(repeat):
        for tag, (key, args) in jobs.items():
            t0 = time.time()
            row = run_system(key, args, timeout)
            runs[tag].append(row)
            report_run(f"{tag}{f' #{rep + 1}' if repeat > 1 else ''}", row, t0)
    return runs


def run_meta(args: dict, cfg: LlamaConfig, load_before, load_after, total: float, **extra) -> dict:
    """What a results JSON records about the run besides its rows."""
    return {
        "model": args["model"], "config": cfg.__dict__, "world_size": args["world_size"],
        "per_rank_batch": args["batch"], "seq": cfg.seq, "warmup": args["warmup"], "steps": args["steps"],
        "cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after, "total_s": total,
        "torch": torch.__version__, "python": platform.python_version(), "machine": platform.machine(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"), **extra,
    }


# ----------------------------------------------------------------------------------------------------
# Round robin in the same processes (the default mode): [Note: round robin in the same processes]
# ----------------------------------------------------------------------------------------------------


def round_robin(keys: list[str], args: dict, cfg: LlamaConfig, twin: str | None, references: list[str],
                timeout: float) -> list[dict]:
    """Every system of ``keys`` (and a second instance of ``twin``) in the same ranks, round robin:
    one row per system with its per-round ratios to each of ``references``."""
    tags = keys + ([twin + RR.TWIN] if twin else [])
    world = args["world_size"]
    ranks = run_distributed(RR.worker, world, tags, {**args, "cfg": cfg}, timeout=timeout * len(tags),
                            pg_timeout=120, backend="gloo", pin_cores=True, nice=args["nice"])
    return RR.summarize(ranks, tags, [*references, *([twin] if twin else [])])


def round_robin_table(rows: list[dict], references: list[str]) -> str:
    """Per system: its time in each round (``_round_robin.round_times``), their median, its ratios to each reference, whether its losses
    are bitwise OURS's (fsdp_pass systems), its first step (compiles included, caches warmed by the
    systems built before it in the same process)."""
    labels = {r["tag"]: r["label"] for r in rows}
    refs = [ref for ref in references if ref in labels]
    ours = next((r for r in rows if r["tag"] == OURS), None)
    head = ("system", "per round ms", "median ms", *[f"x {labels[ref]}" for ref in refs],
            f"losses = {OURS}'s", "first step s")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        same = "-" if ours is None or not r["key"].startswith("fsdp_pass") else (
            "bitwise" if r["losses_rank0"] == ours["losses_rank0"] else "differ")
        lines.append(f"| {r['label']} | {' '.join(f'{1e3 * m:.0f}' for m in r['round_s'])} "
                     f"| {1e3 * r['median_s']:.0f} | {' | '.join(RR.ratio_cell(r['ratios'].get(ref)) for ref in refs)} "
                     f"| {same} | {r['compile_s']:.0f} |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# Bucket sweep: exposed communication against the number of buckets
# ----------------------------------------------------------------------------------------------------


def bucket_settings(cfg: LlamaConfig) -> list[tuple[str, dict]]:
    """The ``--bucket-sweep`` granularities, coarse to fine: fsdp_pass options over OURS's.

    The model's units are the embedding, each layer, the final norm (tiny: merged into a neighbour)
    and the output. A ``min_bucket_bytes`` above the model merges every unit into one bucket;
    ``bucket_size`` (elements) then cuts that into two, or, with the default cost model, cuts every
    unit into parts."""
    with torch.device("meta"):
        n = sum(p.numel() for p in Llama(cfg).parameters())
    unit = n // (cfg.layers + 2)  # the average of the units that count
    merge_all = 1 << 62
    return [("whole model", {"min_bucket_bytes": merge_all}),
            ("two halves", {"min_bucket_bytes": merge_all, "bucket_size": n * 11 // 20}),  # over half: units fit
            ("per unit (default)", {}),
            ("half units", {"bucket_size": unit // 2}),
            ("quarter units", {"bucket_size": unit // 4})]


def bucket_sweep(args: dict, cfg: LlamaConfig, repeat: int, timeout: float) -> list[dict]:
    """OURS at every ``bucket_settings`` granularity, ``repeat`` rounds: one ``sweep_row`` per setting."""
    settings = bucket_settings(cfg)
    runs = run_rounds({label: (OURS, {**args, "options": options}) for label, options in settings}, repeat, timeout)
    return [sweep_row(label, options, runs[label]) for label, options in settings]


def sweep_row(label: str, options: dict, runs: list[dict]) -> dict:
    """One setting: step times pooled over its runs (``merge_repeats``); communication figures from each
    run's profiled step, the median over runs: exposed in total (as in the breakdown) and, per rank, of
    the first all-gather of the forward and the last reduce-scatter of the backward, time in waits and
    the part of it beyond waiting for a late peer (``peer_late_ms``), time issuing collectives."""
    ok = [r for r in runs if "error" not in r]
    if not ok:
        return {"setting": label, "options": options, "error": runs[0]["error"], "runs": runs}

    def median(values):
        values = [v for v in values if v is not None]
        return statistics.median(values) if values else None

    def per_rank(f):
        return [median(f(r["collectives"][k]) for r in ok) for k in range(len(ok[0]["collectives"]))]

    return {"setting": label, "options": options, "buckets": len(ok[0]["notes"]["buckets"]),
            "collectives": len(ok[0]["collectives"][0]), "median_ms": 1e3 * merge_repeats(runs)["median_s"],
            "comm_ms": median(r["comm_ms"] for r in ok), "hidden_fraction": median(r["hidden_fraction"] for r in ok),
            "exposed_ms": median(r["comm_ms"] - r["comm_hidden_ms"] for r in ok),
            "first_ag_exposed_ms": per_rank(lambda c: first_and_last(c)["first_ag_exposed_ms"]),
            "last_rs_exposed_ms": per_rank(lambda c: first_and_last(c)["last_rs_exposed_ms"]),
            "wait_ms": per_rank(lambda c: sum(x["wait_ms"] or 0.0 for x in c)),
            "own_wait_ms": per_rank(lambda c: sum(max(0.0, (x["wait_ms"] or 0.0) - x.get("peer_late_ms", 0.0))
                                                  for x in c)),
            "call_ms": per_rank(lambda c: sum(x["call_ms"] for x in c)), "runs": runs}


def sweep_table(rows: list[dict]) -> str:
    head = ("setting", "buckets", "median ms", "comm ms (hidden)", "exposed comm ms",
            "first AG exposed ms, per rank", "last RS exposed ms, per rank", "in waits ms, per rank",
            "beyond peer lateness", "issuing ms, per rank")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['setting']} | failed: {r['error'][:80]} |" + " |" * (len(head) - 2))
            continue
        per_rank = [" / ".join(map(_ms, r[k])) for k in ("first_ag_exposed_ms", "last_rs_exposed_ms", "wait_ms",
                                                             "own_wait_ms", "call_ms")]
        lines.append(f"| {r['setting']} | {r['buckets']} | {r['median_ms']:.0f} "
                     f"| {r['comm_ms']:.0f} ({100 * (r['hidden_fraction'] or 0):.0f}%) | {r['exposed_ms']:.1f} "
                     f"| {' | '.join(per_rank)} |")
    return "\n".join(lines)


def result_stem(a: argparse.Namespace, name: str) -> Path:
    """``--out``, else ``benchmarks/results/<name>`` (llama) or ``<name>_<model>[_quick]``; its folder exists."""
    stem = a.out or HERE / "results" / (name if a.model == "llama" and not a.quick else
                                        f"{name}_{a.model}{'_quick' if a.quick else ''}")
    stem.parent.mkdir(parents=True, exist_ok=True)
    return stem


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=sorted(CONFIGS), default="llama")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None,
                    help="measured steps: per system and round (default 3; --quick 2), or per run with --sequential "
                         "(default 10; --quick 3)")
    ap.add_argument("--rounds", type=int, default=15, help="round-robin rounds (default 15)")
    ap.add_argument("--twin", default=OURS,
                    help=f"also run a second instance of this system, to show what the ratios resolve "
                         f"(default {OURS}; '' for none)")
    ap.add_argument("--against", default=f"fsdp2,fsdp2_compile,simplefsdp,single,{OURS}",
                    help="the systems every row's per-round ratios are taken to (comma-separated keys)")
    ap.add_argument("--nice", type=int, default=0,
                    help="add this to the ranks' niceness; negative (e.g. -10, as root) puts them ahead of other "
                         "work on shared cores")
    ap.add_argument("--sequential", action="store_true",
                    help="each system in fresh processes, one after another, with memory, copies and overlap per "
                         "system (the profiled step); step times are not comparable across systems under load")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps, the first compiles (default 3)")
    ap.add_argument("--batch", type=int, default=None, help="per-rank batch (sequences)")
    ap.add_argument("--systems", default=None, help=f"comma-separated keys or globs of: {', '.join(SYSTEMS)}")
    ap.add_argument("--quick", action="store_true", help="tiny model and 3 steps: checks that everything runs")
    ap.add_argument("--repeat", type=int, default=1,
                    help="with --sequential or --bucket-sweep: run the list of systems (or the --bucket-sweep settings) this many times, round robin, "
                         "and pool the step times (spreads the effect of other load over all of them)")
    ap.add_argument("--timeout", type=float, default=600, help="seconds per system before its ranks are killed")
    ap.add_argument("--dump-graphs", default=None, help="write the compiled FSDP systems' graphs here (rank 0)")
    ap.add_argument("--out", type=Path, default=None, help="result path stem (default benchmarks/results/step_time)")
    ap.add_argument("--replot", type=Path, default=None, help="redraw the chart of a results JSON and exit")
    ap.add_argument("--bucket-sweep", action="store_true",
                    help=f"run only {OURS} at several bucket granularities (whole model ... quarter units) and "
                         f"report exposed communication per setting (benchmarks/results/bucket_sweep[_<model>].*)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    if a.replot:
        data = json.loads(a.replot.read_text())
        m = data["meta"]
        title = (f"{m['model']}, {data['systems'][0].get('params', 0) / 1e6:.1f}M params, world {m['world_size']}, "
                 f"per-rank batch {m['per_rank_batch']}x{m['seq']}, 1 pinned core/rank, load {m['loadavg_before'][0]:.1f}")
        plot(data["systems"], a.replot.with_suffix(".png"), title)
        return 0
    sequential = a.sequential or a.bucket_sweep
    steps = a.steps if a.steps is not None else ((3 if a.quick else 10) if sequential else (2 if a.quick else 3))
    batch_size = a.batch or (QUICK_BATCH if a.quick else PER_RANK_BATCH[a.model])
    args = {"model": a.model, "world_size": a.world_size, "steps": steps, "warmup": max(2, a.warmup),
            "batch": batch_size, "quick": a.quick, "dump": a.dump_graphs, "nice": a.nice}
    keys = select(a.systems)

    cfg = (QUICK_CONFIGS if a.quick else CONFIGS)[a.model]
    load_before = os.getloadavg()
    print(f"model {a.model}: {cfg}")
    print(f"world size {a.world_size}, per-rank batch {batch_size} x {cfg.seq} tokens, {args['warmup']} warm-up + "
          f"{steps} measured steps{'' if sequential else f' per round, {a.rounds} rounds'}, {os.cpu_count()} CPUs, load average {load_before[0]:.2f} {load_before[1]:.2f} "
          f"{load_before[2]:.2f}, torch {torch.__version__}")
    if a.bucket_sweep:
        t_all = time.time()
        rows = bucket_sweep(args, cfg, a.repeat, a.timeout)
        text = sweep_table(rows)
        print(f"\n{text}")
        stem = result_stem(a, "bucket_sweep")
        meta = run_meta(args, cfg, load_before, os.getloadavg(), time.time() - t_all, repeat=a.repeat)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "settings": rows}, indent=1, default=str))
        stem.with_suffix(".md").write_text(f"Bucket sweep {meta['date']}, model `{a.model}`\n\n{text}\n")
        print(f"wrote {stem.with_suffix('.json')}")
        return 0
    skipped = {}
    if "simplefsdp" in keys:
        err = simplefsdp_import_error()
        if err:
            print(f"SimpleFSDP: not installed / does not import: {err}\n  install: {SIMPLEFSDP_INSTALL}")
            skipped["simplefsdp"] = err
            keys.remove("simplefsdp")
    from _systems import fsdp_pass_options

    dropped = sorted({d for k in keys if SYSTEMS[k].fsdp_pass for d in fsdp_pass_options(SYSTEMS[k].fsdp_pass)[1]})
    if dropped:
        print(f"fsdp_pass: this checkout does not know option(s) {dropped}: they are not passed "
              f"(the overlap on/off rows then run the same configuration)")

    if not sequential:
        t_all = time.time()
        twin = a.twin or None
        references = [k for k in a.against.split(",") if k in keys]
        rows = round_robin(keys, {**args, "rounds": a.rounds}, cfg, twin, references, a.timeout)
        load_after = os.getloadavg()
        total = time.time() - t_all
        text = round_robin_table(rows, [*references, *([twin] if twin and twin not in references else [])])
        g = goals(rows, lambda x, y: x["ratios"][y["tag"]]["median"])
        print(f"\n{text}\n\n{goal_lines(g)}")
        print(f"\ntotal {total:.0f} s; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
        stem = result_stem(a, "step_time")
        meta = run_meta(args, cfg, load_before, load_after, total, mode="round robin", rounds=a.rounds,
                        skipped=skipped, fsdp_pass_options_not_supported=dropped)
        stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "systems": rows, "goals": g}, indent=1,
                                                        default=str))
        md = [f"Round-robin run {meta['date']}: model `{a.model}` ({rows[0]['params'] / 1e6:.2f}M parameters), world "
              f"size {a.world_size}, per-rank batch {batch_size} x {cfg.seq} tokens, {args['warmup']} warm-up steps, then "
              f"{a.rounds} rounds of 1 + {steps} steps per system, torch {torch.__version__}, {os.cpu_count()} CPUs, "
              f"load average (1 min) {load_before[0]:.2f} before and {load_after[0]:.2f} after; {total:.0f} s in all. "
              f"Ratio cells: median of per-round ratios (range) rounds no slower / rounds.", "", text, "", goal_table(g)]
        if skipped:
            md += ["", *[f"Skipped {k}: {v}" for k, v in skipped.items()]]
        stem.with_suffix(".md").write_text("\n".join(md) + "\n")
        print(f"wrote {stem.with_suffix('.json')}")
        return 0

    t_all = time.time()
    runs = run_rounds({k: (k, args) for k in keys}, a.repeat, a.timeout)
    rows = [merge_repeats(runs[k]) for k in keys]
    load_after = os.getloadavg()
    total = time.time() - t_all

    print()
    print(table(rows))
    g = goals(rows, lambda a, b: a["median_s"] / b["median_s"])
    print()
    print(goal_lines(g))
    by = {r["key"]: r for r in rows if "error" not in r}
    bd = {k: breakdown(r, by.get("single")) for k, r in by.items()}
    print()
    print(breakdown_table(bd, rows))
    per_collective = {r["label"]: collectives_table(r["collectives"][0]) for r in rows
                      if "error" not in r and SYSTEMS[r["key"]].fsdp_pass is not None}
    for label, text in per_collective.items():
        print(f"\n{label}: collectives of the profiled step, rank 0\n{text}")
    print(f"\ntotal {total:.0f} s; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")

    stem = result_stem(a, "step_time")
    meta = run_meta(args, cfg, load_before, load_after, total, skipped=skipped, repeat=a.repeat,
                    fsdp_pass_options_not_supported=dropped)
    with open(stem.with_suffix(".json"), "w") as f:
        json.dump({"meta": meta, "systems": rows, "goals": g, "breakdown": bd}, f, indent=1, default=str)
    md = [f"Run {meta['date']}: model `{a.model}` ({rows[0].get('params', 0) / 1e6:.2f}M parameters), world size "
          f"{a.world_size}, per-rank batch {batch_size} x {cfg.seq} tokens, {args['warmup']} warm-up + {steps} measured "
          f"steps{' x %d rounds' % a.repeat if a.repeat > 1 else ''}, torch {torch.__version__}, {os.cpu_count()} CPUs, load average (1 min) {load_before[0]:.2f} before "
          f"and {load_after[0]:.2f} after; {total:.0f} s in all.", "", table(rows), "", breakdown_table(bd, rows), "",
          goal_table(g)]
    for label, text in per_collective.items():
        md += ["", f"{label}: collectives of the profiled step, rank 0", "", text]
    if skipped:
        md += ["", *[f"Skipped {k}: {v}" for k, v in skipped.items()]]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    title = (f"{a.model}, {rows[0].get('params', 0) / 1e6:.1f}M params, world {a.world_size}, per-rank batch "
             f"{batch_size}x{cfg.seq}, 1 pinned core/rank, load {load_before[0]:.1f}")
    if plot(rows, stem.with_suffix(".png"), title):
        print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
