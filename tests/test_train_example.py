"""examples/train.py end to end: 2 ranks under torchrun and 1 plain process, a few steps of a small model (one launch each).

Both runs use aot_eager: a cold Inductor compile takes about a minute on a 2-core machine, more than this
test's budget; the example's Inductor path is the same backend call that tests/test_backend.py covers.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from fsdp_pass.testing.strict_script import strict_launch

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train.py"
SMALL = ["--steps", "30", "--eval-every", "15", "--eval-batches", "2", "--dim", "64", "--layers", "2",
         "--heads", "4", "--seq-len", "64", "--global-batch", "8", "--lr", "3e-3", "--compiler", "aot_eager"]
SUMMARY_ROWS = ("steps", "final train loss", "eval loss", "tokens/s", "step time median",
                "peak memory per rank", "padding", "parameters per rank")


def _run(args: list[str], timeout: float = 120, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **(env or {}))
    start = time.monotonic()
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, (
        f"{' '.join(args)} exited with {proc.returncode} after {time.monotonic() - start:.0f}s\n"
        f"--- stdout ---\n{proc.stdout[-4000:]}\n--- stderr ---\n{proc.stderr[-8000:]}"
    )
    return proc


def _result(stdout: str) -> dict:
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    assert len(lines) == 1, f"expected one RESULT line (rank 0 only), got {len(lines)}:\n{stdout[-4000:]}"
    return json.loads(lines[0][len("RESULT "):])


def _check_summary(stdout: str) -> None:
    table = stdout[stdout.index("\nsummary\n"):]
    for row in SUMMARY_ROWS:
        assert any(line.startswith(row) and "|" in line for line in table.splitlines()), f"summary lacks {row!r}:\n{table}"


def _load_example():
    spec = importlib.util.spec_from_file_location("train_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_two_ranks_and_one_process_train_the_same_model(tmp_path):
    """One torchrun launch and one plain process, with --optimizer muon (built before sharding, so no
    gather to a root): per-step losses equal, the summary and checkpoint complete."""
    ckpt = tmp_path / "ckpt"
    args = [*SMALL, "--optimizer", "muon"]
    script, strict_env = strict_launch(str(EXAMPLE), str(tmp_path / "strict"))  # NCCL's rules held
    two = _run(["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", *script, *args,
                "--checkpoint-dir", str(ckpt), "--log-json", str(tmp_path / "two.json")], env=strict_env)
    result = _result(two.stdout)
    _check_summary(two.stdout)
    assert "bucket 0:" in two.stdout and "collectives per step" in two.stdout, "plan summary missing"
    assert "loss=" in two.stderr and "tok/s=" in two.stderr, "no progress bar on stderr"
    assert "optimizer: Muon (" in two.stdout and "+ AdamW (" in two.stdout, two.stdout[-2000:]
    assert "gathers" not in two.stderr, "Muon's matrices were cut: built after sharding?\n" + two.stderr[-3000:]

    assert result["world_size"] == 2 and result["mesh"] == [2] and result["steps"] == 30
    assert 5.3 < result["first_loss"] < 5.8, result  # ~ ln 256 at initialisation
    assert result["final_train_loss"] < result["first_loss"] - 1.5, result
    assert result["eval_loss"] < result["first_loss"] - 1.5, result
    assert [step for step, _ in result["evals"]] == [15, 30]
    # Every real element lives on exactly one rank; each rank holds a (padded) shard of the same size.
    assert sum(result["parameters_per_rank"]) == result["parameters"]
    assert result["shard_elements_per_rank"] * 2 >= result["parameters"]
    assert len(result["peak_memory_bytes"]) == 2 and min(result["peak_memory_bytes"]) > 0
    assert result["tokens_per_s"] > 0 and result["step_time_median_s"] > 0

    # The checkpoint holds the whole model: reloaded into a plain model it gives the same held-out loss.
    train = _load_example()
    saved = torch.load(ckpt / "model.pt")
    model = train.Llama(train.ModelConfig(**saved["config"]))
    model.load_state_dict(saved["model"])
    _, held, _ = train.load_corpus()
    eval_loss = train.evaluate(model, held, train.parse_args(args), train.Dist())
    assert abs(eval_loss - result["eval_loss"]) < 1e-4 * result["eval_loss"], (eval_loss, result["eval_loss"])
    # The text sample was generated eagerly on the sharded model: the reloaded model writes the same bytes.
    parsed = train.parse_args(args)
    assert result["sample"].startswith(parsed.prompt) and "sample (greedy" in two.stdout
    assert train.generate(model, parsed.prompt, parsed.sample_bytes, parsed.seq_len, torch.device("cpu")) == result["sample"]

    # One plain process (no process group) trains the same model: the same loss at every step.
    one = _run([str(EXAMPLE), *args, "--no-progress", "--log-json", str(tmp_path / "one.json")])
    single = _result(one.stdout)
    _check_summary(one.stdout)
    assert single["world_size"] == 1 and single["mesh"] is None
    assert single["parameters_per_rank"] == [single["parameters"]]
    sharded, alone = (json.loads((tmp_path / f).read_text()) for f in ("two.json", "one.json"))
    assert sharded["optimizer"] == alone["optimizer"] == "muon" and len(sharded["losses"]) == len(alone["losses"]) == 30
    assert sharded["losses"] == pytest.approx(alone["losses"], rel=1e-5, abs=1e-5)
    assert single["eval_loss"] == pytest.approx(result["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("optimizer", ["muon", "shampoo", "adamw8bit", "adamw", "sgd"])
def test_build_optimizers_annotate_blocks_before_sharding(optimizer):
    """Every --optimizer builds; the structure-aware ones annotate the blocks the planner must keep whole."""
    from fsdp_pass.sharding.blocks import annotated_block

    train = _load_example()
    args = train.parse_args([*SMALL, "--optimizer", optimizer])
    model = train.Llama(train.ModelConfig(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                                          ffn=args.ffn, seq=args.seq_len))
    opts = train.build_optimizers(model, args)
    covered = [p for o in opts for g in o.param_groups for p in g["params"]]
    assert sorted(map(id, covered)) == sorted(id(p) for p in model.parameters()), "every parameter optimized once"
    blocks = {name: annotated_block(p) for name, p in model.named_parameters()}
    if optimizer == "muon":
        assert [type(o).__name__ for o in opts] == ["Muon", "AdamW"]
        muon = {id(p) for g in opts[0].param_groups for p in g["params"]}
        for name, p in model.named_parameters():
            assert (id(p) in muon) == (p.ndim == 2 and name not in ("tok_embeddings.weight", "output.weight")), name
            assert blocks[name] == (p.numel() if id(p) in muon else 1), name
    elif optimizer == "adamw8bit":
        assert all(blocks[n] == (256 if p.numel() >= 4096 else 1) for n, p in model.named_parameters()), blocks
    elif optimizer == "shampoo":
        assert blocks["layers.0.attn.wq.weight"] == 64 * 64  # 64 rows <= --shampoo-dim 128: the whole matrix
    else:
        assert set(blocks.values()) == {1}
