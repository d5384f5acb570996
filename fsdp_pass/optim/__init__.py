"""Structure-aware optimizers for RaggedShard parameters (and plain tensors on one process).

Each needs some blocks of a parameter whole (Muon: the matrix; Shampoo: panels of rows; AdamW8bit:
256-element quantization blocks). Built before sharding, they annotate their parameters so the
planner keeps those blocks on one rank and a step needs no communication; on a layout that cuts
them, they gather to a root rank per step and warn once. Results equal a single-process run bitwise.
"""

from .adamw8bit import AdamW8bit
from .muon import Muon, muon_param_groups
from .shampoo import Shampoo

__all__ = ["AdamW8bit", "Muon", "Shampoo", "muon_param_groups"]
