"""Per-rank memory of the fine-tuning flow: meta build → fully_shard → dcp.load of a save_pretrained checkpoint.

One process writes a Hugging Face Llama checkpoint with ``save_pretrained`` (safetensors). Then
``--world`` ranks each build the model on the meta device, shard it with ``fsdp_pass.fully_shard``
(which runs the Hugging Face init into the shards, one module at a time) and read their pieces with
``dcp.load(..., HuggingFaceStorageReader)``. Each rank reports, per phase:

* ``peak_alloc``: the profiler's peak of live CPU allocations made during the phase (allocations
  counted in the allocating op's self memory, in time order; frees included), in MB, leaving out
  the checkpoint files themselves: safetensors (0.8) opens a file as one memory-mapped storage of
  the file's size, which the profiler reports as an allocation although only the pages read become
  resident (and they are file-backed, reclaimable page cache). ``peak_alloc_with_maps`` keeps them;
* ``anon_peak``: the peak of the process's anonymous resident memory (``RssAnon``, sampled every
  millisecond by a thread) minus its value just before the phase: what the phase really holds;
* ``rss_peak``: the resident-set high-water mark (``VmHWM``) minus the resident size before the
  phase; it also counts the file pages of the checkpoint the reader touched (an upper bound);

next to the rank's shards (what must stay), the largest parameter and the whole model.

    python benchmarks/meta_load_memory.py --world 2 --json meta_load_memory.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _measure import status_kib  # noqa: E402

MB = 1e6


def _config(args):
    import transformers

    return transformers.LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.heads,
        tie_word_embeddings=False, dtype="float32",
    )


def _reset_hwm() -> None:
    try:  # Linux: writing 5 to clear_refs resets VmHWM to the current RSS
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def _peak_alloc(prof, mapped_sizes=frozenset()) -> int:
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        if e.name == "[memory]" and abs(e.self_cpu_memory_usage) in mapped_sizes:
            continue  # a memory-mapped checkpoint file (see the module docstring)
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def _phase(fn, mapped_sizes=frozenset()):
    import threading

    from torch.profiler import ProfilerActivity, profile

    rss_before = status_kib("VmRSS") * 1024
    anon_before = status_kib("RssAnon") * 1024
    anon = [anon_before]
    done = threading.Event()

    def sample():
        while not done.wait(0.001):
            anon[0] = max(anon[0], status_kib("RssAnon") * 1024)

    sampler = threading.Thread(target=sample, daemon=True)
    _reset_hwm()
    sampler.start()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    seconds = time.perf_counter() - start
    done.set()
    sampler.join()
    anon[0] = max(anon[0], status_kib("RssAnon") * 1024)
    return {"peak_alloc": _peak_alloc(prof, mapped_sizes), "peak_alloc_with_maps": _peak_alloc(prof),
            "anon_peak": anon[0] - anon_before, "rss_peak": status_kib("VmHWM") * 1024 - rss_before,
            "seconds": seconds}


def _worker(rank: int, world: int, path: str, args) -> dict:
    import torch.distributed.checkpoint as dcp
    import transformers
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    import fsdp_pass
    from fsdp_pass.tensor.ragged_tensor import bucket_of

    out: dict = {}
    holder: dict = {}

    def build():
        with torch.device("meta"):
            holder["model"] = transformers.AutoModelForCausalLM.from_config(_config(args))

    out["build"] = _phase(build)
    model = holder["model"]
    out["fully_shard"] = _phase(lambda: fsdp_pass.fully_shard(model))
    files = frozenset(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))
    out["dcp.load"] = _phase(lambda: dcp.load(model.state_dict(), storage_reader=HuggingFaceStorageReader(path)),
                             files)
    buffers = {id(b): b for b in (bucket_of(p)[0] for p in model.parameters())}.values()
    out["shards"] = sum(b.layout.shard_size * b.shard.element_size() for b in buffers)
    out["largest_param"] = max(p.numel() * p.element_size() for p in model.parameters())
    out["model"] = sum(p.numel() * p.element_size() for p in model.parameters())
    # every element landed: compare a checksum of the loaded model with the checkpoint's
    out["checksum"] = float(sum(p.detach().to_local().double().sum() for p in model.parameters()))
    return out


def build_parser() -> argparse.ArgumentParser:
    """This script's command line (tests/test_docs.py builds it to check the commands the docs show)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--json", default="meta_load_memory.json")
    return parser


def main() -> None:
    args = build_parser().parse_args()

    import transformers

    from fsdp_pass.testing.spawn import run_distributed

    with tempfile.TemporaryDirectory() as root:
        start = time.perf_counter()
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(_config(args))
        params = sum(p.numel() for p in model.parameters())
        model.save_pretrained(root)
        expected = float(sum(p.detach().double().sum() for p in model.parameters()))
        del model
        written = time.perf_counter() - start
        results = run_distributed(_worker, args.world, root, args, timeout=1800, pg_timeout=1200)

    total = sum(r["checksum"] for r in results)
    assert abs(total - expected) <= 1e-6 * max(1.0, abs(expected)), (total, expected)
    print(f"Llama {params / 1e6:.0f}M parameters ({params * 4 / MB:.0f} MB fp32), {args.world} ranks; checkpoint "
          f"written by save_pretrained in {written:.0f} s; loaded checksum matches")
    print(f"{'rank':>4} {'phase':>12} {'peak alloc':>10} {'(+maps)':>8} {'anon peak':>9} {'RSS peak':>8} {'s':>6} | "
          f"{'shards':>7} {'largest param':>13} {'model':>7}   (MB)")
    for rank, r in enumerate(results):
        for phase in ("build", "fully_shard", "dcp.load"):
            m = r[phase]
            print(f"{rank:>4} {phase:>12} {m['peak_alloc'] / MB:>10.1f} {m['peak_alloc_with_maps'] / MB:>8.1f} "
                  f"{m['anon_peak'] / MB:>9.1f} {m['rss_peak'] / MB:>8.1f} {m['seconds']:>6.1f} | "
                  f"{r['shards'] / MB:>7.1f} {r['largest_param'] / MB:>13.1f} {r['model'] / MB:>7.1f}")
    with open(args.json, "w") as f:
        json.dump({"parameters": params, "world": args.world, "config": vars(args), "ranks": results}, f, indent=1)


if __name__ == "__main__":
    main()
