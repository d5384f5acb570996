"""fsdp_pass's eager path against FSDP2 eager: step time, Python time per block, memory, losses (CPU/gloo).

Two parts, each round robin in the same two pinned gloo ranks ([Note: round robin in the same processes] in
``_round_robin.py``; systems in ``_systems.py``):

* ``llama`` (step_time.py's llama: vocab 4096, dim 256, 4 blocks, AdamW):
  ``fsdp2``              FSDP2 ``fully_shard`` on every block, then the root, eager;
  ``fsdp_pass_eager``    ``fsdp_pass.fully_shard(model)`` (defaults), trained without ``torch.compile``:
                         a bucket per block, each bucket's module a unit;
  ``fsdp_pass_eager_blocks`` FSDP2's recipe with fsdp_pass: ``fully_shard`` per block + root, eager: each block
                         a unit ([Note: eager module units] in fsdp_pass/eager/units.py);
  ``fsdp2_compile``      FSDP2's regional recipe: ``fully_shard`` per block + root, each block ``.compile()``d;
  ``fsdp_pass_regional`` fsdp_pass's: ``fully_shard`` per block + root, each block
                         ``.compile(backend="vescale")``; embedding, norm and head eager.
* ``blocks`` (64 small llama blocks: dim 32, 2 heads, FFN 64, 16 tokens x 2 sequences a rank), where the
  compute is small and what each block costs beyond it shows: ``single_eager`` (the model itself, no
  sharding, no communication: the floor), ``fsdp2``, ``fsdp_pass_eager`` and ``fsdp_pass_eager_units``
  (``min_bucket_bytes=0``: a bucket per block, each a unit) and ``fsdp_pass_eager_blocks``
  (``fully_shard`` per block + root, FSDP2's recipe: each block a unit).
  Overhead per block = (forward + backward time - the floor's) / blocks, per round (each the fastest step of
  its round, timed on its slowest rank): everything sharding adds per block call (hooks, dispatch, copies,
  collectives and their waits), the optimizer left out (it runs over half the parameters in the
  sharded systems and all of them in the floor).
* ``checkpointed`` (the llama part's model, each block in torch's non-reentrant ``checkpoint_wrapper`` before
  sharding, torchtitan's order): ``fsdp2_checkpointed`` (FSDP2 per wrapped block + root) and
  ``fsdp_pass_eager_checkpointed`` (``fsdp_pass.fully_shard`` the same way: each wrapper a unit, its recompute
  on the gather before its backward, [Note: a wrapper unit's recompute] in fsdp_pass/eager/units.py). Run it
  with ``--twin fsdp2_checkpointed``.

``--twin`` (default ``fsdp2``) adds a second instance of a system to each part: its ratios to the first are
what a run resolves. Each system's losses (every step of every rank: warm-up, switches and timed steps,
the same batches in the same order) are compared with its FSDP2 reference on the same path (the twin with
its first instance); a difference beyond ``--loss-rtol`` fails the run.

After the rounds, per system and rank: the tensor memory it keeps between steps (live tensor bytes it added,
built and warmed up, ``_measure.live_tensor_bytes``) and its in-step peak above that (one profiled step,
``_measure.in_step_peak_bytes``); the collectives the training thread calls in that step, by op, and the
communication the profiler sees (``_measure.analyze_profile``); and, under ``cProfile``, where the step's
time goes by source file (Python functions' own time; C functions, autograd's engine included, apart).

    python benchmarks/eager_step.py [--parts llama,blocks] [--rounds 10] [--steps 3] [--warmup 3] [--twin fsdp2]
                                    [--nice -10] [--no-profile] [--quick]

Writes ``benchmarks/results/eager_step[_quick].json`` and ``.md``. Results: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import os

os.environ["OMP_NUM_THREADS"] = "1"  # before torch starts its thread pools (children inherit it)

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
try:
    import fsdp_pass  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(0, str(HERE.parent))

import torch  # noqa: E402

import _measure as M  # noqa: E402
import _round_robin as RR  # noqa: E402
from _systems import barrier  # noqa: E402
from fsdp_pass.testing.models import LlamaConfig  # noqa: E402
from fsdp_pass.testing.spawn import run_distributed  # noqa: E402
from step_time import CONFIGS, PER_RANK_BATCH, QUICK_BATCH, QUICK_CONFIGS, run_meta  # noqa: E402

BLOCKS = LlamaConfig(vocab=256, dim=32, layers=64, heads=2, kv_heads=1, ffn=64, seq=16, tie_embeddings=False)
QUICK_BLOCKS = LlamaConfig(vocab=64, dim=16, layers=8, heads=2, kv_heads=1, ffn=32, seq=8, tie_embeddings=False)
BLOCKS_BATCH = 2

# part: (its systems, each measured system's FSDP2 reference on the same path)
PARTS = {
    "llama": (["fsdp2", "fsdp_pass_eager", "fsdp_pass_eager_blocks", "fsdp2_compile", "fsdp_pass_regional"],
              {"fsdp_pass_eager": "fsdp2", "fsdp_pass_eager_blocks": "fsdp2", "fsdp_pass_regional": "fsdp2_compile"}),
    "blocks": (["single_eager", "fsdp2", "fsdp_pass_eager", "fsdp_pass_eager_units", "fsdp_pass_eager_blocks"],
               {"fsdp_pass_eager": "fsdp2", "fsdp_pass_eager_units": "fsdp2", "fsdp_pass_eager_blocks": "fsdp2"}),
    "checkpointed": (["fsdp2_checkpointed", "fsdp_pass_eager_checkpointed"],
                     {"fsdp_pass_eager_checkpointed": "fsdp2_checkpointed"}),
}
FLOOR = "single_eager"


def part_setting(part: str, quick: bool) -> tuple[str, LlamaConfig, int]:
    """(model name, config, per-rank batch) of a part."""
    if part in ("llama", "checkpointed"):
        return "llama", (QUICK_CONFIGS if quick else CONFIGS)["llama"], QUICK_BATCH if quick else PER_RANK_BATCH["llama"]
    return "blocks", QUICK_BLOCKS if quick else BLOCKS, BLOCKS_BATCH


# ----------------------------------------------------------------------------------------------------
# Ranks
# ----------------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, tags: list[str], args: dict) -> dict:
    """Build and warm up every system, the rounds, then (``args["profile"]``) memory and profiles per system."""
    M.trim()
    level = [M.live_tensor_bytes()]
    kept: dict[str, int] = {}

    def built(tag: str) -> None:  # the tensors a system keeps: what is live after its warm-up, beyond before
        M.trim()
        now = M.live_tensor_bytes()
        kept[tag], level[0] = now - level[0], now

    runs, out = RR.build(rank, world, tags, args, built=built)
    index = RR.rounds(runs, out, args, args["warmup"])
    for tag, run in runs.items():
        out[tag]["losses"] = list(run.losses)
        out[tag]["kept_tensor_bytes"] = kept[tag]
    if args["profile"]:
        for tag, run in runs.items():
            out[tag].update(_profiled(run, index, args["profile_steps"]))
            index += 2 + args["profile_steps"]
    return out


def _profiled(run, index: int, python_steps: int) -> dict:
    """One system after the rounds: a step under torch's profiler (memory, collectives), then
    ``python_steps`` under ``cProfile`` (time by source file)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    M.trim()
    barrier()
    # Profiled from one step earlier, so what that step leaves behind is in the allocator records too.
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True, profile_memory=True) as prof:
        run.step(index)
        barrier()
        with record_function(M.STEP_SCOPE):
            run.step(index + 1)
    run.quiesce()
    events = prof.events()
    window = M.step_window(events)
    main = next(e.thread for e in events if e.name == M.STEP_SCOPE)
    comm = M.analyze_profile(events, main, window)
    result = {"in_step_peak_bytes": M.in_step_peak_bytes(prof), "collective_calls": _collective_calls(events, main, window),
              "comm_ms": comm["comm_ms"], "comm_hidden_ms": comm["comm_hidden_ms"]}
    barrier()
    profiler = cProfile.Profile()
    t0 = time.perf_counter()
    profiler.enable()
    for k in range(python_steps):
        run.step(index + 2 + k)
    profiler.disable()
    result["cprofile_step_s"] = (time.perf_counter() - t0) / python_steps
    run.quiesce()
    result["python"] = _by_source(pstats.Stats(profiler), python_steps)
    return result


