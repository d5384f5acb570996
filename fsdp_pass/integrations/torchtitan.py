"""torchtitan: its own trainer (``torchtitan.train``), with fsdp_pass as data parallelism instead of FSDP2.

::

    torchrun --nproc_per_node=8 -m torchtitan.train --module fsdp_pass.integrations.torchtitan \\
        --config llama3_debugmodel --compile.enable

torchtitan looks for ``<module>.config_registry`` and then for ``<module>`` itself, and calls the
function named by ``--config``. This module offers torchtitan's dense llama3 and qwen3 configs
under torchtitan's names (:data:`CONFIGS`), each made by torchtitan's own function with its model
spec, data, optimizer, schedule and loss, and these changes (:func:`with_fsdp_pass`):

* the model spec's ``parallelize_fn`` is :func:`parallelize`: torchtitan's tensor parallelism (when
  asked) and activation checkpointing, then ``fsdp_pass.fully_shard`` on the data-parallel mesh dims
  and, with ``--compile.enable``, each transformer block compiled with the ``vescale`` backend;
  torchtitan's mixed precision, reshard and gradient scale settings carry over;
* the checkpointer is :class:`CheckpointManager`, torchtitan's DCP checkpointer, which saves the
  sharded parameters as they are (any world size loads them);
* a fused QKV projection (``FusedQKVLinear``) is built as torchtitan's separate ``wq``/``wk``/``wv``
  projections (``QKVLinear``): fsdp_pass cannot yet initialize or split a fused weight that is
  sharded (torchtitan's fused init and its state-dict hooks work on whole DTensor rows). torchtitan
  makes both give the same initial values from the same seed and save the same checkpoint keys, so
  checkpoints move between this module and torchtitan's own runs either way;
* the SPMD backend is ``partial_dtensor``, and pipeline parallelism is off (no ``pipelining_fn``).

Every other setting and command-line override means what it means in torchtitan.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torchtitan.components.checkpointer import base as _checkpointer_base
from torchtitan.components.checkpointer.dcp import CheckpointManager as _TorchtitanCheckpointManager
from torchtitan.config import TORCH_DTYPE_MAP
from torchtitan.models import llama3 as _llama3_family
from torchtitan.models import qwen3 as _qwen3_family
from torchtitan.models.common.attention import FusedQKVLinear, QKVLinear
from torchtitan.models.common.linear import Linear
from torchtitan.models.llama3 import config_registry as _llama3_configs
from torchtitan.models.qwen3 import config_registry as _qwen3_configs
from torchtitan.trainer import Trainer

import fsdp_pass
from fsdp_pass.tensor.ragged_tensor import RaggedShardTensor

__all__ = ["CONFIGS", "CheckpointManager", "ModelWrapper", "parallelize", "with_fsdp_pass"]

_COMPILERS = ("inductor", "aot_eager")  # torchtitan's --compile.backend, as fsdp_pass's compiler after its passes


def parallelize(
    model: nn.Module,
    *,
    parallel_dims: Any,
    training: Any,
    parallelism: Any,
    compile_config: Any,
    ac_config: Any,
    dump_folder: str,
) -> nn.Module:
    """torchtitan's ``parallelize_fn`` for its decoders (llama3, qwen3), with fsdp_pass as data parallelism.

    In torchtitan's order: its TP plan (``--parallelism.tensor_parallel_degree``), activation checkpointing,
    then ``fsdp_pass.fully_shard`` of the meta-device model on the data-parallel mesh dims (``fsdp``;
    ``dp_replicate`` x ``fsdp`` for HSDP; with TP, of the mesh that also holds ``tp``) with nothing
    initialized (torchtitan's ``to_empty`` and ``init_weights`` follow), then, with ``--compile.enable``,
    ``block.compile(backend="vescale")`` for each transformer block (``--compile.backend`` is fsdp_pass's
    compiler after its passes; identical blocks share one graph). Gradients are summed over the
    data-parallel ranks (``set_gradient_divide_factor(model, 1.0)``, as torchtitan sets FSDP2): its loss
    is already divided by the global token count. Parameters are gathered in
    ``--training.mixed_precision_param`` and reduced in ``--training.mixed_precision_reduce``, compiled
    or not; ``--parallelism.fsdp_reshard_after_forward never`` keeps compiled blocks' gathered weights
    for backward.
    """
    compiled = compile_config.enable and "model" in compile_config.components
    _check_supported(parallel_dims, training, parallelism, compile_config, compiled)
    if compiled and parallel_dims.tp_enabled and ac_config is not None:
        raise ValueError(
            "fsdp_pass.integrations.torchtitan: --compile.enable with tensor parallelism and activation "
            "checkpointing fails in torch's AOTAutograd (a checkpointed compiled block saves its DeviceMesh); "
            "turn one of them off: activation-checkpoint:none, or drop --compile.enable (eager TP with "
            "activation checkpointing trains); see docs/integrations.md, torchtitan"
        )
    if parallel_dims.tp_enabled:  # torchtitan's TP plan (the model config's sharding configs) comes first
        model.parallelize(parallel_dims)
    if ac_config is not None:
        ac_config.build(dump_folder=dump_folder).apply(model)

    hsdp = parallel_dims.dp_replicate_enabled
    data_parallel = ["dp_replicate", "fsdp"] if hsdp else ["fsdp"]
    # With TP the mesh holds the TP dim too (the parameters' DTensor meshes are slices of it) and
    # fsdp_pass shards over the named data-parallel dims only.
    dims = {"shard_dim": "fsdp", "replicate_dim": "dp_replicate" if hsdp else None} if parallel_dims.tp_enabled else {}
    mesh = parallel_dims.get_mesh([*data_parallel, "tp"] if parallel_dims.tp_enabled else data_parallel)
    # Compiled blocks share one graph only when each block's parameters are a bucket of their own.
    # The compiled blocks and the eager calls (embedding, norm, the chunked loss's head) gather in param_dtype.
    mp_policy = {"param_dtype": TORCH_DTYPE_MAP[training.mixed_precision_param],
                 "reduce_dtype": TORCH_DTYPE_MAP[training.mixed_precision_reduce]}
    fsdp_pass.fully_shard(model, mesh, init="skip", min_bucket_bytes=0 if compiled else None, mp_policy=mp_policy,
                          **dims)
    fsdp_pass.set_gradient_divide_factor(model, 1.0)
    if compiled:
        # torchtitan's settings for compiled blocks (data-dependent shapes; no forward side effects
        # replayed in an activation-checkpointed backward)
        torch._dynamo.config.capture_scalar_outputs = True
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
        options = {
            "mesh": mesh,
            **dims,
            "compiler": compile_config.backend,
            "reshard_after_forward": parallelism.fsdp_reshard_after_forward != "never",
            "gradient_divide_factor": 1.0,
        }
        for block in model.layers.values():
            block.compile(backend="vescale", options=options, fullgraph=True)
    return model


def _check_supported(parallel_dims: Any, training: Any, parallelism: Any, compile_config: Any, compiled: bool) -> None:
    unsupported = []
    if parallelism.spmd_backend != "partial_dtensor":
        unsupported.append(f"--parallelism.spmd_backend {parallelism.spmd_backend} (use partial_dtensor)")
    if parallel_dims.cp_enabled:
        unsupported.append("context parallelism (--parallelism.context_parallel_degree > 1)")
    if parallel_dims.ep_enabled:
        unsupported.append("expert parallelism (--parallelism.expert_parallel_degree > 1)")
    if training.enable_cpu_offload:
        unsupported.append("--training.enable_cpu_offload")
    if parallelism.enable_fsdp_symm_mem:
        unsupported.append("--parallelism.enable_fsdp_symm_mem")
    if compiled and compile_config.backend not in _COMPILERS:
        unsupported.append(f"--compile.backend {compile_config.backend} (use inductor or aot_eager)")
    if unsupported:
        raise ValueError(
            f"fsdp_pass.integrations.torchtitan does not support {'; '.join(unsupported)}. Drop the setting, or "
            f"train with torchtitan's own FSDP2 (--module llama3 / qwen3); see docs/integrations.md, torchtitan"
        )


# -- checkpointing --------------------------------------------------------------------------------


class ModelWrapper(_checkpointer_base.ModelWrapper):
    """torchtitan's ``ModelWrapper`` (the model's flat state dict for DCP), for sharded parameters.

    torchtitan keeps the first state dict and, at each save, copies a fresh value into the kept
    tensor unless both share storage. A sharded parameter has no storage of its own: its values are
    this rank's piece, so the pieces' storages are compared (as torchtitan compares a DTensor's
    local tensor).
    """

    def state_dict(self) -> dict[str, Any]:
        for key, value in self._get_state_dict().items():
            kept = self.cached_state_dict.get(key)
            if kept is None or kept.shape != value.shape or kept.dtype != value.dtype:
                self.cached_state_dict[key] = value
            elif kept is not value and not _same_storage(kept, value):
                kept.copy_(value)
        return self.cached_state_dict


def _local(t: torch.Tensor) -> torch.Tensor:
    """The plain tensor holding ``t``'s data on this rank."""
    while isinstance(t, (DTensor, RaggedShardTensor)):
        t = t._local_tensor if isinstance(t, DTensor) else t.piece
    return t


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    return _local(a).untyped_storage().data_ptr() == _local(b).untyped_storage().data_ptr()


