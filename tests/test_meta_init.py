"""A model built on the meta device: only local shards are allocated, initialized module by module."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.profiler import ProfilerActivity, profile

import fsdp_pass
from fsdp_pass.tensor.ragged_tensor import bucket_of
from fsdp_pass.testing.spawn import run_distributed


class Stack(nn.Module):
    def __init__(self, vocab: int = 128, dim: int = 64, layers: int = 12):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied: keeps the embedding's initialization


def _peak_bytes(prof) -> int:
    """Largest sum of live CPU allocations seen by the profiler, in time order.

    Allocations are counted in the allocating op's *self* memory, frees not tied to an op in
    ``[memory]`` events; children are not double counted.
    """
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _worker(rank: int, world: int) -> None:
    torch.manual_seed(0)
    reference = Stack()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Stack()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fsdp_pass.fully_shard(model)
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert isinstance(p, fsdp_pass.RaggedShardTensor) and not p.to_local().is_meta
        assert torch.equal(p.full_tensor(), ref), name  # same values as a model built on the CPU
    assert model.head.weight is model.embed.weight
    buffers = {id(b): b for b in (bucket_of(p)[0] for p in model.parameters())}.values()
    local_share = sum(b.layout.shard_size * 4 for b in buffers)
    largest_module = max(sum(p.numel() * 4 for p in m.parameters(recurse=False)) for m in model.modules())
    total = sum(p.numel() * 4 for p in model.parameters())
    peak = _peak_bytes(prof)
    assert local_share + largest_module < total  # the bound below is tighter than the full model
    scalars = 1024  # 0-dim temporaries inside init functions
    rng_states = 2 * torch.get_rng_state().numel()  # before/after copies telling whether an init drew random numbers
    assert peak <= local_share + largest_module + scalars + rng_states, (peak, local_share, largest_module, total)


def test_meta_init_matches_cpu_init_and_allocates_local_share_plus_one_module():
    run_distributed(_worker, 2)


class Scale(nn.Module):
    """A norm-like module without reset_parameters: its value is set in __init__ only."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))

    def forward(self, x):
        return x * self.scale


def _unloaded_worker(rank: int, world: int) -> None:
    """A parameter no init reaches is NaN until written, and a forward that uses it raises, naming it."""
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(4, 4), Scale())
    fsdp_pass.fully_shard(model)  # never refused: `1.scale` is left for a checkpoint
    x = torch.ones(2, 4)
    with pytest.raises(RuntimeError, match=r"\['1.scale'\] are used before they were initialized or loaded"):
        model(x)  # eager path
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    with pytest.raises(RuntimeError, match=r"\['1.scale'\] are used before"):
        compiled(x)  # compiled path: every rank raises, also the one whose piece is empty
    full = {k: v for k, v in fsdp_pass.get_full_state_dict(model, rank0_only=False).items()}
    assert torch.isnan(full["1.scale"]).all() and not torch.isnan(full["0.weight"]).any()
    full["1.scale"] = torch.full((4,), 2.0)
    fsdp_pass.set_full_state_dict(model, full)  # any write counts as loaded
    out = compiled(x)
    torch.testing.assert_close(out, (x @ full["0.weight"].T + full["0.bias"]) * 2.0)
    assert torch.equal(fsdp_pass.get_full_state_dict(model, rank0_only=False)["1.scale"], torch.full((4,), 2.0))


def test_parameters_without_init_are_left_for_a_checkpoint_and_raise_when_used_first():
    run_distributed(_unloaded_worker, 2)


