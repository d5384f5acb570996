"""The frameworks people train in, run for real on 2 gloo ranks: accelerate, Lightning, Hugging Face Trainer
(docs/integrations.md).

Each framework's own loop against one process on the same global batch: AdamW with clipping,
gradient accumulation without per-micro-batch reduce-scatters, the framework's saves loaded into
a plain model, and a resumed run that continues exactly. accelerate on 2 ranks runs with the
step-boundary options on (``overlap_last_reduce``, ``prefetch_next_step``). Every sharded run uses
Hugging Face gradient checkpointing (non-reentrant; one process runs without it: the same math):
Lightning with the graph break transformers 5.25's checkpointed layers cause (they run through the
eager path, and accumulate without reducing too), accelerate and the Trainer with Dynamo's switch that
compiles them (``skip_fwd_side_effects_in_bwd_under_checkpoint``, the recipe in docs/integrations.md;
accelerate's step-overlap options need the layers in the first graph).
"""

from __future__ import annotations

import copy
import os
import tempfile

import pytest
import torch

import fsdp_pass
from fsdp_pass.compile.backend import records
from fsdp_pass.step import prefetch as step_prefetch
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.testing.spawn import free_port, run_distributed, set_launcher_env

STEPS, MICRO, GLOBAL_BATCH, SEQ, VOCAB = 6, 2, 8, 8, 61
LR, CLIP = 1e-3, 0.5
LOSS_TOLERANCE, PARAM_TOLERANCE = 1e-6, 1e-5  # relative; one process sums the batch in another order


def _hf_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def _batch(step: int, micro: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + micro)
    return torch.randint(0, VOCAB, (GLOBAL_BATCH // MICRO, SEQ), generator=g)


def _reference(steps: int = STEPS, weight_decay: float = 0.01) -> tuple[list[float], list[float], dict[str, torch.Tensor]]:
    """One process, the global batch: each micro-batch's mean loss / MICRO, clipped AdamW.

    Returns each step's loss and gradient norm (before clipping) and the trained parameters.
    """
    model = _hf_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=weight_decay)
    losses, norms = [], []
    for step in range(steps):
        total = 0.0
        for micro in range(MICRO):
            tokens = _batch(step, micro)
            loss = model(input_ids=tokens, labels=tokens).loss / MICRO
            loss.backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP).item())
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, norms, {n: p.detach().clone() for n, p in model.named_parameters()}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


# -- accelerate --------------------------------------------------------------------------------


def _accelerate(rank: int, world: int, port: int, tmp: str, mesh_shape: tuple[int, int] | None = None,
                step_overlap: bool = False) -> dict:
    """``mesh_shape``: HSDP (replicas, shards) on a mesh the script makes; None: fsdp_pass's default mesh.
    ``step_overlap``: with ``overlap_last_reduce`` and ``prefetch_next_step`` (docs/options.md)."""
    set_launcher_env(rank, world, port)
    import torch.distributed as dist
    from accelerate import Accelerator
    from transformers import LlamaForCausalLM

    from fsdp_pass.integrations.accelerate import prepare

    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True  # compile the checkpointed layers
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=MICRO)
    assert dist.get_world_size() == world
    model = _hf_llama()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    options = {"compiler": "aot_eager"}
    if step_overlap:
        options.update(overlap_last_reduce=True, prefetch_next_step=True, min_bucket_bytes=0)  # several buckets
    if mesh_shape is not None:
        from torch.distributed.device_mesh import init_device_mesh

        options["mesh"] = init_device_mesh("cpu", mesh_shape)
    model.compile(backend="vescale", options=options)  # fsdp_pass line 1
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = prepare(accelerator, model, opt)  # fsdp_pass line 2
    per_rank = GLOBAL_BATCH // MICRO // world

    def run_step(step: int) -> float:
        total = torch.zeros(())
        for micro in range(MICRO):
            tokens = _batch(step, micro)[rank * per_rank:(rank + 1) * per_rank]
            with accelerator.accumulate(model):
                loss = model(input_ids=tokens, labels=tokens).loss
                accelerator.backward(loss)
                if micro < MICRO - 1 and step > 0:  # accumulating: nothing reduce-scattered yet
                    assert all(_pending_gradients(model))
                if accelerator.sync_gradients:
                    norm = accelerator.clip_grad_norm_(model.parameters(), CLIP)
                    assert torch.isfinite(norm)
                opt.step()
                if step_overlap and accelerator.sync_gradients:  # accelerate's optimizer stepped the inner one
                    assert step_prefetch.in_flight(), "no gather issued at the optimizer step"
                opt.zero_grad()
            total += loss.detach() / MICRO
        dist.all_reduce(total)
        return total.item() / world

    losses = [run_step(step) for step in range(3)]
    # the first call sharded every bucket over the mesh the script asked for (HSDP: 2 shards, 2 replicas)
    shapes = {(b.mesh.shard_size, b.mesh.replicate_size) for b in buffers_of(model)}
    assert shapes == {(world, 1) if mesh_shape is None else (mesh_shape[1], mesh_shape[0])}, shapes
    accelerator.save_state(os.path.join(tmp, "state"))
    losses += [run_step(step) for step in range(3, STEPS)]
    trained = {n: p.full_tensor() for n, p in model.named_parameters()}
    accelerator.save_model(model, os.path.join(tmp, "model"))
    accelerator.load_state(os.path.join(tmp, "state"))  # back to step 3, then the same steps again
    resumed = [run_step(step) for step in range(3, STEPS)]
    again = {n: p.full_tensor() for n, p in model.named_parameters()}
    if step_overlap:  # the first micro-batch of a step (no_sync) took the gathers the step before issued
        assert any("forward (accumulate, prefetched)" in r.modules for r in records())
    if rank == 0:
        # load_state wrote every shard after the last step had issued its gathers: never read stale
        assert resumed == losses[3:], (resumed, losses[3:])
        for name, value in trained.items():
            assert torch.equal(again[name], value), f"{name} differs after load_state and the same steps"
        model.config.save_pretrained(os.path.join(tmp, "model"))  # save_model writes the weights only
        saved = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "model"))
        for name, p in saved.named_parameters():
            assert torch.equal(p, trained[name]), f"{name} saved by save_model differs"
    return _parity(losses, trained)


