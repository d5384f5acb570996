"""GPU check: what runs differently on CUDA than on CPU, run on one GPU (benchmarks/gpu_check.sh runs every check).

docs/reliability.md ("What runs differently on GPU") lists every such path in fsdp_pass, what covers it on CPU
and which check here runs it. Each check prints one ``PASS``/``FAIL``/``SKIP``/``INFO`` line per item and exits
non-zero when an item failed on any rank; ``--device cpu`` runs the same code on gloo (a dry run without a GPU:
the GPU-only items say SKIP).

``--check`` picks one (each is its own launch, as gpu_check.sh runs them):

* ``nccl`` (one rank, NCCL): the default group bound to ``cuda:LOCAL_RANK`` by ``init_process_group(...,
  device_id=...)``; fsdp_pass's group maker splitting that communicator (``split_group``), the shard rows
  exchanged over NCCL with the launcher's node variables set; a compiled llama (fsdp_pass.testing.models) under
  Inductor on CUDA (Triton kernels) against eager, fp32; a ``non_blocking`` copy from pinned memory into a
  sharded parameter; a meta-device model sharded onto the bound device; CUDA graphs refused on CUDA.
* ``nccl-shared-gpu`` (two ranks on one GPU): whether NCCL runs two ranks on one device (it is not expected
  to); informational.
* ``gloo-cuda`` (two ranks on one GPU): whether gloo gives the right values for the collectives fsdp_pass
  issues on CUDA tensors (the Work API's all-gather, the functional all-reduce, reduce-scatter, all-to-all and
  all-gather); informational, and the condition for ``nodes``.
* ``cuda-only`` (two ranks on one GPU): the default group has a backend for CUDA tensors only (``cuda:gloo``),
  as a ``nccl`` group has, so a collective on a CPU tensor fails here as it would on NCCL: the groups
  fsdp_pass splits, the shard rows, the compile's agreement check; then ``fully_shard`` of a meta-device model
  without a mesh (are the shards on the GPU?).
* ``nodes`` (four ranks on one GPU, launched as two nodes of two by two ``torchrun`` agents): the launcher's
  node variables make the two-level collectives and the ``reshard_after_forward=2`` node groups; the default
  group is bound to the GPU. NCCL refuses two ranks on one device, so this check runs gloo for CUDA tensors
  (``cpu:gloo,cuda:gloo``; it needs step gloo-cuda to pass): every CUDA-side path of fsdp_pass runs (bound
  device, ``split_group``, CUDA tensors through the collectives and their waits, Inductor on CUDA, the overlap
  schedule kept for CUDA tensors, FP8 all-gather and stochastic quantized reduction on CUDA,
  ``clip_grad_norm_``), NCCL's kernels do not. Losses and final parameters are compared with one process on
  the global batch.
* ``bench`` (one rank, NCCL, the default): fsdp_pass (Inductor, bf16) against FSDP2 at world size 1. At world
  size 1 FSDP2 still copies parameters in and out of its flat buffers every step, while fsdp_pass's parameters
  are views of the (here trivially) gathered bucket. First checks numerics: one fp32 step of fsdp_pass compiled
  by Inductor against the same model run eagerly (TF32 off), loss and every gradient. Then reports median step
  time, peak CUDA memory and the NCCL/CUDA environment for bf16 mixed precision; writes JSON. One process has
  no communication to order or overlap.

Runs as ``torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --check nccl`` and so on (see
gpu_check.sh, which also sets ``PYTHONPATH`` and the time limits).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_pass

CHECKS = ("bench", "nccl", "nccl-shared-gpu", "gloo-cuda", "cuda-only", "nodes")


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.attn_norm, self.ffn_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim, bias=False), nn.Linear(dim, dim, bias=False)
        self.up, self.gate, self.down = (nn.Linear(dim, 4 * dim, bias=False), nn.Linear(dim, 4 * dim, bias=False),
                                         nn.Linear(4 * dim, dim, bias=False))

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, self.heads, d // self.heads).unbind(2)
        attn = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.out(attn.transpose(1, 2).reshape(b, s, d))
        h = self.ffn_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.norm, self.head = nn.RMSNorm(dim), nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


# -- reporting ------------------------------------------------------------------------------------------

class Report:
    """The PASS/FAIL lines of one check on one rank. A failed item does not stop the rank: the ranks keep
    issuing the same collectives, so one rank's failure cannot leave the others waiting in a collective."""

    def __init__(self, check: str, rank: int = 0) -> None:
        self.check, self.rank, self.failed = check, rank, []

    def _line(self, verdict: str, item: str, detail: str, everyone: bool = False) -> None:
        if self.rank == 0 or everyone:
            where = f" [rank {self.rank}]" if everyone else ""
            print(f"{verdict} {self.check}/{item}{where}: {detail}", flush=True)

    def __call__(self, item: str, ok: bool, detail: str) -> bool:
        if not ok:
            self.failed.append(item)
        self._line("PASS" if ok else "FAIL", item, detail, everyone=not ok)
        return ok

    def skip(self, item: str, why: str) -> None:
        self._line("SKIP", item, why)

    def info(self, item: str, detail: str) -> None:
        self._line("INFO", item, detail)

    def attempt(self, item: str, fn, *args):
        """``fn(*args)``; an exception is a FAIL of ``item`` (its message the reason) and gives None."""
        try:
            return fn(*args)
        except Exception as error:  # noqa: BLE001 - each item reports its own failure
            self(item, False, f"{type(error).__name__}: {_first_line(error)}")
            return None

    def exit_code(self, device: torch.device) -> int:
        """1 when an item failed on any rank (collective over the default group while it exists), else 0."""
        failed = len(self.failed)
        if dist.is_initialized():
            count = torch.tensor([failed], dtype=torch.int32, device=device)
            dist.all_reduce(count)
            failed = int(count.item())
        self._line("PASS" if failed == 0 else "FAIL", "all", "every item passed" if failed == 0 else
                   f"{failed} item(s) failed")
        return 1 if failed else 0


