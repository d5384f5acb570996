"""Models Dynamo cannot trace whole train like one process on 2 ranks ([Note: parameters no graph reads]).

One process group runs every case: a block that breaks the graph with a ``print``, a logging call, a
``.item()``, a branch on a tensor (not taken on the first step) and a side effect inside
``torch.utils.checkpoint`` (aot_eager: the eager path is what these exercise), then Hugging Face
gradient checkpointing under Inductor, with the graph break as it is and with Dynamo's switch that
traces the checkpointed layers (``skip_fwd_side_effects_in_bwd_under_checkpoint``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import fsdp_pass
from fsdp_pass.testing.models import GRAPH_BREAKS, BreakingStack, lm_loss, tiny_hf_llama
from fsdp_pass.testing.spawn import run_distributed
from parity import Case, run_case

TOLERANCE = 1e-5  # fp32, relative; reached values are printed


def _flagged_batch(step: int, batch: int):
    """Random inputs whose column 0 is the step's flag (0, 1, 0, ...), shared by every sample."""
    g = torch.Generator().manual_seed(300 + step)
    x = torch.randn(batch, 12, generator=g)
    x[:, 0] = step % 2
    return x, torch.randn(batch, 3, generator=g)


def _tokens(step: int, batch: int):
    g = torch.Generator().manual_seed(400 + step)
    tokens = torch.randint(0, 61, (batch, 8), generator=g)
    return tokens, tokens


def _break_case(kind: str) -> Case:
    return Case(f"break/{kind}", lambda: BreakingStack(kind), _flagged_batch, F.mse_loss, steps=4,
                options={"compiler": "aot_eager"}, tolerance=TOLERANCE)


def _hf_checkpointing_case() -> Case:
    return Case("hf-llama/gradient-checkpointing/inductor", lambda: tiny_hf_llama(layers=2, gradient_checkpointing=True),
                _tokens, lambda out, t: lm_loss(out.logits, t), steps=3, options={"compiler": "inductor"},
                tolerance=TOLERANCE, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1))


def _eager_lines(model) -> list[str]:
    text = fsdp_pass.explain(model, print_output=False).plan_text()
    return [line for line in text.splitlines() if "outside the compiled graphs" in line or "graph break" in line]


def _train_every_case(rank: int, world: int) -> dict:
    results = {}
    for kind in GRAPH_BREAKS:
        results[kind] = run_case(_break_case(kind), rank, world)
    for skip in (False, True):
        with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=skip):
            results[f"hf skip={skip}"] = run_case(_hf_checkpointing_case(), rank, world)
    return results


def test_graph_breaks_train_like_one_process():
    results = run_distributed(_train_every_case, 2, timeout=900)
    print(results[0])
