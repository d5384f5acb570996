"""Initialize a model built on the meta device, one module at a time, into its shards.

Only the local shards are ever allocated for the whole model. Each init call runs on temporary
full-size tensors of one module's own parameters, and this rank's pieces are copied into the
DBuffers, so the peak is the local share plus one module's parameters. Buffers (small, replicated)
are allocated on the real device for good.

[Note: meta-device init order]
A seeded model built on a real device draws its random numbers in a fixed order; replaying that
order makes the meta-device model bit-equal to it. The replay simulates construction:

* a module's constructor builds its children first (in registration order), then initializes its
  own parameters: ``reset_parameters()`` (what ``nn.Linear.__init__`` and friends call), else an
  ``init_weights()`` taking no arguments (torchtitan style);
* a Hugging Face ``PreTrainedModel`` ends its constructor with ``post_init()``, which runs
  ``_initialize_weights`` on every module of its subtree not initialized yet, children before
  parents, switching to an inner ``PreTrainedModel``'s own ``_initialize_weights`` inside it
  (``initialize_weights``' ``smart_apply``), under ``guard_torch_init_functions``. So for
  ``LlamaForCausalLM`` the order is: the constructors' inits of ``model``'s modules, ``model``'s
  ``_init_weights`` pass, ``lm_head``'s constructor init, the root's pass (``lm_head``, root).

A tensor-parallel DTensor parameter's init runs on a whole (global) temporary too; this rank's TP
block of it goes into the bucket ([Note: FSDP over TP/EP] in :mod:`fsdp_pass.sharding.materialize`).

A tied parameter keeps what its first owner (``model.modules()`` order) wrote; other owners'
inits still run on temporaries, since a real-device build draws their random numbers too.

Where the replay cannot know the real order, ``fully_shard`` warns and names the module:

* ``__init__`` code that writes tensors outside ``reset_parameters`` (``nn.init.zeros_(self.out.weight)``,
  ``nn.Parameter(torch.randn(...))``): it did nothing on the meta device, and every random number
  drawn after it shifts (found by reading the class's ``__init__`` source);
* a module with its own parameters *and* submodules whose inits both draw random numbers: the
  replay runs the submodules first (children built, then ``reset_parameters`` at the end of
  ``__init__``); a constructor that initializes its own parameters before building its children
  gives other values.

A parameter no init reaches is left for a checkpoint ([Note: uninitialized shards] in
:mod:`fsdp_pass.buckets.uninitialized`). A root ``init_weights`` that initializes submodules
is not called: it needs every full tensor at once.

Buffers are allocated (floating ones filled with NaN) and initialized by the same calls, first on
their own, before anything is sharded, under a forked RNG. A non-persistent buffer (rotary
``inv_freq``, torchtitan's rope cache) that no replayed init computes cannot come from a checkpoint
either: it stays on the meta device for the user's ``model.to_empty(device=...)`` and the model's
own init (FSDP2's flow), and a forward before that raises naming it ([Note: buffers left on the
meta device] in :mod:`fsdp_pass.buckets.uninitialized`). With ``fully_shard(..., init="skip")``
nothing is replayed: every parameter waits as NaN and every buffer on meta for that flow.
"""

from __future__ import annotations

import ast
import contextlib
import inspect
import sys
import textwrap
import warnings
from dataclasses import dataclass

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor

from ..buckets.uninitialized import mark_initialized, mark_pending
from ..tensor.ragged_tensor import bucket_of, local_block

__all__ = ["MetaInit"]

# Calls in an ``__init__`` that write tensor values (or draw random numbers) outside reset_parameters.
_INIT_CALLS = frozenset({
    "normal_", "uniform_", "zero_", "zeros_", "ones_", "fill_", "constant_", "xavier_uniform_", "xavier_normal_",
    "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "orthogonal_", "eye_", "dirac_", "sparse_", "copy_",
    "random_", "bernoulli_", "exponential_", "randn", "rand", "randint", "randperm", "randn_like", "rand_like",
})


@dataclass
class _Step:
    module: nn.Module
    name: str  # the module's name in the model ("" for the root)
    kind: str  # "reset_parameters", "init_weights" or "hf"
    pretrained: nn.Module | None = None  # for "hf": the PreTrainedModel whose _initialize_weights runs
    inner: tuple[int, int] = (0, 0)  # for constructor steps: the steps of its submodules' constructors
    drew_random: bool = False


def _pretrained_class():
    module = sys.modules.get("transformers.modeling_utils")
    return getattr(module, "PreTrainedModel", None)


def _takes_no_arguments(fn) -> bool:
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return False
    return all(p.default is not p.empty or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params)


