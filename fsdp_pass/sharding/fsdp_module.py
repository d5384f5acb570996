"""FSDP2's module methods on what ``fsdp_pass.fully_shard`` returns: a class swap, as FSDP2 does it.

[Note: FSDP2's module class on a fully_shard-ed module]
FSDP2's ``fully_shard(module)`` changes ``module``'s class to a subclass made for it, ``FSDP<Cls>``,
whose bases are ``FSDPModule`` and ``Cls``; code written for FSDP2 calls its methods
(``set_requires_gradient_sync``, ``unshard`` ...) and frameworks pick their FSDP2 path with
``isinstance(m, FSDPModule)``. ``fsdp_pass.fully_shard`` does the same swap, to ``FSDP<Cls>`` with
bases ``(FSDPPassModule, Cls)``, ``FSDPPassModule`` deriving from torch's ``FSDPModule``, so the
isinstance check holds. What the frameworks installed here then call (torch 2.13 era code):

* Lightning's ``ModelParallelStrategy`` (fabric, ``_FSDPNoSync``): ``set_requires_gradient_sync(flag,
  recurse=False)`` on every FSDPModule, around gradient accumulation;
* torchtitan: ``set_gradient_divide_factor(1.0)`` on every FSDPModule (``disable_fsdp_gradient_division``);
  its chunked loss, on an FSDPModule ``lm_head``: ``set_reshard_after_forward/backward``,
  ``set_requires_gradient_sync(recurse=False)``, ``unshard()``, ``reshard()``;
* transformers' ``Trainer`` with its FSDP path: ``reshard()`` on every FSDPModule before it builds the
  optimizer; transformers' distributed loading: ``set_gradient_divide_factor``;
* accelerate's FSDP2 path (``fsdp2_prepare_model``): an FSDPModule is left as it is (not sharded again).

Every public method of torch's ``FSDPModule`` is overridden here (a test checks it), so none of torch's
implementations, which read FSDP2's hook state, is reachable: each means what it means in FSDP2,
through fsdp_pass's free functions, or raises saying what fsdp_pass does instead. Torch code that
reaches into FSDP2's state directly (``fully_shard.state(module)`` in ``torch.distributed.pipelining``'s
gradient reduction, ``register_fsdp_forward_method``) finds none: ``_get_fsdp_state`` raises, naming
the fix. The swap happens in ``fully_shard``, before any compile; the backend's own lazy sharding
swaps nothing ([Note: Module._apply on sharded parameters] says why).

Pickle and ``copy.deepcopy`` rebuild the swapped class from the original one (``__reduce_ex__``):
torch's FSDP2 refuses deepcopy, but a sharded fsdp_pass module copies (its parameters do; pickling
one still fails on its RaggedShard parameters, a rank's piece, not on the class). The class adds no
state, so state-dict keys are the module's own.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Callable, NoReturn

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from ..buckets.gradient_sync import apply_to_buckets, set_gradient_divide_factor, set_requires_gradient_sync
from ..eager.unshard import unshard as unshard_parameters

__all__ = ["FSDPPassModule", "UnshardHandle", "swap_to_fsdp_class"]


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns, as FSDP2's: the gather already finished, so ``wait()`` returns at once."""

    def wait(self) -> None:
        """The parameters are whole when this returns (they already are)."""