def _first_line(error: BaseException) -> str:
    error = getattr(error, "inner_exception", None) or error  # Dynamo wraps backend errors
    text = str(error).strip().splitlines()
    return text[0][:400] if text else type(error).__name__


@contextlib.contextmanager
def _counting(module, name: str):
    """Count calls of ``module.name`` (looked up at call time by the code under test) while inside."""
    original, calls = getattr(module, name), []

    def counted(*args, **kwargs):
        calls.append((args, kwargs))
        return original(*args, **kwargs)

    setattr(module, name, counted)
    try:
        yield calls
    finally:
        setattr(module, name, original)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-12)).item()


def _exact_fp32(device: torch.device) -> None:
    """TF32 off: Inductor and eager then differ only by fp32 rounding."""
    torch.set_float32_matmul_precision("highest")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False


def _setup(device_name: str, backend: str | None, bind: bool) -> torch.device:
    """This process's device (``cuda:LOCAL_RANK % device count``, made current) and its default group;
    ``bind``: bound to that device (``init_process_group(device_id=...)``)."""
    if device_name == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("FAIL setup: --device cuda, but torch sees no CUDA device")
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        torch.zeros(1, device=device)  # initialise CUDA here: DeviceMesh would otherwise pick cuda:LOCAL_RANK
    else:
        device = torch.device("cpu")
    kwargs = {"device_id": device} if bind and device.type == "cuda" else {}
    dist.init_process_group(backend, timeout=timedelta(seconds=90), **kwargs)
    return device


def _everywhere(ok: bool, device: torch.device) -> bool:
    """Whether ``ok`` holds on every rank (one all-reduce): ranks leave a check together."""
    flag = torch.tensor([0 if ok else 1], dtype=torch.int32, device=device)
    dist.all_reduce(flag)
    return flag.item() == 0


def _graph_code(stage_suffix: str = " (inductor code)") -> str:
    from fsdp_pass.compile.backend import records

    return "\n".join(code for r in records() for stage, code in r.graphs.items() if stage.endswith(stage_suffix))


def _most_in_flight(graph) -> int:
    """The most functional collectives a scheduled graph has issued and not yet waited for at one point."""
    c10d = torch.ops._c10d_functional
    outstanding, most = set(), 0
    for node in graph.nodes:
        target = node.target
        if not (node.op == "call_function" and isinstance(target, torch._ops.OpOverload)):
            continue
        if target is c10d.wait_tensor.default:
            outstanding.discard(node.args[0])
        elif target.namespace == "_c10d_functional":
            outstanding.add(node)
            most = max(most, len(outstanding))
    return most


# -- the checks -----------------------------------------------------------------------------------------

def _small_llama(vocab: int, dim: int, ffn: int, seq: int):
    from fsdp_pass.testing.models import LlamaConfig

    return LlamaConfig(vocab=vocab, dim=dim, layers=2, heads=4, kv_heads=2, ffn=ffn, seq=seq)


