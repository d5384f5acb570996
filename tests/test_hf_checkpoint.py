"""Hugging Face checkpoints through DCP: safetensors written from RaggedShard pieces, read back into them.

Tiny Llama and Mixtral models are sized so that rank boundaries cut rows (and experts) in the
middle, which makes a rank's piece several boxes; every check compares every element.
"""

from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import (
    FileSystemReader,
    FileSystemWriter,
    HuggingFaceStorageReader,
    HuggingFaceStorageWriter,
)
from torch.distributed.checkpoint.api import CheckpointException

import fsdp_pass
from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.placement import flat_range_boxes
from fsdp_pass.tensor.checkpoint import save_rows

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")


@pytest.mark.parametrize("shape", [(3, 4), (2, 3, 2), (5, 1), (1, 6)])
def test_save_rows_give_each_rank_one_box_and_tile_the_tensor(shape):
    """Every split of the flat tensor over 3 ranks: each rank writes one run of whole leading-dim
    slices, every slice exactly once, and a rank writes slice k iff it holds the slice's first element."""
    n, inner = numel(shape), numel(shape[1:])
    for a in range(n + 1):
        for b in range(a, n + 1):
            ranges = [(0, a), (a, b), (b, n)]
            rows = save_rows(shape, ranges)
            assert [k for lo, hi in rows for k in range(lo, hi)] == list(range(shape[0]))
            for (start, end), (lo, hi) in zip(ranges, rows):
                assert all(start <= k * inner < end for k in range(lo, hi))


def numel(shape) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _config(kind: str):
    common = dict(vocab_size=67, hidden_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=10, tie_word_embeddings=False, dtype="float32")
    if kind == "llama":
        return transformers.LlamaConfig(intermediate_size=56, **common)
    return transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **common)


def _model(kind: str, seed: int):
    torch.manual_seed(seed)
    cls = transformers.LlamaForCausalLM if kind == "llama" else transformers.MixtralForCausalLM
    return cls(_config(kind)).float()


def _sharded(kind: str, seed: int, mesh_shape):
    from torch.distributed.device_mesh import init_device_mesh

    model = _model(kind, seed)
    reference = {k: v.detach().clone() for k, v in model.state_dict().items()}
    mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
    # Mixtral: attention matrices kept whole, so that rank boundaries fall inside expert tensors.
    whole = {"*q_proj*": 40, "*o_proj*": 40, "*k_proj*": 20, "*v_proj*": 20} if kind == "mixtral" else None
    fsdp_pass.fully_shard(model, mesh, block_sizes=whole)
    return model, reference


def _pieces_with_several_boxes(model) -> list[str]:
    """Parameters some rank holds as more than one box (the layouts these tests are about)."""
    names = []
    for name, p in model.named_parameters():
        spec = p._spec
        if any(len(flat_range_boxes(spec.shape, s, e)) > 1 for s, e in spec.placement.ranges()):
            names.append(name)
    return names


def _assert_all_equal(got: dict, reference: dict, what: str) -> None:
    assert set(got) == set(reference), f"{what}: keys differ: {sorted(set(got) ^ set(reference))}"
    for name, ref in reference.items():
        value = got[name]
        assert value.dtype == ref.dtype and value.shape == ref.shape, (
            f"{what}: {name} is {value.dtype}{tuple(value.shape)}, expected {ref.dtype}{tuple(ref.shape)}")
        if not torch.equal(value, ref):
            bad = (value != ref).nonzero()
            raise AssertionError(f"{what}: {name} differs at {bad.shape[0]} elements, first {bad[0].tolist()}")


def _safetensors_dir(path: str) -> dict:
    from safetensors.torch import load_file

    out = {}
    for f in sorted(glob.glob(os.path.join(path, "*.safetensors"))):
        out.update(load_file(f))
    return out


def _full(model) -> dict:
    return fsdp_pass.get_full_state_dict(model)


def _load_sharded(target, reader, reference: dict, what: str, rank: int) -> None:
    """``target`` (a sharded model, first overwritten with -7) loaded through ``reader`` equals ``reference``."""
    with torch.no_grad():
        for p in target.parameters():
            p.fill_(-7.0)
    dcp.load(target.state_dict(), storage_reader=reader)
    full = _full(target)
    if rank == 0:
        _assert_all_equal(full, reference, what)


