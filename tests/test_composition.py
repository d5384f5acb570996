"""FSDP over tensor- and expert-parallel DTensor parameters: FSDP x TP, FSDP x EP, HSDP x EP on 4 gloo ranks.

Each case trains the parallelized, sharded model and the plain model on one process side by side
(same global batch) and checks losses, parameters (``full_tensor()``), ``clip_grad_norm_``, the
memory each rank holds and the collectives of the compiled graphs against the composed layout.
"""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_pass
from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.tensor.ragged_tensor import ragged_part
from fsdp_pass.tensor.ragged_tensor import is_sharded
from fsdp_pass.testing.checkpoints import load_and_compare, whole_state
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss

STEPS, GLOBAL_BATCH, SEQ = 6, 8, 8
TOLERANCE = 1e-5  # relative; sums over TP/EP ranks add in another order than one process does
_c10d = torch.ops._c10d_functional


def tensor_parallel(model: Llama, mesh) -> None:
    """Megatron-style TP on every block: column-parallel q/k/v and w1/w3, row-parallel wo and w2."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {"attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(), "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
            "ffn.w2": RowwiseParallel()}
    for block in model.layers:
        parallelize_module(block, mesh["tp"], plan)


def expert_parallel(model: Llama, mesh) -> None:
    """Split every block's stacked experts ``Shard(0)`` over the EP dim."""
    from torch.distributed.tensor import Shard, distribute_tensor

    for block in model.layers:
        for name in ("w1", "w2", "w3"):
            weight = getattr(block.ffn, name)
            setattr(block.ffn, name, nn.Parameter(distribute_tensor(weight.detach(), mesh["ep"], [Shard(0)])))


CASES = {
    # name: (mesh shape, dim names, options, parallelize, model config, batch split over these dims)
    # one layer each: tracing DTensor graphs costs per layer, and one layer holds every placement
    "tp2_fsdp2": ((2, 2), ("dp", "tp"), {"shard_dim": "dp"}, tensor_parallel, LlamaConfig(layers=1), ("dp",)),
    "ep2_fsdp2": ((2, 2), ("dp", "ep"), {"shard_dim": ("dp", "ep")}, expert_parallel,
                  LlamaConfig(layers=1, experts=4, stacked_experts=True), ("dp", "ep")),
    "hsdp2_ep2": ((2, 1, 2), ("rep", "dp", "ep"), {"shard_dim": ("dp", "ep"), "replicate_dim": "rep"},
                  expert_parallel, LlamaConfig(layers=1, experts=4, stacked_experts=True), ("rep", "dp", "ep")),
}


