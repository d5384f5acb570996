"""A sharded model stays usable outside the compiled call: eager forward/backward, generate, unshard,
per-block compilation; and no configuration trains silently wrong (2 gloo ranks vs one process)."""

from __future__ import annotations

import contextlib
import copy
import gc
import weakref
from unittest.mock import patch

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fsdp_pass
from fsdp_pass.buckets import dbuffer
from fsdp_pass.buckets.dbuffer import buffers_of
from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor
from fsdp_pass.testing.loop_programs import Experts
from fsdp_pass.testing.spawn import run_distributed
from fsdp_pass.testing.models import Checkpointed, Llama, LlamaConfig, init_std, lm_loss

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

TOLERANCE = 1e-5  # fp32, relative to the largest value
WORLD = 2


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def _batch(step: int, world: int, cfg: LlamaConfig) -> torch.Tensor:
    g = torch.Generator().manual_seed(300 + step)
    return torch.randint(0, cfg.vocab, (4 * world, cfg.seq), generator=g)


def _mean_over_ranks(x: torch.Tensor) -> float:
    x = x.detach().clone()
    dist.all_reduce(x)
    return float(x) / dist.get_world_size()


def _check_parameters(model: nn.Module, ref: nn.Module) -> float:
    full = fsdp_pass.get_full_state_dict(model)  # collective; whole tensors on rank 0
    if dist.get_rank() != 0:
        return 0.0
    worst, name = max((_rel(full[n], p.detach()), n) for n, p in ref.named_parameters())
    assert worst <= TOLERANCE, (name, worst)
    return worst


def _train_side_by_side(rank: int, world: int, model: nn.Module, ref: nn.Module, steps: int = 3) -> None:
    """``model`` (sharded, any mix of compiled and eager parts) on this rank's half vs ``ref`` on the whole batch."""
    cfg = ref.cfg
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    opt_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for step in range(steps):
        tokens = _batch(step, world, cfg)
        mine = tokens.chunk(world)[rank]
        loss_ref = lm_loss(ref(tokens), tokens)
        loss_ref.backward()
        opt_ref.step()
        opt_ref.zero_grad()
        loss = lm_loss(model(mine), mine)
        loss.backward()
        opt.step()
        opt.zero_grad()
        got = _mean_over_ranks(loss)
        assert abs(got - float(loss_ref)) <= TOLERANCE * abs(float(loss_ref)), (step, got, float(loss_ref))
    print(f"rank {rank}: parameters within {_check_parameters(model, ref):.1e} after {steps} steps")


def _check_backward_work_is_linear(model: nn.Module, tokens: torch.Tensor) -> None:
    """Each eager gradient's bookkeeping looks at its own parameter, not at the whole bucket: a rescan per
    gradient costs the bucket's parameters squared (1.3 s a step for a bucket of 579 parameters)."""
    looks = []  # one entry per parameter looked at: a view check, or a parameter of a trainable-names list
    is_view_of, trainable_names = dbuffer._is_view_of, dbuffer.DBuffer.trainable_names.fget

    def counted_is_view_of(grad, buffer) -> bool:
        looks.append(1)
        return is_view_of(grad, buffer)

    def counted_trainable_names(buf) -> list[str]:
        looks.extend(buf.params)
        return trainable_names(buf)

    with patch.object(dbuffer, "_is_view_of", counted_is_view_of), \
            patch.object(dbuffer.DBuffer, "trainable_names", property(counted_trainable_names)):
        lm_loss(model(tokens), tokens).backward()
    params = sum(len(buf.params) for buf in buffers_of(model))
    assert len(looks) <= 6 * params, f"{len(looks)} looks at parameters in one eager backward over {params}"


