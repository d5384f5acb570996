"""The package's shape: rooms that import one way, no import cycle, and a map that names every module.

The import graph is built from the sources (``ast``), function-local imports included, so a cycle
held together by an import inside a function still counts.
"""

from __future__ import annotations

import ast
import pathlib
import re


PACKAGE = pathlib.Path(__file__).resolve().parent.parent / "fsdp_pass"

# Rooms from the bottom up: a module may import its own room and the rooms below it, never one above.
ROOMS = [
    "base",  # placement, planner, options, log: pure math and plain settings
    "tensor",  # the RaggedShard tensor, its dispatch, collectives, checkpoint form
    "quant",
    "buckets",  # DBuffer and everything per bucket
    "step",  # the step boundary
    "eager",  # eager calls on a sharded model
    "interop",  # adapting to other libraries' calls
    "sharding",  # setup-time policy
    "compile",  # the backend, options, compiled variants, passes
    "testing",
    "plan",  # offline planning
    "optim",
    "api",  # fsdp_pass/__init__.py, __main__.py
    "integrations",
]
BASE = {"placement", "planner", "options", "log"}

# The tensor subclass and its dispatch call each other, as DTensor's _api and _dispatch do: the class
# hands every op to the dispatch, which builds results of the class. Nothing else may form a cycle.
ALLOWED_CYCLE = {"fsdp_pass.tensor.ragged_tensor", "fsdp_pass.tensor.dispatch", "fsdp_pass.tensor.flat_buffers"}


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    return out


def import_graph() -> dict[str, set[str]]:
    """Module → the package modules it imports (anywhere in the file)."""
    modules = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph = {}
    for name, (path, is_package) in modules.items():
        base = name.split(".") if is_package else name.split(".")[:-1]
        targets = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(resolve(a.name) for a in node.names if a.name.startswith("fsdp_pass"))
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    parent = base[: len(base) - node.level + 1]
                    source = ".".join(parent + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                if source.split(".")[0] == "fsdp_pass":
                    targets.update(resolve(f"{source}.{a.name}") for a in node.names)
        graph[name] = {t for t in targets if t and t != name}
    return graph


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on_stack, found, counter = {}, {}, [], set(), [], [0]
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def room_of(module: str) -> str:
    parts = module.split(".")[1:]
    if not parts or parts == ["__main__"]:
        return "api"
    return "base" if len(parts) == 1 and parts[0] in BASE else parts[0]


def test_no_import_cycle():
    cycles = [c for c in strongly_connected(import_graph()) if not c <= ALLOWED_CYCLE]
    assert not cycles, f"import cycles: {[sorted(c) for c in cycles]}"


def test_the_cycle_check_sees_function_local_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert strongly_connected(graph) == [{"a", "b", "c"}]
    # dispatch's reach into the subclass module is itself an import the graph must see
    assert "fsdp_pass.tensor.ragged_tensor" in import_graph()["fsdp_pass.tensor.dispatch"]


def test_rooms_import_one_way():
    graph = import_graph()
    unknown = sorted({room_of(m) for m in graph} - set(ROOMS))
    assert not unknown, f"modules outside every room: {unknown}; add the room to ROOMS in its place"
    upward = [
        f"{m} → {t}" for m, targets in graph.items() for t in targets
        if ROOMS.index(room_of(t)) > ROOMS.index(room_of(m))
    ]
    assert not upward, "imports from a lower room into a higher one:\n" + "\n".join(sorted(upward))


def test_concepts_map_names_every_module():
    text = (PACKAGE.parent / "docs" / "concepts.md").read_text()
    section = text[text.index("## Where the code lives"):]
    listed = set(re.findall(r"`(fsdp_pass/[\w/]+\.py)`", section))
    on_disk = {str(path.relative_to(PACKAGE.parent)) for path in PACKAGE.rglob("*.py")
               if path.name != "__init__.py" or path.parent == PACKAGE}  # a room's __init__ is its docstring
    assert not on_disk - listed, f"modules missing from docs/concepts.md's map: {sorted(on_disk - listed)}"
    listed -= {m for m in listed if m.endswith("/__init__.py") and m != "fsdp_pass/__init__.py"}
    assert not listed - on_disk, f"docs/concepts.md maps modules that do not exist: {sorted(listed - on_disk)}"
