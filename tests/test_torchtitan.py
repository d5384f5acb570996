"""torchtitan's own trainer with ``--module fsdp_pass.integrations.torchtitan``, run for real on 2 gloo ranks
(docs/integrations.md, torchtitan).

Each rank runs torchtitan's ``Trainer`` several times in one process group, configured as
``torchtitan.train`` would configure it from the command line (``ConfigManager().parse_args``), with
torchtitan's llama3 and qwen3 debug models cut to 2 layers, fp32, the same seed and data:

* torchtitan's own FSDP2 run (``--module llama3`` / ``qwen3``) and fsdp_pass's, compiled (the
  ``vescale`` backend per block, activation checkpointing on) and eager, both starting from one
  seed checkpoint made by torchtitan (``--checkpoint.create_seed_checkpoint``, torchtitan's way to
  compare parallelisms; FSDP2's own sharded init on CPU differs from one process's): per-step loss
  and gradient norm;
* fsdp_pass's own meta-device init (no seed checkpoint) gives the seed checkpoint's step-1 loss;
* a DCP checkpoint at step 5 (torchtitan's checkpointer), resumed in a new trainer: steps 6-10 equal
  the uninterrupted run bit for bit;
* the default llama3_debugmodel settings (activation checkpointing, no compile): the eager run;
* on 4 ranks: torchtitan's TP 2 x FSDP 2 (compiled; eager with activation checkpointing). HSDP is not
  run through torchtitan (2x2 HSDP runs through accelerate in tests/test_integrations.py, and in the
  parity, checkpoint and no_sync tests).

[Note: torchtitan 0.3.0 on CPU]
torchtitan does not run on a CPU build of torch as shipped; these patches (the test's only) fill
its gaps, for the FSDP2 reference and fsdp_pass alike:
* it imports triton at import time (fused kernels that this run never calls): a stub answers the
  imports while torchtitan is imported, and is gone afterwards (torch never sees it);
* it sets, synchronizes and measures a CUDA device (``torch.cuda`` as its device module): a CPU
  stand-in answers those calls;
* after the first step it calls ``barrier(device_ids=...)`` and ``torch.distributed.set_timeout``,
  which gloo and CPU do not have: the timeout change is skipped;
* FlexAttention has no backward on CPU: attention runs as ``scaled_dot_product_attention`` with the
  dense form of the same block mask (same math, another kernel, for both runs);
* it compiles ``create_block_mask`` with Inductor: run eagerly (same mask; saves the C++ compile);
* FSDP2's ``set_gradient_divide_factor(1.0)`` reduce-scatters with ``PREMUL_SUM``, which gloo lacks:
  FSDP2 sums instead (what the factor 1.0 means);
* the trainer sleeps 2 s at the end of ``train()``: not here.
Data and tokenizer are the test's own (torchtitan's c4_test data and tokenizer live in its source
tree, not in the wheel): seeded random tokens, one document per row.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import time
import types

import pytest
import torch

from fsdp_pass.testing.spawn import free_port, run_distributed, set_launcher_env

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install torchtitan==0.3.0)")

SEQ, LOCAL_BATCH, VOCAB, LAYERS, STEPS, RESUME_AT, SHORT_STEPS = 32, 2, 2048, 2, 10, 5, 3
LOSS_TOLERANCE = GRAD_NORM_TOLERANCE = 1e-6  # relative, every step
MODULE = "fsdp_pass.integrations.torchtitan"
# every run: the debug model's shapes, fp32 (torchtitan's default mixed precision is bf16), a seed
COMMON = ["--training.seq_len", str(SEQ), "--training.local_batch_size", str(LOCAL_BATCH), "--debug.seed", "0",
          "--training.mixed_precision_param", "float32", "--parallelism.spmd_backend", "partial_dtensor"]


# -- [Note: torchtitan 0.3.0 on CPU] ------------------------------------------------------------


class _Anything:
    """Whatever a triton kernel definition asks for at import time: decorators, types, constants."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else _Anything()

    def __getattr__(self, name: str):
        return _Anything()

    def __getitem__(self, key):
        return _Anything()


class _StubModule(types.ModuleType):
    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything()


class _TritonStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = _StubModule(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module) -> None:
        pass


@contextlib.contextmanager
def _triton_stub():
    if importlib.util.find_spec("triton") is not None:
        yield
        return
    import torch._dynamo  # noqa: F401  torch looks for triton itself: let it find none, before the stub
    import torch._inductor.compile_fx  # noqa: F401
    from torch.utils import _triton

    _triton.has_triton_package(), _triton.has_triton()  # cached answers: no triton
    stub = _TritonStub()
    sys.meta_path.insert(0, stub)
    try:
        yield
    finally:
        sys.meta_path.remove(stub)
        for name in [n for n in sys.modules if n == "triton" or n.startswith("triton.")]:
            del sys.modules[name]