def _eager_training(rank: int, world: int) -> None:
    ref = init_std(Llama(LlamaConfig()))
    model = copy.deepcopy(ref)
    fsdp_pass.fully_shard(model)
    identities = [id(p) for p in model.parameters()]
    _train_side_by_side(rank, world, model, ref)
    assert [id(p) for p in model.parameters()] == identities
    assert all(isinstance(p.grad, RaggedShardTensor) or p.grad is None for p in model.parameters())
    _check_backward_work_is_linear(model, _batch(0, world, ref.cfg).chunk(world)[rank])

    # FSDP2's recipe, eager: a unit per block. Each block's bucket is reduce-scattered as soon as all its
    # gradients arrived, so the backward never holds more than one unsharded block gradient
    ref = init_std(Llama(LlamaConfig(layers=3)))
    model = copy.deepcopy(ref)
    for block in model.layers:
        fsdp_pass.fully_shard(block)
    fsdp_pass.fully_shard(model)
    _train_side_by_side(rank, world, model, ref)
    later_blocks = [buf for block in model.layers[1:] for buf in buffers_of(block)]
    held = []

    def watch_input(_, args) -> None:  # when backward reaches block 0's input, the later blocks are done
        args[0].register_hook(lambda g: held.append([b.pending_bytes for b in later_blocks]))

    model.layers[0].register_forward_pre_hook(watch_input)
    tokens = _batch(0, world, ref.cfg).chunk(world)[rank]
    lm_loss(model(tokens), tokens).backward()
    assert held == [[0] * len(later_blocks)], f"unreduced bytes of later blocks when backward reached block 0: {held}"
    _check_units_run_without_dispatch(model, tokens)
    _check_root_kept_for_backward(model, tokens)
    for per_op in (False, True):
        _experts_complete_on_one_rank(rank, world, per_op)
    _experts_reached_on_one_rank(rank, world)

    # a whole model given to one fully_shard, a bucket per module unit: each bucket's innermost module is a unit
    ref = init_std(Llama(LlamaConfig(layers=2)))
    model = copy.deepcopy(ref)
    fsdp_pass.fully_shard(model, min_bucket_bytes=0)
    assert len(buffers_of(model)) == 4  # the embedding (the model's unit: the head shares it), 2 blocks, the norm
    _train_side_by_side(rank, world, model, ref, steps=2)
    _check_units_run_without_dispatch(model, tokens)

    # units under activation checkpointing: the recompute inside backward keeps what it gathered
    for reentrant, selective in ((False, False), (True, False), (False, True)):
        ref = init_std(Llama(LlamaConfig(layers=2)))
        ref.layers = nn.ModuleList(Checkpointed(block, reentrant, selective) for block in ref.layers)
        model = copy.deepcopy(ref)
        for checkpointed in model.layers:
            fsdp_pass.fully_shard(checkpointed.module)
        fsdp_pass.fully_shard(model)
        _train_side_by_side(rank, world, model, ref, steps=2)

    # torchtitan's order, the wrapper sharded: its unit gathers around the checkpointed call, and the recompute
    # runs on the gather before the unit's backward, not op by op ([Note: a wrapper unit's recompute])
    for reentrant, selective in ((False, False), (True, False), (False, True)):
        ref = init_std(Llama(LlamaConfig(layers=2)))
        ref.layers = nn.ModuleList(Checkpointed(block, reentrant, selective) for block in ref.layers)
        model = copy.deepcopy(ref)
        for checkpointed in model.layers:
            fsdp_pass.fully_shard(checkpointed)
        fsdp_pass.fully_shard(model)
        _train_side_by_side(rank, world, model, ref, steps=2)
        _check_no_dispatch(model, tokens)
        _check_root_kept_for_backward(model, tokens)
        if not selective:  # torch's selective checkpointing refuses a second backward
            _check_backward_twice(model, tokens)


def _check_units_run_without_dispatch(model: nn.Module, tokens: torch.Tensor) -> None:
    """Every parameter of ``model`` is in a one-bucket unit ([Note: eager module units]): a forward and backward
    run no op through RaggedShard dispatch; a unit whose forward raises gets its sharded parameters back."""
    _check_no_dispatch(model, tokens)
    block = model.layers[1]
    with patch.object(type(block.attn), "forward", side_effect=RuntimeError("raised inside the unit")):
        with pytest.raises(RuntimeError, match="inside the unit"):
            model(tokens)
    assert all(isinstance(p, RaggedShardTensor) for p in model.parameters())


