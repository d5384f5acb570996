"""Measurements for ``step_time.py``: memory, FSDP copy bytes and hidden communication (in total and per collective).

Every rule here is applied the same way to every system; ``docs/benchmarks.md`` explains them.
All tensors in these benchmarks are fp32, so byte counts are elements x 4.
"""

from __future__ import annotations

import ctypes
import gc
import math
import re
from typing import Iterable, NamedTuple

import torch
import torch.fx as fx

ELEMENT_BYTES = 4  # fp32 everywhere in this benchmark

# ----------------------------------------------------------------------------------------------------
# Resident memory
# ----------------------------------------------------------------------------------------------------

try:
    _libc = ctypes.CDLL("libc.so.6")
except OSError:  # not glibc
    _libc = None


def status_kib(key: str) -> int:
    """A ``/proc/self/status`` field in KiB (0 where it is missing)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def trim() -> None:
    """Collect garbage and hand freed heap pages back to the OS, so RSS shows live memory."""
    gc.collect()
    if _libc is not None:
        _libc.malloc_trim(0)


def rss_bytes() -> int:
    return status_kib("VmRSS") * 1024


def reset_peak_rss() -> bool:
    """Reset the kernel's high-water mark (VmHWM) to the current RSS (Linux >= 4.0)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss_bytes() -> int:
    return status_kib("VmHWM") * 1024


# ----------------------------------------------------------------------------------------------------
# Live tensor memory
# ----------------------------------------------------------------------------------------------------


def _is_tensor(obj) -> bool:
    try:
        return isinstance(obj, torch.Tensor)
    except ReferenceError:  # a weakref.proxy whose object is gone (isinstance asks it for __class__)
        return False


def live_tensor_bytes() -> int:
    """Bytes of every distinct CPU storage reachable from a live Python tensor (params, grads, optimizer
    state, flat buffers, ...). Wrapper subclasses (DTensor, RaggedShard) have no storage of their own and
    are skipped: their local tensors are found on their own. Fake tensors are skipped."""
    import warnings

    from torch._subclasses.fake_tensor import FakeTensor

    seen: dict[int, int] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance() on deprecated classes in gc's list warns
        objects = [o for o in gc.get_objects() if _is_tensor(o)]
    for obj in objects:
        if isinstance(obj, FakeTensor):
            continue
        try:
            if obj.device.type != "cpu" or obj.is_meta:
                continue
            st = obj.untyped_storage()
            ptr = st.data_ptr()
            if ptr:
                seen[ptr] = max(seen.get(ptr, 0), st.nbytes())
        except Exception:  # wrapper subclass, sparse, ...
            continue
    return sum(seen.values())


STEP_SCOPE = "step_time::analysed_step"
PHASES = ("step_time::forward", "step_time::backward", "step_time::optimizer")
PREFETCH_WAIT = "fsdp_pass::prefetched_gather_wait"  # fsdp_pass.step.prefetch.WAIT_SCOPE


def step_window(events) -> tuple[float, float]:
    """(start, end) in microseconds of the analysed step (the ``STEP_SCOPE`` record_function)."""
    e = next(e for e in events if e.name == STEP_SCOPE)
    return e.time_range.start, e.time_range.end


def in_step_peak_bytes(prof) -> int:
    """Peak of live bytes allocated during the profiled step, above the level at its start.

    From the profiler's allocation records (``profile_memory=True``): each carries the CPU allocator's
    running total of bytes allocated while profiling and not yet freed, so this is the step's transient
    peak on top of what was live when it began (activations, gathered parameters, gradients, buffers)."""
    from torch._C._profiler import _EventType

    records = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            records.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
    if not records:
        return 0
    records.sort()
    lo, hi = scope_ns(prof)
    before = [total for t, _, total in records if t < lo]
    start = before[-1] if before else records[0][2] - records[0][1]
    inside = [total for t, _, total in records if lo <= t <= hi]
    return max(0, max(inside, default=start) - start)


def scope_ns(prof, name: str = STEP_SCOPE) -> tuple[int, int]:
    """(start, end) in ns of the record_function ``name`` in a finished profile."""
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        if e.name == name:
            return e.start_time_ns, e.end_time_ns
        stack.extend(e.children)
    raise RuntimeError(f"no {name} event")


