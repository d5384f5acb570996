import os
import sys

import pytest

# Multi-process tests spawn workers that import helpers from this folder.
sys.path.insert(0, os.path.dirname(__file__))
# Keep each test process on one thread: the machine has 2 cores and xdist runs 2 workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture
def four_fake_ranks():
    """A single-process fake process group of 4 ranks (this process is rank 0), for planning and tracing."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    torch._dynamo.reset()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    yield
    dist.destroy_process_group()
