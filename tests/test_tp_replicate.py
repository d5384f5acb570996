"""FSDP over tensor parallelism with ``Replicate()`` DTensor parameters, 4 gloo ranks (dp=2 x tp=2).

``RowwiseParallel`` leaves a Linear's bias ``Replicate()``; ``SequenceParallel`` norms are
``Replicate()`` weights whose gradients TP leaves partial. Such parameters are sharded over the
data-parallel *and* the TP ranks, like plain parameters, and keep their DTensor placements.
Each case trains side by side with one process on the same global batch (losses, the clipped
gradient norm, every parameter), then a checkpoint saved at TP=2 x FSDP=2 loads at FSDP=4.
The ``biased_meta`` case is torchtitan's flow: built on the meta device, TP applied, sharded with
``init="skip"``, ``to_empty`` and the model's own init, bit-equal to one process before it trains.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import fsdp_pass
from fsdp_pass.tensor.ragged_tensor import is_sharded
from fsdp_pass.tensor.ragged_tensor import ragged_part
from fsdp_pass.interop.state_dict import whole_tensor
from fsdp_pass.testing.checkpoints import load_and_compare, whole_state
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss
from fsdp_pass.testing.spawn import run_distributed

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

STEPS, GLOBAL_BATCH, SEQ, DIM = 3, 8, 8, 32
TOLERANCE = 1e-5  # relative
LLAMA = LlamaConfig(tie_embeddings=False, layers=1)  # TP splits the embedding and the head differently


class BiasedBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc_in = nn.Linear(DIM, 2 * DIM)
        self.fc_out = nn.Linear(2 * DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc_out(F.gelu(self.fc_in(x)))


class BiasedModel(nn.Module):
    """A plain stem, two residual blocks of biased linears (tensor parallel) and a plain head.

    The blocks are registered first on purpose, so a DTensor parameter leads ``parameters()``: the
    list ops of ``clip_grad_norm_`` and of the optimizer (``foreach=True``, the GPU default) then go
    to DTensor's dispatch first, with RaggedShard tensors after ([Note: list ops mixing DTensor and
    RaggedShard parameters] in interop/mixed_lists.py).
    """

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(BiasedBlock() for _ in range(2))
        self.stem = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _biased_model() -> nn.Module:
    torch.manual_seed(0)
    model = BiasedModel()
    with torch.no_grad():  # biases big enough that their gradients matter
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return model


def _biased_parallel(model: BiasedModel, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    for block in model.blocks:
        parallelize_module(block, tp_mesh, {"fc_in": ColwiseParallel(), "fc_out": RowwiseParallel()})


def _meta_init(model: nn.Module) -> None:
    """The init ops torchtitan's ``init_weights`` uses, seeded: run on a meta-built, sharded model after
    ``to_empty`` and on the one-process reference alike."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    torch.manual_seed(1)
    for name, p in model.named_parameters():
        if name.endswith("weight"):
            nn.init.trunc_normal_(p, std=0.2, a=-0.4, b=0.4)
        elif name.startswith("stem"):
            nn.init.zeros_(p)
        elif name.startswith("head"):
            nn.init.ones_(p)
        elif "fc_out" in name:
            value = torch.linspace(-1.0, 1.0, p.numel())
            if isinstance(p, DTensor):  # DTensor's copy_ takes a DTensor (the whole value, distributed)
                value = distribute_tensor(value, p.device_mesh, p.placements)
            with torch.no_grad():
                p.copy_(value)
        else:
            nn.init.normal_(p, 0.0, 0.5)


