"""NCCL's rules, checked on CPU: the strict mode every rank of :func:`~fsdp_pass.testing.spawn.run_distributed`
runs under.

[Note: NCCL's rules, enforced on CPU]
gloo forgives what NCCL does not. Three rules a program must keep to run on NCCL, and how the test kit
checks each on gloo (torch 2.13):

1. **The default group has a bound device** (``init_process_group(device_id=...)``). NCCL then creates
   its communicator at once and makes every later group by splitting it (``ncclCommSplit``), a call
   every rank of the default group must join. torch refuses a CPU bound device: ``init_process_group``
   lets ``device_id=torch.device("cpu")`` through, then ``_new_process_group_helper`` raises
   ``ValueError: init_process_group device_id parameter must be an accelerator with an index``. Setting
   ``bound_device_id`` afterwards makes every ``new_group`` raise the same (``_new_group_with_tag`` hands
   the default group's bound device to that helper); a bound accelerator device on a CPU build breaks
   ``barrier`` (it allocates on the bound device) and every ``new_group`` call of a non-member (gloo
   reports ``supports_splitting`` but ``ProcessGroupGloo`` has no ``perform_nocolor_split``). So no
   rank binds a device here; what a bound device demands of group creation is rule 2, checked directly.
2. **Every rank of the default group makes every process group, in the same order**, members and
   non-members alike (``DeviceMesh`` does; with a bound device ``new_group`` splits the default group's
   communicator, and a non-member's call is its part of the split). A group made with
   ``use_local_synchronization=True`` by a subset of the ranks breaks the rule: under NCCL its members
   wait in the split for ranks that never come. Every creation (``new_group``, ``DeviceMesh``,
   ``new_subgroups`` all go through ``distributed_c10d._new_group_with_tag``) is recorded with its
   ranks, backend and call site and checked *before* torch makes the group: a group made by its members
   alone fails at once; otherwise the rank posts its creation number ``i`` and waits for every other
   rank's creation ``i`` (or word that the rank's function returned), and a difference (other ranks,
   another backend, no such creation) fails naming both call sites. Each wait is bounded by the run's
   ``pg_timeout``.
3. **Every collective matches across its group's ranks**: op, group, order, shapes and dtypes. On a
   mismatch NCCL hangs or corrupts memory; gloo aborts the process, hangs, or silently mixes bytes (a
   float32 all-gather meeting an int32 one of the same size returns garbage). ``TORCH_DISTRIBUTED_DEBUG=
   DETAIL`` wraps each gloo group in ``ProcessGroupWrapper``, which checks a fingerprint before each
   collective, but it does not check the functional all-gather and reduce-scatter
   (``_c10d_functional.all_gather_into_tensor``, ``reduce_scatter_tensor`` reach the backend's
   unchecked ``*_coalesced`` entry points), the collectives fsdp_pass's graphs run, and it adds two gloo
   operations to every collective. So the strict mode reads torch's flight recorder instead:
   ProcessGroupGloo records every collective, eager or compiled (group name, sequence number, op, input
   shapes and dtypes), in a ring of ``TORCH_FR_BUFFER_SIZE`` entries set per rank. When the rank's
   function returns, the ranks exchange their records and compare each group's collectives in order; a
   mismatch fails naming the collective on each rank and each rank's call site. While the function
   runs, a watchdog thread compares them whenever the rank's main thread has stood still a few seconds
   (a collective waiting for a partner that ran something else never returns on its own), and fails
   the run on a collective two ranks ran differently; a rank whose collective timed out, and the parent
   at the run's deadline, ask every rank for its records and say what differs. ``Strict(detail=True)``
   adds the ``DETAIL`` wrapper, which stops a mismatched eager collective before it runs.

Ranks exchange their records through files in the run's temporary directory (a pin board: each value
written whole, then renamed into place; no sockets, no collectives), so a check never adds a collective
to the ones it checks and never waits on a broken group. A test that breaks a rule on purpose passes
``strict=False`` (or a :class:`Strict` with that check off) to ``run_distributed``.
"""

