"""What the backend decides, logged through Python's ``logging`` under the ``fsdp_pass`` logger.

[Note: logging as torch does it]
Two kinds of records, each on a logger of its own below ``fsdp_pass``:

* ``plan`` (``fsdp_pass.log.plan``, level INFO): each new bucket, as its DBuffer prints;
* ``graphs`` (``fsdp_pass.log.graphs``, level DEBUG): every graph stage the backend makes.

Both are off by default: the ``fsdp_pass`` logger has no level of its own, so Python's default
(WARNING) drops them; warnings (``warnings.warn``) are shown as usual. Three ways to switch them on:

* ``FSDP_PASS_LOG=plan,graphs`` (or ``all``), read when fsdp_pass is imported, or
  :func:`configure` with the same string: a stderr handler on ``fsdp_pass`` and the kinds' levels;
* ``TORCH_LOGS="fsdp_pass"`` (INFO: the plan) or ``TORCH_LOGS="+fsdp_pass"`` (DEBUG: the graphs too), or
  ``torch._logging.set_logs(modules={"fsdp_pass": logging.DEBUG})``: torch's own handler and format.
  torch accepts any importable module name there, so fsdp_pass registers nothing in torch's registry
  (whose ``register_log`` is private);
* any ``logging`` configuration of the ``fsdp_pass`` logger or its children.

Each record carries ``record.rank``: the default process group's rank, or None without one. The
FSDP_PASS_LOG handler prints it (``[fsdp_pass rank1]``); torch's format prints ``[rank1]:`` itself.
"""

from __future__ import annotations

import logging
import os
import sys

import torch.distributed as dist

__all__ = ["GRAPHS", "LOGGER", "PLAN", "configure", "graph", "plan"]

LOGGER = logging.getLogger("fsdp_pass")  # the package's root logger: handlers and TORCH_LOGS attach here
PLAN = logging.getLogger("fsdp_pass.log.plan")  # each new bucket, INFO
GRAPHS = logging.getLogger("fsdp_pass.log.graphs")  # every graph stage, DEBUG
_KIND_LEVELS = {PLAN: logging.INFO, GRAPHS: logging.DEBUG}
_KIND_NAMES = {"plan": PLAN, "graphs": GRAPHS}


class _RankFormatter(logging.Formatter):
    """``[fsdp_pass rankR] message`` (``[fsdp_pass] message`` without a process group)."""

    def format(self, record: logging.LogRecord) -> str:
        rank = getattr(record, "rank", None)
        prefix = "[fsdp_pass]" if rank is None else f"[fsdp_pass rank{rank}]"
        return f"{prefix} {record.getMessage()}"


class _EnvHandler(logging.StreamHandler):
    """The stderr handler :func:`configure` installs (told apart from a user's own handlers)."""


def configure(kinds: str) -> None:
    """Log the comma-separated ``kinds`` (``plan``, ``graphs``, ``all``) to stderr, as ``FSDP_PASS_LOG``
    does; ``""`` undoes it (the kinds' levels and the handler this function installed)."""
    wanted = {k.strip() for k in kinds.split(",") if k.strip()}
    unknown = wanted - set(_KIND_NAMES) - {"all"}
    if unknown:
        raise ValueError(f"FSDP_PASS_LOG lists {sorted(unknown)}; use plan, graphs or all, comma-separated")
    for handler in [h for h in LOGGER.handlers if isinstance(h, _EnvHandler)]:
        LOGGER.removeHandler(handler)
    for name, logger in _KIND_NAMES.items():
        logger.setLevel(_KIND_LEVELS[logger] if name in wanted or "all" in wanted else logging.NOTSET)
    if wanted:
        handler = _EnvHandler(sys.stderr)
        handler.setFormatter(_RankFormatter())
        LOGGER.addHandler(handler)


def _rank() -> int | None:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else None


def plan(buffer) -> None:
    """Log a new bucket (its DBuffer's repr) on :data:`PLAN`."""
    if PLAN.isEnabledFor(logging.INFO):
        PLAN.info("%r", buffer, extra={"rank": _rank()})


def graph(stage: str, text: str) -> None:
    """Log a graph stage's readable code on :data:`GRAPHS`."""
    if GRAPHS.isEnabledFor(logging.DEBUG):
        GRAPHS.debug("===== %s graph =====\n%s", stage, text, extra={"rank": _rank()})


if os.environ.get("FSDP_PASS_LOG"):
    configure(os.environ["FSDP_PASS_LOG"])