def _check_no_dispatch(model: nn.Module, tokens: torch.Tensor) -> None:
    """A forward and backward of ``model`` run no op through RaggedShard dispatch."""
    from fsdp_pass.tensor import dispatch

    with patch.object(dispatch, "dispatch", side_effect=AssertionError("an op went through dispatch")):
        lm_loss(model(tokens), tokens).backward()


def _check_backward_twice(model: nn.Module, tokens: torch.Tensor) -> None:
    """A second backward through the same graph (``retain_graph``) adds the same gradients again."""
    model.zero_grad()
    lm_loss(model(tokens), tokens).backward()
    once = [p.grad.full_tensor() for p in model.parameters()]
    model.zero_grad()
    loss = lm_loss(model(tokens), tokens)
    loss.backward(retain_graph=True)
    loss.backward()
    for (name, p), grad in zip(model.named_parameters(), once):
        assert _rel(p.grad.full_tensor(), 2 * grad) <= TOLERANCE, name


def _check_root_kept_for_backward(model: nn.Module, tokens: torch.Tensor) -> None:
    """FSDP2's recipe: each unit gathers once in forward; the blocks again before their backward, the root not (its
    forward ends the model's and its bucket is the first the backward reads)."""
    from fsdp_pass.eager import units

    counts = {"forward": 0, "backward": 0}

    def counted(name, gather):
        def call(*args, **kwargs):
            counts[name] += 1
            return gather(*args, **kwargs)
        return call

    with (patch.object(units, "gathered_views", counted("forward", units.gathered_views)),
          patch.object(units, "gather_in_backward", counted("backward", units.gather_in_backward))):
        lm_loss(model(tokens), tokens).backward()
    assert counts == {"forward": len(model.layers) + 1, "backward": len(model.layers)}, counts