from __future__ import annotations

import functools
import inspect
import os
import pickle
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

__all__ = ["Strict", "StrictModeError", "StrictRank", "report_stuck_ranks", "strict_config"]

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_REPO_DIR = str(Path(__file__).resolve().parents[2]) + os.sep
_KIT_FILES = {os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
              for name in ("strict.py", "spawn.py", "strict_script.py")}
_NOTE = "[Note: NCCL's rules, enforced on CPU] in fsdp_pass/testing/strict.py"
_WATCH_S = 0.5  # how often the watchdog looks at the rank's main thread
_STALL_S = 5.0  # how long the main thread stands still before the watchdog compares collectives
_SITE_WAIT_S = 5.0  # how long a rank that found a mismatch waits for the others to say where they ran it


@dataclass(frozen=True)
class Strict:
    """Which of NCCL's rules the ranks of a run are held to ([Note: NCCL's rules, enforced on CPU]).

    ``groups``: every rank makes every process group, in the same order (checked at each creation).
    ``fingerprints``: every collective matches across its group's ranks (op, order, shapes, dtypes;
    from torch's flight recorder, when the rank's function returns and while it stands still).
    ``detail``: also ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (a check before each eager collective, two gloo
    operations more each). ``recorded``: the flight recorder's ring per rank; a longer run compares
    each rank's last ``recorded`` collectives.
    """

    groups: bool = True
    fingerprints: bool = True
    detail: bool = False
    recorded: int = 1 << 13


class StrictModeError(AssertionError):
    """A rank broke one of NCCL's rules ([Note: NCCL's rules, enforced on CPU])."""


def strict_config(strict: bool | Strict) -> Strict | None:
    """The :class:`Strict` a ``run_distributed(strict=...)`` argument asks for (None: off)."""
    if isinstance(strict, Strict):
        return strict
    if isinstance(strict, bool):
        return Strict() if strict else None
    raise TypeError(f"strict must be a bool or a Strict, got {type(strict).__name__}")


# -- the pin board: what the ranks exchange, as files ----------------------------------------------

_ABSENT = object()


class _Board:
    """Values posted under keys in a directory every rank sees: written whole, then renamed into place."""

    def __init__(self, path: str) -> None:
        self.path = path
        os.makedirs(path, exist_ok=True)

    def post(self, key: str, value: Any) -> None:
        partial = os.path.join(self.path, f".{key}.{os.getpid()}.{threading.get_ident()}")
        with open(partial, "wb") as f:
            pickle.dump(value, f)
        os.replace(partial, os.path.join(self.path, key))

    def read(self, key: str) -> Any:
        """The value under ``key``, or ``_ABSENT``."""
        try:
            with open(os.path.join(self.path, key), "rb") as f:
                return pickle.load(f)
        except FileNotFoundError:
            return _ABSENT

    def wait_any(self, keys: list[str], timeout: float) -> tuple[str, Any] | None:
        """The first of ``keys`` (in order) posted within ``timeout`` seconds, with its value; None if none was."""
        deadline = time.monotonic() + timeout
        pause = 0.002
        while True:
            for key in keys:
                value = self.read(key)
                if value is not _ABSENT:
                    return key, value
            if time.monotonic() >= deadline:
                return None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)

    def read_ranks(self, world_size: int, keys: tuple[str, ...], wait: float) -> dict[int, Any]:
        """Each rank's value under the first of ``keys`` it has posted, waiting up to ``wait`` seconds in all
        for the ranks that have posted none."""
        deadline = time.monotonic() + wait
        found = {}
        for r in range(world_size):
            got = self.wait_any([f"{key}.{r}" for key in keys], max(0.0, deadline - time.monotonic()))
            if got is not None:
                found[r] = got[1]
        return found


# -- call sites -------------------------------------------------------------------------------------

Frame = tuple[str, int, str]  # file, line, function


