import os
import sys

import pytest

# Spawned ranks import the test modules (and parity.py) by name from this folder.
sys.path.insert(0, os.path.dirname(__file__))
# Keep each test process on one thread: the machine has 2 cores and xdist runs 2 workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def four_fake_ranks():
    """A single-process fake process group of 4 ranks (this process is rank 0), for planning and tracing."""
    import torch

    from fsdp_pass.testing.fake_pg import fake_process_group

    torch._dynamo.reset()
    with fake_process_group(4):
        yield
