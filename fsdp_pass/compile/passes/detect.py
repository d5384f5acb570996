"""Pass 1: find the parameters in a Dynamo graph and the block structure the graph asks of each.

Dynamo lifts module parameters to graph placeholders, in first-use order; the backend's example
inputs at those positions are the real ``nn.Parameter`` objects, and each placeholder carries its
source (``L['self']._modules['layers']._modules['0']._parameters['weight']``), which gives the
fully qualified name.

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
import re
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn as nn

from ...quant import BLOCK_QUANTIZE_OPS  # importing registers the ops

__all__ = ["ParamSite", "dynamo_source", "find_parameters", "graph_block_rows"]



@dataclass
class ParamSite:
    """One parameter placeholder of the graph."""

    index: int  # position among the graph's placeholders / example inputs
    node: fx.Node
    name: str  # fully qualified name, from the Dynamo source
    param: nn.Parameter


_SOURCE_PART = re.compile(r"\.?_(?:modules|parameters|buffers)\['([^']+)'\]|\.([A-Za-z_][A-Za-z_0-9]*)")


def dynamo_source(node: fx.Node):
    """Where Dynamo read a placeholder's value in the traced frame (``L['self']._modules[...]...``), or None."""
    source = getattr(node, "_dynamo_source", None)
    if source is None and "grapharg" in node.meta:
        source = node.meta["grapharg"].source
    return source


def _qualified_name(node: fx.Node) -> str:
    source = dynamo_source(node)
    name = getattr(source, "name", None)
    text = (name() if callable(name) else name) if name is not None else node.name
    text = re.sub(r"^L\['[^']+'\]", "", text)  # drop the root (L['self'], L['fn'], ...)
    parts = [a or b for a, b in _SOURCE_PART.findall(text)]
    return ".".join(parts) if parts else node.name


def find_parameters(gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[ParamSite]:
    """Parameter placeholders in graph order (= first use), with their FQNs and objects.

    Raises if the graph writes to a parameter in place: a sharded parameter is a view of a
    temporary gathered buffer inside the graph, so the write would be lost.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    sites = []
    for i, (node, value) in enumerate(zip(placeholders, example_inputs)):
        if isinstance(value, nn.Parameter):
            site = ParamSite(i, node, _qualified_name(node), value)
            _reject_in_place_writes(site)
            sites.append(site)
    return sites


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