def _is_ours(filename: str) -> bool:
    """A frame worth naming: not torch's, not the test kit's harness, not the interpreter's machinery."""
    path = os.path.abspath(filename)
    return not (path.startswith(_TORCH_DIR) or path in _KIT_FILES or filename.startswith("<")
                or f"{os.sep}multiprocessing{os.sep}" in path
                or path.endswith(tuple(f"{os.sep}{name}.py" for name in ("functools", "contextlib", "threading", "runpy"))))


def _site(frames: list[Frame], depth: int = 3) -> str:
    """``file:line in function`` of the ``depth`` innermost frames outside torch, innermost first."""
    ours = []
    for file, line, name in frames:
        if _is_ours(file):
            path = os.path.abspath(file)
            ours.append(f"{path[len(_REPO_DIR):] if path.startswith(_REPO_DIR) else file}:{line} in {name}")
    return " <- ".join(ours[:depth]) if ours else "(no frame outside torch)"


def _stack_here() -> list[Frame]:
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        frames.append((frame.f_code.co_filename, frame.f_lineno, frame.f_code.co_name))
        frame = frame.f_back
    return frames


# -- rule 2: group creation -------------------------------------------------------------------------

@dataclass(frozen=True)
class _GroupCall:
    """One call that makes a process group, as one rank made it."""

    index: int  # this rank's creation number, from 0
    ranks: tuple[int, ...]  # global ranks, as the group holds them
    backend: str
    local: bool  # use_local_synchronization
    site: str

    def agreed(self) -> tuple:
        """What every rank's creation ``index`` must share."""
        return self.ranks, self.backend, self.local

    def describe(self) -> str:
        how = " by its members alone (use_local_synchronization=True)" if self.local else ""
        backend = f", backend {self.backend}" if self.backend != "default" else ""
        return f"group #{self.index} of ranks {list(self.ranks)}{backend}{how} at {self.site}"


_session: "StrictRank | None" = None  # this process's rank, while its function runs


def _install_group_hook() -> None:
    """Wrap ``torch.distributed.distributed_c10d._new_group_with_tag``, once per process (test ranks only).

    torch 2.13 has no hook on group creation. ``new_group`` looks this function up in its module at each
    call, and ``DeviceMesh`` and ``new_subgroups`` reach it through ``new_group``, so it sees every group
    a CPU run makes; wrapping ``dist.new_group`` would miss ``DeviceMesh``'s groups (its module imported
    ``new_group`` by name). ``split_group``, the other way to make a group, needs a bound device."""
    c10d = torch.distributed.distributed_c10d
    original = c10d._new_group_with_tag
    if getattr(original, "_strict_original", None) is not None:
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def recorded(*args: Any, **kwargs: Any) -> Any:
        session = _session
        if session is None:  # not a strict rank, or its function has returned
            return original(*args, **kwargs)
        call = signature.bind(*args, **kwargs)
        call.apply_defaults()
        made = session.before_group(call.arguments, _stack_here())
        group = original(*args, **kwargs)
        session.after_group(made, group)
        return group

    recorded._strict_original = original  # type: ignore[attr-defined]
    c10d._new_group_with_tag = recorded


# -- rule 3: collective fingerprints ----------------------------------------------------------------

@dataclass(frozen=True)
class _Collective:
    """One collective as torch's flight recorder saw it on one rank."""

    group: str  # the process group's name
    seq: int  # its number among the group's collectives on this rank, from 1
    op: str  # e.g. gloo:all_gather
    sizes: tuple[tuple[int, ...], ...]  # input shapes
    dtypes: tuple[str, ...]  # input dtypes
    record: int  # the flight recorder's record id: this rank's order over all its groups

    def fingerprint(self) -> tuple:
        """What every rank of the group must agree on: the op always; dtypes unless only the root holds
        tensors (scatter, gather); shapes unless they may differ by rank (those and an uneven all-to-all)."""
        kind = _kind(self.op)
        return (self.op,) if kind == "rooted" else (self.op, self.dtypes) if kind == "uneven" else \
            (self.op, self.sizes, self.dtypes)

    def describe(self) -> str:
        tensors = ", ".join(f"{dtype} {list(size)}" for dtype, size in zip(self.dtypes, self.sizes)) or "no tensor"
        return f"{self.op} of {tensors}"