# ----------------------------------------------------------------------------------------------------
# Profiler: copies attributed to FSDP / DDP machinery, communication overlap
# ----------------------------------------------------------------------------------------------------

COPY_OPS = {"aten::copy_", "aten::_foreach_copy_", "aten::cat", "aten::split_with_sizes_copy",
            "aten::_chunk_cat", "aten::chunk_cat", "aten::clone", "aten::constant_pad_nd"}
# Scopes of data-parallel machinery: FSDP2's record_functions and custom ops, DDP's reducer.
MACHINERY = re.compile(r"^(FSDP::|fsdp::)|reducer::")
# Communication ops: what runs inside them is the communication library's business.
COMM = re.compile(r"^(c10d::|_c10d_functional::|gloo:|record_param_comms|nccl)")
COMPUTE = re.compile(r"^(aten::|mkldnn::|fsdp::)|cpp_fused")


def _ancestors(e):
    p = e.cpu_parent
    while p is not None:
        yield p
        p = p.cpu_parent


def _numel(shape) -> int:
    return math.prod(shape) if shape else 0


def _own_bytes(e) -> int:
    """Elements written by one copy-like event, x 4."""
    shapes = [s for s in (e.input_shapes or []) if isinstance(s, list)]
    if e.name == "aten::copy_" and len(shapes) >= 2:
        return _numel(shapes[1]) * ELEMENT_BYTES
    if e.name in ("aten::mul", "aten::div") and shapes:  # DDP's copy-in: grad * (1/world) into the bucket
        return _numel(shapes[0]) * ELEMENT_BYTES
    if e.name == "aten::split_with_sizes_copy" and shapes:
        return _numel(shapes[0]) * ELEMENT_BYTES
    if e.cpu_memory_usage and e.cpu_memory_usage > 0:  # allocates its output (cat, clone, pad)
        return int(e.cpu_memory_usage)
    nonempty = [s for s in shapes if s]
    return _numel(nonempty[-1]) * ELEMENT_BYTES if nonempty else 0  # out= variant: the output shape


def _is_copy(e, in_reducer: bool) -> bool:
    return e.name in COPY_OPS or (in_reducer and e.name in ("aten::mul", "aten::div"))


def _copy_bytes(e, in_reducer: bool) -> int:
    """Bytes of an outermost copy event: its innermost copy descendants if it has any, else its own."""
    kids = [c for c in e.cpu_children if _is_copy(c, in_reducer)]
    if kids:
        return sum(_copy_bytes(c, in_reducer) for c in kids)
    return _own_bytes(e)


def _union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _length(iv) -> float:
    return sum(e - s for s, e in iv)


def _intersection(a, b) -> float:
    i = j = 0
    total = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if hi > lo:
            total += hi - lo
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


class Transfer(NamedTuple):
    """A collective's transfer on a gloo thread (``gloo:all_gather``, ...), in microseconds."""

    name: str
    numel: int  # elements of its input
    start: float
    end: float


class Call(NamedTuple):
    """A functional collective issued, or a ``wait_tensor``, on the training thread, in microseconds."""

    name: str
    numel: int  # elements of its (first) input
    group_size: int  # of the collective's process group (1 where the call does not say it)
    start: float
    end: float


_WAIT = "_c10d_functional::wait_tensor"
# Functional collectives the training thread issues: kind, and which argument is the group size.
_ISSUED = {"_c10d_functional::all_gather_into_tensor": ("AG", 1),
           "_c10d_functional::all_gather_into_tensor_out": ("AG", 1),
           "_c10d_functional::reduce_scatter_tensor": ("RS", 2),
           "_c10d_functional::all_reduce": ("AR", None)}
# The gloo work event a collective of each kind runs as (gloo emulates reduce-scatter with an all-reduce).
_TRANSFERS = {"AG": ("gloo:all_gather",), "RS": ("gloo:reduce_scatter", "gloo:all_reduce"), "AR": ("gloo:all_reduce",)}


def _call(e) -> Call:
    """A profiler event of ``_ISSUED`` or ``_WAIT`` (``record_shapes=True`` gives shapes and scalar args)."""
    shapes = [s for s in (e.input_shapes or []) if isinstance(s, list)]
    kind = _ISSUED.get(e.name)
    concrete = getattr(e, "concrete_inputs", None) or []
    group = concrete[kind[1]] if kind and kind[1] is not None and len(concrete) > kind[1] else None
    return Call(e.name, _numel(shapes[0]) if shapes else 0, group if isinstance(group, int) else 1,
                e.time_range.start, e.time_range.end)


