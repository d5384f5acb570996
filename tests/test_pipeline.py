"""Pipeline parallelism: each stage sharded over its own data-parallel sub-mesh, 4 gloo ranks (pp=2 x dp=2).

Every collective the backend issues (the compile-time agreement check, gathers, reduce-scatters)
runs over the stage's ``mesh["dp"]`` only, so the two stages compile and train different graphs at
their own pace. The tests train the stages side by side with one process per stage on the same
global batch, then drive the stages with ``torch.distributed.pipelining`` schedules.
"""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_pass
from fsdp_pass.testing.collectives import CountCollectives
from fsdp_pass.tensor.ragged_tensor import is_sharded
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss
from fsdp_pass.testing.spawn import run_distributed

pytestmark = pytest.mark.slow

STEPS, GLOBAL_BATCH, SEQ, MICRO_BATCHES = 3, 16, 8, 4
TOLERANCE = 1e-5  # relative
CFG = LlamaConfig(layers=2, tie_embeddings=False)  # the embedding and the head live on different stages


class Stage(nn.Module):
    """Some consecutive layers of a :class:`Llama`; the first stage embeds, the last normalizes and projects.

    The layers keep their index as name, so parameter names are the whole model's.
    """

    def __init__(self, model: Llama, layers: range) -> None:
        super().__init__()
        first, last = layers.start == 0, layers.stop == len(model.layers)
        self.tok_embeddings = model.tok_embeddings if first else None
        self.layers = nn.ModuleDict({str(i): model.layers[i] for i in layers})
        self.norm = model.norm if last else None
        self.output = model.output if last else None
        self.register_buffer("freqs", model.freqs, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tok_embeddings is not None:
            x = self.tok_embeddings(x)
        freqs = self.freqs[: x.shape[1], None, :]
        for layer in self.layers.values():
            x = layer(x, freqs)
        if self.output is not None:
            x = self.output(self.norm(x))
        return x


def _stages(model: Llama) -> list[Stage]:
    half = len(model.layers) // 2
    return [Stage(model, range(0, half)), Stage(model, range(half, len(model.layers)))]


def _tokens(step: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab, (GLOBAL_BATCH, SEQ), generator=torch.Generator().manual_seed(step))


def _hidden(step: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, SEQ, CFG.dim, generator=torch.Generator().manual_seed(100 + step))


def _optimizer(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def _compare_parameters(model: nn.Module, reference: nn.Module) -> float:
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        assert is_sharded(p), f"{name} was not sharded"
        diff = _relative(p.full_tensor(), ref[name])
        assert diff <= TOLERANCE, f"{name}: rel diff {diff:.3g}"
        worst = max(worst, diff)
    return worst


def _mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))


# ---------------------------------------------------------------------------------------------
# sub-meshes: each rank pair compiles its own stage over mesh["dp"]
# ---------------------------------------------------------------------------------------------


def _sub_mesh_worker(rank: int, world: int) -> float:
    mesh = _mesh()
    stage, dp = mesh.get_local_rank("pp"), mesh["dp"]
    torch._dynamo.reset()
    model = _stages(init_std(Llama(CFG), 0))[stage]  # stage 0: embedding + layer 0; stage 1: layer 1 + head
    reference = copy.deepcopy(model)
    opt, ref_opt = _optimizer(model.parameters()), _optimizer(reference.parameters())
    compiled = torch.compile(model, backend="vescale", dynamic=False, options={"mesh": dp, "compiler": "aot_eager"})
    per = GLOBAL_BATCH // dp.size()
    rows = slice(dp.get_local_rank() * per, (dp.get_local_rank() + 1) * per)

    def loss_of(module, step, rows):
        tokens = _tokens(step)[rows]
        if stage == 0:
            return module(tokens).square().mean()
        return lm_loss(module(_hidden(step)[rows]), tokens)

    worst = 0.0
    for step in range(STEPS):
        loss = loss_of(compiled, step, rows)
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_loss = loss_of(reference, step, slice(None))
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        total = loss.detach().clone()
        dist.all_reduce(total, group=dp.get_group())
        worst = max(worst, abs(total.item() / dp.size() - ref_loss.item()) / ref_loss.item())
    assert worst <= TOLERANCE, f"stage {stage}: loss rel diff {worst:.3g}"
    worst = max(worst, _compare_parameters(model, reference))
    buffers = fsdp_pass.explain(compiled, print_output=False).buffers
    assert buffers and all(b.mesh.mesh is dp and b.mesh.shard_size == 2 for b in buffers)

    # A disagreement inside one stage's mesh is reported there; the other stage is not involved.
    if stage == 1:
        class Divergent(nn.Module):
            def __init__(self):
                super().__init__()
                self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

            def forward(self, x):
                return self.b(self.a(x)) if dp.get_local_rank() == 0 else self.a(x)

        divergent = torch.compile(Divergent(), backend="vescale", options={"mesh": dp, "compiler": "aot_eager"})
        with pytest.raises(Exception, match=r"ranks disagree on the parameters this graph uses \(ranks \[3\] differ "
                                            r"from rank 2\)"):
            divergent(torch.randn(2, 4))
    return worst


def test_stages_on_sub_meshes_train_like_one_process_per_stage():
    worst = run_distributed(_sub_mesh_worker, 4, timeout=600, pg_timeout=120)
    print(f"sub-mesh stages: worst relative difference (losses, parameters) {max(worst):.2e}")