def _parity(losses: list[float] | None, params: dict[str, torch.Tensor], grad_norms: list[float] | None = None,
            weight_decay: float = 0.01) -> dict[str, float]:
    """Worst relative differences from one process (numbers: tensors do not cross the pipe of a finished rank)."""
    ref_losses, ref_norms, ref_params = _reference(weight_decay=weight_decay)
    result = {"param_rel": max(_rel(params[n], ref_params[n]) for n in ref_params)}
    if losses is not None:
        assert len(losses) == len(ref_losses), (losses, ref_losses)
        result["loss_rel"] = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
    if grad_norms is not None:
        assert len(grad_norms) == len(ref_norms), (grad_norms, ref_norms)
        result["grad_norm_rel"] = max(abs(a - b) / abs(b) for a, b in zip(grad_norms, ref_norms))
    return result


@pytest.mark.parametrize("world, mesh_shape, step_overlap", [(2, None, True), (4, (2, 2), False)],
                         ids=["2 ranks, step overlap options", "2x2 HSDP"])
def test_accelerate_trains_saves_and_resumes_like_one_process(world, mesh_shape, step_overlap):
    with tempfile.TemporaryDirectory() as tmp:
        result = run_distributed(_accelerate, world, free_port(), tmp, mesh_shape, step_overlap, backend=None)[0]
    print(f"accelerate, {world} ranks, mesh {mesh_shape}, step overlap {step_overlap}: {result}")
    assert result["loss_rel"] <= LOSS_TOLERANCE and result["param_rel"] <= PARAM_TOLERANCE, result


# -- Lightning ---------------------------------------------------------------------------------


def _pending_gradients(model: torch.nn.Module) -> list[bool]:
    """Per trainable bucket of ``model``: whether it holds a summed gradient not reduce-scattered yet."""
    return [b.pending_bytes > 0 for b in buffers_of(model) if b.shard.requires_grad]


def _lightning_module(batches: list[torch.Tensor]):
    import lightning as L

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.model = _hf_llama()

        def configure_model(self) -> None:
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            mesh = self.device_mesh["data_parallel"]
            fsdp_pass.fully_shard(self.model, mesh)  # fsdp_pass line 1
            self.model.compile(backend="vescale", options={"mesh": mesh, "compiler": "aot_eager"})  # fsdp_pass line 2

        def training_step(self, micro_batch, index):
            tokens = batches[self.global_step * MICRO + index % MICRO]  # this step's micro-batch, resumed or not
            return self.model(input_ids=tokens, labels=tokens).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    return LitLlama()