def _kind(op: str) -> str:
    """``"rooted"``: a scatter or gather, whose tensor list only the root holds; ``"uneven"``: an all-to-all,
    whose splits may differ by rank; ``"even"``: every other collective (all-gather and reduce-scatter too)."""
    name = op.split(":")[-1]
    if name.startswith(("all_gather", "allgather", "reduce_scatter")):
        return "even"
    if "all_to_all" in name or "alltoall" in name:
        return "uneven"
    return "rooted" if "scatter" in name or "gather" in name else "even"


def _flight_records(with_frames: bool = False) -> list[dict]:
    raw = torch._C._distributed_c10d._dump_fr_trace(includeCollectives=True, includeStackTraces=with_frames,
                                                    onlyActive=False)
    return pickle.loads(raw).get("entries", [])


def _summary(groups: dict[str, tuple[int, ...]]) -> dict:
    """This rank's collectives as its flight recorder holds them (send/recv left out: they pair two ranks,
    not a group), the groups it is a member of, and whether the recorder dropped its oldest records."""
    records = _flight_records()
    collectives = [_Collective(r["process_group"][0], int(r["collective_seq_id"]), r["profiling_name"],
                               tuple(tuple(s) for s in r["input_sizes"]), tuple(r["input_dtypes"]),
                               int(r["record_id"])) for r in records if not r.get("is_p2p")]
    return {"groups": dict(groups), "collectives": collectives,
            "wrapped": bool(records) and int(records[0]["record_id"]) > 0}


def _lives(collectives: list[_Collective]) -> list[dict[int, _Collective]]:
    """One group name's collectives on one rank, split where the sequence restarts (the group was destroyed
    and a new one took its name), each part keyed by sequence number."""
    lives: list[dict[int, _Collective]] = []
    last = None
    for c in sorted(collectives, key=lambda c: c.record):
        if last is None or c.seq <= last:
            lives.append({})
        lives[-1][c.seq] = c
        last = c.seq
    return lives


Mismatch = tuple[str, tuple[int, ...], dict[int, "_Collective | None"], str]  # group, its ranks, rank -> collective, kind


def _first_mismatch(posts: dict[int, dict], default_group: str, final: set[int] | None = None) -> Mismatch | None:
    """Across the ranks' posts, the first collective whose fingerprint differs between two ranks of its
    group (kind ``"differs"``), or that one rank ran and another did not (``"missing"``): (group, its
    ranks, rank -> that collective or None, kind). None when every group's collectives agree.

    A collective is missing only on a rank in ``final`` (posted once its function ended; default: every
    rank): a running rank may not have reached it yet. A rank whose flight recorder dropped its oldest
    records (``wrapped``) is compared only from its oldest record on."""
    final = set(posts) if final is None else final
    members: dict[str, tuple[int, ...]] = {default_group: tuple(sorted(posts))}
    for post in posts.values():
        members.update(post["groups"])
    found = []
    for group, ranks in members.items():
        ranks = tuple(r for r in ranks if r in posts)
        if len(ranks) < 2:
            continue
        lives = {r: _lives([c for c in posts[r]["collectives"] if c.group == group]) for r in ranks}
        wrapped = any(posts[r]["wrapped"] for r in ranks)
        if wrapped and not set(ranks) <= final:
            continue  # a running rank's records cannot be lined up with ones a ring dropped
        count = max(len(v) for v in lives.values())
        for i in range(count):  # the groups of one name in order: from the first, or from the last if a ring wrapped
            if found and found[-1][0] == group:
                break  # this name's first mismatch is found
            life = {}
            for r in ranks:
                k = i - (count - len(lives[r])) if wrapped else i
                if 0 <= k < len(lives[r]):
                    life[r] = (lives[r][k], min(lives[r][k]))
                elif not posts[r]["wrapped"]:
                    life[r] = ({}, 0)  # it ran nothing on this group
            for seq in sorted(set().union(*(ran for ran, _ in life.values()))):
                ran = {r: life[r][0].get(seq) if r in life else None for r in ranks}
                if len({c.fingerprint() for c in ran.values() if c is not None}) > 1:
                    found.append((group, ranks, ran, "differs"))
                    break
                if any(ran[r] is None and r in life and r in final and (not posts[r]["wrapped"] or seq > life[r][1])
                       for r in ranks):
                    found.append((group, ranks, ran, "missing"))
                    break
    if not found:
        return None
    return min(found, key=lambda f: min(c.record for c in f[2].values() if c is not None))