class _CpuDevice:
    """``torch.cpu`` with the ``torch.cuda`` calls torchtitan makes (device name, memory statistics)."""

    def __getattr__(self, name: str):
        return getattr(torch.cpu, name)

    def set_device(self, device) -> None:
        pass

    def current_device(self) -> int:
        return 0

    def device_count(self) -> int:
        return 1

    def synchronize(self, device=None) -> None:
        pass

    def get_device_name(self, device=None) -> str:
        return "cpu"

    def get_device_properties(self, device=None):
        return types.SimpleNamespace(total_memory=1 << 34)

    def memory_stats(self, device=None) -> dict:
        return {}

    def reset_peak_memory_stats(self, device=None) -> None:
        pass

    def empty_cache(self) -> None:
        pass


def _dense_flex_attention(q, k, v, *, score_mod=None, block_mask=None, scale=None, enable_gqa=False,
                          return_aux=None, kernel_options=None):
    """FlexAttention's result for a mask-only call, computed by SDPA on the dense mask (has a CPU backward)."""
    from torch.nn.attention.flex_attention import AuxOutput, create_mask

    assert score_mod is None and (return_aux is None or not return_aux.lse)
    mask = create_mask(block_mask.mask_mod, q.shape[0], 1, q.shape[2], k.shape[2], device=q.device)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale,
                                                           enable_gqa=enable_gqa)
    return out, AuxOutput()


class _NoSleep:
    def __getattr__(self, name: str):
        return getattr(time, name)

    def sleep(self, seconds: float) -> None:
        pass


def _torchtitan_on_cpu() -> None:
    """Import torchtitan and the integration, and fill torchtitan's CPU gaps (the note above)."""
    with _triton_stub():
        import torchtitan.trainer  # noqa: F401
        import torchtitan.models.llama3.config_registry  # noqa: F401
        import torchtitan.models.qwen3.config_registry  # noqa: F401
        import fsdp_pass.integrations.torchtitan  # noqa: F401
    import torchtitan.components.metrics as metrics
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.distributed.utils as dist_utils
    import torchtitan.models.common.attention as attention
    import torchtitan.tools.utils as tool_utils
    import torchtitan.trainer as trainer
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives
    from torch.nn.attention.flex_attention import create_block_mask

    for module in (tool_utils, dist_utils, parallel_dims, metrics):
        if hasattr(module, "device_type"):
            module.device_type = "cpu"
        if hasattr(module, "device_module"):
            module.device_module = _CpuDevice()
    dist_utils.set_pg_timeouts = lambda timeout, parallel_dims: None
    attention.FlexAttention._compiled_flex_attn = staticmethod(_dense_flex_attention)
    attention._compiled_create_block_mask = create_block_mask
    divide_factors = _fsdp_collectives._get_gradient_divide_factors

    def sum_then_divide(group, all_reduce_group, dtype, device_type="", factor=None, force_sum=False):
        return divide_factors(group, all_reduce_group, dtype, device_type, factor, True)

    _fsdp_collectives._get_gradient_divide_factors = sum_then_divide
    trainer.time = _NoSleep()


# -- the test's data and tokenizer ---------------------------------------------------------------


def _components():
    from torchtitan.components.dataloader import BaseDataLoader
    from torchtitan.components.tokenizer import BaseTokenizer

    class Tokenizer(BaseTokenizer):
        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseTokenizer.Config):
            pass

        def __init__(self, config, tokenizer_path=None) -> None:
            super().__init__()
            self.eos_id = 0

        def encode(self, *args, **kwargs) -> list[int]:
            return []

        def decode(self, *args, **kwargs) -> str:
            return ""

        def get_vocab_size(self) -> int:
            return VOCAB

    class Batches(BaseDataLoader):
        """Step i: a seeded global batch of random tokens, this rank's rows; resumable (its state: i)."""

        @dataclasses.dataclass(kw_only=True, slots=True)
        class Config(BaseDataLoader.Config):
            pass

        def __init__(self, config, *, dp_world_size, dp_rank, seq_len, local_batch_size, **unused) -> None:
            self.rank, self.world, self.seq, self.rows, self.step = dp_rank, dp_world_size, seq_len, local_batch_size, 0

        def __iter__(self):
            while True:
                g = torch.Generator().manual_seed(1000 * self.step + 7)
                tokens = torch.randint(0, VOCAB, (self.rows * self.world, self.seq + 1), generator=g)
                mine = tokens[self.rank * self.rows:(self.rank + 1) * self.rows]
                self.step += 1
                positions = torch.arange(self.seq).expand(self.rows, -1).contiguous()  # one document per row
                yield {"input": mine[:, :-1], "positions": positions}, mine[:, 1:]

        def state_dict(self) -> dict:
            return {f"step_of_rank_{self.rank}": self.step}  # one key per rank: DCP keeps every rank's

        def load_state_dict(self, state: dict) -> None:
            if state:
                self.step = state[f"step_of_rank_{self.rank}"]

    return Tokenizer, Batches


