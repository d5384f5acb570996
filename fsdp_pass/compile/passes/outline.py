"""Pass 3b: repeated blocks outlined into one shared subgraph (compile time flat in depth).

[Note: repeated blocks compiled once]
A whole-model graph holds n transformer blocks that are the same computation on different
parameters. Compiled flat, AOTAutograd traces and partitions each of them and Inductor lowers and
generates code for each of them: about 2-3 s per block on CPU, so compile time grows with depth.
After the rewrite (pass 3), each block's nodes read its parameters as views of a gathered bucket;
this pass moves the nodes of every block that matches another one into a shared ``GraphModule`` and
calls it through torch's ``invoke_subgraph`` operator (what ``torch.compiler.nested_compile_region``
produces), one call per block, with the block's activations and parameter views as operands.
AOTAutograd then traces and partitions the block once per distinct subgraph (its invoke_subgraph
cache is keyed by the identifier this pass gives), and Inductor lowers each distinct subgraph once.

What stays in the outer graph, so the schedule is what the flat graph gives: every gather, split and
parameter view (the rewrite's nodes: they carry no module), the embedding, the final norm and the
head, and the reduce-scatters. Two fixes keep memory and traffic as they were:
- backward re-gathers resharded buckets: a subgraph's partition saves views of its parameter operands
  for backward, which as subgraph outputs would keep the gathered buckets alive; the joint-graph pass
  :func:`rematerialize_parameter_views` replays those views from the operands in the outer graph,
  where the reshard tags (pass 4) recompute them from a fresh gather;
- gradients leave the subgraph as its outputs, so the bucket write (pass 5) copies them into the
  bucket instead of having the matmul write there: ``explain()`` lists them under "gradient copied".

A block is a module whose path ends in an index (``layers.3``, an entry of a ModuleList/ModuleDict):
its nodes are those whose module stack has it outermost. Two blocks merge when their node sequences
are the same ops with the same constants and their operands have the same shapes, strides and
dtypes. A group is outlined from ``MIN_CALLS`` blocks on: a shared subgraph is one more graph for
AOTAutograd and Inductor, and for two calls it cost more than it saved (llama dim 256, 2 ranks,
Inductor, empty cache: 3 layers, whose layers 0 and 2 match, 79.8 s outlined against 71.8 s flat;
4 layers, two pairs, 83.1 against 79.5 s; with pairs left flat, 5 layers 82.9 against 88.9 s and 8
layers 95.5 against 100.0 s in the same run). A block is left flat, and :attr:`Outlined.left_flat`
says why, when it matches too few other blocks, holds a nested graph (activation checkpointing),
takes tensor-subclass or symbolic operands, or is interleaved with code outside it.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field

import torch
import torch.fx as fx

from .schedule import GATHER_VIEW_OPS

__all__ = ["Outlined", "outline_repeated_blocks", "rematerialize_parameter_views", "shared_backward_subgraphs"]

_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
MIN_CALLS = 3  # blocks of one computation before they share a subgraph (see the note)
_INDEXED = re.compile(r"^(.*)(\.(\d+)|\[['\"]?(\d+)['\"]?\])$")  # "L['self'].layers.3", "...layers['3']"
_ROOT = re.compile(r"^L(\[[^\]]*\])+\.")  # the traced frame's local: "L['self'].", "L['args'][0]."


@dataclass
class Outlined:
    """What :func:`outline_repeated_blocks` did to one graph (``explain()`` prints it)."""

    shared: dict[str, list[str]] = field(default_factory=dict)  # subgraph identifier → the blocks calling it
    left_flat: dict[str, str] = field(default_factory=dict)  # block → why it stays in the outer graph

    def lines(self) -> list[str]:
        lines = [f"repeated blocks compiled once: {_span([_readable(b) for b in blocks])} call one subgraph "
                 f"({ident}, {len(blocks)} calls)" for ident, blocks in self.shared.items()]
        return lines + [f"block left flat: {_readable(block)} ({why})" for block, why in self.left_flat.items()]


def _readable(block: str) -> str:
    """A block's path without the traced frame's local it was reached through (``layers.3``)."""
    return _ROOT.sub("", block)


def _span(blocks: list[str]) -> str:
    return ", ".join(blocks) if len(blocks) <= 4 else f"{blocks[0]}, {blocks[1]}, … {blocks[-1]}"


def _block_of(node: fx.Node) -> str | None:
    """The outermost indexed module on ``node``'s module stack (``L['self'].layers.3``)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if _INDEXED.match(path):
            return path  # the full path, root included: two models of one frame have distinct blocks
    return None