def _hf_worker(rank: int, world: int, root: str, mesh_shape, kinds=("mixtral", "llama")) -> None:
    for kind in kinds:
        model, reference = _sharded(kind, 7, mesh_shape)
        target, _ = _sharded(kind, 1234, mesh_shape)
        several = _pieces_with_several_boxes(model)
        if world > 1:
            assert several, f"{kind}: no rank holds a piece of several boxes; resize the model"
            if kind == "mixtral":
                assert any(".experts." in name for name in several), f"no expert tensor is cut: {several}"
        out = os.path.join(root, kind)

        # 1. Distributed save + consolidation: the consolidated files are the full tensors.
        hf = os.path.join(out, "hf")
        dcp.save(model.state_dict(),
                 storage_writer=HuggingFaceStorageWriter(hf, save_distributed=True, enable_consolidation=True))
        dist.barrier()
        if rank == 0:
            _assert_all_equal(_safetensors_dir(hf), reference, f"{kind} consolidated safetensors")
            model.config.save_pretrained(hf)
            loaded = type(model).from_pretrained(hf, dtype=torch.float32)
            _assert_all_equal({k: v.detach() for k, v in loaded.state_dict().items()}, reference,
                              f"{kind} from_pretrained of the consolidated checkpoint")
        dist.barrier()

        # 2. The per-rank files (one chunk per tensor and rank) and the consolidated files read
        #    back into the shards through HuggingFaceStorageReader.
        _load_sharded(target, HuggingFaceStorageReader(os.path.join(hf, "sharded")), reference,
                      f"{kind} per-rank safetensors -> shards", rank)
        _load_sharded(target, HuggingFaceStorageReader(hf), reference,
                      f"{kind} consolidated safetensors -> shards", rank)

        # 3. Distributed save without consolidation.
        raw = os.path.join(out, "raw")
        dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(raw, save_distributed=True))
        dist.barrier()
        _load_sharded(target, HuggingFaceStorageReader(raw), reference,
                      f"{kind} unconsolidated safetensors -> shards", rank)

        # 4. save_distributed=False is rank-0 checkpointing of a full state dict. A sharded state
        #    dict there (every rank writing the same file) or with no_dist=True is refused.
        if world > 1 and kind == "llama":
            single_sharded = os.path.join(out, "single_sharded")
            with pytest.raises((ValueError, CheckpointException), match="save_distributed=True"):
                dcp.save(model.state_dict(), storage_writer=HuggingFaceStorageWriter(single_sharded))
            with pytest.raises((ValueError, CheckpointException), match="no_dist=True"):
                dcp.save(model.state_dict(), storage_writer=FileSystemWriter(single_sharded), no_dist=True)
            assert not glob.glob(os.path.join(single_sharded, "*.safetensors"))
        full = _full(model)
        single = os.path.join(out, "single")
        if rank == 0:
            _assert_all_equal(full, reference, f"{kind} get_full_state_dict")
            dcp.save(full, storage_writer=HuggingFaceStorageWriter(single), no_dist=True)
            _assert_all_equal(_safetensors_dir(single), reference, f"{kind} rank-0 safetensors")
        dist.barrier()

        # 5. The default FileSystemWriter / FileSystemReader round trip.
        fs = os.path.join(out, "dcp")
        dcp.save(model.state_dict(), storage_writer=FileSystemWriter(fs))
        _load_sharded(target, FileSystemReader(fs), reference, f"{kind} FileSystemWriter round trip", rank)

    # 6. A save_pretrained directory read into the shards (Mixtral's save_pretrained writes the
    #    per-expert legacy names, so this uses Llama, whose names are the module's; the loop ends
    #    with Llama's reference and target).
    if kinds[-1] != "llama":
        return
    pretrained = os.path.join(root, "pretrained")
    if rank == 0:
        _model("llama", 7).save_pretrained(pretrained)
    dist.barrier()
    _load_sharded(target, HuggingFaceStorageReader(pretrained), reference, "save_pretrained -> shards", rank)


@pytest.mark.parametrize("world, mesh_shape", [(1, None), (2, None), (4, (2, 2))],
                         ids=["1 rank", "2 ranks", "2x2 HSDP"])
def test_hf_safetensors_round_trip(tmp_path, world, mesh_shape):
    run_distributed(_hf_worker, world, str(tmp_path), mesh_shape)


@pytest.mark.slow
def test_hf_safetensors_round_trip_at_four_ranks(tmp_path):
    """Four ranks on one 1-D mesh: an expert matrix spread over several ranks (Mixtral only, for time)."""
    run_distributed(_hf_worker, 4, str(tmp_path), None, ("mixtral",))


# -- Fine-tuning a pretrained model built on the meta device (docs/howto.md) ----------------------------------------


