"""Ranks that share one compile cache compile each graph once between them (``options["shared_compile_cache"]``).

[Note: ranks compile a graph once between them]
Every rank of a data-parallel job compiles the same graphs: same shapes, same collectives over the
same group names, so the same Inductor FX-graph cache keys. Compiling at the same moment, they all
miss the cache and each one lowers, generates and builds every graph. With a cache folder all ranks
see (``TORCHINDUCTOR_CACHE_DIR`` on a node-local or shared file system), rank 0 compiles each graph
first and the other ranks wait for it at a barrier; then they compile the same graph and find
AOTAutograd's and Inductor's output in torch's own caches (see the next note). The backward graph is
compiled inside the same turn (``force_non_lazy_backward_lowering``), before the first collective
runs, so the wait never sits between two ranks' collectives. Dynamo and the backend's passes 1-3b
still run on every rank. A second launch with the cache kept (a warm start) finds every graph there.

Without a shared folder the others gain nothing and wait for rank 0 first, which is why it is an option.

[Note: AOTAutograd's output cached with the backend's settings in its key]
Inductor's FX-graph cache alone leaves every rank, and every warm launch, tracing the joint graph and
partitioning it again (AOTAutograd: about a fifth of a cold compile, and most of a warm one).
torch's AOTAutograd cache skips that, but refuses a graph that calls functions it does not know
(the rewrite's ``gather_bucket``), and its key is Dynamo's graph, the inputs and torch's configs: it
does not see what the backend does between AOTAutograd and Inductor (the joint-graph reshard pass,
the overlap schedule, the gradient writes), which the options decide. So with
``shared_compile_cache`` the compile names the backend's functions in the graph as cacheable and
adds to torch's cache key tag a digest of the options, the buckets and the package's source: a graph
is loaded only for the settings and code that produced it. Without the option the AOTAutograd cache
stays off for these graphs, as before. A loaded graph skips the backend's stages, so ``explain()``
shows no stage graphs for it and says so.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from pathlib import Path
from typing import Iterator, Sequence

import torch
import torch.distributed as dist
import torch.fx as fx

from ..buckets.dbuffer import DBuffer
from ..options import Options

__all__ = ["cache_compiled_graphs", "compile_in_turn"]

_PACKAGE = Path(__file__).resolve().parents[1]  # fsdp_pass/


@contextlib.contextmanager
def compile_in_turn(enabled: bool) -> Iterator[None]:
    """Around one graph's compile: rank 0 compiles first, the other ranks after it (a no-op when not
    ``enabled`` or on one rank). The barrier waits under the process group's timeout."""
    if not (enabled and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        yield
        return
    first = dist.get_rank() == 0
    if not first:
        dist.barrier()  # rank 0's graph is in the cache once it arrives
    try:
        with torch._functorch.config.patch(force_non_lazy_backward_lowering=True):
            yield
    finally:
        if first:
            dist.barrier()  # also when rank 0 failed: the others then compile, and fail, on their own


@contextlib.contextmanager
def cache_compiled_graphs(enabled: bool, gm: fx.GraphModule, opts: Options,
                          buffers: Sequence[DBuffer]) -> Iterator[None]:
    """Around one graph's compile: AOTAutograd's cache on, keyed by the backend's settings ([Note:
    AOTAutograd's output cached with the backend's settings in its key]), or off when not ``enabled``."""
    if not enabled:
        with torch._functorch.config.patch(enable_autograd_cache=False):
            yield
        return
    digest = _settings_digest(opts, buffers)
    marked = dict(torch._inductor.config.unsafe_marked_cacheable_functions)
    marked.update({name: digest for name in _package_functions(gm)})
    tag = f"{torch.compiler.config.cache_key_tag}|fsdp_pass:{digest}"
    with torch._inductor.config.patch(unsafe_marked_cacheable_functions=marked), \
            torch.compiler.config.patch(cache_key_tag=tag):
        yield


@functools.cache
def _source_digest() -> str:
    """Of every source file of the package: a cached graph is used only by the code that made it."""
    digest = hashlib.sha256()
    for path in sorted(_PACKAGE.rglob("*.py")):
        digest.update(str(path.relative_to(_PACKAGE)).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _settings_digest(opts: Options, buffers: Sequence[DBuffer]) -> str:
    """The options and bucket layouts the backend compiles a graph with, and its source. A value whose
    text differs between processes (an object's address) only makes the cache miss."""
    parts = [_source_digest(), repr(opts)]
    parts += [repr((b.names, b.dtype, b.fp8_tile, b.layout.shard_size, b.mesh.shard_size,
                    b.mesh.replicate_size)) for b in buffers]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:32]


def _package_functions(gm: fx.GraphModule) -> set[str]:
    """Qualified names of the package's functions that ``gm`` (or a subgraph of it) calls."""
    names = set()
    for module in gm.modules():
        if not isinstance(module, fx.GraphModule):
            continue
        for node in module.graph.nodes:
            if node.op != "call_function":
                continue
            owner = getattr(node.target, "__module__", None) or ""
            name = getattr(node.target, "__name__", None)  # a callable object has none: left unmarked, not cached
            if name and owner.split(".")[0] == __name__.split(".")[0]:
                names.add(f"{owner}.{name}")
    return names