def _lightning_trainer(epochs: int, tmp: str, backwards: list[list[bool]], distributed_checkpoint: bool = True):
    """``backwards`` gets, after each micro-batch's backward, :func:`_pending_gradients` of the model."""
    import lightning as L

    from fsdp_pass.integrations.lightning import ModelParallelStrategy

    class PendingAfterBackward(L.Callback):
        def on_after_backward(self, trainer, pl_module):
            backwards.append(_pending_gradients(pl_module.model))

    return L.Trainer(accelerator="cpu", devices=2, num_nodes=1, max_epochs=epochs,
                     strategy=ModelParallelStrategy(data_parallel_size=2, tensor_parallel_size=1,
                                                    save_distributed_checkpoint=distributed_checkpoint),
                     accumulate_grad_batches=MICRO, gradient_clip_val=CLIP, use_distributed_sampler=False,
                     logger=False, enable_checkpointing=False, enable_progress_bar=False,
                     enable_model_summary=False, default_root_dir=tmp, callbacks=[PendingAfterBackward()])


def _rank_batches(rank: int, world: int, steps: int) -> list[torch.Tensor]:
    """This rank's part of every micro-batch, in the order the reference takes them."""
    per_rank = GLOBAL_BATCH // MICRO // world
    return [_batch(step, micro)[rank * per_rank:(rank + 1) * per_rank] for step in range(steps) for micro in range(MICRO)]


def _lightning(rank: int, world: int, port: int, tmp: str) -> dict:
    set_launcher_env(rank, world, port)
    from torch.utils.data import DataLoader

    def loader():  # an epoch of 3 steps; training_step takes each step's micro-batches by step number
        return DataLoader(list(range(MICRO * 3)), batch_size=None)

    # One epoch (3 steps), both checkpoint kinds, then 3 more; a second run resumes from the distributed checkpoint.
    backwards = []  # every micro-batch of the three fits below, each a whole number of steps
    lit = _lightning_module(_rank_batches(rank, world, STEPS))
    trainer = _lightning_trainer(1, tmp, backwards)
    trainer.fit(lit, loader())
    sharded_path, full_path = os.path.join(tmp, "step3"), os.path.join(tmp, "step3_full.ckpt")
    trainer.save_checkpoint(sharded_path)
    trainer.strategy._save_distributed_checkpoint = False  # the same run, saved as one full file
    trainer.save_checkpoint(full_path)
    step3 = {n: p.full_tensor() for n, p in lit.model.named_parameters()}
    trainer = _lightning_trainer(2, tmp, backwards)
    trainer.fit(lit, loader(), ckpt_path=sharded_path)  # continues the same module to step 6
    trained = {n: p.full_tensor() for n, p in lit.model.named_parameters()}

    resumed_module = _lightning_module(_rank_batches(rank, world, STEPS))
    trainer = _lightning_trainer(2, tmp, backwards)
    trainer.fit(resumed_module, loader(), ckpt_path=sharded_path)  # a fresh module from the checkpoint
    resumed = {n: p.full_tensor() for n, p in resumed_module.model.named_parameters()}
    # Accumulation: nothing reduce-scattered before a step's last micro-batch, whose backward reduce-scatters all.
    assert len(backwards) == 3 * 3 * MICRO and all(backwards), backwards
    for i, pending in enumerate(backwards):
        last = i % MICRO == MICRO - 1
        assert (not any(pending)) if last else all(pending), f"micro-batch {i}: pending per bucket {pending}"
    if rank == 0:
        for name, value in trained.items():
            assert torch.equal(resumed[name], value), f"{name}: the resumed run differs"
        from transformers import LlamaForCausalLM

        plain = LlamaForCausalLM(_hf_llama().config)
        state = torch.load(full_path, weights_only=False)["state_dict"]
        plain.load_state_dict({k.removeprefix("model."): v for k, v in state.items()})
        for name, p in plain.named_parameters():
            assert torch.equal(p, step3[name]), f"{name} in the full checkpoint differs"
    return _parity(None, trained)


def test_lightning_model_parallel_strategy_trains_checkpoints_and_resumes_like_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        result = run_distributed(_lightning, 2, free_port(), tmp, backend=None)[0]
    print(f"Lightning ModelParallelStrategy, 2 ranks: {result}")
    assert result["param_rel"] <= PARAM_TOLERANCE, result


# -- Hugging Face Trainer ----------------------------------------------------------------------


