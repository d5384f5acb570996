"""Run a test body on N gloo ranks in fresh processes, with a hard timeout (never a hang)."""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank: int, world_size: int, init_file: str, fn, args, errors, pg_timeout: float) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
            timeout=timedelta(seconds=pg_timeout),
        )
        fn(rank, world_size, *args)
    except BaseException:
        errors.put((rank, traceback.format_exc()))
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    # The body passed and the group is gone. Skip interpreter finalization: on a loaded machine a
    # C++ thread left by gloo or Dynamo is sometimes still joinable there and aborts the process
    # ("terminate called without an active exception"), which would read as a failed rank.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_distributed(fn, world_size: int, *args, timeout: float = 300, pg_timeout: float = 60) -> None:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise the first failure.

    ``fn`` must be a module-level function (it is pickled into spawned processes). ``pg_timeout``
    is the process group's collective timeout; ``timeout`` bounds the whole run.
    """
    ctx = mp.get_context("spawn")
    errors = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "init")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, init_file, fn, args, errors, pg_timeout), daemon=True)
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [i for i, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
        failures = []
        while not errors.empty():
            failures.append(errors.get())
        if failures:
            rank, tb = sorted(failures)[0]
            raise AssertionError(f"rank {rank} failed:\n{tb}")
        if hung:
            raise TimeoutError(f"ranks {hung} did not finish within {timeout} s")
        bad = [(i, p.exitcode) for i, p in enumerate(procs) if p.exitcode != 0]
        if bad:
            raise AssertionError(f"ranks exited with codes {bad}")
