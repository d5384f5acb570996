"""Pass 1: find the parameters in a Dynamo graph and the block structure the graph asks of each.

Dynamo lifts module parameters to graph placeholders, in first-use order; the backend's example
inputs at those positions are the real ``nn.Parameter`` objects, and each placeholder carries its
source (``L['self']._modules['layers']._modules['0']._parameters['weight']``), which leads to the module
that names it ([Note: parameters known by identity]).

Graph patterns that ask for blocks (rows no rank boundary may cut; :mod:`fsdp_pass.sharding.blocks` combines
them with annotations and options):

* a reshape that splits dim 0 into ``(blocks, b, ...)`` (block-wise quantization) → ``b`` rows;
* ``split``/``chunk``/``unbind`` of the parameter along dim 0 (fused QKV, fused experts) → each piece
  starts on a block boundary: the GCD of the piece sizes, in rows;
* ``fsdp_pass::fp8_block_quantize`` / ``int8_block_quantize`` of the parameter → panels of ``tile``
  (128) rows, so every rank quantizes whole tiles.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.fx as fx
import torch.nn as nn
from torch._dynamo.symbolic_convert import InstructionTranslator

from ...quant import BLOCK_QUANTIZE_OPS  # importing registers the ops

__all__ = ["ParamSite", "dynamo_source", "find_parameters", "graph_block_rows"]



@dataclass
class ParamSite:
    """One parameter placeholder of the graph."""

    index: int  # position among the graph's placeholders / example inputs
    node: fx.Node
    name: str  # the parameter's name in its root module's named_parameters() ([Note: parameters known by identity])
    param: nn.Parameter
    root: nn.Module | None = None  # the outermost module the traced frame reached it through; None outside Dynamo
    root_source: str = ""  # how the frame reached ``root`` (``L['self']``, ``G['model']``)


# [Note: parameters known by identity]
# A placeholder's Dynamo source says how the frame reached a parameter
# (``L['self']._modules['a']._parameters['weight']``, or ``L['self'].__dict__['_modules']['a']...`` for a module
# that defines ``__getattr__``, ``getattr`` chains, ``_orig_mod`` ...): its text is no name, and two different
# parameters parsed into one string would share a bucket slot. So the parameter is known by its object (the
# example input is the real ``nn.Parameter``) and named by its root module: the outermost module on its source
# chain, resolved by Dynamo itself, and that module's ``named_parameters()`` (the first name of a tied
# parameter). Buckets, rewrites and ``block_sizes`` key on that name, which :func:`find_parameters` makes unique
# per object or refuses.


def dynamo_source(node: fx.Node):
    """Where Dynamo read a placeholder's value in the traced frame (``L['self']._modules[...]...``), or None."""
    source = getattr(node, "_dynamo_source", None)
    if source is None and "grapharg" in node.meta:
        source = node.meta["grapharg"].source
    return source


def _source_text(source) -> str:
    name = getattr(source, "name", None)
    return str(name() if callable(name) else name)


def _source_chain(source) -> list:
    """The source's links from the frame's local or global inwards."""
    chain = []
    while source is not None:
        chain.append(source)
        source = getattr(source, "base", None)
    return chain[::-1]


def _current_tx():
    try:
        return InstructionTranslator.current_tx()
    except AttributeError:  # this thread never traced a frame (the scale benchmark runs the passes directly)
        return None


def _root_of(tx, source) -> tuple[nn.Module | None, str]:
    """The outermost module on ``source``'s chain, and the text of the link that reached it."""
    for link in _source_chain(source):
        try:
            value = tx.output.resolve_source_value(link)
        except Exception:  # read through one of Dynamo's own helpers, like every link inside it
            break
        if isinstance(value, nn.Module):
            return value, _source_text(link)
    return None, ""


class _Namer:
    """Names parameters by identity ([Note: parameters known by identity]) for one backend call."""

    def __init__(self, tx):
        self.tx = tx
        self._tables: dict[int, dict[int, str]] = {}  # id(root) → id(parameter) → its first name under root

    def name(self, node: fx.Node, param: nn.Parameter) -> tuple[str, nn.Module | None, str]:
        """(name, root module, the root's source text) of the parameter ``node`` reads."""
        source = dynamo_source(node)
        if self.tx is None or source is None:  # outside Dynamo: the placeholder's own name, unique per graph
            return node.name, None, ""
        root, root_source = _root_of(self.tx, source)
        if root is None:  # a parameter that no module holds (a global, an argument): named by its source
            return _source_text(source), None, ""
        table = self._tables.get(id(root))
        if table is None:
            table = self._tables[id(root)] = {}
            for name, p in root.named_parameters():  # tied parameters: the first name wins
                table.setdefault(id(p), name)
        name = table.get(id(param))
        if name is None:
            raise RuntimeError(
                f"a parameter of shape {tuple(param.shape)} read as {_source_text(source)} is not among the "
                f"named_parameters() of {type(root).__name__} ({root_source}), the module the compiled code reached "
                f"it through, so it cannot be named or sharded safely; register it on a module (an nn.Parameter "
                f"attribute, nn.ParameterList or nn.ParameterDict)"
            )
        return name, root, root_source