def _fuse_legacy_mixtral(src: str, dst: str) -> None:
    """Rename a Mixtral ``save_pretrained`` directory to the module's parameter names.

    ``save_pretrained`` writes Mixtral experts under their legacy per-expert names
    (``block_sparse_moe.experts.{e}.w1/w2/w3.weight``), which ``HuggingFaceStorageReader`` cannot map
    to the fused ``mlp.experts.gate_up_proj`` / ``down_proj`` parameters: this step (one process,
    whole tensors) writes them under the module's names, the layout DCP loads piece by piece.
    """
    import re

    from safetensors.torch import save_file

    legacy = _safetensors_dir(src)
    out, experts = {}, {}
    for key, value in legacy.items():
        m = re.match(r"(.*)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight$", key)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = value
        else:
            out[key.replace(".block_sparse_moe.", ".mlp.")] = value
    for layer, ws in experts.items():
        count = 1 + max(e for e, _ in ws)
        out[f"{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([ws[(e, "w1")], ws[(e, "w3")]]) for e in range(count)])
        out[f"{layer}.mlp.experts.down_proj"] = torch.stack([ws[(e, "w2")] for e in range(count)])
    os.makedirs(dst, exist_ok=True)
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})


def _write_pretrained(root: str, kinds) -> None:
    """What a user starts from: ``save_pretrained`` directories, written by one process."""
    for kind in kinds:
        pretrained = os.path.join(root, kind, "pretrained")
        _model(kind, 7).save_pretrained(pretrained)
        if kind == "mixtral":
            _fuse_legacy_mixtral(pretrained, os.path.join(root, kind, "load"))


def _finetune_worker(rank: int, world: int, root: str, mesh_shape, kinds) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_pass.testing.models import lm_loss

    mesh = init_device_mesh("cpu", mesh_shape) if mesh_shape else None
    for kind in kinds:
        pretrained = os.path.join(root, kind, "pretrained")
        load_dir = os.path.join(root, kind, "load") if kind == "mixtral" else pretrained
        torch._dynamo.reset()

        # The flow of docs/howto.md: meta build, shard, load each rank's pieces, compile, train, save.
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(_config(kind))
        fsdp_pass.fully_shard(model, mesh)
        dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(load_dir))

        reference = type(model).from_pretrained(pretrained, dtype=torch.float32)
        expected = {k: v.detach().clone() for k, v in reference.state_dict().items()}
        loaded = _full(model)
        if rank == 0:
            _assert_all_equal(loaded, expected, f"{kind} meta build + DCP load vs from_pretrained")
        ref_buffers = dict(reference.named_buffers())
        for name, b in model.named_buffers():
            assert not b.is_meta and torch.equal(b, ref_buffers[name]), f"{kind}: buffer {name}"

        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
        ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-3, weight_decay=0.1)
        options = {"compiler": "aot_eager", **({"mesh": mesh} if mesh is not None else {})}
        compiled = torch.compile(model, backend="vescale", options=options)
        per_rank = 2
        for step in range(3):
            tokens = torch.randint(0, 67, (per_rank * world, 8), generator=torch.Generator().manual_seed(step))
            mine = tokens[rank * per_rank:(rank + 1) * per_rank]
            lm_loss(compiled(mine).logits, mine).backward()
            opt.step()
            opt.zero_grad()
            lm_loss(reference(tokens).logits, tokens).backward()  # equal per-rank sizes: the mean of the means
            ref_opt.step()
            ref_opt.zero_grad()
        trained = _full(model)
        if rank == 0:
            for name, p in reference.named_parameters():
                rel = ((trained[name] - p.detach()).norm() / p.detach().norm()).item()
                assert rel <= 1e-5, f"{kind}: {name} differs from one process by {rel:.3g} after 3 steps"

        out = os.path.join(root, kind, f"finetuned-{world}")
        dcp.save(model.state_dict(),
                 storage_writer=HuggingFaceStorageWriter(out, save_distributed=True, enable_consolidation=True))
        dist.barrier()
        if rank == 0:
            model.config.save_pretrained(out)
            again = type(reference).from_pretrained(out, dtype=torch.float32)
            _assert_all_equal({k: v.detach() for k, v in again.state_dict().items()}, trained,
                              f"{kind} from_pretrained of the fine-tuned checkpoint")
        dist.barrier()


@pytest.mark.parametrize("world, mesh_shape, kinds", [(2, None, ("llama", "mixtral")), (4, (2, 2), ("llama",))],
                         ids=["2 ranks", "2x2 HSDP"])
def test_finetune_pretrained_from_meta_device(tmp_path, world, mesh_shape, kinds):
    _write_pretrained(str(tmp_path), kinds)
    run_distributed(_finetune_worker, world, str(tmp_path), mesh_shape, kinds)


@pytest.mark.slow
def test_finetune_pretrained_from_meta_device_at_four_ranks(tmp_path):
    _write_pretrained(str(tmp_path), ("llama",))
    run_distributed(_finetune_worker, 4, str(tmp_path), None, ("llama",))