def _tokens(step: int, vocab: int = LlamaConfig.vocab) -> torch.Tensor:
    """Step ``step``'s global batch, the same on every rank."""
    return torch.randint(0, vocab, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _compile_tp(model: nn.Module, mesh) -> nn.Module:
    return torch.compile(model, backend="vescale", dynamic=False,
                         options={"mesh": mesh, "shard_dim": "dp", "compiler": "aot_eager"})


def _batch_rows(mesh, batch_dims: tuple[str, ...]) -> slice:
    """This rank's rows of the global batch: split over ``batch_dims`` (row-major), same on the others."""
    names = mesh.mesh_dim_names
    index, count = 0, 1
    for name in batch_dims:
        size = mesh.size(names.index(name))
        index, count = index * size + mesh.get_local_rank(name), count * size
    per = GLOBAL_BATCH // count
    return slice(index * per, (index + 1) * per)


def _collectives(gm) -> list[tuple[str, str, int]]:
    """``(op, group name, bytes moved into this rank's output)`` of every collective in a graph."""
    found = []
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or getattr(target, "namespace", None) != "_c10d_functional":
            continue
        op = target.__name__.split(".")[0].rstrip("_")  # all_reduce_ (in place) counts as all_reduce
        if op == "wait_tensor":
            continue
        value = node.meta["val"]
        found.append((op, node.args[-1], value.numel() * value.dtype.itemsize))
    return found


def _composed_worker(rank: int, world: int, case: str, compiler: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    shape, names, options, parallelize, cfg, batch_dims = CASES[case]
    torch._dynamo.reset()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(0)
    model = init_std(Llama(cfg), 0)
    reference = copy.deepcopy(model)
    parallelize(model, mesh)
    if "ep" in names:
        # Expert parallelism sums each token's expert outputs in another order than one process
        # (per EP rank, then across), and AdamW's first steps turn a near-zero gradient's last-bit
        # difference into a whole lr-sized step (1.4e-4 relative on a router at lr 1e-2). SGD
        # shows the sharding's own error; TP runs AdamW.
        make_opt = lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9, weight_decay=0.1)  # noqa: E731
    else:
        make_opt = lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)  # noqa: E731
    opt, ref_opt = make_opt(model.parameters()), make_opt(reference.parameters())
    compiled = torch.compile(model, backend="vescale", dynamic=False,
                             options={"mesh": mesh, "compiler": compiler, **options})
    rows = _batch_rows(mesh, batch_dims)
    data_parallel = math.prod(mesh.size(names.index(n)) for n in batch_dims)
    worst_loss = worst_norm = 0.0
    for step in range(STEPS):
        tokens = _tokens(step, cfg.vocab)
        loss = lm_loss(compiled(tokens[rows]), tokens[rows])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # below the norm: it clips
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(tokens), tokens)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # ranks outside the batch dims hold copies: average over all
        worst_loss = max(worst_loss, abs(total.item() / world - ref_loss.item()) / ref_loss.item())
        norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
        worst_norm = max(worst_norm, abs(norm.item() - ref_norm.item()) / ref_norm.item())
    assert worst_loss <= TOLERANCE, f"{case}: loss rel diff {worst_loss:.3g}"
    assert worst_norm <= TOLERANCE, f"{case}: gradient norm rel diff {worst_norm:.3g}"

    from torch.distributed.tensor import DTensor, Shard

    ref_params = dict(reference.named_parameters())
    model_parallel = 0
    worst_param = 0.0
    for name, p in model.named_parameters():
        assert is_sharded(p), f"{name} was not sharded"
        full = p.full_tensor()
        diff = ((full - ref_params[name]).norm() / ref_params[name].norm()).item()
        assert diff <= TOLERANCE, f"{case}: {name} rel diff {diff:.3g}"
        worst_param = max(worst_param, diff)
        if isinstance(p, DTensor):  # TP/EP first, then FSDP: the DTensor keeps its placement
            model_parallel += 1
            assert all(isinstance(pl, Shard) for pl in p.placements)
            ragged = p._local_tensor
            assert tuple(ragged_part(p)._local.shape) == (ragged.placement.local_numel(ragged._spec.rank),)
            for placement in p.placements:  # Shard(d > 0): no rank boundary cuts the local rows
                if placement.dim > 0:
                    assert ragged.placement.block % math.prod(ragged.shape[placement.dim:]) == 0, name
    assert model_parallel > 0
    if rank == 0:
        print(f"{case} {compiler}: relative differences: loss {worst_loss:.2e}, gradient norm {worst_norm:.2e}, "
              f"parameters {worst_param:.2e}")

    # Each rank holds 1/world of the parameters, plus padding.
    buffers = fsdp_pass.explain(compiled, print_output=False).buffers
    total = sum(p.numel() for p in reference.parameters())
    held = sum(b.layout.shard_size for b in buffers)
    padding = sum(b.layout.padding / b.mesh.shard_size for b in buffers)
    assert held == sum(ragged_part(p)._local.numel() for p in model.parameters()) + padding
    copies = mesh.size(names.index("rep")) if "rep" in names else 1  # HSDP replicas
    counted = torch.tensor([float(held - padding)], dtype=torch.float64)
    dist.all_reduce(counted)
    assert counted.item() == pytest.approx(total * copies), "the pieces do not add up to the model"
    share = total * copies / world
    assert share <= held <= share * 1.05 + 64, f"rank {rank} holds {held} of {total} elements"

    # Communication per step is what the composed layout predicts.
    record = next(r for r in fsdp_pass.compile.backend.records() if r.buffers)
    forward, backward = _collectives(record.modules["forward"]), _collectives(record.modules["backward"])
    fsdp = {b.config(b.dtype, b.dtype).shard_group: b for b in buffers}
    gathers = [(g, n) for op, g, n in forward if op == "all_gather_into_tensor" and g in fsdp]
    expected = sorted((b.config(b.dtype, b.dtype).shard_group, b.layout.shard_size * b.mesh.shard_size * 4)
                      for b in buffers if b.mesh.shard_size > 1)
    assert sorted(gathers) == expected
    scatters = [(g, n) for op, g, n in backward if op == "reduce_scatter_tensor" and g in fsdp]
    assert sorted(scatters) == sorted((g, b.layout.shard_size * 4) for g, b in (
        (b.config(b.dtype, b.dtype).shard_group, b) for b in buffers if b.mesh.shard_size > 1))
    model_ops = sorted((op, n) for op, g, n in forward if g not in fsdp)
    local_batch = GLOBAL_BATCH // data_parallel
    activation = local_batch * SEQ * cfg.dim * 4
    if "tp" in names:  # row-parallel wo and w2 all-reduce their outputs
        assert model_ops == [("all_reduce", activation)] * (2 * cfg.layers)
    else:  # each MoE layer gathers tokens and gates over EP and reduce-scatters the outputs
        ep = mesh.size(names.index("ep"))
        expected_ops = [("all_gather_into_tensor", activation * ep),
                        ("all_gather_into_tensor", local_batch * SEQ * cfg.experts * 4 * ep),
                        ("reduce_scatter_tensor", activation)] * cfg.layers
        assert model_ops == sorted(expected_ops)
    text = fsdp_pass.explain(compiled, print_output=False).plan_text()
    assert "Shard(" in text and "RaggedShard(" in text


