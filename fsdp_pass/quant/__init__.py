"""Block-wise weight quantization ops (FP8 e4m3 / INT8, 128×128 tiles) that trace under torch.compile."""

from .fp8 import *  # noqa: F403  (the public names are fp8.__all__)
from .fp8 import __all__  # noqa: F401