def _train(module: str, config: str, args: list[str], components, seed_checkpoint: bool = False) -> dict:
    """torchtitan's trainer as ``torchtitan.train --module module --config config *args`` builds it.

    Returns each step's (loss, gradient norm) and the number of graphs fsdp_pass compiled.
    """
    from torchtitan.config import ConfigManager

    import fsdp_pass

    tokenizer, batches = components
    config = ConfigManager().parse_args(["--module", module, "--config", config, *COMMON, *args])
    config.tokenizer, config.dataloader = tokenizer.Config(), batches.Config()
    del config.model_spec.model.layers[LAYERS:]
    start = time.monotonic()
    trainer = config.build()
    if seed_checkpoint:  # what torchtitan.train does for --checkpoint.create_seed_checkpoint
        trainer.checkpointer.save(curr_step=0, last_step=True)
        trainer.close()
        return {}
    steps = {}
    log = trainer.metrics_processor.log

    def record(step, loss, max_loss, grad_norm, extra_metrics=None):
        steps[step] = (loss, grad_norm)
        return log(step, loss, max_loss, grad_norm, extra_metrics=extra_metrics)

    trainer.metrics_processor.log = record
    trainer.train()
    graphs = len(fsdp_pass.explain(trainer.model_parts[0], print_output=False).graphs) if module == MODULE else 0
    trainer.close()
    return {"steps": steps, "graphs": graphs, "seconds": round(time.monotonic() - start, 1)}


def _seed_checkpoint(family: str, tmp: str, components) -> list[str]:
    """torchtitan's seed checkpoint of ``family``'s debug model, made here; the arguments that load it."""
    folder = os.path.join(tmp, f"{family}_seed")
    _train(family, f"{family}_debugmodel", ["--dump_folder", folder, "--checkpoint.enable",
                                            "--checkpoint.create_seed_checkpoint"], components, seed_checkpoint=True)
    return ["--checkpoint.enable", "--checkpoint.initial_load_path", os.path.join(folder, "checkpoint", "step-0")]


def _torchtitan(rank: int, world: int, port: int, tmp: str) -> dict:
    set_launcher_env(rank, world, port)
    _torchtitan_on_cpu()
    components = _components()
    out, seeds = {}, {}

    def folder(name: str) -> list[str]:
        return ["--dump_folder", os.path.join(tmp, name)]

    def from_seed(family: str) -> list[str]:
        return seeds[family]

    compiled = ["--compile.enable", "--compile.backend", "aot_eager"]
    for family in ("llama3", "qwen3"):
        name, length = f"{family}_debugmodel", ["--training.steps", str(STEPS)]
        seeds[family] = _seed_checkpoint(family, tmp, components)
        out[f"{family} FSDP2"] = _train(family, name, [*folder(f"{family}_fsdp2"), *length, *from_seed(family)],
                                        components)
        out[f"{family} fsdp_pass"] = _train(MODULE, name, [*folder(f"{family}_vescale"), *length, *from_seed(family),
                                                           *compiled, "--checkpoint.interval", str(RESUME_AT)],
                                            components)

    name, length = "llama3_debugmodel", ["--training.steps", str(STEPS)]
    step3 = os.path.join(tmp, "llama3_vescale", "checkpoint", f"step-{RESUME_AT}")
    out["llama3 fsdp_pass resumed"] = _train(MODULE, name, [
        *folder("llama3_resumed"), *length, *compiled, "--checkpoint.enable", "--checkpoint.initial_load_path", step3,
        "--checkpoint.no-initial-load-model-only"], components)
    short = ["--training.steps", str(SHORT_STEPS)]
    # torchtitan's llama3_debugmodel as it is: uncompiled, activation checkpointing on
    out["llama3 fsdp_pass eager"] = _train(MODULE, name, [*folder("llama3_eager"), *short, *from_seed("llama3")],
                                           components)
    out["llama3 fsdp_pass own init"] = _train(MODULE, name, [*folder("llama3_own_init"), "--training.steps", "1",
                                                             "activation-checkpoint:none"], components)
    return out