class CheckpointManager(_TorchtitanCheckpointManager):
    """torchtitan's DCP checkpointer for a model sharded by fsdp_pass; ``--checkpoint.*`` as in torchtitan.

    DCP writes each rank's pieces and reads them back at any world size, so a run resumes where it
    stopped (model, optimizer, learning-rate schedule, data loader, step).
    """

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(_TorchtitanCheckpointManager.Config):
        pass

    def __init__(self, config: Config, *, model_parts: list[nn.Module], **kwargs: Any) -> None:
        super().__init__(config, model_parts=model_parts, **kwargs)
        if self.enable:
            self.states[_checkpointer_base.MODEL] = ModelWrapper(model_parts)


# -- configs --------------------------------------------------------------------------------------


def with_fsdp_pass(config: Trainer.Config, qkv_init: dict[str, Callable]) -> Trainer.Config:
    """torchtitan's ``config`` trained with fsdp_pass (module docstring): :func:`parallelize`,
    :class:`CheckpointManager`, separate QKV projections initialized by ``qkv_init`` (the family's
    init of ``wq``/``wk``/``wv``), the ``partial_dtensor`` backend, no pipelining."""
    spec = config.model_spec
    _separate_qkv(spec, qkv_init)
    config.model_spec = dataclasses.replace(spec, parallelize_fn=parallelize, pipelining_fn=None)
    config.parallelism.spmd_backend = "partial_dtensor"
    kept = {f.name: getattr(config.checkpoint, f.name) for f in dataclasses.fields(config.checkpoint)}
    config.checkpoint = CheckpointManager.Config(**kept)
    return config


