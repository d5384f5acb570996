"""docs/troubleshooting.md lists every error message the package raises."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# The test kit's reference models, process harness and node lab raise for tests and benchmarks, not for
# users (fake_pg stays checked: the command line uses it).
NOT_USER_FACING = {"fsdp_pass/testing/models.py", "fsdp_pass/testing/spawn.py", "fsdp_pass/testing/node_lab.py"}


def _message_fragments(node: ast.Raise) -> list[str]:
    """Literal text runs of the raised exception's first argument (f-string placeholders dropped)."""
    call = node.exc
    if not isinstance(call, ast.Call) or not call.args:
        return []
    pieces = []
    for part in ast.walk(call.args[0]):
        if isinstance(part, ast.Constant) and isinstance(part.value, str):
            pieces.append(part.value)
    return pieces


def _longest_fragment(node: ast.Raise) -> str | None:
    fragments = [f.strip() for f in _message_fragments(node) if len(f.strip()) >= 12]
    return max(fragments, key=len) if fragments else None


def test_every_error_message_is_documented():
    doc = " ".join((ROOT / "docs" / "troubleshooting.md").read_text().split())
    missing = []
    for path in sorted((ROOT / "fsdp_pass").rglob("*.py")):
        if path.relative_to(ROOT).as_posix() in NOT_USER_FACING:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):  # error built by a helper
                node = ast.Raise(exc=node.value, lineno=node.lineno)
            if isinstance(node, ast.Raise) and isinstance(node.exc, ast.Call):
                name = getattr(node.exc.func, "id", getattr(node.exc.func, "attr", ""))
                if name in ("SystemExit", "AssertionError") or not name.endswith(("Error", "Exception")):
                    continue  # command-line usage messages, internal invariants, non-errors
                fragment = _longest_fragment(node)
                if fragment and " ".join(fragment.split()) not in doc:
                    missing.append(f"{path.relative_to(ROOT)}:{node.lineno}: {fragment!r}")
    assert not missing, "error messages missing from docs/troubleshooting.md:\n" + "\n".join(missing)
