"""Round robin in the same processes: every system a few steps in turn, round after round, compared by
the ratio of their step times within each round.

[Note: round robin in the same processes]
On two cores shared with other work, a load spike lasts from seconds to minutes. Runs of one system
after another in fresh processes put each spike on whichever system was running, so the medians of
two runs of the same system differed by up to 110 ms of 390 (docs/benchmarks.md), more than the
effects to be measured. Here every system lives in the same two processes (a model, an optimizer and
compiled graphs each, built and warmed up one after another); a round runs each system for a few
steps, in turn, the order rotated by one system each round, so a spike longer than a few steps hits
the systems of that round alike. Systems are compared round by round: A's fastest step in round r
over B's in round r (``round_times``); the report gives the median of those ratios, their range,
and in how many rounds A was no slower. A second instance of one system (the twin, built and compiled like the first) measures
what the method resolves: its ratios to the first would all be 1.00 on a quiet machine.

Between two systems' slices each rank waits at a barrier, and the first step of each slice is not
timed (the switch evicts caches: that step pays for the previous system's memory traffic). Python's
cyclic garbage collector is run before a slice's timed steps and held off during them: every system's
compiled graphs live in the same heap, so a collection walks all of them and would land on
whichever system happened to be running (on a quiet machine the twin's per-round ratios spread
0.79-1.23 with the collector on, 0.93-1.13 with it held off; 8 rounds each, llama). An
fsdp_pass system leaves no gather in flight when its slice ends (``Training.quiesce``).
"""

from __future__ import annotations

import gc
import math
import statistics
import time
from typing import Callable

import torch

from _systems import ALL_SYSTEMS, Training, barrier
from fsdp_pass.testing.models import Llama, init_std

TWIN = "#2"  # suffix of the second instance's tag


def system_key(tag: str) -> str:
    """The ``ALL_SYSTEMS`` key of a tag (a key, or a key + ``TWIN``)."""
    return tag.removesuffix(TWIN)


def worker(rank: int, world: int, tags: list[str], args: dict) -> dict:
    """One rank: build and warm up every system of ``tags`` on the model ``args["cfg"]``, then ``args["rounds"]`` rounds of
    ``args["steps"]`` timed steps each (after one untimed). Returns, per tag, each round's step
    times (this rank's), the first step's time (compiles included), the losses of every step, notes."""
    runs, out = build(rank, world, tags, args)
    rounds(runs, out, args, args["warmup"])
    for tag, run in runs.items():
        out[tag]["losses"] = run.losses
    return out


def build(rank: int, world: int, tags: list[str], args: dict, built: Callable[[str], None] | None = None
          ) -> tuple[dict[str, Training], dict[str, dict]]:
    """Every system of ``tags`` built and warmed up (``args["warmup"]`` steps) one after another: tag -> its
    training, and tag -> what is recorded about it (``compile_s``, ``notes``, ``params``, an empty ``rounds``).
    ``built(tag)``, when given, is called once each system is warmed up, before the next is built."""
    # Every system compiles the same forward functions (Llama.forward, ...): one cache entry each.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(tags))
    cfg = args["cfg"]
    runs: dict[str, Training] = {}
    out: dict[str, dict] = {}
    for tag in tags:
        model = init_std(Llama(cfg))
        runs[tag] = Training(ALL_SYSTEMS[system_key(tag)], model, world, rank, args["batch"], lambda name, gm: None)
        barrier()
        t0 = time.perf_counter()
        runs[tag].step(0)
        compile_s = time.perf_counter() - t0
        for i in range(1, args["warmup"]):
            runs[tag].step(i)
        runs[tag].quiesce()
        out[tag] = {"compile_s": compile_s, "rounds": [], "notes": runs[tag].notes,
                    "params": sum(p.numel() for p in model.parameters())}
        if built is not None:
            built(tag)
    return runs, out