def check_nccl(args, report: Report) -> torch.device:
    """One rank, NCCL, the default group bound to the GPU: the paths that differ at setup, then Inductor."""
    from torch._inductor import config as inductor_config

    from fsdp_pass.buckets.launcher_nodes import groups_made_everywhere, world_rows
    from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor
    from fsdp_pass.testing.models import Llama, init_std, lm_loss, random_tokens

    cuda = args.device == "cuda"
    device = _setup(args.device, "nccl" if cuda else "gloo", bind=True)
    world = dist.get_world_size()
    default = dist.distributed_c10d._get_default_group()
    report("bound-device", default.bound_device_id == (device if cuda else None),
           f"backend {dist.get_backend()}, default group's bound_device_id {default.bound_device_id}")

    # [Note: every rank makes every group]: with a bound accelerator the groups are split from the default
    # communicator (ncclCommSplit), once for all of them
    with _counting(dist, "split_group") as splits, _counting(dist, "new_group") as news:
        group = report.attempt("split-group", groups_made_everywhere, [list(range(world))], default, device.type)
    if group is not None:
        ones = torch.ones(1, device=device)
        dist.all_reduce(ones, group=group)
        made = f"{len(splits)} split_group and {len(news)} new_group call(s), group backend {dist.get_backend(group)}"
        report("split-group", (len(splits), len(news)) == ((1, 0) if cuda else (0, 1)) and ones.item() == world,
               made + f", all_reduce over it gave {ones.item():g} (expected {world})")
    rows = report.attempt("shard-rows", world_rows, default)  # all_gather_object over NCCL with a bound device
    if rows is not None:
        nodes = os.environ.get("GROUP_RANK")
        report("shard-rows", rows.rows == (tuple(range(world)),) and (nodes is None or rows.node_of is not None),
               f"rows {rows.rows}, nodes {rows.node_of} (GROUP_RANK={nodes})")

    _exact_fp32(device)
    cfg = _small_llama(vocab=512, dim=128, ffn=256, seq=64)
    torch.manual_seed(0)
    base = init_std(Llama(cfg)).to(device)
    tokens = random_tokens(cfg, 4, seed=1).to(device)
    eager, model = copy.deepcopy(base), copy.deepcopy(base)
    compiled = torch.compile(model, backend="vescale", options={"compiler": args.compiler})
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    losses = []
    for m in (eager, compiled):
        loss = lm_loss(m(tokens), tokens)
        loss.backward()
        losses.append(loss.detach())

    def whole(t):
        return t.full_tensor() if isinstance(t, RaggedShardTensor) else t

    grads = [_rel(whole(p.grad), q.grad) for p, q in zip(model.parameters(), eager.parameters())]
    report(f"{args.compiler}-numerics", _rel(losses[1], losses[0]) < 1e-5 and max(grads) < 1e-4,
           f"compiled llama on {device} against eager, fp32: loss rel diff {_rel(losses[1], losses[0]):.1e} "
           f"(< 1e-5), worst gradient rel diff {max(grads):.1e} (< 1e-4)")
    sharded = [p for p in model.parameters() if isinstance(p, RaggedShardTensor)]
    report("shards-on-device", bool(sharded) and all(p.piece.device == device for p in sharded),
           f"{len(sharded)} sharded parameters, pieces on {sorted({str(p.piece.device) for p in sharded})}")
    code = _graph_code()
    if args.compiler != "inductor":
        report.skip("triton", f"compiler {args.compiler}")
    elif cuda:
        report("triton", "triton" in code, f"Inductor's generated code ({len(code)} characters) "
                                           f"{'imports' if 'triton' in code else 'does not import'} triton")
    else:
        report.skip("triton", "CPU: Inductor writes C++ kernels")
    if cuda:
        report.info("peak-memory", f"{torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB allocated at peak "
                                   f"(torch.cuda.max_memory_allocated; fsdp_pass reports no memory of its own)")

    # a non_blocking copy from pinned host memory into a sharded parameter: the copy is asynchronous on CUDA
    # (on CPU non_blocking does nothing), and what reads the parameter next is ordered after it on the stream
    p = sharded[0] if sharded else None
    if p is not None:
        whole_value = torch.randn(p.shape)
        source = whole_value.pin_memory() if cuda else whole_value
        with torch.no_grad():
            p.copy_(source, non_blocking=True)
        back = p.full_tensor().cpu()
        report("non-blocking-copy", torch.equal(back, whole_value),
               f"{'pinned ' if cuda else ''}host tensor {tuple(p.shape)} copied into a RaggedShard parameter with "
               f"non_blocking=True, read back {'equal' if torch.equal(back, whole_value) else 'DIFFERENT'}")

    # a meta-device model sharded over the default mesh (backend 'nccl': a CUDA mesh): shards on the bound device
    with torch.device("meta"):
        meta_model = Llama(cfg)
    fsdp_pass.fully_shard(meta_model)
    places = sorted({str(q.piece.device) for q in meta_model.parameters() if isinstance(q, RaggedShardTensor)})
    report("meta-init", places == [str(device)], f"meta-device llama after fully_shard: shards on {places}")

    # CUDA graphs: refused however they are turned on (here the global Inductor config), on a real device
    with inductor_config.patch({"triton.cudagraphs": True}):
        try:
            torch.compile(nn.Linear(8, 8).to(device), backend="vescale")(torch.ones(2, 8, device=device))
            refusal = None
        except Exception as error:  # noqa: BLE001
            refusal = _first_line(error)
    report("cudagraphs-refused", refusal is not None and "CUDA graphs" in refusal,
           f"triton.cudagraphs=True: {refusal or 'NOT refused'}")
    return device