def _collective_calls(events, main_thread: int, window: tuple[float, float]) -> dict[str, list[float]]:
    """Communication ops the training thread called in the analysed step (the outermost of nested ones,
    waits included): op -> [calls, ms]."""
    calls: dict[str, list[float]] = {}
    for e in events:
        if e.thread != main_thread or not M.COMM.match(e.name) or e.name.startswith("gloo:"):
            continue
        if not window[0] <= e.time_range.start < window[1] or any(M.COMM.match(a.name) for a in M._ancestors(e)):
            continue
        c = calls.setdefault(e.name, [0, 0.0])
        c[0] += 1
        c[1] += (e.time_range.end - e.time_range.start) / 1e3
    return calls


def _source(filename: str, name: str) -> str:
    """A profiled function's file as ``fsdp_pass/...``, ``torch/...`` or its base name; C functions: ``(C)``.
    ``OpOverload.redispatch`` (torch/_ops.py) calls into C++ without a C function cProfile sees, so its own
    time is the op it runs (for the functional collectives' autograd wrappers: the collective, its wait
    included): ``(C, redispatched)``."""
    if filename == "~":
        return "(C)"
    if name == "redispatch" and filename.endswith(f"torch{os.sep}_ops.py"):
        return "(C, redispatched)"
    parts = Path(filename).parts
    for root in ("fsdp_pass", "torch"):
        if root in parts:
            return "/".join(parts[len(parts) - 1 - parts[::-1].index(root):])
    return Path(filename).name