def rounds(runs: dict[str, Training], out: dict[str, dict], args: dict, index: int,
           meter: Callable[[], float] | None = None) -> int:
    """``args["rounds"]`` rounds over ``runs`` from batch ``index`` on, appending each slice's step times to
    ``out[tag]["rounds"]`` and their forward + backward times to ``out[tag]["fwd_bwd"]`` (and, with a
    ``meter``, what it counted over the timed steps to ``out[tag]["metered"]``); returns the next batch index."""
    tags = list(runs)
    for r in range(args["rounds"]):
        order = tags[r % len(tags):] + tags[:r % len(tags)]
        for tag in order:
            barrier()
            runs[tag].step(index)  # the switch's step: not timed
            gc.collect()  # no collector pass inside a timed step (see the note)
            gc.disable()
            barrier()
            before = meter() if meter else 0.0
            times, fwd_bwd = [], []
            for k in range(args["steps"]):
                t0 = time.perf_counter()
                forward, backward, _ = runs[tag].step(index + 1 + k)
                times.append(time.perf_counter() - t0)
                fwd_bwd.append(forward + backward)
            gc.enable()
            if meter:
                barrier()  # every rank's steps are done: the meter counts them all
                out[tag].setdefault("metered", []).append(meter() - before)
            runs[tag].quiesce()
            out[tag]["rounds"].append(times)
            out[tag].setdefault("fwd_bwd", []).append(fwd_bwd)
        index += 1 + args["steps"]
    return index


def round_times(ranks: list[dict], tag: str, field: str = "rounds") -> list[float]:
    """Per round, the fastest of its timed steps, each step timed on its slowest rank (seconds); ``field``
    "fwd_bwd": the same of the steps' forward + backward times.

    The fastest, not the median: other work on the cores only ever slows a step down, so the least
    disturbed step of a slice is the closest to what the system itself costs."""
    rounds = zip(*(r[tag][field] for r in ranks))
    return [min(max(steps) for steps in zip(*per_rank)) for per_rank in rounds]


# Student's t, two-sided 95%, by degrees of freedom (rounds - 1), up to 30.
_T95 = (12.71, 4.30, 3.18, 2.78, 2.57, 2.45, 2.36, 2.31, 2.26, 2.23, 2.20, 2.18, 2.16, 2.14, 2.13, 2.12, 2.11,
        2.10, 2.09, 2.09, 2.08, 2.07, 2.07, 2.06, 2.06, 2.06, 2.05, 2.05, 2.05, 2.04)


def _t95(dof: int) -> float:
    """Beyond the table, the first terms of the Cornish-Fisher expansion around the normal 1.96 (off by
    under 0.005 there)."""
    if dof <= len(_T95):
        return _T95[dof - 1]
    z = 1.96
    return z + (z ** 3 + z) / (4 * dof)


def ratio_summary(ratios: list[float]) -> dict:
    """The median of per-round ratios, their range, the rounds in which the ratio was at most 1, and
    the geometric mean with its 95% confidence interval (Student's t on the log ratios): the interval
    is what the run resolves, where the range only shows single rounds."""
    logs = [math.log(r) for r in ratios]
    mean = statistics.fmean(logs)
    half = _t95(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs)) if len(logs) > 1 else math.inf
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "no_slower": sum(r <= 1.0 for r in ratios), "rounds": len(ratios), "ratios": ratios,
            "geo_mean": math.exp(mean), "ci95": (math.exp(mean - half), math.exp(mean + half))}


def ratio_cell(s: dict | None) -> str:
    """``median (min-max) k/n, mean [low-high]``: the median per-round ratio, its range, the rounds it was
    at most 1, and the geometric mean ratio with its 95% confidence interval (``ratio_summary``)."""
    if s is None:
        return "-"
    low, high = s["ci95"]
    return (f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f}) {s['no_slower']}/{s['rounds']}, "
            f"{s['geo_mean']:.2f} [{low:.2f}-{high:.2f}]")


def per_round_ratios(a: list[float], b: list[float]) -> list[float]:
    """System A's round times over system B's, round by round."""
    return [x / y for x, y in zip(a, b)]


def summarize(ranks: list[dict], tags: list[str], references: list[str]) -> list[dict]:
    """One row per tag: its time in each round, and its per-round ratios to each of ``references`` that ran
    (``ratio_summary``)."""
    per_round = {tag: round_times(ranks, tag) for tag in tags}
    r0 = ranks[0]
    rows = []
    for tag in tags:
        system = ALL_SYSTEMS[system_key(tag)]
        rows.append({
            "tag": tag, "key": system.key,
            "label": system.label + (" (second instance)" if tag.endswith(TWIN) else ""),
            "params": r0[tag]["params"], "notes": r0[tag]["notes"],
            "round_s": per_round[tag], "median_s": statistics.median(per_round[tag]),
            "compile_s": max(r[tag]["compile_s"] for r in ranks), "losses_rank0": r0[tag]["losses"],
            "ratios": {ref: ratio_summary(per_round_ratios(per_round[tag], per_round[ref]))
                       for ref in references if ref in per_round and ref != tag},
        })
    return rows