class Rotary(nn.Module):
    """Buffers only: a non-persistent table recomputed by reset_parameters, a persistent one set there too."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", torch.empty(dim // 2), persistent=False)
        self.register_buffer("steps", torch.empty((), dtype=torch.long))
        self.reset_parameters()

    def reset_parameters(self):
        self.inv_freq.copy_(1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim)))
        self.steps.zero_()


class RotaryInInit(nn.Module):
    def __init__(self, dim: int = 8):
        super().__init__()
        self.dim = dim
        self.register_buffer("inv_freq", self.compute(), persistent=False)

    def compute(self) -> torch.Tensor:
        return 1.0 / (10000 ** (torch.arange(0, self.dim, 2).float() / self.dim))

    def forward(self, x):
        return x * self.inv_freq.sum()


def test_buffers_are_materialized_and_computed():
    reference = nn.Sequential(nn.Linear(8, 8), Rotary())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Rotary())
    fsdp_pass.fully_shard(model)
    for (name, b), ref in zip(model.named_buffers(), reference.buffers()):
        assert b.device.type == "cpu" and torch.equal(b, ref), name


def test_buffer_no_init_computes_waits_on_meta_for_to_empty_and_the_models_init():
    """FSDP2's flow: shard on meta, ``to_empty``, then the model's own init computes the buffer."""
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), RotaryInInit())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), RotaryInInit())
    fsdp_pass.fully_shard(model)
    assert model[1].inv_freq.is_meta and not model[0].weight.is_meta
    x = torch.randn(2, 8)
    for call in (model, torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})):
        with pytest.raises(RuntimeError, match=r"buffers \['1.inv_freq'\] are still on the meta device.*to_empty"):
            call(x)
    model.to_empty(device="cpu")
    with torch.no_grad():  # the model's own init
        model[1].inv_freq.copy_(model[1].compute())
        model[0].weight.copy_(reference[0].weight)
        model[0].bias.copy_(reference[0].bias)
    assert torch.equal(model(x), reference(x))


def test_init_skip_leaves_everything_to_the_models_init():
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(8, 8), Rotary())
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(8, 8), Rotary())
    with pytest.raises(ValueError, match="init must be 'replay' or 'skip'"):
        fsdp_pass.fully_shard(model, init="none")
    state = torch.get_rng_state()
    fsdp_pass.fully_shard(model, init="skip")
    assert torch.equal(state, torch.get_rng_state())  # nothing replayed, nothing drawn
    assert all(b.is_meta for b in model.buffers())
    with pytest.raises(RuntimeError, match=r"buffers \['1.inv_freq', '1.steps'\] are still on the meta device"):
        model(torch.ones(2, 8))
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    for m in model.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    for (name, p), ref in zip(model.named_parameters(), reference.parameters()):
        assert torch.equal(p.full_tensor(), ref), name
    for (name, b), ref in zip(model.named_buffers(), reference.buffers()):
        assert torch.equal(b, ref), name


class ZeroOutput(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.out = nn.Linear(4, 4)
        nn.init.zeros_(self.out.weight)  # outside reset_parameters: does nothing on the meta device


class OwnFirst(nn.Module):
    """Initializes its own parameter before building its submodule (a real build draws it first)."""

    def __init__(self):
        super().__init__()
        self.gain = nn.Parameter(torch.empty(4))
        self.reset_parameters()
        self.inner = nn.Linear(4, 4)

    def reset_parameters(self):
        nn.init.uniform_(self.gain)


@pytest.mark.parametrize("cls, match", [(ZeroOutput, r"<root> \(ZeroOutput\) writes tensors in __init__ outside "
                                                     r"reset_parameters \(zeros_\)"),
                                        (OwnFirst, r"<root> \(OwnFirst\) has its own parameters and submodules")])
def test_init_order_a_meta_build_cannot_replay_warns_naming_the_module(cls, match):
    torch.manual_seed(0)
    reference = cls()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = cls()
    with pytest.warns(UserWarning, match=match):
        fsdp_pass.fully_shard(model)
    full = fsdp_pass.get_full_state_dict(model)
    assert any(not torch.equal(full[k], v) for k, v in reference.state_dict().items())  # what the warning says


def test_meta_build_of_hugging_face_models_matches_the_cpu_build_without_warnings(recwarn):
    transformers = pytest.importorskip("transformers")
    common = dict(vocab_size=67, hidden_size=40, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=10, dtype="float32", tie_word_embeddings=True)
    for config in (transformers.LlamaConfig(intermediate_size=56, **common),
                   transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2,
                                              **common)):
        torch.manual_seed(0)
        reference = transformers.AutoModelForCausalLM.from_config(config)
        torch.manual_seed(0)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        fsdp_pass.fully_shard(model)
        full = fsdp_pass.get_full_state_dict(model)
        for name, value in reference.state_dict().items():
            assert torch.equal(full[name], value), name
        ref_buffers = dict(reference.named_buffers())
        for name, b in model.named_buffers():
            assert torch.equal(b, ref_buffers[name]), name
    assert not [w for w in recwarn if "fully_shard" in str(w.message)]


def test_mesh_messages_say_what_to_do():
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_pass.testing.fake_pg import fake_process_group

    with fake_process_group(8):
        mesh = init_device_mesh("cpu", (2, 2, 2))
        with pytest.raises(ValueError, match=r"has 3 dims \(2, 2, 2\); give a 1-D mesh \(FSDP\) or a 2-D"):
            fsdp_pass.fully_shard(nn.Linear(4, 4), mesh)
    with fake_process_group(4):
        mesh = init_device_mesh("cpu", (2, 2))
        with pytest.raises(ValueError, match=r"shard_dim=2 is not a dim .*; pass shard_dim in range\(2\)"):
            fsdp_pass.fully_shard(nn.Linear(4, 4), mesh, shard_dim=2)