class FSDPPassModule(FSDPModule):
    """FSDP2's ``FSDPModule`` methods on a module sharded by :func:`fsdp_pass.fully_shard`.

    A module's own parameters are those of its subtree that no nested ``fully_shard``-ed module holds
    (FSDP2's parameter group of the module); ``recurse=True`` means every parameter of the subtree.
    """

    _orig_cls_mro_index = 3  # [FSDP<Cls>, FSDPPassModule, FSDPModule, Cls, ...]: FSDPModule.__new__ builds Cls

    def _own_parameters(self) -> list[nn.Parameter]:
        nested = {id(p) for m in self.modules() if m is not self and isinstance(m, FSDPPassModule)
                  for p in m.parameters()}
        return [p for p in self.parameters() if id(p) not in nested]

    def _chosen(self, recurse: bool) -> list[nn.Parameter] | None:
        return None if recurse else self._own_parameters()

    def _holds_none(self, recurse: bool) -> bool:
        """Whether the parameters a call with ``recurse`` acts on are none: FSDP2's methods are no-ops then
        (frameworks call them on every FSDPModule, a container with no parameters of its own too)."""
        chosen = self._chosen(recurse)
        return not (chosen if chosen is not None else list(self.parameters()))

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """Whether compiled backwards reduce-scatter gradients (False: each rank accumulates; see
        :func:`fsdp_pass.set_requires_gradient_sync`); ``recurse=False``: this module's own parameters."""
        if not self._holds_none(recurse):
            set_requires_gradient_sync(self, requires_gradient_sync, parameters=self._chosen(recurse))

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's own summed gradients by ``factor`` (:func:`fsdp_pass.set_gradient_divide_factor`)."""
        if not self._holds_none(recurse=False):
            set_gradient_divide_factor(self, factor, parameters=self._own_parameters())

    def set_reduce_scatter_divide_factor(self, factor: float) -> None:
        """FSDP2's older name of :meth:`set_gradient_divide_factor`."""
        self.set_gradient_divide_factor(factor)

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """Whether graphs compiled over these parameters free them after forward (True) or keep them for
        backward (False). A training call of a graph compiled with the other value refuses to run:
        set it before the first compiled call, or ``torch._dynamo.reset()`` to compile again."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"set_reshard_after_forward takes a bool (FSDP2's meaning), got {reshard_after_forward!r}; "
                             f"for a group size k use fsdp_pass.fully_shard(..., reshard_after_forward=k)")
        if not self._holds_none(recurse):
            apply_to_buckets(self, "set_reshard_after_forward", self._chosen(recurse),
                             reshard_after_forward=reshard_after_forward)

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        """True is what compiled graphs do (they free every gathered bucket when backward ends); False is refused."""
        if not reshard_after_backward:
            _refuse("set_reshard_after_backward(False)",
                    "a compiled graph frees its gathered buckets when its backward ends, and the next forward "
                    "gathers them again; there is no gathered state to keep between micro-batches. Accumulate "
                    "without communication with set_requires_gradient_sync(False) (no reduce-scatter), or overlap "
                    "the next step's first gathers with options={'prefetch_next_step': True}")

    def set_is_last_backward(self, is_last_backward: bool) -> None:
        """True is what fsdp_pass always does (every backward finishes its reduce-scatters); False is refused."""
        if not is_last_backward:
            _refuse("set_is_last_backward(False)",
                    "fsdp_pass's compiled backward finishes each bucket's reduce-scatter itself (or, with "
                    "options['overlap_last_reduce'], where the gradient is first read); there is no end-of-backward "
                    "wait to skip. For micro-batches, use set_requires_gradient_sync(False) or fsdp_pass.no_sync")

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:
        """Gather this module's own parameters into whole tensors until :meth:`reshard` (collective).

        As FSDP2's: not recursive, a no-op when already unsharded, and ``async_op=True`` returns a
        handle (the gather has finished already). Meanwhile call the module eagerly (not compiled) to
        evaluate or inspect; a gradient made on the whole tensors makes :meth:`reshard` raise, since
        it has no place in the shards (train through the compiled module instead).
        """
        if self.__dict__.get("_fsdp_pass_unsharded") is None and not self._holds_none(recurse=False):
            stack = contextlib.ExitStack()
            stack.enter_context(unshard_parameters(self, parameters=self._own_parameters()))
            self.__dict__["_fsdp_pass_unsharded"] = stack  # the open unshard block, closed by reshard()
        return UnshardHandle() if async_op else None

    def reshard(self) -> None:
        """Put the sharded parameters back after :meth:`unshard` (a no-op when they are sharded, as FSDP2's)."""
        stack = self.__dict__.pop("_fsdp_pass_unsharded", None)
        if stack is None:
            return
        own = {id(p) for p in self._own_parameters()}
        with_grad = [name for name, p in self.named_parameters() if id(p) in own and p.grad is not None]
        stack.close()
        if with_grad:
            raise RuntimeError(
                f"{type(self).__name__}.reshard(): {with_grad[0]!r} got a gradient while unsharded (a backward through "
                f"an eager call after unshard()); fsdp_pass discarded it, since it has no place in the shards. Train "
                f"through the module without unshard(): compiled graphs gather and reduce-scatter themselves"
            )

    def set_modules_to_forward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Refused: the compiled schedule orders every all-gather (``options['prefetch']``)."""
        _refuse("set_modules_to_forward_prefetch", _PREFETCH_REASON)

    def set_modules_to_backward_prefetch(self, modules: list[FSDPModule]) -> None:
        """Refused: the compiled schedule orders every all-gather (``options['prefetch']``)."""
        _refuse("set_modules_to_backward_prefetch", _PREFETCH_REASON)

    def set_all_reduce_hook(self, hook: Callable, *, stream: Any = None) -> None:
        """Refused: gradients are reduced inside the compiled graph, where no Python hook runs."""
        _refuse("set_all_reduce_hook",
                "fsdp_pass reduces gradients inside the compiled backward (reduce-scatter, and on a 2-D mesh an "
                "all-reduce over the replicate dim: give the (replicate, shard) mesh for HSDP); no Python hook runs "
                "on the reduced gradient there. Read or change p.grad after backward instead")

    def _get_fsdp_state(self) -> NoReturn:
        _refuse("FSDP2's internal state", "this module is sharded by fsdp_pass, which keeps no FSDP2 hook state; the "
                "code calling it reaches into FSDP2's internals (torch.distributed.pipelining's FSDP path, "
                "register_fsdp_forward_method). Compile the module with torch.compile(module, backend='vescale') and "
                "pass the compiled wrapper, or use fsdp_pass.no_sync / fsdp_pass.reduce_gradients")

    def _apply(self, *args: Any, **kwargs: Any) -> Any:
        # Past FSDPModule._apply, which reshards through FSDP2's state: the class's own (or nn.Module's).
        return super(FSDPModule, self)._apply(*args, **kwargs)

    def __reduce_ex__(self, protocol: Any) -> Any:
        # The swapped class is made at run time, so pickle cannot name it: rebuild it from the original class.
        rebuild, args, *rest = super().__reduce_ex__(max(protocol, 2))  # (copyreg.__newobj__, (cls, ...), state, ...)
        return (_new_swapped, (_original_class(type(self)), *args[1:]), *rest)


_PREFETCH_REASON = ("fsdp_pass's compiled schedule issues each bucket's all-gather options['prefetch'] buckets ahead "
                    "of its use (default 1), in forward and backward, from the graph's order; explicit prefetch lists "
                    "have nothing to act on. Set torch.compile(..., backend='vescale', options={'prefetch': k})")

# FSDPModule methods for FSDP2's eager hooks, streams and custom collectives: what fsdp_pass does instead.
_REFUSED = {
    "reset_iter_state": "fsdp_pass keeps no FSDP2 per-iteration hook state to reset; after a failed step, zero the "
                        "gradients (opt.zero_grad()) and run the next step",
    "set_requires_all_reduce": "the replicate-dim all-reduce of HSDP runs with the reduce-scatter inside the compiled "
                               "backward; switch both off with set_requires_gradient_sync(False)",
    "set_custom_all_gather": "the compiled graph gathers each bucket's shard with fsdp_pass's own all-gather",
    "set_custom_reduce_scatter": "the compiled graph reduce-scatters each bucket's gradient with fsdp_pass's own "
                                 "collective (options['quantized_reduce'] for int8 reductions)",
    "set_post_optim_event": "compiled graphs issue their collectives in graph order on the current stream; "
                            "options['prefetch_next_step'] starts the next forward's gathers at the optimizer step",
    "set_force_sum_reduction_for_comms": "the compiled graph sums gradients and divides by the gradient divide "
                                         "factor (set_gradient_divide_factor(1.0): the sum)",
    "set_reduce_scatter_unused_params": "every bucket's gradient is reduce-scattered whole, unused parameters' "
                                        "zeros included",
    "set_reduce_scatter_max_input_buffers": "the compiled graph writes each bucket's gradient into one buffer "
                                            "and frees it after its reduce-scatter",
    "set_separate_reduce_scatter_group": "gradients are reduced over the shard dim of the module's mesh",
    "set_unshard_in_backward": "compiled backwards gather what they use (reshard_after_forward decides whether "
                               "again)",
    "set_allocate_memory_from_process_group_for_comm": "collective buffers are allocated by the compiled graph",
    "set_symm_mem_for_comm": "collectives go through torch's functional collectives on the mesh's process group",
    "_set_unshard_async_op": "compiled graphs issue every all-gather asynchronously and wait where it is used",
    # torch 2.15's FSDPModule adds these
    "finalize_backward": "each compiled backward finishes its own reduce-scatters; there is no deferred "
                         "end-of-backward work to run by hand",
    "set_manual_backward_finalization": "each compiled backward finishes its own reduce-scatters; there is no "
                                        "end-of-backward work to defer",
    "set_keep_unsharded_storage": "compiled graphs free each gathered bucket after its last use (reshard_after_forward "
                                  "decides whether backward gathers again)",
}


def _refuse(call: str, reason: str) -> NoReturn:
    raise NotImplementedError(f"{call} is not supported on a module sharded by fsdp_pass: {reason}")


def _refusing(name: str, reason: str, unreviewed: bool = False) -> Callable[..., NoReturn]:
    def refused(self: FSDPPassModule, *args: Any, **kwargs: Any) -> NoReturn:
        _refuse(name, reason)

    refused.__name__ = refused.__qualname__ = name
    refused.__doc__ = f"Refused: {reason}."
    refused.unreviewed = unreviewed  # True: filled in for a method newer than fsdp_pass (tests/test_fsdp2_api.py)
    return refused


for _name, _reason in _REFUSED.items():
    setattr(FSDPPassModule, _name, _refusing(_name, _reason))
# A method a newer torch adds to FSDPModule would reach FSDP2's hook state, which a module sharded by fsdp_pass
# does not have: refuse it too, until it is given a meaning here.
for _name, _value in list(vars(FSDPModule).items()):
    if callable(_value) and _name != "__new__" and _name not in vars(FSDPPassModule):
        setattr(FSDPPassModule, _name, _refusing(_name, "this FSDPModule method is newer than the torch releases "
                                                        "fsdp_pass was checked on and has no fsdp_pass meaning yet",
                                                 unreviewed=True))


@functools.cache
def _fsdp_class(cls: type) -> type:
    """The one ``FSDP<Cls>`` class of ``cls`` (one per class: Dynamo's guards on a module's type then match
    for every module of that class)."""
    return type(f"FSDP{cls.__name__}", (FSDPPassModule, cls), {"__module__": cls.__module__})


def _original_class(swapped: type) -> type:
    return swapped.__mro__[FSDPPassModule._orig_cls_mro_index]


def _new_swapped(cls: type, *args: Any) -> nn.Module:
    """An empty instance of ``cls``'s swapped class, for pickle and deepcopy to fill."""
    return object.__new__(_fsdp_class(cls), *args)


def swap_to_fsdp_class(module: nn.Module) -> nn.Module:
    """Give ``module`` its ``FSDP<Cls>`` class (once; a module already swapped keeps its class)."""
    if not isinstance(module, FSDPPassModule):
        module.__class__ = _fsdp_class(type(module))
    return module