# DTensor parameters under Inductor run in tests/test_tp_replicate.py (TP x FSDP, with sequence-parallel
# norms and Replicate() biases): the graphs Inductor gets are plain tensors and functional collectives
# for TP and EP alike; stacked experts' gradients written into buckets under Inductor are checked in
# tests/test_grad_into_bucket.py.
@pytest.mark.parametrize("case,compiler", [("tp2_fsdp2", "aot_eager"), ("ep2_fsdp2", "aot_eager"),
                                           ("hsdp2_ep2", "aot_eager")])
def test_composed_training_matches_one_process(case, compiler):
    run_distributed(_composed_worker, 4, case, compiler, timeout=600, pg_timeout=120)


def _tp_model_and_optimizer(mesh):
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig()), 0)
    if mesh is not None and "tp" in mesh.mesh_dim_names:
        tensor_parallel(model, mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def _save_tp_worker(rank: int, world: int, path: str) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model, opt = _tp_model_and_optimizer(mesh)
    compiled = _compile_tp(model, mesh)
    rows = _batch_rows(mesh, ("dp",))
    for step in range(2):
        tokens = _tokens(step)
        lm_loss(compiled(tokens[rows]), tokens[rows]).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
             checkpoint_id=path)
    full = whole_state(model, opt)
    if rank == 0:
        torch.save(full, f"{path}/full.pt")
    # The whole-tensor state dict: gathered over FSDP and TP ranks, and loaded back piece by piece.
    exported = fsdp_pass.get_full_state_dict(model, rank0_only=False)
    assert all(torch.equal(exported[n], full[n]) for n, _ in model.named_parameters())
    fresh, _ = _tp_model_and_optimizer(mesh)
    fsdp_pass.fully_shard(fresh, mesh, shard_dim="dp")
    fsdp_pass.set_full_state_dict(fresh, exported)
    assert all(torch.equal(p.full_tensor(), full[n]) for n, p in fresh.named_parameters())


def _load_worker(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model, opt = _tp_model_and_optimizer(None)
    if world > 1:
        fsdp_pass.fully_shard(model, init_device_mesh("cpu", (world,)))
    load_and_compare(model, opt, path, f"{world} rank(s)")


def test_checkpoint_saved_at_tp2_fsdp2_loads_at_fsdp4_and_one_rank(tmp_path):
    path = str(tmp_path / "tp2_fsdp2")
    run_distributed(_save_tp_worker, 4, path, timeout=600, pg_timeout=120)
    run_distributed(_load_worker, 4, path, timeout=600, pg_timeout=120)
    run_distributed(_load_worker, 1, path, timeout=600, pg_timeout=120)


def _muon_worker(rank: int, world: int) -> None:
    """Muon on tensor-parallel, sharded matrices: each whole matrix is gathered over FSDP and TP ranks."""
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_pass.optim import Muon, muon_param_groups

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig()), 0)
    reference = copy.deepcopy(model)
    tensor_parallel(model, mesh)

    def optimizers(m):
        matrices, rest = muon_param_groups(m, exclude=("tok_embeddings", "output"))
        return (Muon(matrices, lr=0.02, ns_dtype=torch.float32),
                torch.optim.AdamW([p for _, p in rest], lr=1e-2))

    from fsdp_pass.optim import blockwise

    on_roots = []  # TP matrices go to an FSDP root, where the TP group gathers them
    gather_to_root = blockwise._on_fsdp_root
    blockwise._on_fsdp_root = lambda job, whole, root, compute: (
        on_roots.append(root) or gather_to_root(job, whole, root, compute))
    opts, ref_opts = optimizers(model), optimizers(reference)
    assert any(isinstance(p, torch.distributed.tensor.DTensor) for p in opts[0].param_groups[0]["params"])
    compiled = _compile_tp(model, mesh)
    rows = _batch_rows(mesh, ("dp",))
    for step in range(3):
        tokens = _tokens(step)
        lm_loss(compiled(tokens[rows]), tokens[rows]).backward()
        lm_loss(reference(tokens), tokens).backward()
        for opt in (*opts, *ref_opts):
            opt.step()
            opt.zero_grad()
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        diff = ((p.full_tensor() - ref_params[name]).norm() / ref_params[name].norm()).item()
        assert diff <= TOLERANCE, f"{name} rel diff {diff:.3g} after Muon steps"
    matrices = len(opts[0].param_groups[0]["params"])
    assert len(on_roots) == 3 * matrices and set(on_roots) == {0, 1}, on_roots  # roots balanced over dp


def test_muon_on_tensor_parallel_sharded_matrices():
    run_distributed(_muon_worker, 4, timeout=600, pg_timeout=120)