def check_cuda_only(args, report: Report) -> torch.device:
    """Two ranks on the GPU, the default group with a backend for CUDA tensors only (``cuda:gloo``), as an
    ``init_process_group("nccl")`` group has: a collective on a CPU tensor raises ``No backend type associated
    with device type cpu`` here as it does on NCCL. What fsdp_pass runs before any bucket's collective: the
    groups it splits, the shard rows, the compile's agreement check; then ``fully_shard`` of a meta-device
    model without a mesh (the default mesh's device comes from ``dist.get_backend()``). None of it needs gloo's
    functional collectives on CUDA tensors (step gloo-cuda)."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_pass.buckets.launcher_nodes import groups_made_everywhere, world_rows
    from fsdp_pass.sharding.agreement import check_ranks_agree
    from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor
    from fsdp_pass.testing.models import Llama

    cuda = args.device == "cuda"
    device = _setup(args.device, "cuda:gloo" if cuda else "gloo", bind=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    report.rank = rank
    default = dist.distributed_c10d._get_default_group()
    report("backend", world == 2 and (dist.get_backend() == "cuda:gloo") == cuda,
           f"{world} ranks, default group {dist.get_backend()!r} bound to {default.bound_device_id}"
           + ("" if cuda else " (dry run: CPU tensors need the CPU backend)"))
    with _counting(dist, "split_group") as splits:
        group = report.attempt("split-group", groups_made_everywhere, [[r] for r in range(world)], default,
                               device.type)
    if _everywhere(group is not None, device):
        report("split-group", dist.get_process_group_ranks(group) == [rank] and len(splits) == (1 if cuda else 0),
               f"{len(splits)} split_group call(s), this rank's group {dist.get_process_group_ranks(group)}")
    rows = report.attempt("shard-rows", world_rows, default)
    if rows is not None:
        report("shard-rows", rows.rows == (tuple(range(world)),), f"rows {rows.rows}, nodes {rows.node_of}")
    mesh = init_device_mesh(device.type, (world,))
    # sharding/agreement.py: every compile of a graph with parameters, before anything is sharded
    agreed = report.attempt("agreement", lambda: check_ranks_agree(["w:(2, 2)"], "the parameters this graph uses",
                                                                   mesh) or True)
    if agreed:
        report("agreement", True, "check_ranks_agree over the mesh's group")

    # the default mesh (no mesh given) of a meta-device model: on the current accelerator, whatever the backend's name
    with torch.device("meta"):
        meta_model = Llama(_small_llama(vocab=256, dim=64, ffn=128, seq=32))
    if _everywhere(report.attempt("default-mesh", fsdp_pass.fully_shard, meta_model) is not None, device):
        places = sorted({str(q.piece.device) for q in meta_model.parameters() if isinstance(q, RaggedShardTensor)})
        report("default-mesh", places == [str(device)],
               f"fully_shard(meta model) without a mesh under {dist.get_backend()!r}: shards on {places}, expected "
               f"[{str(device)!r}] (fsdp_pass/sharding/mesh_roles.py default_device_type)")
    return device


def check_gloo_cuda(args, report: Report) -> torch.device:
    """Two ranks on the GPU, gloo carrying CUDA tensors (``cuda:gloo``): do the collectives fsdp_pass issues give
    the right values? Informational, and the gate of step nodes: gloo stages CUDA tensors through host memory
    for its all-gather, all-reduce and all-to-all, but in the torch sources read its coalesced all-gather,
    which the functional all-gather calls, has no CUDA path. The functional all-gather runs last: it may crash."""
    cuda = args.device == "cuda"
    device = _setup(args.device, "cuda:gloo" if cuda else "gloo", bind=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    report.rank = rank
    c10d, name = torch.ops._c10d_functional, dist.group.WORLD.group_name
    mine = torch.arange(4, dtype=torch.float32, device=device) + 10 * rank
    every = torch.cat([torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world)])
    rows = torch.arange(4 * world, dtype=torch.float32, device=device) + rank  # row r goes to rank r

    def gathered_with_work():
        out = torch.empty(4 * world, device=device)
        dist.all_gather_into_tensor(out, mine, async_op=True).wait()  # step/prefetch.py's form
        return out

    results = {}
    for item, run, expected in (
            ("work-all-gather", gathered_with_work, every),
            ("all-reduce", lambda: c10d.wait_tensor(c10d.all_reduce(mine, "sum", name)),
             sum(torch.arange(4, dtype=torch.float32) + 10 * r for r in range(world))),
            ("reduce-scatter", lambda: c10d.wait_tensor(c10d.reduce_scatter_tensor(rows, "sum", world, name)),
             world * torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + sum(range(world))),
            ("all-to-all", lambda: c10d.wait_tensor(c10d.all_to_all_single(rows, [4] * world, [4] * world, name)),
             torch.cat([torch.arange(4 * rank, 4 * rank + 4, dtype=torch.float32) + r for r in range(world)])),
            ("all-gather", lambda: c10d.wait_tensor(c10d.all_gather_into_tensor(mine, world, name)), every)):
        got = report.attempt(item, run)
        results[item] = got is not None and torch.equal(got.cpu(), expected)
        if got is not None:
            report(item, results[item], f"{'functional ' if item != 'work-all-gather' else ''}{item} of {device} "
                                        f"tensors over {dist.get_backend()}: {'right' if results[item] else 'WRONG'} "
                                        f"values")
    if _everywhere(all(results.values()), device):
        report("functional-collectives", True, "every collective fsdp_pass issues gives the right values on "
                                               f"{device} tensors over {dist.get_backend()}: step nodes can run")
    return device


def check_nccl_shared_gpu(args, report: Report) -> torch.device:
    """Two ranks, one GPU, NCCL: informational (NCCL is expected to refuse a device held by two ranks)."""
    if args.device != "cuda":
        report.skip("two-ranks-one-gpu", "needs a GPU")
        return torch.device("cpu")
    try:
        device = _setup("cuda", "nccl", bind=True)
        x = torch.ones(1, device=device)
        dist.all_reduce(x)
        torch.cuda.synchronize()
        report.info("two-ranks-one-gpu", f"NCCL ran {dist.get_world_size()} ranks on {device}: all_reduce gave "
                                         f"{x.item():g}")
    except Exception as error:  # noqa: BLE001 - the expected outcome is an error
        print(f"INFO nccl-shared-gpu/two-ranks-one-gpu [rank {os.environ.get('RANK')}]: NCCL refused: "
              f"{type(error).__name__}: {_first_line(error)}", flush=True)
        raise SystemExit(3)
    return device


def check_nodes(args, report: Report) -> torch.device:
    """Four ranks on one GPU as two nodes of two (torchrun's GROUP_RANK, LOCAL_WORLD_SIZE), gloo for CUDA
    tensors, the default group bound to the GPU; fsdp_pass against one process on the global batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_pass.buckets.mesh import ShardingMesh
    from fsdp_pass.buckets.node_collectives import all_gather_in_two_levels, reduce_scatter_in_two_levels
    from fsdp_pass.buckets.quantized_reduce import ROUNDING_STREAM
    from fsdp_pass.compile.backend import records

    cuda = args.device == "cuda"
    # NCCL refuses two ranks on one device (check nccl-shared-gpu shows it): gloo carries the CUDA tensors
    device = _setup(args.device, "cpu:gloo,cuda:gloo" if cuda else "gloo", bind=True)
    rank, world = dist.get_rank(), dist.get_world_size()
    report.rank = rank
    nodes, per_node = os.environ.get("GROUP_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
    report("launcher", nodes is not None and per_node == "2" and world == 4,
           f"world {world}, GROUP_RANK={nodes}, LOCAL_WORLD_SIZE={per_node} (two torchrun agents of 2 ranks)")
    bound = dist.distributed_c10d._get_default_group().bound_device_id
    report("bound-device", bound == (device if cuda else None),
           f"backend {dist.get_backend()}, bound_device_id {bound}, every rank on {device}")
    mesh = init_device_mesh(device.type, (world,))
    sharding = ShardingMesh(mesh, 0)
    with _counting(dist, "split_group") as splits, _counting(dist, "new_group") as news:
        levels = report.attempt("two-levels", sharding.node_levels)
        group_k = report.attempt("node-groups", sharding.node_group, 2)
    if not _everywhere(levels is not None and group_k is not None, device):
        return device  # every rank stops here: what follows needs the groups
    resolve = dist.distributed_c10d._resolve_process_group
    within = dist.get_process_group_ranks(resolve(levels.within))
    across = dist.get_process_group_ranks(resolve(levels.across))
    report("two-levels", (levels.nodes, levels.per_node) == (2, 2) and within == [rank // 2 * 2, rank // 2 * 2 + 1]
           and across == [rank % 2, rank % 2 + 2], f"{levels.nodes} nodes of {levels.per_node}: within {within}, "
                                                   f"across {across}")
    report("node-groups", dist.get_process_group_ranks(resolve(group_k.group_name)) == within,
           f"reshard_after_forward=2 group {dist.get_process_group_ranks(resolve(group_k.group_name))}")
    report("groups-made", (len(splits) > 0 and not news) if cuda else (len(news) > 0 and not splits),
           f"{len(splits)} split_group / {len(news)} new_group call(s) "
           f"({'split from the bound communicator' if cuda else 'no bound device: new_group'})")

    # the two-level collectives on this device's tensors against the one-step ones
    torch.manual_seed(rank)
    shard = torch.randn(7, device=device)
    grad = torch.randn(world * 7, device=device) * torch.logspace(-3, 3, world * 7, device=device)
    flat = torch.empty(world * 7, device=device)
    dist.all_gather_into_tensor(flat, shard)
    every = [torch.empty_like(grad) for _ in range(world)]
    dist.all_gather(every, grad)
    exact = torch.stack(every).double().sum(0)[rank * 7:(rank + 1) * 7]
    gathered = all_gather_in_two_levels(shard, levels)
    reduced = reduce_scatter_in_two_levels(grad, levels)
    report("two-level-collectives", torch.equal(gathered, flat) and torch.allclose(reduced.double(), exact, 1e-6, 1e-6),
           f"on {device}: all-gather {'equal' if torch.equal(gathered, flat) else 'DIFFERS'}, reduce-scatter rel diff "
           f"{_rel(reduced, exact):.1e}")

    _exact_fp32(device)
    cfg = _small_llama(vocab=256, dim=64, ffn=128, seq=32)
    exact_options = {"reshard_after_forward": 2, "prefetch_next_step": True, "overlap_last_reduce": True}
    lossy_options = {"mp_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32},
                     "fp8_all_gather": {"tile": 32}, "quantized_reduce": {"block": 32, "rounding": "stochastic"}}
    for name, extra, optimizer, tolerance in (("fp32", exact_options, "sgd", 1e-4),
                                              ("bf16-fp8-quantized", lossy_options, "adamw", 5e-2)):
        # not an attempt: a rank that raises here must end the run (the others would wait in its collectives)
        losses, reference, params_rel = _train_against_one_process(cfg, mesh, device, args.compiler, extra, optimizer)
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        report(f"train-{name}", worst < tolerance and params_rel < max(tolerance, 1e-4),
               f"{args.compiler}, {optimizer}, {sorted(extra)}: losses {['%.5f' % x for x in losses]} against one "
               f"process {['%.5f' % x for x in reference]}, worst rel diff {worst:.1e}, final parameters rel diff "
               f"{params_rel:.1e} (< {tolerance:g})")
        record = records()[-1]
        groups = {node.args[2] for gm in record.modules.values() for node in gm.graph.find_nodes(
            op="call_function", target=torch.ops._c10d_functional.all_gather_into_tensor.default)}
        report(f"train-{name}-two-levels", {levels.across, levels.within} <= groups,
               f"the compiled graphs gather over {len(groups)} group(s), the across and within groups among them")
        in_flight = max(_most_in_flight(gm.graph) for gm in record.modules.values())
        # [Note: one collective in flight on gloo]: CPU tensors get one at a time; CUDA tensors the overlap schedule
        report(f"train-{name}-schedule", in_flight > 1 if cuda else in_flight == 1,
               f"at most {in_flight} collective(s) in flight in a compiled graph "
               f"({'overlap kept for CUDA tensors' if cuda else 'one at a time for CPU tensors'})")
        if name != "fp32":
            code = "\n".join(record.graphs.values())
            report("fp8-gather", "fp8_pack_shard" in code, "the forward packs FP8 codes (fsdp_pass::fp8_pack_shard)"
                   if "fp8_pack_shard" in code else "no fsdp_pass::fp8_pack_shard in the graphs")
            generators = sorted(str(d) for d in ROUNDING_STREAM._generators)
            report("rounding-stream", generators == [str(device)],
                   f"stochastic rounding drew from generators on {generators}")
    if cuda and args.compiler == "inductor":
        code = _graph_code()
        report("triton", "triton" in code, f"Inductor's code for the sharded graphs "
                                           f"{'imports' if 'triton' in code else 'does not import'} triton")
        report.info("peak-memory", f"rank {rank}: {torch.cuda.max_memory_allocated(device) / 2**20:.1f} MiB at peak")
    return device


def _train_against_one_process(cfg, mesh, device: torch.device, compiler: str, extra: dict, optimizer: str):
    """Three steps of fsdp_pass on this rank's part of the global batch, and of one process on all of it
    (here, eagerly); the global losses of both and the final parameters' relative difference (on every rank)."""
    from fsdp_pass.testing.models import Llama, init_std, lm_loss, random_tokens

    rank, world = dist.get_rank(), dist.get_world_size()
    per_rank = 2
    torch.manual_seed(0)
    base = init_std(Llama(cfg)).to(device)
    reference, model = copy.deepcopy(base), copy.deepcopy(base)
    options = {"mesh": mesh, "compiler": compiler, "min_bucket_bytes": 0, **extra}
    compiled = torch.compile(model, backend="vescale", options=options)

    def make(params, fused):
        if optimizer == "sgd":
            return torch.optim.SGD(params, lr=0.1)
        return torch.optim.AdamW(params, lr=1e-3, **({"fused": True} if fused else {}))

    opt, ref_opt = make(model.parameters(), device.type == "cuda"), make(reference.parameters(), False)
    losses, reference_losses = [], []
    for step in range(3):
        tokens = random_tokens(cfg, world * per_rank, seed=100 + step).to(device)
        mine = tokens[rank * per_rank:(rank + 1) * per_rank]
        loss = lm_loss(compiled(mine), mine)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # RaggedShard norms: one all-reduce
        opt.step()
        opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses.append(total.item() / world)
        ref_loss = lm_loss(reference(tokens), tokens)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        reference_losses.append(ref_loss.item())
    whole = fsdp_pass.get_full_state_dict(model, rank0_only=False)
    expected = {k: v.detach().cpu() for k, v in reference.state_dict().items()}
    common = sorted(set(whole) & {k for k, _ in reference.named_parameters()})
    if not common:
        raise AssertionError(f"get_full_state_dict gave none of the parameters: {sorted(whole)[:5]}")
    params_rel = max(_rel(whole[k].cpu(), expected[k]) for k in common)
    return losses, reference_losses, params_rel


# -- the benchmark (world size 1) -------------------------------------------------------------------------

def _fsdp2(model: nn.Module, device: str) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (1,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    return fully_shard(model, mesh=mesh, mp_policy=policy)


def _measure(name: str, model: nn.Module, args, device: str) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device == "cuda")
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    times, losses = [], []
    if device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        sync()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad()
        sync()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
            losses.append(loss.item())
    peak = torch.cuda.max_memory_allocated() if device == "cuda" else None
    return {"system": name, "median_ms": 1e3 * statistics.median(times), "min_ms": 1e3 * min(times),
            "max_ms": 1e3 * max(times), "peak_bytes": peak, "last_loss": losses[-1]}


def _numerics(base: nn.Module, args, device: str) -> dict:
    """One fp32 forward/backward: fsdp_pass + Inductor against eager, same tokens; worst relative differences."""
    from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor

    _exact_fp32(torch.device(device))
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), generator=g).to(device)
    losses, grads = [], []
    for model in (copy.deepcopy(base), torch.compile(copy.deepcopy(base), backend="vescale",
                                                     options={"compiler": "inductor"})):
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, args.vocab), tokens[:, 1:].reshape(-1))
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.full_tensor() if isinstance(p.grad, RaggedShardTensor) else p.grad
                      for p in getattr(model, "_orig_mod", model).parameters()])
    torch.set_float32_matmul_precision("high")  # the timed runs below: bf16, TF32 allowed as in training
    if device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    return {"loss_rel": _rel(losses[1], losses[0]), "grad_rel": max(_rel(a, b) for a, b in zip(grads[1], grads[0]))}


