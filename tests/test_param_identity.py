"""Parameters are known by identity, whatever source form Dynamo reaches them through
([Note: parameters known by identity] in compile/passes/detect.py): each form trains like one process
on 2 gloo ranks in every compile order, and two parameters can never share a name or a bucket slot."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import fsdp_pass
from fsdp_pass.testing.source_forms import SOURCE_FORMS
from fsdp_pass.testing.spawn import run_distributed
from parity import Case, run_case

pytestmark = pytest.mark.compat  # relies on torch internals: run on each supported torch release

WORLD = 2
TOLERANCE = 1e-5  # fp32, relative (Frobenius)


def _batch(step: int, batch: int):
    g = torch.Generator().manual_seed(500 + step)
    return torch.randn(batch, 8, generator=g), torch.randn(batch, 8, generator=g)


def _fully_shard_then_compile(model: nn.Module, options: dict):
    fsdp_pass.fully_shard(model)
    return torch.compile(model, backend="vescale", options=options)


def _per_block(model: nn.Module, options: dict):
    fsdp_pass.fully_shard(model)  # default buckets: a small model's blocks share them with modules outside the block
    for block in model.blocks():
        block.compile(backend="vescale", options=options)
    return model


ORDERS = {"compile": None, "fully_shard_then_compile": _fully_shard_then_compile, "per_block": _per_block}


def _forms(rank: int, world: int, form: str) -> None:
    for order, prepare in ORDERS.items():
        case = Case(f"{form}/{order}", SOURCE_FORMS[form], _batch, F.mse_loss, steps=3, prepare=prepare,
                    options={"compiler": "aot_eager"}, tolerance=TOLERANCE)
        result = run_case(case, rank, world)
        if rank == 0:
            print(f"{case.name}: loss {result['loss_rel']:.1e}, parameters {result['param_rel']:.1e}")


@pytest.mark.parametrize("form", sorted(SOURCE_FORMS))
def test_every_source_form_trains_like_one_process_in_every_order(form):
    run_distributed(_forms, WORLD, form)


class _GetattrNet(nn.Module):
    """The smallest model that once trained silently wrong: ``a`` computed with ``b``'s weights."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 8)
        self.b = nn.Linear(8, 8)

    def __getattr__(self, name: str):
        return super().__getattr__(name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))


class _Unregistered(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        object.__setattr__(self, "loose", nn.Parameter(torch.ones(8)))  # bypasses registration

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.loose


def _one_process_checks(rank: int, world: int) -> None:
    from fsdp_pass.compile.backend import records
    from fsdp_pass.compile.passes.detect import find_parameters

    torch.manual_seed(0)
    net, x = _GetattrNet(), torch.randn(4, 8)
    expected = net(x).detach()
    fsdp_pass.fully_shard(net, bucket_size=64)  # small buckets: each layer's parameters apart
    got = torch.compile(net, backend="vescale", options={"compiler": "aot_eager"})(x)
    assert torch.equal(got, expected), (got - expected).abs().max()
    names = {n for r in records() for b in r.buffers for n in b.names}
    assert names == {"a.weight", "a.bias", "b.weight", "b.bias"}, names

    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"not among the named_parameters\(\) of _Unregistered .*register it"):
        torch.compile(_Unregistered(), backend="vescale", options={"compiler": "aot_eager"})(x)

    # the assertion where the mapping is built: two objects under one name never pass
    gm = torch.fx.symbolic_trace(nn.Bilinear(2, 2, 2))
    params = [nn.Parameter(torch.ones(2)), nn.Parameter(torch.zeros(2))]
    with pytest.raises(RuntimeError, match=r"two different parameters .* both named 'w'"):
        find_parameters(gm, params, names={0: "w", 1: "w"})


def test_a_module_with_getattr_trains_right_and_an_unnamed_parameter_is_refused():
    run_distributed(_one_process_checks, 1)