def _by_source(stats: pstats.Stats, steps: int) -> dict:
    """cProfile's own time (tottime) per step, by source file, and the functions with the most of it."""
    files: dict[str, float] = {}
    functions = []
    for (filename, line, name), (_, calls, own, _cum, _) in stats.stats.items():
        where = _source(filename, name)
        files[where] = files.get(where, 0.0) + own / steps
        label = name if where == "(C)" else f"{_source(filename, '')}:{line}({name})"
        functions.append((label, own / steps, calls / steps))
    functions.sort(key=lambda f: -f[1])
    return {"files_ms": {k: 1e3 * v for k, v in sorted(files.items(), key=lambda kv: -kv[1])},
            "top_functions": [{"function": f, "ms": 1e3 * t, "calls": c} for f, t, c in functions[:25]]}


# ----------------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------------


def loss_check(ranks: list[dict], tag: str, reference: str, rtol: float) -> dict:
    """``tag``'s losses against ``reference``'s, step by step on every rank: the largest relative difference."""
    worst = 0.0
    bitwise = True
    steps = 0
    for r in ranks:
        a, b = r[tag]["losses"], r[reference]["losses"]
        if len(a) != len(b):
            return {"reference": reference, "steps": 0, "max_rel_diff": None, "ok": False,
                    "error": f"{len(a)} losses against {len(b)}"}
        steps += len(a)
        bitwise &= a == b
        worst = max([worst, *(abs(x - y) / abs(y) for x, y in zip(a, b))])
    return {"reference": reference, "steps": steps, "max_rel_diff": worst, "bitwise": bitwise,
            "rtol": rtol, "ok": worst <= rtol}


def summarize(ranks: list[dict], tags: list[str], references: dict[str, str], rtol: float,
              cfg: LlamaConfig) -> list[dict]:
    """One row per tag: ``RR.summarize``'s (per-round times, ratios to its reference and to FSDP2), the loss
    check, memory and profiles (largest over ranks), and, with a floor in the part, the overhead per block."""
    rows = RR.summarize(ranks, tags, sorted({"fsdp2", *references.values()}))
    floor = RR.round_times(ranks, FLOOR, "fwd_bwd") if FLOOR in tags else None
    fsdp2_overhead = None
    for row in rows:
        tag = row["tag"]
        ref = references.get(tag) or (RR.system_key(tag) if tag.endswith(RR.TWIN) else None)
        row["reference"] = ref
        row["losses"] = loss_check(ranks, tag, ref, rtol) if ref else None
        if FLOOR in tags and tag != FLOOR:  # the floor's first loss is the others' (same weights, same batch)
            row["first_loss_is_floor"] = all(r[tag]["losses"][0] == r[FLOOR]["losses"][0] for r in ranks)
        row["kept_tensor_bytes"] = max(r[tag]["kept_tensor_bytes"] for r in ranks)
        if "in_step_peak_bytes" in ranks[0][tag]:
            row["in_step_peak_bytes"] = max(r[tag]["in_step_peak_bytes"] for r in ranks)
            row["peak_tensor_bytes"] = max(r[tag]["kept_tensor_bytes"] + r[tag]["in_step_peak_bytes"] for r in ranks)
            row["profile_rank0"] = {k: ranks[0][tag][k] for k in ("collective_calls", "comm_ms", "comm_hidden_ms",
                                                                  "cprofile_step_s", "python")}
        row["fwd_bwd_s"] = RR.round_times(ranks, tag, "fwd_bwd")
        if floor is not None and tag != FLOOR:
            row["overhead_per_block_s"] = [(t - f) / cfg.layers for t, f in zip(row["fwd_bwd_s"], floor)]
            if tag == "fsdp2":
                fsdp2_overhead = row["overhead_per_block_s"]
    for row in rows:
        if fsdp2_overhead is not None and "overhead_per_block_s" in row and row["tag"] != "fsdp2":
            row["overhead_vs_fsdp2"] = RR.ratio_summary(RR.per_round_ratios(row["overhead_per_block_s"], fsdp2_overhead))
    return rows