def find_parameters(gm: fx.GraphModule, example_inputs: Sequence[Any],
                    names: Mapping[int, str] | None = None) -> list[ParamSite]:
    """Parameter placeholders in graph order (= first use), with their objects, names and root modules.

    Names come from the root module's ``named_parameters()`` ([Note: parameters known by identity]);
    ``names`` (placeholder position → name) gives them instead, for graphs run outside Dynamo's call.
    Raises if two parameters would share a name, or if the graph writes to a parameter in place: a
    sharded parameter is a view of a temporary gathered buffer inside the graph, so the write would be lost.
    """
    namer = _Namer(None if names is not None else _current_tx())
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sites = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, nn.Parameter):
            name, root, root_source = (names[i], None, "") if names is not None else namer.name(node, value)
            sites.append(ParamSite(i, node, name, value, root, root_source))
    _qualify_across_roots(sites)
    _check_one_object_per_name(sites)
    for site in sites:
        _reject_in_place_writes(site)
    return sites


def _qualify_across_roots(sites: list[ParamSite]) -> None:
    """Parameters of several root modules in one frame (``self`` and a global model, two models passed in):
    names from every root but the frame's ``self`` are prefixed with how the frame reached that root."""
    if len({id(s.root) for s in sites if s.root is not None}) < 2:
        return
    for site in sites:
        if site.root is not None and site.root_source != "L['self']":
            site.name = f"{site.root_source}.{site.name}"


def _check_one_object_per_name(sites: list[ParamSite]) -> None:
    """Two different parameters under one name would share a bucket slot: never let that pass."""
    by_name: dict[str, ParamSite] = {}
    for site in sites:
        other = by_name.setdefault(site.name, site)
        if other.param is not site.param:
            raise RuntimeError(
                f"two different parameters (shapes {tuple(other.param.shape)} and {tuple(site.param.shape)}) are both "
                f"named {site.name!r} in this graph (read as {_source_text(dynamo_source(other.node))} and "
                f"{_source_text(dynamo_source(site.node))}); each needs its own name to be sharded. Compile the "
                f"module that holds both, so both are named by its named_parameters()"
            )


def _reject_in_place_writes(site: ParamSite) -> None:
    for user in site.node.users:
        name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
        written = user.args[:1] == (site.node,) or user.kwargs.get("out") is site.node
        if written and (name.endswith("_") and not name.endswith("__") and name != "requires_grad_" or name == "copy_"):
            raise RuntimeError(
                f"parameter {site.name!r} (shape {tuple(site.param.shape)}) is modified in place inside the "
                f"compiled forward ({name}); sharded parameters are views of a buffer gathered for the "
                f"step, so the write would be lost. Update it outside the compiled region under "
                f"torch.no_grad(), or register it as a buffer"
            )


def _shape_of(node: fx.Node) -> tuple[int, ...] | None:
    value = node.meta.get("example_value")
    if isinstance(value, torch.Tensor):
        try:
            return tuple(int(s) for s in value.shape)
        except TypeError:  # symbolic sizes
            return None
    return None


def graph_block_rows(site: ParamSite) -> list[int]:
    """Row blocks implied by how the graph uses this parameter (see the module docstring)."""
    node, shape = site.node, tuple(site.param.shape)
    if not shape:
        return []
    rows = shape[0]
    found = []
    for user in node.users:
        if user.target in BLOCK_QUANTIZE_OPS and user.args[:1] == (node,):
            tile = user.args[1] if len(user.args) > 1 else user.kwargs.get("tile", 128)
            found.append(tile if rows % tile == 0 else rows)  # whole tiles; the whole tensor if 128 does not divide
            continue
        name = user.target if isinstance(user.target, str) else getattr(user.target, "__name__", "")
        if name in ("view", "reshape"):
            out = _shape_of(user)
            # dim 0 split into (n, b, ...) with n * b == rows: blocks of b rows
            if out and len(out) > len(shape) and out[0] * out[1] == rows and math.prod(out[2:]) == math.prod(shape[1:]):
                found.append(out[1])
        elif name in ("split", "chunk", "unbind", "tensor_split", "split_with_sizes"):
            dim = user.kwargs.get("dim", user.args[2] if len(user.args) > 2 else 0)
            value = user.meta.get("example_value")
            if dim in (0, -len(shape)) and isinstance(value, (list, tuple)):
                sizes = [1 if name == "unbind" else int(v.shape[0]) for v in value]
                if sizes:
                    found.append(math.gcd(*sizes))
    return found