@dataclass
class _Region:
    block: str
    nodes: list[fx.Node]  # in graph order
    inputs: list[fx.Node] = field(default_factory=list)  # values from outside, in first-use order
    outputs: list[fx.Node] = field(default_factory=list)  # region values read outside, in graph order
    signature: str = ""


def _regions(graph: fx.Graph) -> list[_Region]:
    regions: dict[str, _Region] = {}
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method", "call_module", "get_attr"):
            continue
        block = _block_of(node)
        if block is not None:
            regions.setdefault(block, _Region(block, [])).nodes.append(node)
    return list(regions.values())


def _bucket_views(view: fx.Node) -> list[fx.Node] | None:
    """If ``view`` is a parameter view of a gathered bucket (``view(getitem(split_with_sizes(gathered)))``,
    the rewrite's chain): the bucket's split, its getitems and their views; else None."""
    piece = view.args[0] if view.target is torch.ops.aten.view.default and view.args else None
    split = piece.args[0] if isinstance(piece, fx.Node) and piece.target is operator.getitem else None
    if not (isinstance(split, fx.Node) and split.target is torch.ops.aten.split_with_sizes.default):
        return None
    pieces = list(split.users)
    views = [v for p in pieces for v in p.users]
    if not all(p.target is operator.getitem for p in pieces) or \
            not all(v.target is torch.ops.aten.view.default for v in views):
        return None
    return [split, *pieces, *views]


def _take_whole_buckets(region: _Region, order: dict[fx.Node, int]) -> None:
    """Move into ``region`` the split and views of every bucket only it reads, so the subgraph takes the
    gathered bucket itself and returns its whole gradient (which pass 5 then builds in place,
    [Note: gradients written into the bucket])."""
    members = set(region.nodes)
    for node in region.nodes:
        for arg in node.all_input_nodes:
            chain = None if arg in members else _bucket_views(arg)
            if chain and all(u in members for v in chain if v.target is torch.ops.aten.view.default
                             for u in v.users):
                members.update(chain)
    region.nodes = sorted(members, key=order.__getitem__)


def _why_not(region: _Region, order: dict[fx.Node, int]) -> str | None:
    """Why ``region`` cannot become one subgraph call (None: it can); fills its inputs and outputs."""
    _take_whole_buckets(region, order)
    members = set(region.nodes)
    last = order[region.nodes[-1]]
    for node in region.nodes:
        if node.op in ("get_attr", "call_module"):
            return "holds a nested graph or module call (activation checkpointing?)"
        for arg in node.all_input_nodes:
            if arg not in members and arg not in region.inputs:
                region.inputs.append(arg)
        outside = [u for u in node.users if u not in members]
        if any(order[u] < last for u in outside):
            return "interleaved with code outside the block"
        if outside:
            region.outputs.append(node)
    for value in region.inputs + region.outputs:
        example = value.meta.get("example_value")
        if not isinstance(example, torch.Tensor):
            return f"non-tensor value {value.name} crosses the block boundary"
        if type(example) is not torch._subclasses.FakeTensor:
            return f"tensor subclass value {value.name} ({type(example).__name__}) crosses the block boundary"
        if any(not isinstance(d, int) for d in example.shape):
            return "dynamic shapes"
    if not region.outputs:
        return "no output"
    region.signature = _signature(region)
    return None


def _signature(region: _Region) -> str:
    """The region's computation up to its operands' identities: equal strings, one subgraph."""
    label = {n: f"in{i}" for i, n in enumerate(region.inputs)}
    label.update({n: f"n{i}" for i, n in enumerate(region.nodes)})
    examples = [v.meta["example_value"] for v in region.inputs]
    parts = [f"{tuple(e.shape)}:{e.stride()}:{e.dtype}:{e.requires_grad}" for e in examples]
    for node in region.nodes:
        args = fx.node.map_arg((node.args, node.kwargs), lambda n: label[n])
        parts.append(f"{node.op}:{node.target}:{args!r}")
    parts.append("out:" + ",".join(label[n] for n in region.outputs))
    return "\n".join(parts)


def _subgraph(region: _Region) -> fx.GraphModule:
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for i, value in enumerate(region.inputs):
        env[value] = graph.placeholder(f"operand{i}")
        env[value].meta["example_value"] = value.meta["example_value"]
    for node in region.nodes:
        env[node] = graph.node_copy(node, lambda n: env[n])
    graph.output(tuple(env[n] for n in region.outputs))
    return fx.GraphModule(torch.nn.Module(), graph)