class _RoutedModel(nn.Module):
    """A layer, experts some ranks' tokens skip, a head: the experts' bucket sits between two others."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk = nn.Linear(8, 8)
        self.moe = Experts(count=3)
        self.head = nn.Linear(8, 2)

    def forward(self, x: torch.Tensor, active: tuple[bool, ...]) -> torch.Tensor:
        return self.head(self.moe(torch.relu(self.trunk(x)), active))


def _experts_complete_on_one_rank(rank: int, world: int, per_op: bool) -> None:
    """Rank 0's tokens reach every expert, the others' skip one: rank 0's experts' bucket is complete before the
    backward ends, the others' is not, and it must still be reduced at the same point on every rank ([Note: an eager
    bucket's gradient is reduced once every rank has it]; reduced on rank 0 alone, the strict harness names the
    mismatched collectives). As units (the agreement in the gather before each unit's backward), and ``per_op``
    with no unit registered (the agreement in an all-reduce before each gather dispatch makes)."""
    from fsdp_pass.sharding import fully_shard as sharding

    torch.manual_seed(0)
    ref = _RoutedModel()
    model = copy.deepcopy(ref)
    with patch.object(sharding, "register_unit", lambda module, buckets: None) if per_op else contextlib.nullcontext():
        fsdp_pass.fully_shard(model.moe)
        fsdp_pass.fully_shard(model)
    x = torch.randn(2 * world, 8, generator=torch.Generator().manual_seed(1))
    active = [(True, True, True)] + [(True, True, False)] * (world - 1)
    sum(ref(x[2 * r:2 * r + 2], active[r]).square().mean() for r in range(world)).div(world).backward()
    model(x[2 * rank:2 * rank + 2], active[rank]).square().mean().backward()
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert _rel(p.grad.full_tensor(), q.grad) <= TOLERANCE, name


def _experts_reached_on_one_rank(rank: int, world: int) -> None:
    """Rank 0's tokens reach an expert, the others' reach none: only rank 0 holds a gradient sum for the experts'
    bucket, and every rank must still reduce it, at the same point ([Note: an eager bucket's gradient is reduced
    once every rank has it]): at the backward's end, at the next synced backward after ``no_sync`` micro-batches
    (one that reaches no expert on any rank), and in ``reduce_gradients``. The experts no rank reached keep
    ``.grad`` None, as one process's do. A model deleted with such a sum is dropped on every rank."""
    from fsdp_pass.sharding import fully_shard as sharding

    x = torch.randn(4 * world, 8, generator=torch.Generator().manual_seed(2))
    micro_batches = [x[:2 * world], x[2 * world:]]
    one_rank = [(True, False, False)] + [(False, False, False)] * (world - 1)
    none = [(False, False, False)] * world
    # first a model deleted on every rank while rank 0 alone holds a no_sync sum of it: that sum keeps rank 0's
    # bucket alive, the others' bucket is freed, so the next backward's end drops the sum everywhere
    experts = Experts(count=3)
    fsdp_pass.fully_shard(experts)
    with fsdp_pass.no_sync(experts):
        experts(x[2 * rank:2 * rank + 2].clone().requires_grad_(), one_rank[rank]).square().mean().backward()
    bucket = weakref.ref(buffers_of(experts)[0])
    del experts
    gc.collect()
    assert (bucket() is None) == (rank > 0), "a deleted model is kept by its unreduced sum only"
    # (per micro-batch: each rank's experts, and whether it syncs); a last unsynced one ends with reduce_gradients
    loops = [[(one_rank, True)], [(one_rank, False), (none, True)], [(one_rank, False), (one_rank, False)]]
    for loop in loops:
        torch.manual_seed(0)
        ref = _RoutedModel()
        model = copy.deepcopy(ref)
        fsdp_pass.fully_shard(model.moe)
        fsdp_pass.fully_shard(model)
        for xs, (active, sync) in zip(micro_batches, loop):
            sum(ref(xs[2 * r:2 * r + 2], active[r]).square().mean() for r in range(world)).div(world).backward()
            with contextlib.nullcontext() if sync else fsdp_pass.no_sync(model):
                model(xs[2 * rank:2 * rank + 2], active[rank]).square().mean().backward()
        if not loop[-1][1]:
            fsdp_pass.reduce_gradients(model)
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            assert (p.grad is None) == (q.grad is None), (loop, name)
            assert q.grad is None or _rel(p.grad.full_tensor(), q.grad) <= TOLERANCE, (loop, name)


def test_eager_forward_backward_and_step_match_one_process():
    run_distributed(_eager_training, WORLD)


def _per_block_compilation(rank: int, world: int, compiler: str, min_bucket_bytes: int | None) -> None:
    from fsdp_pass.compile.backend import records

    ref = init_std(Llama(LlamaConfig(layers=3)))
    model = copy.deepcopy(ref)
    before = len(records())
    fsdp_pass.fully_shard(model, min_bucket_bytes=min_bucket_bytes)  # the eager embedding, norm and head too
    for block in model.layers:
        block.compile(backend="vescale", options={"compiler": compiler})
    _train_side_by_side(rank, world, model, ref)
    graphs = len(records()) - before
    print(f"rank {rank}: {graphs} graph(s) compiled for {len(model.layers)} blocks (min_bucket_bytes={min_bucket_bytes})")
    if min_bucket_bytes == 0:  # a bucket per block: one graph serves every block ([Note: one graph for identical blocks])
        assert graphs == 1, graphs


@pytest.mark.slow
# aot_eager: a block graph run on other blocks' buckets is the same rebinding under Inductor, whose
# code generation the whole-model tests cover (tests/test_compile_parity.py, tests/test_schedule.py).
@pytest.mark.parametrize("compiler,min_bucket_bytes", [("aot_eager", 0), ("aot_eager", None)])
def test_per_block_compilation_matches_one_process(compiler, min_bucket_bytes):
    run_distributed(_per_block_compilation, WORLD, compiler, min_bucket_bytes)


def _blocks_compiled_alone(rank: int, world: int) -> None:
    ref = init_std(Llama(LlamaConfig()))
    model = copy.deepcopy(ref)
    for block in model.layers:  # nothing shards the embedding and the head
        block.compile(backend="vescale", options={"compiler": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = _batch(0, world, ref.cfg).chunk(world)[rank]
    lm_loss(model(tokens), tokens).backward()
    with pytest.raises(RuntimeError, match=r"parameter 'tok_embeddings.weight' .* is not sharded .*fully_shard\(model\)"):
        opt.step()


def test_blocks_compiled_alone_refuse_to_train_unsynchronized_parameters():
    run_distributed(_blocks_compiled_alone, WORLD)


def _compiled_then_eager(rank: int, world: int) -> None:
    ref = init_std(Llama(LlamaConfig()))
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    tokens = _batch(0, world, ref.cfg)
    with torch.no_grad():
        compiled(tokens.chunk(world)[rank])  # shards the parameters
        eager = model(tokens)  # the original module, every parameter sharded
        assert _rel(eager, ref(tokens)) <= TOLERANCE
        first = model.layers[0](ref.tok_embeddings(tokens), ref.freqs[: tokens.shape[1], None, :])
        assert _rel(first, ref.layers[0](ref.tok_embeddings(tokens), ref.freqs[: tokens.shape[1], None, :])) <= TOLERANCE


def test_compiled_model_also_runs_eagerly():
    run_distributed(_compiled_then_eager, WORLD)


def _peak_allocated_bytes(prof) -> int:
    """Peak of the CPU allocator's live bytes during the profile, above the level where it began."""
    from torch._C._profiler import _EventType

    records, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            records.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.total_allocated))
    records.sort()
    start = records[0][2] - records[0][1]
    return max(total for _, _, total in records) - start


_GLOO_WORKER_THREADS = dist.ProcessGroupGloo._Options()._threads  # 2: the default the tests run with


def _eager_peak_memory(rank: int, world: int) -> None:
    """An eager forward holds a bounded number of gathered buckets, never the whole model.

    Ours: the kept bucket is freed before the next is gathered, so one at a time. gloo's: its
    ``_allgather_base`` gathers into a flat staging copy of the output (one more bucket), and each of
    its worker threads (``_GLOO_WORKER_THREADS``) keeps its last finished work, which holds that
    work's output, until the thread runs again; on 2 busy cores that is sometimes after the next
    gather has begun (seen: peaks of 2, 3 and 4 buckets, and always 2 with a 5 ms pause after each
    gather). So the bound is 1 + 1 + 2 buckets plus activations, and the model is made large enough
    that holding it whole would exceed that.
    """
    from fsdp_pass.buckets import whole_values as eager
    from fsdp_pass.tensor.ragged_tensor import bucket_of

    cfg = LlamaConfig(dim=64, ffn=128, layers=10, vocab=64, tie_embeddings=False)
    model = init_std(Llama(cfg))
    fsdp_pass.fully_shard(model, min_bucket_bytes=0)  # one bucket per unit: embedding, 10 layers, norm, head
    buffers = {id(b): b for b in (bucket_of(p)[0] for p in model.parameters())}.values()
    whole_bytes = [b.layout.shard_size * WORLD * b.dtype.itemsize for b in buffers]
    largest = max(whole_bytes)
    tokens = _batch(0, world, cfg)[:1]
    eager.drop_gathered()
    with torch.no_grad(), torch.profiler.profile(profile_memory=True) as prof:
        model(tokens)
    peak = _peak_allocated_bytes(prof)
    print(f"rank {rank}: eager forward peak {peak / 2**10:.0f} KiB; largest bucket {largest / 2**10:.0f} KiB; "
          f"whole model {sum(whole_bytes) / 2**10:.0f} KiB")
    bound = (1 + 1 + _GLOO_WORKER_THREADS) * largest + 256 * 2**10  # activations of one token row: < 256 KiB
    assert peak <= bound, (peak, largest)
    assert sum(whole_bytes) > bound  # the whole model would not fit that bound


def test_eager_forward_gathers_one_bucket_at_a_time():
    run_distributed(_eager_peak_memory, WORLD)


def _hf_tiny_llama():
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = HFLlamaConfig(vocab_size=61, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                        tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


def _generate(rank: int, world: int) -> None:
    ref = _hf_tiny_llama()
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    prompt = torch.tensor([[5, 17, 3, 42]])
    with torch.no_grad():
        compiled(prompt)  # the first compiled call shards the parameters
    tokens = compiled.generate(prompt, max_new_tokens=6, do_sample=False)
    expected = ref.generate(prompt, max_new_tokens=6, do_sample=False)
    assert torch.equal(tokens, expected), (tokens, expected)


def test_hf_generate_on_a_compiled_sharded_model_returns_one_process_tokens():
    run_distributed(_generate, WORLD)


def _unshard(rank: int, world: int) -> None:
    ref = init_std(Llama(LlamaConfig()))
    model = copy.deepcopy(ref)
    fsdp_pass.fully_shard(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    identities = [id(p) for p in model.parameters()]

    with fsdp_pass.unshard(model):
        state = model.state_dict()
        for name, p in ref.state_dict().items():
            assert torch.equal(state[name], p), name
        assert not any(isinstance(p, RaggedShardTensor) for p in model.parameters())
        with pytest.raises(ValueError, match="already unsharded"):
            with fsdp_pass.unshard(model):
                pass
    assert [id(p) for p in model.parameters()] == identities
    assert all(isinstance(p, RaggedShardTensor) for p in model.parameters())

    with fsdp_pass.unshard(model, writeback=True):  # weight surgery
        with torch.no_grad():
            model.layers[1].attn.wo.weight.zero_()
            model.norm.weight.mul_(2)
    with torch.no_grad():
        ref.layers[1].attn.wo.weight.zero_()
        ref.norm.weight.mul_(2)
    tokens = _batch(0, world, ref.cfg)
    with torch.no_grad():
        assert _rel(model(tokens), ref(tokens)) <= TOLERANCE

    with pytest.raises(KeyError):  # the body raises: nothing written back, shards restored
        with fsdp_pass.unshard(model, writeback=True):
            with torch.no_grad():
                model.norm.weight.fill_(7)
            raise KeyError("boom")
    assert all(isinstance(p, RaggedShardTensor) for p in model.parameters())
    with torch.no_grad():
        assert _rel(model(tokens), ref(tokens)) <= TOLERANCE

    lm_loss(model(tokens.chunk(world)[rank]), tokens.chunk(world)[rank]).backward()
    opt.step()  # the optimizer's handles are still the parameters

    with fsdp_pass.unshard(model):
        with pytest.raises(ValueError, match="inside an fsdp_pass.unshard block"):
            with fsdp_pass.no_sync(model):
                pass

    plain = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="has no sharded parameters"):
        with fsdp_pass.unshard(plain):
            pass


def test_unshard_gives_whole_parameters_and_restores_the_shards():
    run_distributed(_unshard, WORLD)


def _compiled_call_inside_unshard(rank: int, world: int) -> None:
    model = init_std(Llama(LlamaConfig()))
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    tokens = _batch(0, world, model.cfg)
    compiled(tokens)
    with fsdp_pass.unshard(model):
        with pytest.raises(Exception, match="inside fsdp_pass.unshard"):
            compiled(tokens)


def test_compiled_call_inside_unshard_is_refused():
    run_distributed(_compiled_call_inside_unshard, WORLD)


def _hf_export(rank: int, world: int, out: str) -> None:
    from transformers import LlamaForCausalLM

    ref = _hf_tiny_llama()
    model = copy.deepcopy(ref)
    compiled = torch.compile(model, backend="vescale", options={"compiler": "aot_eager"})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.randint(0, 61, (2 * world, 8), generator=torch.Generator().manual_seed(5))
    mine = tokens.chunk(world)[rank]
    lm_loss(compiled(mine).logits, mine).backward()
    opt.step()

    full = fsdp_pass.get_full_state_dict(model)  # way 1: gather to rank 0
    if rank == 0:
        model.save_pretrained(f"{out}/gathered", state_dict=dict(full))  # save_pretrained consumes its dict
    with fsdp_pass.unshard(model):  # way 2: whole parameters on every rank
        if rank == 0:
            model.save_pretrained(f"{out}/unsharded")
    dist.barrier()
    if rank == 0:
        for way in ("gathered", "unsharded"):
            loaded = LlamaForCausalLM.from_pretrained(f"{out}/{way}")
            for name, p in loaded.named_parameters():
                assert torch.equal(p, full[name]), (way, name)
        assert not torch.equal(full["model.norm.weight"], ref.model.norm.weight)  # the trained values


def test_hf_export_both_ways(tmp_path):
    run_distributed(_hf_export, WORLD, str(tmp_path))