def _init_calls_in_constructor(cls: type) -> list[str]:
    """Value-writing calls in the ``__init__`` of ``cls`` and its non-torch bases (read from the source)."""
    found: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in klass.__dict__ or klass.__module__.split(".")[0] == "torch":
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass.__dict__["__init__"])))
        except (OSError, TypeError, SyntaxError):
            continue
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)
                if name in _INIT_CALLS and name not in found:
                    found.append(name)
    return found


def _rng_state(device: torch.device) -> torch.Tensor:
    if device.type == "cpu":
        return torch.get_rng_state()
    return torch.get_device_module(device.type).get_rng_state(device)


class MetaInit:
    """The init of a meta-device model: planned before sharding, run after it.

    Args:
        root: the model.
        meta_ids: ids of its meta-device parameters (taken before sharding swaps them).
        device: where shards, buffers and temporaries live.
    """

    def __init__(self, root: nn.Module, meta_ids: set[int], device: torch.device, replay: bool = True) -> None:
        self.root, self.meta_ids, self.device, self.replay = root, meta_ids, device, replay
        self.names = {id(m): n for n, m in reversed(list(root.named_modules(remove_duplicate=False)))}
        self.first_owner: dict[int, nn.Module] = {}
        for m in root.modules():
            for p in m._parameters.values():
                if p is not None:
                    self.first_owner.setdefault(id(p), m)
        self.buffer_owners = {id(m) for m in root.modules()
                              if any(b is not None and b.is_meta for b in m._buffers.values())}
        self.steps = self._plan() if replay and (meta_ids or self.buffer_owners) else []
        self._buffers: list[tuple[nn.Module, str, torch.Tensor, torch.Tensor, int]] = []
        self.left_on_meta: list[tuple[nn.Module, str]] = []  # buffers no replayed init computes

    # -- planning ------------------------------------------------------------------------------
    def _has_meta(self, m: nn.Module) -> bool:
        return id(m) in self.buffer_owners or any(
            p is not None and id(p) in self.meta_ids for p in m._parameters.values())

    def _plan(self) -> list[_Step]:
        pretrained = _pretrained_class()
        steps: list[_Step] = []
        built: set[int] = set()
        hf_done: set[int] = set()

        def is_pretrained(m):
            return pretrained is not None and isinstance(m, pretrained)

        def hf_pass(m: nn.Module, owner: nn.Module) -> None:
            for child in m.children():
                hf_pass(child, child if is_pretrained(child) else owner)
            if id(m) not in hf_done:
                hf_done.add(id(m))
                if self._has_meta(m):
                    steps.append(_Step(m, self.names[id(m)], "hf", owner))

        def construct(m: nn.Module) -> None:
            if id(m) in built:
                return
            built.add(id(m))
            start = len(steps)
            for child in m.children():
                construct(child)
            inner = (start, len(steps))
            if self._has_meta(m):
                if callable(getattr(m, "reset_parameters", None)):
                    steps.append(_Step(m, self.names[id(m)], "reset_parameters", inner=inner))
                elif not is_pretrained(m) and callable(getattr(m, "init_weights", None)) and _takes_no_arguments(
                        m.init_weights):
                    steps.append(_Step(m, self.names[id(m)], "init_weights", inner=inner))
            if is_pretrained(m):
                hf_pass(m, m)

        construct(self.root)
        return steps

    # -- running -------------------------------------------------------------------------------
    def _call(self, step: _Step) -> dict[str, torch.Tensor]:
        """Run one init call on temporaries of the module's own meta parameters; return their values."""
        m = step.module
        originals = dict(m._parameters)
        temporary = {
            n: nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device=self.device), requires_grad=p.requires_grad)
            for n, p in originals.items() if p is not None and id(p) in self.meta_ids
        }
        before = _rng_state(self.device)
        try:
            m._parameters.update(temporary)
            with torch.no_grad():
                if step.kind == "hf":
                    self._hf_init(step)
                else:
                    getattr(m, step.kind)()
            values = {n: m._parameters[n] for n in temporary}  # the call may have replaced a parameter
        finally:
            m._parameters.update(originals)
        step.drew_random = step.drew_random or not torch.equal(before, _rng_state(self.device))
        return values

    @staticmethod
    def _hf_init(step: _Step) -> None:
        owner = step.pretrained
        guard = getattr(sys.modules.get("transformers.initialization"), "guard_torch_init_functions", None)
        with guard() if guard is not None else contextlib.nullcontext():
            if "is_custom_code" in inspect.signature(owner._initialize_weights).parameters:
                owner._initialize_weights(step.module, is_custom_code=owner.is_custom_code())
            else:
                owner._initialize_weights(step.module)

    def prepare_buffers(self) -> None:
        """Allocate the meta buffers and compute them (before sharding); a non-persistent one that stays
        unset goes back to the meta device, for the user's ``to_empty`` and init (:attr:`left_on_meta`)."""
        if not self.replay:
            self.left_on_meta = [(m, n) for m in self.root.modules() for n, b in m._buffers.items()
                                 if b is not None and b.is_meta]
            return
        made: dict[int, torch.Tensor] = {}
        for m in self.root.modules():
            for n, b in list(m._buffers.items()):
                if b is None or not b.is_meta:
                    continue
                if id(b) not in made:
                    new = torch.empty(b.shape, dtype=b.dtype, device=self.device)
                    new.fill_(float("nan")) if new.is_floating_point() else new.zero_()
                    made[id(b)] = new
                new = made[id(b)]
                m._buffers[n] = new
                self._buffers.append((m, n, b, new, new._version))
        if not self._buffers:
            return
        on_device = self.device.type != "cpu"
        devices = []
        if on_device:  # the device the buffers' init draws on: a mesh's device has no index, meaning the current one
            index = self.device.index
            devices = [torch.get_device_module(self.device.type).current_device() if index is None else index]
        with torch.random.fork_rng(devices=devices,
                                   device_type=self.device.type if on_device else "cuda"):
            for step in self.steps:
                if id(step.module) in self.buffer_owners:
                    self._call(step)
        for step in self.steps:  # the real pass runs these again
            step.module.__dict__.pop("_is_hf_initialized", None)
            step.drew_random = False
        unset = [(m, n, old) for m, n, old, new, v in self._buffers
                 if n in m._non_persistent_buffers_set and m._buffers[n] is new and new._version == v]
        for m, n, old in unset:
            m._buffers[n] = old
            self.left_on_meta.append((m, n))

    def restore_buffers(self) -> None:
        for m, n, old, _, _ in reversed(self._buffers):
            m._buffers[n] = old
        self._buffers.clear()

    def run(self) -> list[str]:
        """Mark every meta parameter pending, run the init calls into the shards; return the names left."""
        params = {id(p): (n, p) for n, p in self.root.named_parameters() if id(p) in self.meta_ids}
        for _, p in params.values():
            mark_pending(*bucket_of(p))
        if not self.replay:
            return sorted(n for n, _ in params.values())
        self._warn_constructor_code()
        left = dict(params)
        for step in self.steps:
            for p in self._write(step):
                left.pop(id(p), None)
        self._warn_order()
        return sorted(n for n, _ in left.values())

    def _write(self, step: _Step) -> list[nn.Parameter]:
        """Run ``step`` and copy this rank's pieces into the shards; its temporaries die on return."""
        written = []
        for n, value in self._call(step).items():
            p = step.module._parameters[n]
            if self.first_owner.get(id(p)) is not step.module:
                continue  # a tied parameter keeps its first owner's init
            buf, fqn = bucket_of(p)
            if isinstance(p, DTensor):  # the init ran on the whole tensor; the bucket holds this rank's TP block
                value = local_block(value, p._spec)
            buf.load_full(fqn, value)
            mark_initialized(buf, fqn)
            written.append(p)
        return written

    # -- warnings ------------------------------------------------------------------------------
    def _warn_constructor_code(self) -> None:
        seen: dict[type, list[str]] = {}
        for m in self.root.modules():
            if not self._subtree_has_meta(m):
                continue
            cls = type(m)
            if cls not in seen:
                seen[cls] = _init_calls_in_constructor(cls)
                if seen[cls]:
                    warnings.warn(
                        f"fully_shard: {self.names[id(m)] or '<root>'} ({cls.__name__}) writes tensors in __init__ "
                        f"outside reset_parameters ({', '.join(seen[cls])}); on the meta device that code did "
                        f"nothing, so its values, and the random numbers drawn after it, differ from a model built "
                        f"on a real device. Move that code into reset_parameters(), or load a checkpoint",
                        stacklevel=4,
                    )

    def _subtree_has_meta(self, m: nn.Module) -> bool:
        return any(id(x) in self.buffer_owners or any(id(p) in self.meta_ids for p in x._parameters.values()
                                                      if p is not None) for x in m.modules())

    def _warn_order(self) -> None:
        for step in self.steps:
            if step.kind == "hf" or not step.drew_random:
                continue
            a, b = step.inner
            if any(s.drew_random for s in self.steps[a:b]):
                warnings.warn(
                    f"fully_shard: {step.name or '<root>'} ({type(step.module).__name__}) has its own parameters "
                    f"and submodules whose inits all draw random numbers; its {step.kind}() ran after theirs (as "
                    f"when __init__ builds the submodules, then initializes its own parameters). If its __init__ "
                    f"initializes its own parameters before building the submodules, the values differ from a "
                    f"model built on a real device",
                    stacklevel=4,
                )