def _biased_on_meta(mesh) -> tuple[nn.Module, nn.Module]:
    """Built on meta, TP applied, sharded over dp, ``to_empty`` and the model's own init (torchtitan's
    order): every element and the generator state bit-equal to the same init in one process."""
    reference = BiasedModel()
    _meta_init(reference)
    after_reference = torch.rand(4)
    with torch.device("meta"):
        model = BiasedModel()
    _biased_parallel(model, mesh["tp"])
    fsdp_pass.fully_shard(model, mesh, shard_dim="dp", init="skip")
    model.to_empty(device="cpu")
    _meta_init(model)
    assert torch.equal(torch.rand(4), after_reference), "the generator state after the init differs"
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        assert p.device.type == "cpu" and ragged_part(p).device.type == "cpu", name
        assert torch.equal(whole_tensor(p), q), name
    torch.manual_seed(2)  # and fully_shard's own replay of the constructors' inits (init="replay")
    built = BiasedModel()
    torch.manual_seed(2)
    with torch.device("meta"):
        replayed = BiasedModel()
    _biased_parallel(replayed, mesh["tp"])
    fsdp_pass.fully_shard(replayed, mesh, shard_dim="dp")
    for (name, p), q in zip(replayed.named_parameters(), built.parameters()):
        assert torch.equal(whole_tensor(p), q), f"replayed {name}"
    return model, reference


