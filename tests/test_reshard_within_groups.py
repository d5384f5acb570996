"""``reshard_after_forward=k``: after forward each rank keeps 1/k of every bucket, backward gathers within
groups of k ranks ([Note: reshard within a node after forward]).

Backward computes on the same gathered values as with ``True`` (a piece of forward's gather, gathered
back), so every run here is bitwise the ``True`` run, whose parity with one process
tests/test_compile_parity.py, test_fp8_all_gather.py and test_eager.py check.
"""

from __future__ import annotations

import contextlib
import os

import pytest
import torch

import fsdp_pass
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.buckets.mesh import _make_node_groups
from fsdp_pass.compile.backend import records
from fsdp_pass.options import Options
from fsdp_pass.testing.checkpoints import load_and_compare, whole_state
from fsdp_pass.testing.models import Llama, LlamaConfig, init_std, lm_loss
from fsdp_pass.testing.spawn import run_distributed

WORLD, K = 4, 2
STEPS = 2


def _batch(step: int, batch: int = 8, seq: int = 8):
    tokens = torch.randint(0, LlamaConfig().vocab, (batch, seq), generator=torch.Generator().manual_seed(300 + step))
    return tokens, tokens


def _train(rank: int, world: int, setting, mesh, *, per_block: bool = False, micro: int = 1,
           compiler: str = "aot_eager", **sharding):
    """Losses and the whole state after STEPS steps with ``reshard_after_forward=setting`` and the
    ``sharding`` arguments (mp_policy, fp8_all_gather): through fully_shard for per-block compilation,
    the compile options otherwise."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = init_std(Llama(LlamaConfig()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    options = {"mesh": mesh, "compiler": compiler}
    if per_block:  # the eager embedding and head, each block a graph of one bucket
        fsdp_pass.fully_shard(model, mesh, min_bucket_bytes=0, reshard_after_forward=setting, **sharding)
        for block in model.layers:
            block.compile(backend="vescale", options=options)
        run = model
    else:
        run = torch.compile(model, backend="vescale", options={**options, **sharding, "reshard_after_forward": setting})
    losses, saved = [], {}
    for step in range(STEPS):
        saved.clear()  # the last step's
        tokens, _ = _batch(step)
        mine = tokens.chunk(world)[rank]
        for i, part in enumerate(mine.chunk(micro)):
            last = i == micro - 1
            sync = contextlib.nullcontext() if last or step == 0 else fsdp_pass.no_sync(run)
            with sync, torch.autograd.graph.saved_tensors_hooks(_recorder(saved), lambda t: t):
                loss = lm_loss(run(part), part) / micro
            loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad()
    shards = {b.shard.untyped_storage().data_ptr() for b in buffers_of(model)}
    saved_beyond_shards = sum(n for ptr, n in saved.items() if ptr not in shards)
    return losses, whole_state(model, opt), model, opt, saved_beyond_shards


def _recorder(saved: dict[int, int]):
    """A saved-tensor pack hook recording each storage saved for backward: data pointer -> bytes (a sharded
    parameter an eager op saves is its shard: not counted)."""
    def pack(t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, fsdp_pass.RaggedShardTensor):
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    return pack


def _gathers(record, stage: str) -> list[str]:
    """The all-gather calls of the record's ``stage`` graphs (its Inductor code, where it has some)."""
    return [line for name, code in record.graphs.items() if name.startswith(stage)
            for line in code.splitlines() if "all_gather_into_tensor.default(" in line]


