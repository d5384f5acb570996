"""Small models that make Dynamo reach their parameters through each source form it writes.

Each model maps ``(batch, 8)`` to ``(batch, 8)`` and names, in :meth:`blocks`, the submodules a
per-block compile compiles. [Note: parameters known by identity] (compile/passes/detect.py) is why
they exist: parameters must be named by object, whatever text Dynamo's source holds.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SOURCE_FORMS"]

DIM = 8


class _GetattrMixin:
    """A module that defines ``__getattr__`` (diffusers' ModelMixin, peft's wrappers): Dynamo then reads its
    children as ``L['self'].__dict__['_modules']['x']``."""

    def __getattr__(self, name: str):
        return super().__getattr__(name)


class _Pair(_GetattrMixin, nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(DIM, DIM)
        self.b = nn.Linear(DIM, DIM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.b(torch.tanh(self.a(x)))


class GetattrModules(_GetattrMixin, nn.Module):
    """``__dict__['_modules']`` sources: ``down.0`` and ``up.0`` differ only in the part a parser once dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.down = nn.ModuleList([_Pair(), _Pair()])
        self.up = nn.ModuleList([_Pair()])

    def blocks(self) -> list[nn.Module]:
        return [*self.down, *self.up]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in [*self.down, *self.up]:
            x = block(x)
        return x


class GetattrChain(nn.Module):
    """Children reached with ``getattr(self, f"layer{i}")``."""

    def __init__(self) -> None:
        super().__init__()
        for i in range(3):
            setattr(self, f"layer{i}", nn.Linear(DIM, DIM))

    def blocks(self) -> list[nn.Module]:
        return [getattr(self, f"layer{i}") for i in range(3)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i in range(3):
            x = torch.tanh(getattr(self, f"layer{i}")(x))
        return x


class CompiledChild(nn.Module):
    """A child compiled before the whole model (an ``OptimizedModule``: ``inner._orig_mod.a.weight``); a
    per-block compile compiles the rest (the child is a compiled block already)."""

    def __init__(self) -> None:
        super().__init__()
        self.inner = torch.compile(_Pair(), backend="vescale", options={"compiler": "aot_eager"})
        self.head = nn.Linear(DIM, DIM)

    def blocks(self) -> list[nn.Module]:
        return [self.head]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


class Containers(nn.Module):
    """Children in a ``ModuleDict``, a ``ModuleList``, a plain attribute and behind a property."""

    def __init__(self) -> None:
        super().__init__()
        self.by_key = nn.ModuleDict({"first": nn.Linear(DIM, DIM), "second": nn.Linear(DIM, DIM)})
        self.listed = nn.ModuleList([nn.Linear(DIM, DIM)])
        self.plain = nn.Linear(DIM, DIM)
        self._hidden = nn.Linear(DIM, DIM)

    @property
    def behind_property(self) -> nn.Module:
        return self._hidden

    def blocks(self) -> list[nn.Module]:
        return [self.by_key["first"], self.by_key["second"], self.listed[0], self.plain, self._hidden]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.tanh(self.by_key["first"](x)) + self.by_key["second"](x)
        x = torch.tanh(self.listed[0](x))
        return self.behind_property(self.plain(x))


class _OwnWeight(nn.Module):
    def __init__(self, through_dict: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.bias = nn.Parameter(torch.zeros(DIM))
        self.through_dict = through_dict

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.through_dict:
            return F.linear(x, self._parameters["weight"], self._parameters["bias"])
        return F.linear(x, self.weight, self.bias)


class DirectParameters(nn.Module):
    """Parameters read as ``self.weight`` and through ``self._parameters['weight']``."""

    def __init__(self) -> None:
        super().__init__()
        self.attribute = _OwnWeight(through_dict=False)
        self.through_dict = _OwnWeight(through_dict=True)

    def blocks(self) -> list[nn.Module]:
        return [self.attribute, self.through_dict]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.through_dict(torch.tanh(self.attribute(x)))


class TwoPaths(nn.Module):
    """One module registered under two names and called through both (``named_parameters`` gives the first)."""

    def __init__(self) -> None:
        super().__init__()
        self.shared = nn.Linear(DIM, DIM)
        self.other = nn.Linear(DIM, DIM)
        self.alias = self.shared

    def blocks(self) -> list[nn.Module]:
        return [self.shared, self.other]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.alias(torch.tanh(self.other(torch.tanh(self.shared(x)))))


# form → the model class showing it
SOURCE_FORMS: dict[str, Callable[[], nn.Module]] = {
    "getattr_modules": GetattrModules,
    "getattr_chain": GetattrChain,
    "compiled_child": CompiledChild,
    "containers": Containers,
    "direct_parameters": DirectParameters,
    "two_paths": TwoPaths,
}