def _separate_qkv(spec: Any, qkv_init: dict[str, Callable]) -> None:
    """Replace each ``FusedQKVLinear`` of ``spec``'s model by the equivalent ``QKVLinear``."""
    for _, fused, parent, field in list(spec.traverse(FusedQKVLinear.Config)):
        wqkv = fused.wqkv

        def projection(heads: int) -> Linear.Config:
            return Linear.Config(in_features=wqkv.in_features, out_features=heads * fused.head_dim, bias=wqkv.bias,
                                 param_init=qkv_init)

        separate = QKVLinear.Config(head_dim=fused.head_dim, wq=projection(fused.n_heads),
                                    wkv=projection(fused.n_kv_heads))
        if isinstance(parent, list):
            parent[field] = separate
        else:
            setattr(parent, field, separate)


def _mirror(family_configs: Any, qkv_init: dict[str, Callable], name: str) -> Callable[[], Trainer.Config]:
    build = getattr(family_configs, name)

    def config() -> Trainer.Config:
        return with_fsdp_pass(build(), qkv_init)

    config.__name__ = config.__qualname__ = name
    config.__doc__ = f"torchtitan's ``{name}``, trained with fsdp_pass (see the module docstring)."
    return config


# torchtitan's dense llama3 and qwen3 configs, under torchtitan's names. Both families initialize
# wq/wk/wv (fused or not) with their _LINEAR_INIT.
CONFIGS = ("llama3_debugmodel", "llama3_debugmodel_ce_loss", "llama3_8b", "llama3_70b", "llama3_405b",
           "qwen3_debugmodel", "qwen3_debugmodel_non_fused_qkv", "qwen3_0_6b", "qwen3_1_7b", "qwen3_14b", "qwen3_32b")

for _name in CONFIGS:
    if _name.startswith("llama3"):
        globals()[_name] = _mirror(_llama3_configs, _llama3_family._LINEAR_INIT, _name)
    else:
        globals()[_name] = _mirror(_qwen3_configs, _qwen3_family._LINEAR_INIT, _name)
del _name