def per_collective(calls: list[Call], transfers: list[Transfer], compute: list[tuple[float, float]],
                   phases: list[tuple[str, float, float]], t0: float) -> list[dict]:
    """Every collective of the step in issue order, named by kind in that order (``AG0``, ``AG1``, ...,
    ``RS0``, ...), with its bytes and timing in ms (from ``t0``, the step's start).

    A collective's transfer is the first gloo event of its kind and input size that starts after it is
    issued (gloo runs its queue in order); its wait is the first ``wait_tensor`` on a tensor of its
    output size after it is issued (waits of same-sized buckets come in issue order). ``hidden`` is
    the part of the transfer during which the training thread ran compute (``compute``: the same
    union of operator intervals the step's total hidden fraction is measured against); ``exposed``
    is the rest. ``call`` is the time the training thread spent issuing it (dispatch, gloo's enqueue;
    a reduce-scatter's also clones its input for gloo's all-reduce); ``window`` is issue to wait: the
    compute the schedule put in between; ``wait`` is the time the training thread sat in the wait (a
    reduce-scatter's also copies this rank's chunk out). Transfers run concurrently (gloo has two
    worker threads), so per-collective times can add up to more than the step's communication."""
    rows: list[dict] = []
    pending: list[tuple[int, float, dict]] = []  # (output elements, issue time, row): not waited on yet
    left = sorted(transfers, key=lambda t: t.start)
    count: dict[str, int] = {}
    for c in sorted(calls, key=lambda c: c.start):
        if c.name == _WAIT:
            hit = next((p for p in pending if p[0] == c.numel), None)
            if hit is not None:
                pending.remove(hit)
                hit[2].update(window_ms=(c.start - hit[1]) / 1e3, wait_ms=(c.end - c.start) / 1e3)
            continue
        kind = _ISSUED[c.name][0]
        out_numel = {"AG": c.numel * c.group_size, "RS": c.numel // c.group_size}.get(kind, c.numel)
        name = f"{kind}{count.get(kind, 0)}"
        count[kind] = count.get(kind, 0) + 1
        row = {"name": name, "kind": kind,
               "phase": next((ph for ph, s, e in phases if s <= c.start < e), None),
               "bytes": max(c.numel, out_numel) * ELEMENT_BYTES,  # the whole bucket
               "issue_ms": (c.start - t0) / 1e3, "call_ms": (c.end - c.start) / 1e3, "transfer_ms": None,
               "hidden_ms": None, "exposed_ms": None, "window_ms": None, "wait_ms": None}
        t = next((t for t in left if t.name in _TRANSFERS[kind] and t.numel == c.numel and t.start >= c.start), None)
        if t is not None:
            left.remove(t)
            hidden = _intersection([(t.start, t.end)], compute)
            row.update(transfer_ms=(t.end - t.start) / 1e3, hidden_ms=hidden / 1e3,
                       exposed_ms=(t.end - t.start - hidden) / 1e3)
        pending.append((out_numel, c.start, row))
        rows.append(row)
    return rows


def add_peer_lateness(per_rank: list[list[dict]]) -> None:
    """Set every collective's ``peer_late_ms``: how much later than this rank the last rank issued it.

    A collective cannot finish before every rank has issued it, so up to that much of an early rank's
    transfer is waiting for a peer, not moving data. Issue times count from each rank's analysed-step
    start, which a barrier aligns. Nothing is set when the ranks' collectives differ."""
    names = [[c["name"] for c in rows] for rows in per_rank]
    if any(n != names[0] for n in names):
        return
    for same in zip(*per_rank):
        last = max(c["issue_ms"] for c in same)
        for c in same:
            c["peer_late_ms"] = last - c["issue_ms"]


def first_and_last(collectives: list[dict]) -> dict:
    """The first all-gather of the forward and the last reduce-scatter of the backward, and their
    exposed ms (None where the step has no such collective or its transfer was not found)."""
    ag = next((c for c in collectives if c["kind"] == "AG" and c["phase"] == "forward"), None)
    rs = next((c for c in reversed(collectives) if c["kind"] == "RS"), None)
    return {"first_ag": ag and ag["name"], "first_ag_exposed_ms": ag and ag["exposed_ms"],
            "last_rs": rs and rs["name"], "last_rs_exposed_ms": rs and rs["exposed_ms"]}


def analyze_profile(events, main_thread: int, window: tuple[float, float]) -> dict:
    """Copies by data-parallel machinery, comm-internal copies, collective time and its overlap, in
    the analysed step (``window``; collectives are clipped to it), in total and per collective."""
    machinery_bytes = machinery_us = comm_internal_bytes = 0.0
    machinery_ops: dict[str, int] = {}
    transfers: list[Transfer] = []
    calls, compute_iv, phase_iv, prefetch_waits = [], [], [], []
    phase_us = {p.split("::")[1]: 0.0 for p in PHASES}
    for e in events:
        if e.name == "[memory]":
            continue
        start, end = e.time_range.start, e.time_range.end
        if end <= window[0] or start >= window[1]:
            continue
        if e.name.startswith("gloo:"):
            shapes = [s for s in (e.input_shapes or []) if isinstance(s, list)]
            transfers.append(Transfer(e.name, _numel(shapes[0]) if shapes else 0,
                                      max(start, window[0]), min(end, window[1])))
            continue
        if e.thread != main_thread:
            continue
        if e.name in PHASES:
            phase_us[e.name.split("::")[1]] += end - start
            phase_iv.append((e.name.split("::")[1], start, end))
            continue
        if e.name in _ISSUED or e.name == _WAIT:
            calls.append(_call(e))
            continue
        if e.name == PREFETCH_WAIT:
            prefetch_waits.append((start, end))
            continue
        anc = list(_ancestors(e))
        in_comm = any(COMM.match(a.name) for a in anc)
        if COMPUTE.search(e.name) and not in_comm and not COMM.match(e.name):
            compute_iv.append((start, end))
        in_reducer = any("reducer::" in a.name for a in anc)
        if not _is_copy(e, in_reducer):
            continue
        if any(_is_copy(a, in_reducer) for a in anc):
            continue  # counted with its outermost copy ancestor
        nbytes = _copy_bytes(e, in_reducer)
        if in_comm:
            comm_internal_bytes += nbytes
        elif any(MACHINERY.search(a.name) for a in anc):
            machinery_bytes += nbytes
            machinery_us += end - start
            machinery_ops[e.name] = machinery_ops.get(e.name, 0) + 1
    comm = _union((t.start, t.end) for t in transfers)
    compute = _union(compute_iv)
    comm_us = _length(comm)
    hidden_us = _intersection(comm, compute)
    return {
        "runtime_copy_bytes": int(machinery_bytes),
        "runtime_copy_ms": machinery_us / 1e3,
        "runtime_copy_ops": machinery_ops,
        "comm_internal_copy_bytes": int(comm_internal_bytes),
        "comm_ms": comm_us / 1e3,
        "comm_hidden_ms": hidden_us / 1e3,
        "compute_ms": _length(compute) / 1e3,
        "phase_ms": {k: v / 1e3 for k, v in phase_us.items()},
        "collectives": _prefetched_rows(prefetch_waits, phase_iv, window[0])
        + per_collective(calls, transfers, compute, phase_iv, window[0]),
    }


def _prefetched_rows(waits: list[tuple[float, float]], phases, t0: float) -> list[dict]:
    """A row for each all-gather the previous step issued for this one (``prefetch_next_step``): only
    its wait is in this step (the agreement and the wait for the transfer), and all of it is exposed."""
    return [{"name": "AG (issued at the last step)", "kind": "AG",
             "phase": next((ph for ph, s, e in phases if s <= start < e), None), "bytes": None,
             "issue_ms": (start - t0) / 1e3, "call_ms": 0.0, "transfer_ms": None, "hidden_ms": 0.0,
             "exposed_ms": (end - start) / 1e3, "window_ms": None, "wait_ms": (end - start) / 1e3}
            for start, end in waits]


# ----------------------------------------------------------------------------------------------------
# Graphs: copies on the data path of a collective (compiled FSDP: SimpleFSDP, fsdp_pass)
# ----------------------------------------------------------------------------------------------------

_aten = torch.ops.aten
_c10d = torch.ops._c10d_functional
COLLECTIVES = {_c10d.all_gather_into_tensor.default, _c10d.reduce_scatter_tensor.default,
               _c10d.all_reduce.default, _c10d.all_gather_into_tensor_out.default}
for _name in ("all_gather_into_tensor_coalesced", "reduce_scatter_tensor_coalesced", "all_reduce_coalesced"):
    if hasattr(_c10d, _name):
        COLLECTIVES.add(getattr(_c10d, _name).default)
GRAPH_COPIES = {_aten.cat.default, _aten.copy_.default, _aten.copy.default, _aten.clone.default,
                _aten.split_with_sizes_copy.default, _aten.constant_pad_nd.default, _aten._chunk_cat.default,
                _aten.slice_scatter.default}
if hasattr(_aten, "chunk_cat"):
    GRAPH_COPIES.add(_aten.chunk_cat.default)
VIEWS = {_aten.view.default, _aten.view.dtype, _aten._unsafe_view.default, _aten.reshape.default, _aten.split_with_sizes.default,
         _aten.split.Tensor, _aten.slice.Tensor, _aten.t.default, _aten.permute.default, _aten.transpose.int,
         _aten.expand.default, _aten.alias.default, _aten.as_strided.default, _aten.squeeze.dim,
         _aten.unsqueeze.default, _aten.narrow.default, _aten.select.int, _aten.squeeze.default}
# Producers Inductor calls as extern kernels: their outputs cannot be written into a concatenation in place.
EXTERN = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default,
          _aten._scaled_dot_product_flash_attention_for_cpu.default,
          _aten._scaled_dot_product_flash_attention_for_cpu_backward.default}