def _llama_model() -> nn.Module:
    torch.manual_seed(0)
    model = init_std(Llama(LLAMA), 0)
    with torch.no_grad():  # norm weights away from one, so their gradients are not all alike
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def _llama_sequence_parallel(model: Llama, tp_mesh) -> None:
    """torchtitan's llama plan: sequence-parallel norms, column/row-parallel projections."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module,
    )

    parallelize_module(model, tp_mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate(), use_local_output=True),
    })
    for block in model.layers:
        parallelize_module(block, tp_mesh, {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
            "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.w1": ColwiseParallel(), "ffn.w3": ColwiseParallel(),
            "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        })


def _batch(case: str, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    if case.startswith("biased"):
        return torch.randn(GLOBAL_BATCH, DIM, generator=g), torch.randn(GLOBAL_BATCH, 4, generator=g)
    tokens = torch.randint(0, LLAMA.vocab, (GLOBAL_BATCH, SEQ), generator=g)
    return tokens, tokens


def _loss(case: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return (out - target).square().mean() if case.startswith("biased") else lm_loss(out, target)


CASES = {"biased": (_biased_model, _biased_parallel), "biased_meta": (None, None),
         "llama_sp": (_llama_model, _llama_sequence_parallel)}


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=True)  # as on a GPU


def _collectives(gm) -> dict[str, int]:
    counts: dict[str, int] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and getattr(node.target, "namespace", None) == "_c10d_functional":
            op = node.target.__name__.split(".")[0].rstrip("_")
            if op != "wait_tensor":
                counts[op] = counts.get(op, 0) + 1
    return counts


def _train(case: str, compiler: str, mesh) -> tuple[dict, nn.Module, torch.optim.Optimizer]:
    from torch.distributed.tensor import DTensor, Replicate

    make, parallelize = CASES[case]
    torch._dynamo.reset()
    if case == "biased_meta":
        model, reference = _biased_on_meta(mesh)
    else:
        model = make()
        reference = copy.deepcopy(model)
        parallelize(model, mesh["tp"])
    replicated = [n for n, p in model.named_parameters()
                  if isinstance(p, DTensor) and any(isinstance(pl, Replicate) for pl in p.placements)]
    assert replicated, "the plan leaves no Replicate() parameter"
    opt, ref_opt = _optimizer(model.parameters()), _optimizer(reference.parameters())
    compiled = torch.compile(model, backend="vescale", dynamic=False,
                             options={"mesh": mesh, "shard_dim": "dp", "compiler": compiler})
    dp = mesh.get_local_rank("dp")
    rows = slice(dp * GLOBAL_BATCH // 2, (dp + 1) * GLOBAL_BATCH // 2)
    worst = {"loss": 0.0, "norm": 0.0, "parameters": 0.0}
    for step in range(STEPS):
        x, y = _batch(case, step)
        loss = _loss(case, compiled(x[rows]), y[rows])
        loss.backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5, foreach=True)  # below the norm: it clips
        opt.step()
        opt.zero_grad()
        ref_loss = _loss(case, reference(x), y)
        ref_loss.backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total)  # TP ranks hold copies of their dp rank's loss
        worst["loss"] = max(worst["loss"], abs(total.item() / 4 - ref_loss.item()) / ref_loss.item())
        norm = norm.full_tensor() if isinstance(norm, DTensor) else norm
        worst["norm"] = max(worst["norm"], abs(norm.item() - ref_norm.item()) / ref_norm.item())
    ref_params = dict(reference.named_parameters())
    for name, p in model.named_parameters():
        assert is_sharded(p), f"{name} was not sharded"
        diff = ((whole_tensor(p) - ref_params[name]).norm() / ref_params[name].norm()).item()
        assert diff <= TOLERANCE, f"{case} {compiler}: {name} rel diff {diff:.3g}"
        worst["parameters"] = max(worst["parameters"], diff)
        if name in replicated:  # the DTensor keeps its placements; its local tensor is sharded over dp x tp
            assert isinstance(p, DTensor) and all(isinstance(pl, Replicate) for pl in p.placements), name
            assert p._local_tensor._spec.world_size == 4, name
    assert worst["loss"] <= TOLERANCE and worst["norm"] <= TOLERANCE, (case, compiler, worst)
    record = [r for r in fsdp_pass.compile.backend.records() if r.buffers][-1]  # this case's graph
    worst["forward"] = _collectives(record.modules["forward"])
    worst["backward"] = _collectives(record.modules["backward"])
    worst["buckets"] = len(record.buffers)
    return worst, model, opt


def _train_worker(rank: int, world: int, compiler: str, cases: tuple[str, ...], path: str | None) -> dict:
    mesh = _mesh()
    results = {}
    for case in cases:
        results[case], model, opt = _train(case, compiler, mesh)
    if path is not None:  # the last case's model and optimizer, saved as global tensors
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

        dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                 checkpoint_id=path)
        full = whole_state(model, opt)
        if rank == 0:
            torch.save(full, f"{path}/full.pt")
    return results


def _load_worker(rank: int, world: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    model = _llama_model()
    opt = _optimizer(model.parameters())
    fsdp_pass.fully_shard(model, init_device_mesh("cpu", (world,)))
    load_and_compare(model, opt, path, f"FSDP={world}")


def _report(compiler: str, results: dict) -> None:
    for case, r in results.items():
        print(f"{case} {compiler}: relative differences: loss {r['loss']:.2e}, clipped gradient norm {r['norm']:.2e}, "
              f"parameters {r['parameters']:.2e}; {r['buckets']} buckets; collectives per step: forward "
              f"{r['forward']}, backward {r['backward']}")


@pytest.mark.slow
def test_replicated_tp_parameters_train_like_one_process_and_checkpoint_to_fsdp4(tmp_path):
    path = str(tmp_path / "tp2_fsdp2_replicate")
    results = run_distributed(_train_worker, 4, "aot_eager", ("biased", "biased_meta", "llama_sp"), path, timeout=600,
                              pg_timeout=120)
    _report("aot_eager", results[0])
    run_distributed(_load_worker, 4, path, timeout=600, pg_timeout=120)


@pytest.mark.slow
def test_replicated_tp_parameters_under_inductor():
    results = run_distributed(_train_worker, 4, "inductor", ("llama_sp",), None, timeout=600, pg_timeout=120)
    _report("inductor", results[0])


# ---------------------------------------------------------------------------------------------
# refused placements: before anything is sharded (single process, fake 4-rank group)
# ---------------------------------------------------------------------------------------------


def test_partial_and_strided_placements_are_refused_before_sharding(four_fake_ranks):
    from torch.distributed.tensor import DTensor, Partial, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    mesh = _mesh()
    tp = mesh["tp"]
    for placements, pattern in (
        ([Partial()], r"parameter 'blocks\.1\.fc_in\.weight' .* a Partial parameter holds pending sums"),
        ([_StridedShard(0, split_factor=2)], r"parameter 'blocks\.1\.fc_in\.weight' .* _StridedShard comes from"),
    ):
        model = BiasedModel()
        weight = model.blocks[1].fc_in.weight.detach()
        model.blocks[1].fc_in.weight = nn.Parameter(DTensor.from_local(weight, tp, placements, run_check=False))
        model.blocks[0].fc_in.weight = nn.Parameter(DTensor.from_local(weight[:32], tp, [Shard(0)], run_check=False))
        with pytest.raises(ValueError, match=pattern):
            fsdp_pass.fully_shard(model, mesh, shard_dim="dp")
        assert not any(is_sharded(p) for p in model.parameters())