def _cases(rank: int, world: int, tmp: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (world,))

    # node-local groups follow the launcher's nodes ([Note: node-local groups follow the launcher's nodes]):
    # nodes {0, 2} and {1, 3} refuse groups of consecutive ranks; nodes {0, 1} and {2, 3} give them
    os.environ["GROUP_RANK"] = str(rank % K)
    try:
        with pytest.raises(ValueError, match=r"group of ranks \[0, 1\], but the launcher placed them on nodes \[0, 1\] "
                                             r"\(ranks by node: \{0: \[0, 2\], 1: \[1, 3\]\}\).*LOCAL_WORLD_SIZE"):
            _make_node_groups(mesh, 0, K)
        os.environ["GROUP_RANK"] = str(rank // K)
        assert _make_node_groups(mesh, 0, K).index == rank % K
    finally:
        del os.environ["GROUP_RANK"]

    # bitwise the True run: the whole model compiled; blocks compiled one by one (fully_shard's setting)
    # with mixed precision, FP8 gathers and no_sync
    variants = {
        "plain": {},
        # Inductor drops a clone as a no-op, and its partitioner keeps every collective that forward
        # values reach in the forward graph ([Note: reshard within a node after forward])
        "inductor": {"compiler": "inductor"},
        "per_block+bf16+fp8+no_sync": {"per_block": True, "micro": 2, "fp8_all_gather": {"tile": 16},
                                       "mp_policy": {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}},
    }
    for name, kwargs in variants.items():
        exact_losses, exact, _, _, saved_true = _train(rank, world, True, mesh, **kwargs)
        losses, state, model, opt, saved_k = _train(rank, world, K, mesh, **kwargs)
        assert losses == exact_losses, f"{name}: losses {losses} != {exact_losses}"
        for key, tensor in exact.items():
            assert torch.equal(state[key], tensor), f"{name}: {key} differs from reshard_after_forward=True"
        gathers = _gathers(records()[-1], "backward")
        assert gathers, f"{name}: backward gathers nothing: no bucket was resharded"
        assert all(f", {K}, " in line for line in gathers), f"{name}: a backward all-gather spans more than {K} ranks"
        forward = _gathers(records()[-1], "forward")
        assert forward and all(f", {world}, " in line for line in forward), (
            f"{name}: forward runs an all-gather of another size than the bucket's {world} ranks: {forward}")
        if kwargs.get("per_block"):
            assert all(b.reshard_after_forward == K for b in buffers_of(model)), "fully_shard's setting was not kept"
        if name in ("plain", "inductor"):
            # memory: saved for backward beyond the parameter shards, True keeps activations (and the last of
            # several buckets, gathered into backward); k keeps 1/k of every other bucket on top, nothing more
            bucket_bytes = [b.layout.shard_size * world * b.shard.element_size() for b in buffers_of(model)]
            resharded = sum(bucket_bytes) - (bucket_bytes[-1] if len(bucket_bytes) > 1 else 0)
            assert saved_k - saved_true == resharded // K, (
                f"k={K} saved {saved_k - saved_true} bytes more than True; 1/{K} of the resharded buckets is "
                f"{resharded // K} (buckets {bucket_bytes})")
        if name == "plain":  # checkpoints: the shards are the usual ones, DCP reshards them as ever
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

            dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)},
                     checkpoint_id=tmp)
            if rank == 0:
                torch.save(state, f"{tmp}/full.pt")
            torch.distributed.barrier()
            fresh = init_std(Llama(LlamaConfig()))
            fsdp_pass.fully_shard(fresh, mesh, min_bucket_bytes=0)  # another bucketing
            load_and_compare(fresh, torch.optim.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1), tmp, name)


@pytest.mark.slow
@pytest.mark.compat  # relies on the partitioner's must_be_in_backward tag and Inductor's no-op removal
def test_reshard_within_groups_is_bitwise_reshard_true(tmp_path):
    run_distributed(_cases, WORLD, str(tmp_path))


@pytest.mark.parametrize("value", [0, 1, -2, 2.0, "node", None])
def test_option_refuses_what_is_not_a_group_size(value):
    with pytest.raises(ValueError, match=r"options\['reshard_after_forward'\] is .*use True .*False .*group size k"):
        Options.from_dict({"reshard_after_forward": value})


@pytest.mark.parametrize("size", [3, 4, 8])
def test_group_size_must_cut_the_shard_dim(size):
    from fsdp_pass.buckets.mesh import check_reshard_group_size

    with pytest.raises(ValueError, match=r"reshard_after_forward=\d+ does not cut the shard dim of 4 ranks.*one of \[2\]"):
        check_reshard_group_size(size, 4, "reshard_after_forward")
