"""Per-layer parameter shapes of the benchmarked models (the tables live in ``fsdp_pass.plan.model_configs``).

The padding benchmark covers the three large public configs: Llama-3-70B, GPT-OSS-120B and
DeepSeek-V3 (see ``fsdp_pass/plan/model_configs.py`` for their shapes and sources). A model is a list of
*units* ``(unit_name, [(param_name, shape), ...])``: the embedding, each transformer layer, the head.

Run ``python benchmarks/model_shapes.py`` to print the totals.
"""

from __future__ import annotations

import sys
from pathlib import Path

try:
    import fsdp_pass  # noqa: F401  (installed, or on PYTHONPATH)
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fsdp_pass.plan import model_configs  # noqa: E402
from fsdp_pass.plan.model_configs import QUOTED_PARAMS, distinct_units, model_units, representative_layer, total_params, unit_numel

__all__ = ["MODELS", "QUOTED_PARAMS", "distinct_units", "model_units", "representative_layer", "total_params",
           "unit_numel"]

BENCHMARKED = ("llama3-70b", "gpt-oss-120b", "deepseek-v3")
MODELS = {name: model_configs.MODELS[name] for name in BENCHMARKED}

if __name__ == "__main__":
    for model in MODELS:
        total = total_params(model)
        parts = ", ".join(f"{name} x{count} ({unit_numel(p) / 1e6:,.1f}M each)" for name, p, count in distinct_units(model))
        print(f"{model:14s} {total / 1e9:8.2f}B parameters (quoted ~{QUOTED_PARAMS[model] / 1e9:.1f}B): {parts}")