def bench(args, report: Report) -> torch.device:
    device = _setup(args.device, "nccl" if args.device == "cuda" else "gloo", bind=False)
    torch.manual_seed(0)
    base = Model(args.vocab, args.dim, args.layers, args.heads).to(device)
    numerics = _numerics(base, args, args.device)
    report("inductor-numerics", numerics["loss_rel"] < 1e-4 and numerics["grad_rel"] < 1e-4,
           f"Inductor vs eager, fp32, one step: loss rel diff {numerics['loss_rel']:.2e}, worst gradient rel diff "
           f"{numerics['grad_rel']:.2e} (< 1e-4)")
    results = []
    fsdp2 = _fsdp2(copy.deepcopy(base), args.device)
    results.append(_measure("FSDP2 eager (bf16)", fsdp2, args, args.device))
    del fsdp2
    ours = torch.compile(copy.deepcopy(base), backend="vescale", options={
        "compiler": "inductor", "mp_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}})
    results.append(_measure("fsdp_pass inductor (bf16)", ours, args, args.device))
    reference = results[0]["median_ms"]
    cuda = args.device == "cuda"
    print(f"torch {torch.__version__}, device {torch.cuda.get_device_name() if cuda else 'cpu'}, "
          f"NCCL {torch.cuda.nccl.version() if cuda else '-'}")
    print(f"{'system':28s} {'median ms':>10s} {'min-max ms':>16s} {'peak MiB':>10s} {'ratio':>7s} {'loss':>8s}")
    for r in results:
        peak = f"{r['peak_bytes'] / 2**20:.0f}" if r["peak_bytes"] is not None else "-"
        print(f"{r['system']:28s} {r['median_ms']:10.1f} {r['min_ms']:7.1f}-{r['max_ms']:<8.1f} {peak:>10s} "
              f"{r['median_ms'] / reference:7.2f} {r['last_loss']:8.4f}")
    gap = abs(results[1]["last_loss"] - results[0]["last_loss"]) / abs(results[0]["last_loss"])
    report("bf16-losses", gap < 2e-2, f"last loss fsdp_pass {results[1]['last_loss']:.4f} against FSDP2 "
                                      f"{results[0]['last_loss']:.4f} (rel diff {gap:.1e} < 2e-2)")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"args": vars(args), "numerics": numerics, "results": results}, f, indent=2)
    return device


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", choices=CHECKS, default="bench", help="which check this launch runs")
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--compiler", choices=["inductor", "aot_eager"], default="inductor",
                        help="the backend's compiler in the nccl and nodes checks (aot_eager: a quicker CPU dry run)")
    parser.add_argument("--dim", type=int, default=2048, help="bench: model width")
    parser.add_argument("--layers", type=int, default=8, help="bench: layers")
    parser.add_argument("--heads", type=int, default=16, help="bench: attention heads")
    parser.add_argument("--vocab", type=int, default=32000, help="bench: vocabulary")
    parser.add_argument("--batch", type=int, default=8, help="bench: sequences per step")
    parser.add_argument("--seq", type=int, default=1024, help="bench: tokens per sequence")
    parser.add_argument("--warmup", type=int, default=3, help="bench: untimed steps")
    parser.add_argument("--steps", type=int, default=10, help="bench: timed steps")
    parser.add_argument("--out", default="benchmarks/results/gpu_check.json", help="bench: the JSON it writes")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    report = Report(args.check, int(os.environ.get("RANK", 0)))
    run = {"bench": bench, "nccl": check_nccl, "nccl-shared-gpu": check_nccl_shared_gpu, "gloo-cuda": check_gloo_cuda,
           "cuda-only": check_cuda_only, "nodes": check_nodes}[args.check]
    try:
        device = run(args, report)
    except Exception as error:
        print(f"FAIL {args.check}/crash [rank {report.rank}]: {type(error).__name__}: {_first_line(error)}", flush=True)
        raise
    code = report.exit_code(device)
    if dist.is_initialized():
        dist.destroy_process_group()
    raise SystemExit(code)


if __name__ == "__main__":
    main()