def _mib(b) -> str:
    return "-" if b is None else f"{b / 2**20:.1f}"


def _loss_cell(check: dict | None) -> str:
    if check is None:
        return "-"
    if check["max_rel_diff"] is None:
        return f"FAIL: {check['error']}"
    same = "bitwise" if check["bitwise"] else f"max rel diff {check['max_rel_diff']:.1e}"
    return f"{'ok' if check['ok'] else 'FAIL'}: {same}, {check['steps']} steps"


def step_table(rows: list[dict]) -> str:
    """Per system: its time in each round, their median, its ratio to FSDP2's on the same path (and to eager
    FSDP2), the loss check, the first step, memory."""
    labels = {r["tag"]: r["label"] for r in rows}
    head = ("system", "per round ms", "median ms", "x its FSDP2 reference", "x FSDP2 eager", "losses vs reference",
            "first step s", "kept MiB", "in-step peak MiB")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ref = r["reference"]
        ref_cell = f"{RR.ratio_cell(r['ratios'].get(ref))} ({labels[ref]})" if ref else "-"
        lines.append(f"| {r['label']} | {' '.join(f'{1e3 * m:.0f}' for m in r['round_s'])} | {1e3 * r['median_s']:.0f} "
                     f"| {ref_cell} | {RR.ratio_cell(r['ratios'].get('fsdp2'))} | {_loss_cell(r['losses'])} "
                     f"| {r['compile_s']:.1f} | {_mib(r['kept_tensor_bytes'])} | {_mib(r.get('in_step_peak_bytes'))} |")
    return "\n".join(lines)


def overhead_table(rows: list[dict], blocks: int) -> str:
    """Per system of the blocks part: forward + backward per round, and what it costs per block beyond the floor."""
    head = ("system", "forward + backward per round ms", "median ms", f"per block beyond the floor, per round µs",
            "median µs", "x FSDP2's")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        per_block = r.get("overhead_per_block_s")
        lines.append(f"| {r['label']} | {' '.join(f'{1e3 * t:.0f}' for t in r['fwd_bwd_s'])} "
                     f"| {1e3 * statistics.median(r['fwd_bwd_s']):.0f} "
                     f"| {' '.join(f'{1e6 * t:.0f}' for t in per_block) if per_block else '-'} "
                     f"| {f'{1e6 * statistics.median(per_block):.0f}' if per_block else '-'} "
                     f"| {RR.ratio_cell(r.get('overhead_vs_fsdp2')) if r.get('overhead_vs_fsdp2') else '-'} |")
    return f"{blocks} blocks\n\n" + "\n".join(lines)


def profile_lines(rows: list[dict], top: int = 8) -> str:
    """Per system (rank 0): the collectives of the profiled step, and cProfile's time by source file."""
    out = []
    for r in rows:
        p = r.get("profile_rank0")
        if p is None or r["tag"].endswith(RR.TWIN):
            continue
        calls = ", ".join(f"{name} x{int(n)} {ms:.1f} ms" for name, (n, ms) in
                          sorted(p["collective_calls"].items(), key=lambda kv: -kv[1][1]))
        files = ", ".join(f"{f} {ms:.1f}" for f, ms in list(p["python"]["files_ms"].items())[:top])
        funcs = ", ".join(f"{f['function']} {f['ms']:.1f} ms x{f['calls']:.0f}" for f in p["python"]["top_functions"][:top])
        out.append(f"{r['label']}:\n  collectives in the profiled step: {calls or 'none'}; comm {p['comm_ms']:.1f} ms "
                   f"({p['comm_hidden_ms']:.1f} hidden)\n  cProfile, step {1e3 * p['cprofile_step_s']:.0f} ms; own time "
                   f"by file, ms/step: {files}\n  top functions: {funcs}")
    return "\n".join(out)


# ----------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------