# ---------------------------------------------------------------------------------------------
# torch.distributed.pipelining schedules over the sharded stages
# ---------------------------------------------------------------------------------------------


def _pipeline_worker(rank: int, world: int, schedule_name: str) -> dict:
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    mesh = _mesh()
    stage, dp = mesh.get_local_rank("pp"), mesh["dp"]
    torch._dynamo.reset()
    whole = init_std(Llama(CFG), 0)
    reference = copy.deepcopy(whole)
    model = _stages(whole)[stage]
    # SGD with momentum: a wrong gradient scale shows in the parameters (AdamW would normalize it away).
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    compiled = torch.compile(model, backend="vescale", dynamic=False, options={"mesh": dp, "compiler": "aot_eager"})
    per = GLOBAL_BATCH // dp.size()
    rows = slice(dp.get_local_rank() * per, (dp.get_local_rank() + 1) * per)
    micro = per // MICRO_BATCHES
    hidden = torch.zeros(micro, SEQ, CFG.dim, requires_grad=True)  # activations between the stages carry gradients
    # Static shapes given up front: the stage never runs the module for shape inference.
    pipe_stage = PipelineStage(
        compiled, stage, 2, torch.device("cpu"),
        input_args=torch.zeros(micro, SEQ, dtype=torch.long) if stage == 0 else hidden,
        output_args=hidden if stage == 0 else torch.zeros(micro, SEQ, CFG.vocab, requires_grad=True),
        group=mesh.get_group("pp"),
    )
    schedule_cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[schedule_name]
    # Each micro-batch's mean loss; the schedule divides the gradients by the micro-batch count.
    # scale_grads=False: under deferred sync the gradients arrive after the schedule's step returns, too
    # late for its division by the micro-batch count, so each micro-batch's loss carries it instead.
    schedule = schedule_cls(pipe_stage, n_microbatches=MICRO_BATCHES, scale_grads=False,
                            loss_fn=lambda out, target: lm_loss(out, target) / MICRO_BATCHES)

    per_step, worst_loss, trained_buckets = [], 0.0, None
    for step in range(STEPS):
        tokens = _tokens(step)
        losses: list[torch.Tensor] = []
        # Deferred sync: the schedule runs every micro-batch's backward inside one call, so it runs under
        # no_sync and the sum is reduce-scattered once afterwards (the first step compiles and shards).
        deferred = trained_buckets is not None
        with CountCollectives() as counted:
            with fsdp_pass.no_sync(compiled) if deferred else contextlib.nullcontext():
                if stage == 0:
                    schedule.step(tokens[rows])
                else:
                    schedule.step(target=tokens[rows], losses=losses)
            if deferred:
                fsdp_pass.reduce_gradients(compiled)
        if deferred:
            per_step.append(counted.counts["reduce_scatter_tensor"])
        else:  # the first step compiled the stage (both graph variants come later): its buckets exist now
            buffers = fsdp_pass.explain(compiled, print_output=False).buffers
            trained_buckets = sum(1 for b in buffers if b.shard.requires_grad and b.mesh.shard_size > 1)
        opt.step()
        opt.zero_grad()
        ref_loss = lm_loss(reference(tokens), tokens)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        if stage == 1:
            assert len(losses) == MICRO_BATCHES
            total = torch.stack(losses).sum().detach()  # each is a micro-batch's loss / MICRO_BATCHES
            dist.all_reduce(total, group=dp.get_group())
            worst_loss = max(worst_loss, abs(total.item() / dp.size() - ref_loss.item()) / ref_loss.item())
    assert worst_loss <= TOLERANCE, f"{schedule_name}: loss rel diff {worst_loss:.3g}"
    worst_param = _compare_parameters(model, reference)

    # Deferred sync: gradients are reduce-scattered once per bucket per step, not once per micro-batch.
    syncs_per_step = 1
    assert per_step and all(n == syncs_per_step * trained_buckets for n in per_step), (per_step, trained_buckets)
    # One compiled graph per stage (forward and backward): the schedules ran the compiled path, not
    # eager; its backward reduce-scatters each bucket once, over the stage's dp ranks only.
    records = [r for r in fsdp_pass.compile.backend.records() if r.buffers]
    assert len(records) == 1 and "backward" in records[0].modules, [r.modules.keys() for r in records]
    scatters = [n.args[-1] for n in records[0].modules["backward"].graph.nodes
                if n.op == "call_function" and "reduce_scatter" in str(n.target)]
    assert scatters == [dp.get_group().group_name] * trained_buckets, scatters
    return {"loss": worst_loss if stage == 1 else float("nan"), "parameters": worst_param, "reduce_scatters_per_step": per_step[0],
            "buckets": trained_buckets}


@pytest.mark.parametrize("schedule_name", ["gpipe", "1f1b"])
def test_pipeline_schedule_over_sharded_stages_matches_one_process(schedule_name):
    results = run_distributed(_pipeline_worker, 4, schedule_name, timeout=600, pg_timeout=120)
    print(f"{schedule_name}: " + "; ".join(
        f"rank {r}: loss {x['loss']:.2e} parameters {x['parameters']:.2e} reduce-scatters/step "
        f"{x['reduce_scatters_per_step']} ({x['buckets']} buckets, {MICRO_BATCHES} micro-batches)"
        for r, x in enumerate(results)))
