"""Compile-time logging, switched on by ``FSDP_PASS_LOG=plan,graphs`` (comma-separated)."""

from __future__ import annotations

import os
import sys

__all__ = ["enabled", "graph", "plan"]


def enabled(kind: str) -> bool:
    """Whether ``FSDP_PASS_LOG`` lists ``kind`` (``plan`` or ``graphs``; ``all`` enables both)."""
    wanted = {k.strip() for k in os.environ.get("FSDP_PASS_LOG", "").split(",") if k.strip()}
    return kind in wanted or "all" in wanted


def plan(buffer) -> None:
    if enabled("plan"):
        print(f"[fsdp_pass] {buffer!r}", file=sys.stderr)


def graph(stage: str, text: str) -> None:
    if enabled("graphs"):
        print(f"[fsdp_pass] ===== {stage} graph =====\n{text}", file=sys.stderr)