def _torchtitan_4_ranks(rank: int, world: int, port: int, tmp: str) -> dict:
    """torchtitan's tensor parallelism under fsdp_pass (TP 2 x FSDP 2), compiled and eager, against FSDP2's."""
    set_launcher_env(rank, world, port)
    _torchtitan_on_cpu()
    components = _components()
    name, steps = "llama3_debugmodel", ["--training.steps", str(SHORT_STEPS)]
    seed = _seed_checkpoint("llama3", tmp, components)
    out = {}
    # compiled TP blocks run without activation checkpointing (refused with it, below)
    for label, parallelism, fsdp_pass_only in (
            ("tp", ["--parallelism.tensor_parallel_degree", "2"], ["activation-checkpoint:none"]),):
        out[f"llama3 FSDP2 {label}"] = _train("llama3", name, [
            "--dump_folder", os.path.join(tmp, f"fsdp2_{label}"), *steps, *parallelism, *seed], components)
        out[f"llama3 fsdp_pass {label}"] = _train(MODULE, name, [
            "--dump_folder", os.path.join(tmp, f"vescale_{label}"), *steps, *parallelism, *seed,
            "--compile.enable", "--compile.backend", "aot_eager", *fsdp_pass_only], components)
    with pytest.raises(ValueError, match="activation-checkpoint:none, or drop --compile.enable"):
        _train(MODULE, name, ["--dump_folder", os.path.join(tmp, "refused"), *steps, "--compile.enable",
                              "--parallelism.tensor_parallel_degree", "2"], components)
    out["llama3 fsdp_pass tp eager"] = _train(MODULE, name, [  # torchtitan's default activation checkpointing
        "--dump_folder", os.path.join(tmp, "vescale_tp_eager"), *steps, "--parallelism.tensor_parallel_degree", "2",
        *seed], components)
    return out


def _worst(runs: dict, label: str, reference: str) -> tuple[float, float]:
    """Worst relative differences of run ``label`` from ``reference`` over the steps it ran: loss, grad norm."""
    reference, steps = runs[reference]["steps"], runs[label]["steps"]
    assert steps and set(steps) <= set(reference), (label, sorted(steps))
    loss = max(abs(steps[s][0] - reference[s][0]) / abs(reference[s][0]) for s in steps)
    norm = max(abs(steps[s][1] - reference[s][1]) / abs(reference[s][1]) for s in steps)
    return loss, norm


def test_torchtitan_trains_like_its_fsdp2_and_resumes_exactly(tmp_path):
    start = time.monotonic()
    runs = run_distributed(_torchtitan, 2, free_port(), str(tmp_path), backend=None, timeout=600)[0]
    seconds = time.monotonic() - start
    worst = {label: _worst(runs, label, reference) for label, reference in (
        ("llama3 fsdp_pass", "llama3 FSDP2"), ("llama3 fsdp_pass eager", "llama3 FSDP2"),
        ("qwen3 fsdp_pass", "qwen3 FSDP2"))}
    print(f"torchtitan, 2 ranks, {seconds:.0f} s: worst relative (loss, grad norm) vs FSDP2: {worst}; seconds per "
          f"run: { {label: run['seconds'] for label, run in runs.items()} }")
    for label, (loss, norm) in worst.items():
        assert loss <= LOSS_TOLERANCE and norm <= GRAD_NORM_TOLERANCE, (label, loss, norm, runs)
    assert runs["llama3 fsdp_pass"]["graphs"] == runs["qwen3 fsdp_pass"]["graphs"] == 1, runs  # blocks share one
    assert runs["llama3 fsdp_pass eager"]["graphs"] == 0, runs
    full, resumed = runs["llama3 fsdp_pass"]["steps"], runs["llama3 fsdp_pass resumed"]["steps"]
    assert sorted(resumed) == list(range(RESUME_AT + 1, STEPS + 1)), resumed
    assert all(resumed[s] == full[s] for s in resumed), (resumed, full)  # bit for bit
    # fsdp_pass's sharded init of the meta-device model is one process's: the seed checkpoint's first loss
    assert runs["llama3 fsdp_pass own init"]["steps"][1][0] == full[1][0], runs["llama3 fsdp_pass own init"]


def test_torchtitan_tensor_parallel_trains_like_its_fsdp2(tmp_path):
    start = time.monotonic()
    runs = run_distributed(_torchtitan_4_ranks, 4, free_port(), str(tmp_path), backend=None, timeout=600)[0]
    worst = {label: _worst(runs, f"llama3 fsdp_pass {label}", f"llama3 FSDP2 {label.split()[0]}")
             for label in ("tp", "tp eager")}
    print(f"torchtitan, 4 ranks, {time.monotonic() - start:.0f} s: worst relative (loss, grad norm) vs FSDP2: "
          f"{worst}; seconds per run: { {label: run['seconds'] for label, run in runs.items()} }")
    for label, (loss, norm) in worst.items():
        assert loss <= LOSS_TOLERANCE and norm <= GRAD_NORM_TOLERANCE, (label, loss, norm, runs)
