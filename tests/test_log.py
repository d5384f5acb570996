"""Logging through Python's ``logging`` under ``fsdp_pass`` ([Note: logging as torch does it]): off by
default, on through FSDP_PASS_LOG, TORCH_LOGS or a handler of one's own, with the rank in each record."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_pass import log
from fsdp_pass.testing.fake_pg import fake_process_group

ROOT = Path(__file__).resolve().parent.parent


class _Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept():
    handler = _Kept()
    log.LOGGER.addHandler(handler)
    yield handler
    log.LOGGER.removeHandler(handler)
    log.configure("")


@pytest.mark.skipif(bool(os.environ.get("FSDP_PASS_LOG") or os.environ.get("TORCH_LOGS")),
                    reason="logging switched on in this environment")
def test_off_by_default_except_warnings(kept):
    log.plan("bucket")
    log.graph("forward", "code")
    assert kept.records == []
    assert log.LOGGER.isEnabledFor(logging.WARNING)


def test_configure_logs_the_kinds_asked_for_with_the_rank(kept, capsys):
    log.configure("graphs")
    log.plan("bucket")
    with fake_process_group(4, rank=3):
        log.graph("forward", "code")
    assert [(r.name, r.levelno, r.rank) for r in kept.records] == [("fsdp_pass.log.graphs", logging.DEBUG, 3)]
    assert capsys.readouterr().err == "[fsdp_pass rank3] ===== forward graph =====\ncode\n"
    log.configure("all")
    log.plan("bucket")
    assert kept.records[-1].name == "fsdp_pass.log.plan" and kept.records[-1].rank is None
    assert capsys.readouterr().err == "[fsdp_pass] 'bucket'\n"
    log.configure("")
    log.plan("bucket")
    assert len(kept.records) == 2 and capsys.readouterr().err == ""
    with pytest.raises(ValueError, match="FSDP_PASS_LOG lists \\['plans'\\]"):
        log.configure("plans")


def _run(env: dict[str, str], code: str) -> str:
    env = {**{k: v for k, v in os.environ.items() if k not in ("FSDP_PASS_LOG", "TORCH_LOGS")},
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]), **env}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stderr


def test_fsdp_pass_log_prints_what_the_backend_compiles_per_rank():
    err = _run({"FSDP_PASS_LOG": "all"}, """
import torch, fsdp_pass
from fsdp_pass.testing.fake_pg import fake_process_group
with fake_process_group(2, rank=1):
    model = torch.compile(torch.nn.Linear(4, 4), backend="vescale", options={"compiler": "aot_eager"})
    model(torch.ones(2, 4)).sum().backward()
""")
    assert "[fsdp_pass rank1] DBuffer(0: 2 params" in err, err[-2000:]
    assert "[fsdp_pass rank1] ===== rewritten graph =====" in err, err[-2000:]


def test_torch_logs_reaches_the_fsdp_pass_logger():
    """``TORCH_LOGS="+fsdp_pass"``: DEBUG, so both kinds, in torch's format (``"fsdp_pass"`` alone is
    INFO: the plan, as the levels above say)."""
    err = _run({"TORCH_LOGS": "+fsdp_pass"}, "from fsdp_pass import log\nlog.plan('bucket')\nlog.graph('forward', 'code')")
    lines = err.splitlines()
    assert any(line.startswith("I") and line.endswith("] 'bucket'") for line in lines), err[-2000:]
    assert any(line.startswith("V") and line.endswith("] ===== forward graph =====") for line in lines), err[-2000:]