def outline_repeated_blocks(gm: fx.GraphModule) -> Outlined:
    """Replace every block that matches another one by a call of their shared subgraph (in place)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    outlined = Outlined()
    groups: dict[str, list[_Region]] = {}
    replaced: dict[fx.Node, fx.Node] = {}  # an outlined block's output → its getitem of the call
    for region in _regions(graph):
        why = _why_not(region, order)
        if why is None:
            groups.setdefault(region.signature, []).append(region)
        else:
            outlined.left_flat[region.block] = why
    for regions in groups.values():
        if len(regions) < MIN_CALLS:
            why = "matches no other block" if len(regions) == 1 else f"{len(regions)} alike; shared from {MIN_CALLS}"
            outlined.left_flat.update((r.block, why) for r in regions)
            continue
        ident = f"fsdp_block_{len(outlined.shared)}"
        regions[0].inputs = [replaced.get(n, n) for n in regions[0].inputs]
        gm.register_module(ident, _subgraph(regions[0]))
        outlined.shared[ident] = [r.block for r in regions]
        for region in regions:
            _call(graph, region, ident, replaced)
    if outlined.shared:
        graph.lint()
        gm.recompile()
    return outlined


def _call(graph: fx.Graph, region: _Region, ident: str, replaced: dict[fx.Node, fx.Node]) -> None:
    """Replace ``region``'s nodes by one ``invoke_subgraph`` call of the module ``ident``; ``replaced``
    (an outlined block's output → the getitem that now stands for it) gets this one's outputs."""
    region.inputs = [replaced.get(n, n) for n in region.inputs]  # outputs of blocks outlined before
    with graph.inserting_after(region.nodes[-1]):
        module = graph.get_attr(ident)
    with graph.inserting_after(module):
        call = graph.call_function(_INVOKE_SUBGRAPH, (module, ident, *region.inputs))
    call.meta["example_value"] = tuple(n.meta["example_value"] for n in region.outputs)
    anchor = call
    for i, node in enumerate(region.outputs):
        with graph.inserting_after(anchor):
            anchor = graph.call_function(operator.getitem, (call, i))
        anchor.meta["example_value"] = node.meta["example_value"]
        node.replace_all_uses_with(anchor)
        replaced[node] = anchor
    for node in reversed(region.nodes):
        graph.erase_node(node)


# Views that a subgraph's partition may save of a parameter operand (a transposed weight, or a
# parameter of a bucket the subgraph takes whole): the gather chain's views, which are free to replay
# outside the subgraph (not its wait or FP8 dequantization).
_VIEWS = GATHER_VIEW_OPS | {operator.getitem}


def _view_chain(output: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """If a subgraph output is a chain of views of one of its placeholders: (placeholder index, views
    from the placeholder outwards); else None."""
    chain = []
    node = output
    while node.op == "call_function" and node.target in _VIEWS:
        chain.append(node)
        node = node.args[0]
    if node.op != "placeholder":
        return None
    placeholders = list(node.graph.find_nodes(op="placeholder"))
    return placeholders.index(node), chain[::-1]


def rematerialize_parameter_views(gm: fx.GraphModule, is_parameter_view) -> fx.GraphModule:
    """On the joint graph (subgraphs already partitioned): a forward subgraph output that backward
    reads and that is only a view of a parameter operand (``is_parameter_view(operand)``) is replayed
    from that operand in the outer graph, and backward reads the replay. The outer partitioner then
    sees the gather chain it may recompute ([Note: repeated blocks compiled once])."""
    graph = gm.graph
    for call in list(graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH)):
        if not (isinstance(call.args[1], str) and call.args[1].startswith("partitioned_fw")):
            continue
        sub = getattr(gm, call.args[0].target)
        results = list(sub.graph.find_nodes(op="output"))[0].args[0]
        operands = call.args[2:]
        for user in list(call.users):
            if not (user.op == "call_function" and user.target is operator.getitem):
                continue
            found = _view_chain(results[user.args[1]]) if isinstance(results[user.args[1]], fx.Node) else None
            if found is None or not is_parameter_view(operands[found[0]]):
                continue
            value, anchor = operands[found[0]], user
            for view in found[1]:  # in order, each after the last
                with graph.inserting_after(anchor):
                    value = anchor = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
                value.meta["val"] = view.meta.get("val")
            user.replace_all_uses_with(value)
            graph.erase_node(user)
    graph.lint()
    gm.recompile()
    return gm


def shared_backward_subgraphs(gm: fx.GraphModule) -> list[fx.GraphModule]:
    """The backward subgraphs a (partitioned) backward graph calls, each once."""
    modules = {call.args[0].target for call in gm.graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH)
               if isinstance(call.args[1], str) and call.args[1].startswith("partitioned_bw")}
    return [getattr(gm, name) for name in sorted(modules)]
