import os
import sys

# Multi-process tests spawn workers that import helpers from this folder.
sys.path.insert(0, os.path.dirname(__file__))
# Keep each test process on one thread: the machine has 2 cores and xdist runs 2 workers.
os.environ.setdefault("OMP_NUM_THREADS", "1")