def _describe_mismatch(found: Mismatch, sites: dict[int, str]) -> str:
    group, ranks, ran, kind = found
    seq = next(c.seq for c in ran.values() if c is not None)
    lines = [f"  rank {r}: no collective #{seq} on this group" if ran[r] is None
             else f"  rank {r}: {ran[r].describe()} at {sites.get(r, '(call site not known)')}" for r in ranks]
    what = "differs across its ranks" if kind == "differs" else "did not run on every rank of its group"
    return (f"collective #{seq} on process group '{group}' (ranks {list(ranks)}) {what}:\n" + "\n".join(lines)
            + f"\nEvery rank of a group must run the same collectives in the same order, with the same shapes "
              f"and dtypes ({_NOTE})")


def _default_group_name() -> str:
    # torch names the default group "0" (the first of its sequential names); read it while it exists
    return dist.group.WORLD.group_name if dist.is_initialized() else "0"


def _position(thread: int) -> tuple[int, int] | None:
    """Where ``thread`` is (its innermost frame and instruction), holding no reference once it returns: a
    frame the watchdog kept would keep the running function's locals alive, and a gradient with one more
    reference is copied by autograd's accumulation instead of taken over (a strict run must not change
    what the program does)."""
    frame = sys._current_frames().get(thread)
    return None if frame is None else (id(frame), frame.f_lasti)


# -- one rank --------------------------------------------------------------------------------------

