"""A script run as one rank of a ``torchrun`` launch under the strict mode ([Note: NCCL's rules, enforced on
CPU] in testing/strict.py), for the tests that launch scripts the way users do instead of through
:func:`~fsdp_pass.testing.spawn.run_distributed`::

    FSDP_PASS_STRICT_BOARD=/tmp/run1 torchrun --nproc-per-node 2 -m fsdp_pass.testing.strict_script \\
        examples/train.py --steps 4

``FSDP_PASS_STRICT_BOARD`` names the directory where the ranks post what they compare: one per launch, seen
by every rank of it (every node of a node lab shares the file system). ``FSDP_PASS_STRICT_TIMEOUT`` bounds
each wait for another rank, in seconds (default 60). A rank that breaks a rule exits with code 1 after
printing the :class:`~fsdp_pass.testing.strict.StrictModeError`, so ``torchrun`` stops the launch.
"""

from __future__ import annotations

import os
import runpy
import sys
import threading
import traceback

from .strict import Strict, StrictRank

__all__ = ["BOARD_VARIABLE", "main", "strict_launch"]

BOARD_VARIABLE = "FSDP_PASS_STRICT_BOARD"
TIMEOUT_VARIABLE = "FSDP_PASS_STRICT_TIMEOUT"


def strict_launch(script: str, board: str) -> tuple[list[str], dict[str, str]]:
    """What a test puts in ``torchrun``'s command line in place of ``script``, and the environment to add: the
    launch's ranks run ``script`` under the strict mode, posting in ``board`` (a fresh directory per launch)."""
    return ["-m", "fsdp_pass.testing.strict_script", script], {BOARD_VARIABLE: board}


def main(argv: list[str]) -> None:
    """Run ``argv[0]`` as ``__main__`` with ``argv[1:]`` as its arguments, under the strict mode."""
    if not argv:
        raise SystemExit("usage: torchrun ... -m fsdp_pass.testing.strict_script SCRIPT [ARGS...]")
    board = os.environ.get(BOARD_VARIABLE)
    if not board:
        raise SystemExit(f"{BOARD_VARIABLE} must name a directory every rank of the launch sees, one per launch")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    session = StrictRank(Strict(), rank, world, board, float(os.environ.get(TIMEOUT_VARIABLE, "60")))
    reporting = threading.Lock()  # the watchdog and the main thread may both report

    def fail_now(message: str) -> None:
        with reporting:
            print(f"strict mode, rank {rank}: {message}", file=sys.stderr, flush=True)
            os._exit(1)

    session.start_watchdog(fail_now)
    sys.argv = list(argv)
    try:
        runpy.run_path(argv[0], run_name="__main__")
        session.finish()  # raises StrictModeError when the ranks broke one of NCCL's rules
    except SystemExit as done:
        if done.code not in (None, 0):
            raise
        session.finish()
    except BaseException as error:
        with reporting:
            traceback.print_exc()
            print(session.explain(error), file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    finally:
        session.close()


if __name__ == "__main__":
    main(sys.argv[1:])