def _trainer_dataset() -> list[dict[str, torch.Tensor]]:
    """Every micro-batch of every step, in order: with the sequential sampler and ``GLOBAL_BATCH // MICRO // world``
    rows per device, accelerate hands rank r the r-th slice of each global micro-batch, as the reference takes it."""
    rows = torch.cat([_batch(step, micro) for step in range(STEPS) for micro in range(MICRO)])
    return [{"input_ids": row, "labels": row} for row in rows]


def _trainer_arguments(out: str, world: int, **overrides):
    from transformers import TrainingArguments

    settings = dict(output_dir=out, use_cpu=True, per_device_train_batch_size=GLOBAL_BATCH // MICRO // world,
                    gradient_accumulation_steps=MICRO, learning_rate=LR, lr_scheduler_type="constant",
                    weight_decay=0.0, max_grad_norm=CLIP, num_train_epochs=1, logging_steps=1,
                    save_strategy="steps", save_steps=3, train_sampling_strategy="sequential", report_to="none",
                    disable_tqdm=True, dataloader_num_workers=0, seed=0, gradient_checkpointing=True,
                    gradient_checkpointing_kwargs={"use_reentrant": False})
    return TrainingArguments(**{**settings, **overrides})


def _hf_trainer(rank: int, world: int, port: int, tmp: str) -> dict:
    set_launcher_env(rank, world, port)
    torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True  # compile the checkpointed layers
    import torch.distributed as dist
    from transformers import LlamaForCausalLM, TrainerCallback

    from fsdp_pass.integrations.transformers import Trainer

    data = _trainer_dataset()
    accumulating = []  # per micro-batch but the last of a step: whether every bucket still holds its gradients

    class Accumulating(TrainerCallback):
        def on_substep_end(self, args, state, control, model=None, **kwargs):
            if state.global_step > 0:
                accumulating.append(all(_pending_gradients(model)))

    def compiled_llama():
        model = _hf_llama()
        model.compile(backend="vescale", options={"compiler": "aot_eager"})  # fsdp_pass line 1
        return model

    # The natural mistakes fail at once, naming the recipe.
    with pytest.raises(ValueError, match="torch_compile_backend='vescale'.*model.compile"):
        Trainer(model=compiled_llama(), args=_trainer_arguments(tmp, world, torch_compile_backend="vescale"))
    with pytest.raises(ValueError, match="not torch.compile's wrapper"):
        Trainer(model=torch.compile(_hf_llama(), backend="vescale"), args=_trainer_arguments(tmp, world))
    with pytest.raises(ValueError, match="neither compiled in place"):
        Trainer(model=_hf_llama(), args=_trainer_arguments(tmp, world))

    def train(out: str, resume: str | None = None):
        trainer = Trainer(model=compiled_llama(), args=_trainer_arguments(out, world), train_dataset=data,
                          callbacks=[Accumulating()])  # fsdp_pass line 2: the Trainer class
        trainer.train(resume_from_checkpoint=resume)
        assert dist.get_world_size() == world
        logs = [entry for entry in trainer.state.log_history if "loss" in entry]
        params = {n: p.full_tensor() for n, p in trainer.model.named_parameters()}
        return trainer, [e["loss"] for e in logs], [e["grad_norm"] for e in logs], params

    trainer, losses, norms, trained = train(os.path.join(tmp, "run"))  # saves checkpoint-3 and checkpoint-6
    trainer.save_model(os.path.join(tmp, "model"))
    _, resumed_losses, resumed_norms, resumed = train(os.path.join(tmp, "resumed"),
                                                      resume=os.path.join(tmp, "run", "checkpoint-3"))
    assert accumulating and all(accumulating), accumulating
    if rank == 0:
        assert resumed_losses == losses and resumed_norms == norms, (resumed_losses, losses)
        for name, value in trained.items():
            assert torch.equal(resumed[name], value), f"{name}: the run resumed from checkpoint-3 differs"
        saved = LlamaForCausalLM.from_pretrained(os.path.join(tmp, "model"))
        for name, p in saved.named_parameters():
            assert torch.equal(p, trained[name]), f"{name} saved by save_model differs"
    return _parity(losses, trained, grad_norms=norms, weight_decay=0.0)


def test_hf_trainer_trains_saves_and_resumes_like_one_process():
    with tempfile.TemporaryDirectory() as tmp:
        result = run_distributed(_hf_trainer, 2, free_port(), tmp, backend=None)[0]
    print(f"Hugging Face Trainer, 2 ranks: {result}")
    assert result["loss_rel"] <= LOSS_TOLERANCE and result["param_rel"] <= PARAM_TOLERANCE, result
    assert result["grad_norm_rel"] <= PARAM_TOLERANCE, result