# Reductions: Inductor computes one into a buffer of its own, so a ``copy_`` of it into a bucket is a
# copy (a ``cat`` realizes a reduction straight into its slice: ``ConcatKernel.can_realize_into_without_copy``).
REDUCTIONS = {_aten.sum.default, _aten.sum.dim_IntList, _aten.mean.default, _aten.mean.dim, _aten.amax.default,
              _aten.amin.default, _aten.max.dim, _aten.min.dim, _aten.prod.default, _aten.prod.dim_int,
              _aten.var.correction, _aten.linalg_vector_norm.default}


def _is_getitem(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "getitem"


def _is_control_deps(n: fx.Node) -> bool:
    return n.op == "call_function" and getattr(n.target, "__name__", "") == "control_deps"


def _data_inputs(n: fx.Node) -> list[fx.Node]:
    """Inputs that carry data: ``control_deps(deps, subgraph, *args)`` (Inductor's overlap-ordering
    wrapper) carries only ``args``."""
    if _is_control_deps(n):
        return [a for a in n.args[2:] if isinstance(a, fx.Node)]
    return n.all_input_nodes


def _is_wait(n: fx.Node) -> bool:
    if n.target is _c10d.wait_tensor.default:
        return True
    return _is_control_deps(n) and "wait_tensor" in str(getattr(n.args[1], "target", n.args[1]))


def _bucket_op(n: fx.Node) -> str | None:
    """Inductor's bucketing copy-in ops (``bucketing._pre_bucket_all_gather`` / ``_reduce_scatter``)."""
    name = str(n.target) if n.op == "call_function" else ""
    if name.startswith("bucketing._pre_bucket_all_gather"):
        return "ag"
    if name.startswith("bucketing._pre_bucket_reduce_scatter"):
        return "rs"
    return None


def _is_copy_node(n: fx.Node) -> bool:
    return n.op == "call_function" and (n.target in GRAPH_COPIES or _bucket_op(n) is not None)


def _passthrough(n: fx.Node) -> bool:
    return n.target in VIEWS or _is_copy_node(n) or _is_getitem(n)


def _nbytes(n: fx.Node) -> int:
    v = n.meta.get("val")
    if isinstance(v, torch.Tensor):
        return v.numel() * v.element_size()
    if isinstance(v, (list, tuple)):
        return sum(x.numel() * x.element_size() for x in v if isinstance(x, torch.Tensor))
    return 0


def _feeds_collective(n: fx.Node) -> bool:
    stack, seen = [n], set()
    while stack:
        cur = stack.pop()
        if cur.target is _aten.copy_.default:
            # It writes into its destination (a view of a buffer): follow the buffer. Not a graph input:
            # a copy_ into one is an input mutation (aot_autograd's epilogue), not a bucket being filled.
            base = _origin(cur.args[0])
            if base.op != "placeholder" and base not in seen:
                seen.add(base)
                stack.append(base)
        for u in cur.users:
            if u in seen:
                continue
            seen.add(u)
            if u.target in COLLECTIVES and cur in _data_inputs(u):
                return True
            if _passthrough(u):
                stack.append(u)
    return False


# Views that unflatten a gathered buffer into parameters. A copy reached from a gather only through
# these is a copy-out; one behind a transpose/permute/expand is the model's own (e.g. ``matmul`` making
# a transposed 3-D weight contiguous), which every system pays in its compute.
UNFLATTEN = {_aten.view.default, _aten.view.dtype, _aten._unsafe_view.default, _aten.reshape.default,
             _aten.split_with_sizes.default, _aten.split.Tensor, _aten.slice.Tensor, _aten.narrow.default,
             _aten.as_strided.default, _aten.alias.default, _aten.squeeze.dim, _aten.squeeze.default,
             _aten.unsqueeze.default, _aten.select.int}


def _fed_by_collective(n: fx.Node) -> bool:
    stack, seen = list(_data_inputs(n)), set()
    while stack:
        cur = stack.pop()
        if cur in seen:
            continue
        seen.add(cur)
        if _is_wait(cur):
            if any(x.target in COLLECTIVES for x in _data_inputs(cur)):
                return True
            stack.extend(_data_inputs(cur))
        elif cur.target in UNFLATTEN or _is_copy_node(cur) or _is_getitem(cur):
            stack.extend(_data_inputs(cur))
    return False


def _origin(n: fx.Node) -> fx.Node:
    while n.op == "call_function" and (n.target in VIEWS or _is_getitem(n)) and n.all_input_nodes:
        n = n.all_input_nodes[0]
    return n


def _from_extern(x: fx.Node) -> bool:
    o = _origin(x)
    if _is_control_deps(o):  # the wrapped op's name is the subgraph's
        return any(k in str(getattr(o.args[1], "target", o.args[1])) for k in ("mm", "bmm", "attention", "wait_tensor"))
    return o.op == "placeholder" or o.target in EXTERN or o.target is _c10d.wait_tensor.default


def _from_reduction(x: fx.Node) -> bool:
    return _origin(x).target in REDUCTIONS


def graph_copy_bytes(gm: fx.GraphModule, inductor: bool) -> dict:
    """Copies on a collective's data path in one graph (runs once per step).

    A copy-like node counts when its output reaches a collective's input through views and other
    copies only (a ``copy_`` through the buffer it writes into), or its input comes from a
    collective's wait through unflattening views (no transpose/permute/expand) and other copies only.
    Under Inductor a ``cat`` costs only the inputs that come from extern kernels (matmuls, attention)
    or graph inputs: pointwise producers write straight into the concatenated buffer; a ``copy_``
    costs its source when that is an extern kernel, a graph input or a reduction, and nothing when it
    is pointwise or a constant (fused into the store). A matmul that writes into the bucket itself
    (``fsdp_pass::matmul_into``) is no copy. Under aot_eager a ``copy_`` costs its source."""
    total = 0
    ops: dict[str, int] = {}
    for n in gm.graph.nodes:
        if not _is_copy_node(n):
            continue
        if not (_feeds_collective(n) or _fed_by_collective(n)):
            continue
        bucket = _bucket_op(n)
        if n.target is _aten.copy_.default:
            src = n.args[1]
            # Inductor computes a pointwise or constant source straight into the destination.
            materialized = _from_extern(src) or _from_reduction(src)
            nbytes = _nbytes(src) if materialized or not inductor else 0
        elif bucket == "ag":  # copies this rank's shards into its slot of the gather buffer
            nbytes = _nbytes(n) // int(n.args[1])
        elif inductor and (n.target is _aten.cat.default or bucket == "rs"):
            nbytes = sum(_nbytes(x) for x in n.args[0] if isinstance(x, fx.Node) and _from_extern(x))
        else:
            nbytes = _nbytes(n)
        total += nbytes
        name = str(n.target).replace(".default", "")
        ops[name] = ops.get(name, 0) + 1
    return {"bytes": total, "ops": ops}