class StrictRank:
    """The strict mode of one rank of a run ([Note: NCCL's rules, enforced on CPU]): made before the rank
    joins its process group; :meth:`start_watchdog` then; :meth:`finish` after the rank's function
    returns, :meth:`explain` if it raised; :meth:`close` last."""

    def __init__(self, strict: Strict, rank: int, world_size: int, board: str, timeout: float) -> None:
        global _session
        self.strict = strict
        self.rank = rank
        self.world_size = world_size
        self.board = _Board(board)
        self.timeout = timeout
        self.made: list[_GroupCall] = []
        self.groups: dict[str, tuple[int, ...]] = {}  # name -> ranks, of the groups this rank is a member of
        self._stop = threading.Event()
        if strict.fingerprints:
            os.environ.setdefault("TORCH_FR_BUFFER_SIZE", str(strict.recorded))  # read when the first group is made
        if strict.detail:
            dist.set_debug_level(dist.DebugLevel.DETAIL)
        _install_group_hook()
        _session = self

    def close(self) -> None:
        global _session
        self._stop.set()
        if _session is self:
            _session = None

    # -- rule 2 ---------------------------------------------------------------------------------

    def before_group(self, arguments: dict[str, Any], frames: list[Frame]) -> _GroupCall:
        """Record a group creation and, under ``groups``, check it against every other rank's creation of
        the same number, before torch makes it."""
        world = dist.get_world_size()
        given = arguments["ranks"]
        listed = list(range(world)) if given is None else [int(r) for r in given]
        ranks = tuple(sorted(listed) if arguments["sort_ranks"] else listed)
        call = _GroupCall(len(self.made), ranks, str(arguments["backend"] or "default"),
                          bool(arguments["use_local_synchronization"]), _site(frames))
        self.made.append(call)
        if not self.strict.groups:
            return call
        if call.local and set(ranks) != set(range(world)):
            outside = sorted(set(range(world)) - set(ranks))
            raise StrictModeError(
                f"rank {self.rank} made process {call.describe()}; ranks {outside} of the default group take no part. "
                f"Under NCCL every rank of the default group makes every group (with a bound device, new_group "
                f"splits the default group's communicator, and a non-member's call is its part of the split), so "
                f"the members would wait for ranks that never come. Make the group on every rank, in the same "
                f"order: a DeviceMesh, or new_group on all ranks without use_local_synchronization ({_NOTE})")
        self.board.post(f"group.{call.index}.{self.rank}", call)
        for other in range(self.world_size):
            if other != self.rank:
                self._agree(call, other)
        return call

    def _agree(self, call: _GroupCall, other: int) -> None:
        got = self.board.wait_any([f"group.{call.index}.{other}", f"done.{other}"], self.timeout)
        mine = f"rank {self.rank} made process {call.describe()}"
        rule = f"Every rank of the default group must make every process group, in the same order ({_NOTE})"
        if got is None:
            last = self.board.read(f"group.{call.index - 1}.{other}") if call.index else _ABSENT
            before = "it made none before" if last is _ABSENT else f"its last was {last.describe()}"
            raise StrictModeError(f"{mine}, but rank {other} made no group #{call.index} within {self.timeout:.0f} s "
                                  f"({before}). {rule}")
        key, value = got
        if key.startswith("done."):
            raise StrictModeError(f"{mine}, but rank {other} returned from its function after making {value} "
                                  f"group(s), with no group #{call.index}. {rule}")
        if value.agreed() != call.agreed():
            raise StrictModeError(f"process group #{call.index} differs across ranks: {mine}; rank {other} made "
                                  f"{value.describe()}. {rule}")

    def after_group(self, call: _GroupCall, group: Any) -> None:
        if isinstance(group, dist.ProcessGroup):  # a member holds the group; a non-member gets a sentinel
            self.groups[group.group_name] = call.ranks

    # -- rule 3 ---------------------------------------------------------------------------------

    def _compare(self, posts: dict[int, dict], final: set[int] | None = None) -> str | None:
        """What the first mismatched collective is on each rank and where each rank ran it, or None.
        Every rank that finds it says where it ran its own; the others are asked to look."""
        found = _first_mismatch(posts, _default_group_name(), final)
        if found is None:
            return None
        group, ranks, ran, _ = found
        seq = next(c.seq for c in ran.values() if c is not None)
        mine = ran.get(self.rank)
        if mine is not None:
            stack = next((r.get("frames", []) for r in _flight_records(with_frames=True)
                          if int(r["record_id"]) == mine.record), [])
            self.board.post(f"site.{group}.{seq}.{self.rank}", _site([(f["filename"], f["line"], f["name"])
                                                                       for f in stack]))
        self.board.post("report", (self.rank, time.monotonic()))  # the other ranks' watchdogs look now
        sites = {}
        for r in ranks:
            if ran[r] is not None:
                got = self.board.wait_any([f"site.{group}.{seq}.{r}"], _SITE_WAIT_S)
                sites[r] = got[1] if got else f"(rank {r} did not say within {_SITE_WAIT_S:.0f} s)"
        return _describe_mismatch(found, sites)

    def _look(self) -> str | None:
        """Post this rank's collectives so far and compare them with what the others posted: a collective
        two ranks ran differently, or one a finished rank never ran."""
        self.board.post(f"live.{self.rank}", _summary(self.groups))
        posts = self.board.read_ranks(self.world_size, ("collectives", "failed", "live"), 0.0)
        final = {r for r in posts if self.board.read(f"collectives.{r}") is not _ABSENT
                 or self.board.read(f"failed.{r}") is not _ABSENT}
        return self._compare(posts, final)

    def _watch(self, fail: Callable[[str], None]) -> None:
        """The watchdog thread ([Note: NCCL's rules, enforced on CPU], rule 3): looks when the main thread
        has stood still for ``_STALL_S`` (and again each ``_STALL_S`` it stays still), and when another
        rank asks; a mismatch ends the rank through ``fail``."""
        main = threading.main_thread().ident
        seen, still_since, looked_at, answered = None, time.monotonic(), 0.0, _ABSENT
        while not self._stop.wait(_WATCH_S):
            where = _position(main)
            now = time.monotonic()
            if where != seen:
                seen, still_since = where, now
            asked = self.board.read("report")
            if asked != answered or (now - still_since >= _STALL_S and now - looked_at >= _STALL_S):
                answered, looked_at = asked, now
                try:
                    problem = self._look()
                except Exception:  # the watchdog only adds a diagnosis; it never fails a good run
                    continue
                if problem and not self._stop.is_set():
                    fail(f"StrictModeError (found by rank {self.rank}'s watchdog): {problem}")

    def start_watchdog(self, fail: Callable[[str], None]) -> None:
        """Compare collectives while the rank's function runs; ``fail(message)`` reports and ends the rank."""
        if self.strict.fingerprints:
            threading.Thread(target=self._watch, args=(fail,), name="strict-watchdog", daemon=True).start()

    def finish(self) -> None:
        """After the rank's function returned: post that it did; compare every collective across the ranks
        (waiting at most the run's ``pg_timeout`` for them); raise :class:`StrictModeError` on the first
        difference."""
        self._stop.set()
        self.board.post(f"done.{self.rank}", len(self.made))
        if not self.strict.fingerprints:
            return
        self.board.post(f"collectives.{self.rank}", _summary(self.groups))
        posts = self.board.read_ranks(self.world_size, ("collectives", "failed"), self.timeout)
        if len(posts) < self.world_size:
            late = sorted(set(range(self.world_size)) - set(posts))
            raise StrictModeError(f"rank {self.rank} returned from its function, but ranks {late} did not within "
                                  f"{self.timeout:.0f} s: the collectives cannot be compared ({_NOTE})")
        problem = self._compare(posts)
        if problem:
            raise StrictModeError(problem)

    def explain(self, error: BaseException) -> str:
        """After the rank's function raised: when a collective timed out (how a mismatch ends under gloo,
        when it ends), ask every rank for its collectives, compare what arrives within a few seconds and
        say what differs; '' otherwise."""
        self._stop.set()
        if not self.strict.fingerprints or isinstance(error, StrictModeError) or "timed out" not in str(error).lower():
            return ""
        try:
            self.board.post(f"failed.{self.rank}", _summary(self.groups))
            self.board.post("report", (self.rank, time.monotonic()))
            posts = self.board.read_ranks(self.world_size, ("collectives", "failed", "live"), min(10.0, self.timeout))
            problem = self._compare(posts)
        except Exception:  # a diagnosis must never hide the error it explains
            return "\nstrict mode: the collectives could not be compared:\n" + traceback.format_exc()
        return "\nstrict mode: " + (problem or f"the collectives ranks {sorted(posts)} posted agree as far as they got")


def report_stuck_ranks(board: str, world_size: int, wait: float = 5.0) -> str:
    """In the parent, for a run past its deadline: ask the ranks' watchdogs for their collectives and say
    which collective they disagree on, or each rank's last; '' when no rank answers."""
    pins = _Board(board)
    pins.post("report", ("parent", time.monotonic()))
    time.sleep(min(wait, 3 * _WATCH_S))  # the watchdogs answer within one look: read what they post then
    posts = pins.read_ranks(world_size, ("live", "failed", "collectives"), wait)
    if not posts:
        return ""
    found = _first_mismatch(posts, "0")
    if found is not None:
        return "strict mode: " + _describe_mismatch(found, {})
    last = {r: max(post["collectives"], key=lambda c: c.record, default=None) for r, post in posts.items()}
    return "strict mode: the collectives agree; each rank's last: " + "; ".join(
        f"rank {r}: " + (f"#{c.seq} on process group '{c.group}', {c.describe()}" if c else "none")
        for r, c in sorted(last.items()))