def run_part(part: str, a: argparse.Namespace, args: dict) -> dict:
    """One part in its own two ranks: its rows, tables and settings."""
    model, cfg, batch = part_setting(part, a.quick)
    keys, references = PARTS[part]
    tags = keys + ([a.twin + RR.TWIN] if a.twin else [])
    part_args = {**args, "model": model, "cfg": cfg, "batch": batch}
    t0 = time.time()
    print(f"\n== {part}: {cfg}, per-rank batch {batch} x {cfg.seq} tokens; systems {', '.join(tags)}", flush=True)
    ranks = run_distributed(_worker, args["world_size"], tags, part_args, timeout=a.timeout, pg_timeout=120,
                            backend="gloo", pin_cores=True, nice=a.nice)
    rows = summarize(ranks, tags, references, a.loss_rtol, cfg)
    text = step_table(rows)
    if FLOOR in tags:
        text += "\n\n" + overhead_table(rows, cfg.layers)
    prof = profile_lines(rows)
    print(f"\n{text}\n\n{prof}\n\n{part}: {time.time() - t0:.0f} s, load average {os.getloadavg()[0]:.2f}", flush=True)
    return {"part": part, "model": model, "config": cfg.__dict__, "per_rank_batch": batch, "wall_s": time.time() - t0,
            "systems": rows, "table": text, "profile": prof}


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated: {', '.join(PARTS)}")
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=10, help="round-robin rounds (default 10)")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per system and round (default 3)")
    ap.add_argument("--warmup", type=int, default=3, help="warm-up steps per system, the first compiles (default 3)")
    ap.add_argument("--twin", default="fsdp2", help="a second instance of this system in each part ('' for none)")
    ap.add_argument("--loss-rtol", type=float, default=1e-5,
                    help="largest relative loss difference from the FSDP2 reference, any step, any rank (default 1e-5)")
    ap.add_argument("--nice", type=int, default=0, help="add this to the ranks' niceness (negative, as root: ahead of "
                                                        "other work on shared cores)")
    ap.add_argument("--no-profile", action="store_true", help="skip memory and profiles after the rounds")
    ap.add_argument("--profile-steps", type=int, default=2, help="steps per system under cProfile (default 2)")
    ap.add_argument("--quick", action="store_true", help="tiny models, 2 rounds: checks that everything runs")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per part before its ranks are killed")
    ap.add_argument("--out", type=Path, default=None, help="result path stem (default benchmarks/results/eager_step)")
    return ap


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    parts = [p.strip() for p in a.parts.split(",") if p.strip()]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        raise SystemExit(f"unknown part(s) {unknown}; choose from {', '.join(PARTS)}")
    rounds = 2 if a.quick and a.rounds == 10 else a.rounds
    args = {"world_size": a.world_size, "rounds": rounds, "steps": a.steps, "warmup": max(2, a.warmup),
            "profile": not a.no_profile, "profile_steps": a.profile_steps}
    load_before = os.getloadavg()
    print(f"world size {a.world_size}, {args['warmup']} warm-up steps, then {rounds} rounds of 1 + {a.steps} steps per "
          f"system; {os.cpu_count()} CPUs, load average {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"torch {torch.__version__}", flush=True)
    t_all = time.time()
    results = [run_part(p, a, args) for p in parts]
    load_after = os.getloadavg()
    total = time.time() - t_all
    failed = [f"{res['part']}: {r['label']} ({_loss_cell(r['losses'])})" for res in results for r in res["systems"]
              if r["losses"] and not r["losses"]["ok"]]
    print(f"\ntotal {total:.0f} s; load average before {load_before[0]:.2f}, after {load_after[0]:.2f}")
    if failed:
        print("losses differ from the FSDP2 reference beyond --loss-rtol:\n  " + "\n  ".join(failed))

    stem = a.out or HERE / "results" / ("eager_step_quick" if a.quick else "eager_step")
    stem.parent.mkdir(parents=True, exist_ok=True)
    meta = run_meta({**args, "model": ",".join(parts), "batch": None},
                    part_setting(parts[0], a.quick)[1], load_before, load_after, total, mode="round robin",
                    rounds=rounds, parts=parts, twin=a.twin, loss_rtol=a.loss_rtol, losses_ok=not failed)
    for key in ("config", "per_rank_batch", "seq"):  # per part, in each part's record
        meta.pop(key)
    stem.with_suffix(".json").write_text(json.dumps({"meta": meta, "parts": results}, indent=1, default=str))
    md = [f"Round-robin run {meta['date']}: world size {a.world_size}, {args['warmup']} warm-up steps, then {rounds} rounds "
          f"of 1 + {a.steps} steps per system, torch {torch.__version__}, {os.cpu_count()} CPUs, load average (1 min) "
          f"{load_before[0]:.2f} before and {load_after[0]:.2f} after; {total:.0f} s in all. Ratio cells: median of "
          f"per-round ratios (range) rounds no slower / rounds, geometric mean [95% interval]."]
    for res in results:
        md += ["", f"### {res['part']} ({res['per_rank_batch']} x {res['config']['seq']} tokens a rank)", "", res["table"],
               "", "```", res["profile"], "```"]
    stem.with_suffix(".md").write_text("\n".join(md) + "\n")
    print(f"wrote {stem.with_suffix('.json')} and {stem.with_suffix('.md')}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
