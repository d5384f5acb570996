"""Train a small llama-style byte-level language model, fully sharded by ``fsdp_pass``.

    torchrun --standalone --nproc-per-node 2 examples/train.py      # 2 processes, FSDP over gloo
    python examples/train.py                                        # 1 process, no process group

The model code is ordinary PyTorch; sharding happens in one line::

    model = torch.compile(model, backend="vescale", options={"mesh": mesh, ...})

The text is the Python standard library's own source code (every machine with Python has it), read as
bytes (vocabulary 256) in sorted file order and split into train and held-out files by a hash of each
file's path, so every run on the same Python sees the same data. Every step draws one global batch from a
seeded generator; each rank trains on its own slice of it (per-rank batch = global batch / world size).

At the end rank 0 prints a summary table and one machine-readable line ``RESULT {json}``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import statistics
import sys
import sysconfig
import time
import zlib
from dataclasses import asdict, dataclass
from datetime import timedelta

# One thread per rank: torchrun starts one process per core and oversubscription halves throughput.
# (Must be set before torch starts its thread pools.)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from tqdm import tqdm

import fsdp_pass  # registers the "vescale" torch.compile backend
from fsdp_pass.optim import AdamW8bit, Muon, Shampoo, muon_param_groups

# ----------------------------------------------------------------------------------------------------
# Model: a llama-style decoder (RMSNorm, rotary embeddings, grouped-query attention, SwiGLU).
# ----------------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    vocab: int = 256
    dim: int = 128
    layers: int = 4
    heads: int = 4
    kv_heads: int = 2
    ffn: int = 352
    seq: int = 128


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope(x: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    cos, sin = freqs.cos(), freqs.sin()
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = cfg.heads, cfg.kv_heads, cfg.dim // cfg.heads
        self.wq = nn.Linear(cfg.dim, cfg.heads * self.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.kv_heads * self.head_dim, bias=False)
        self.wo = nn.Linear(cfg.heads * self.head_dim, cfg.dim, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.head_dim)
        k = self.wk(x).view(b, s, self.kv_heads, self.head_dim)
        v = self.wv(x).view(b, s, self.kv_heads, self.head_dim)
        q, k = rope(q, freqs), rope(k, freqs)
        rep = self.heads // self.kv_heads
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim)
        self.ffn = SwiGLU(cfg.dim, cfg.ffn)

    def forward(self, x, freqs):
        x = x + self.attn(self.attn_norm(x), freqs)
        return x + self.ffn(self.ffn_norm(x))


class Llama(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.norm = RMSNorm(cfg.dim)
        self.output = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        head_dim = cfg.dim // cfg.heads
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        self.register_buffer("freqs", torch.outer(torch.arange(cfg.seq).float(), inv), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        nn.init.normal_(self.tok_embeddings.weight, std=1.0)
        for name, p in self.named_parameters():
            if p.dim() == 2 and name != "tok_embeddings.weight":
                nn.init.normal_(p, std=p.shape[1] ** -0.5)
        for block in self.layers:  # residual branches start small (GPT-2 style)
            block.attn.wo.weight.mul_((2 * self.cfg.layers) ** -0.5)
            block.ffn.w2.weight.mul_((2 * self.cfg.layers) ** -0.5)
        self.output.weight.mul_(0.1)  # start near the uniform distribution: loss ~ ln 256 = 5.55

    def forward(self, tokens):
        x = self.tok_embeddings(tokens)
        freqs = self.freqs[: tokens.shape[1], None, :]
        for layer in self.layers:
            x = layer(x, freqs)
        return self.output(self.norm(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1))


# ----------------------------------------------------------------------------------------------------
# Data: the standard library's source, as bytes.
# ----------------------------------------------------------------------------------------------------

_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__"}


def stdlib_files() -> list[str]:
    """Every ``.py`` file of the standard library (not site-packages), as sorted relative paths."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        for f in filenames:
            if f.endswith(".py"):
                found.append(os.path.relpath(os.path.join(dirpath, f), root))
    return sorted(found)


def load_corpus(held_out_every: int = 20, max_bytes: int | None = None) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(train bytes, held-out bytes, info). A file is held out when crc32(its path) % held_out_every == 0."""
    root = sysconfig.get_paths()["stdlib"]
    train, held = [], []
    n_train = n_held = 0
    files = stdlib_files()
    for rel in files:
        try:
            with open(os.path.join(root, rel), "rb") as f:
                data = f.read()
        except OSError:
            continue
        if zlib.crc32(rel.encode()) % held_out_every == 0:
            held.append(data)
            n_held += 1
        else:
            train.append(data)
            n_train += 1
    train_bytes, held_bytes = b"".join(train), b"".join(held)
    if max_bytes:
        train_bytes = train_bytes[:max_bytes]
    if len(held_bytes) < 1 << 16 or len(train_bytes) < 1 << 16:
        raise SystemExit(f"too little standard-library source under {root} to train on")
    info = {"root": root, "files": len(files), "train_files": n_train, "held_out_files": n_held,
            "train_bytes": len(train_bytes), "held_out_bytes": len(held_bytes)}
    as_tensor = lambda b: torch.frombuffer(bytearray(b), dtype=torch.uint8)
    return as_tensor(train_bytes), as_tensor(held_bytes), info


def global_batch(data: torch.Tensor, batch: int, seq: int, seed: int) -> torch.Tensor:
    """``batch`` windows of ``seq + 1`` bytes at seeded random offsets: the same on every rank."""
    g = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq + 1)
    return data[idx].long()


# ----------------------------------------------------------------------------------------------------
# Distributed setup and helpers
# ----------------------------------------------------------------------------------------------------


@dataclass
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def on(self) -> bool:
        return dist.is_initialized()


def setup(args) -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("--device cuda: no CUDA device is available")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    if world > 1 or "RANK" in os.environ:
        backend = "nccl" if device.type == "cuda" else "gloo"
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timedelta(minutes=10), **kwargs)
        world, rank = dist.get_world_size(), dist.get_rank()
    return Dist(rank, world, local_rank, device)


def ranks_per_node(d: Dist) -> int:
    """The processes on this rank's node, as the launcher reports them (torchrun's LOCAL_WORLD_SIZE)."""
    if "LOCAL_WORLD_SIZE" not in os.environ:
        raise SystemExit("--mesh node / --reshard-within-node: launch with torchrun, which says how many processes "
                         "run on each node (LOCAL_WORLD_SIZE)")
    return int(os.environ["LOCAL_WORLD_SIZE"])


def make_mesh(spec: str | None, d: Dist):
    """``None`` → all ranks (1-D); ``"4"`` → 1-D; ``"2x2"`` → (replicate, shard) for HSDP; ``"node"`` → HSDP
    sharded within each node and replicated across nodes, by the launcher's processes per node."""
    if spec is None:
        return init_device_mesh(d.device.type, (d.world,), mesh_dim_names=("shard",)) if d.on else None
    if spec == "node":
        spec = f"{d.world // ranks_per_node(d)}x{ranks_per_node(d)}"
    try:
        shape = tuple(int(s) for s in spec.lower().split("x"))
    except ValueError:
        raise SystemExit(f"--mesh {spec!r}: give ranks per dim, e.g. 4 or 2x2 (replicate x shard)") from None
    if len(shape) not in (1, 2) or math.prod(shape) != d.world:
        raise SystemExit(f"--mesh {spec}: needs 1 or 2 dims whose product is the world size {d.world}")
    if not d.on:
        return None
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    return init_device_mesh(d.device.type, shape, mesh_dim_names=names)


def gather_scalars(values: list[float], d: Dist) -> torch.Tensor:
    """(world, len(values)): every rank's values, on every rank (one small all-reduce)."""
    if not d.on:
        return torch.tensor([values], dtype=torch.float64)
    slots = torch.zeros(d.world, len(values), dtype=torch.float64, device=d.device)
    slots[d.rank] = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(slots)  # each rank fills its own row
    return slots.cpu()


def memory_bytes(d: Dist) -> float:
    """Peak memory of this rank: CUDA allocator peak on cuda, else peak resident set size."""
    if d.device.type == "cuda":
        return float(torch.cuda.max_memory_allocated(d.device))
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)  # Linux: KiB


def mib(b: float) -> str:
    return f"{b / 2**20:.0f}MiB"


# ----------------------------------------------------------------------------------------------------
# Training
# ----------------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    """The command line; :func:`parse_args` also fills in the derived defaults and checks the model shape."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        epilog="--compiler: inductor (the default) spends 30-75 s compiling on a 2-core CPU machine, then "
        "runs each step about twice as fast as aot_eager (measured on the default model with 2 ranks: "
        "127 vs 259 ms per step), so it wins within the default run (about 2-4 minutes on 2 cores); "
        "aot_eager starts in a few seconds and suits short runs and debugging.",
    )
    m = p.add_argument_group("model")
    m.add_argument("--dim", type=int, default=128)
    m.add_argument("--layers", type=int, default=4)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=None, help="grouped-query attention (default: heads // 2)")
    m.add_argument("--ffn", type=int, default=None, help="SwiGLU hidden size (default: ~8/3 dim, a multiple of 32)")
    m.add_argument("--seq-len", type=int, default=128)
    t = p.add_argument_group("training")
    t.add_argument("--global-batch", type=int, default=16, help="sequences per step over all ranks")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warmup, cosine decay)")
    t.add_argument("--warmup", type=int, default=None, help="warmup steps (default: steps // 20)")
    t.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="muon: Muon on hidden matrices + AdamW on the rest; shampoo, adamw8bit: fsdp_pass.optim")
    t.add_argument("--weight-decay", type=float, default=0.1)
    t.add_argument("--muon-lr", type=float, default=0.02, help="--optimizer muon: peak lr of the Muon matrices "
                   "(--lr is the AdamW part's)")
    t.add_argument("--shampoo-dim", type=int, default=128,
                   help="--optimizer shampoo: max_preconditioner_dim (rows and columns of one block)")
    t.add_argument("--shampoo-every", type=int, default=10,
                   help="--optimizer shampoo: precondition_frequency (steps between inverse-root refreshes)")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping (0: off)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--eval-every", type=int, default=100, help="evaluate every N steps (0: only at the end)")
    t.add_argument("--eval-batches", type=int, default=4, help="fixed held-out global batches per evaluation")
    t.add_argument("--max-data-bytes", type=int, default=None, help="use only the first N training bytes")
    s = p.add_argument_group("sharding and compilation")
    s.add_argument("--mesh", default=None, help="ranks per mesh dim: 4 (FSDP) or 2x2 (HSDP: replicate x shard); "
                   "node: HSDP, sharded within each node and replicated across nodes (torchrun's LOCAL_WORLD_SIZE)")
    s.add_argument("--compiler", choices=("inductor", "aot_eager"), default="inductor",
                   help="what compiles the sharded graphs (see below)")
    s.add_argument("--no-reshard", action="store_true", help="keep gathered parameters from forward to backward")
    s.add_argument("--reshard-within-node", action="store_true",
                   help="after forward keep 1/k of each bucket, k the processes per node (torchrun's LOCAL_WORLD_SIZE): "
                   "backward gathers within the node, not across nodes (reshard_after_forward=k)")
    s.add_argument("--mp", choices=("none", "bf16"), default="none",
                   help="bf16: gather and compute in bf16, reduce gradients in fp32")
    s.add_argument("--bucket-size", type=int, default=None, help="most elements per communication bucket")
    s.add_argument("--fp8", action="store_true",
                   help="all-gather the block weights as FP8 codes + 128x128 tile scales (docs/fp8.md)")
    s.add_argument("--quantized-reduce", choices=("nearest", "stochastic"), default=None,
                   help="reduce-scatter gradients as int8 codes + one scale per 128 elements, rounding to nearest "
                        "or stochastically (options['quantized_reduce'])")
    s.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: NCCL, one GPU per rank (cuda:LOCAL_RANK)")
    s.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    o = p.add_argument_group("output")
    o.add_argument("--checkpoint-dir", default=None, help="rank 0 saves the full model state dict here at the end")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    o.add_argument("--sample-bytes", type=int, default=160, help="bytes of text generated after training (0: none)")
    o.add_argument("--prompt", default="def ", help="what the generated sample continues")
    o.add_argument("--log-json", default=None, metavar="PATH",
                   help="rank 0 writes the RESULT json plus every step's loss ('losses') and the arguments here")
    return p


def parse_args(argv=None) -> argparse.Namespace:
    p = build_parser()
    args = p.parse_args(argv)
    if args.kv_heads is None:
        args.kv_heads = max(1, args.heads // 2)
    if args.ffn is None:
        args.ffn = max(32, 32 * round(8 * args.dim / 3 / 32))
    if args.warmup is None:
        args.warmup = max(1, args.steps // 20)
    if args.dim % args.heads or args.heads % args.kv_heads or (args.dim // args.heads) % 2:
        p.error("--dim must be a multiple of --heads with an even head size, and --heads of --kv-heads")
    return args


OPTIMIZERS = ("adamw", "sgd", "muon", "shampoo", "adamw8bit")


def build_optimizers(model: nn.Module, args) -> list[torch.optim.Optimizer]:
    """The optimizer(s) of ``--optimizer``; each gets the same lr schedule (a factor on its own peak lr)."""
    wd = args.weight_decay
    if args.optimizer == "adamw":
        return [torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=wd)]
    if args.optimizer == "sgd":
        return [torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9, weight_decay=wd)]
    if args.optimizer == "muon":
        # Hidden 2-D weights to Muon (orthogonalized whole, in fp32: bf16 matmul is ~25x slower on CPUs);
        # embeddings, output head and norms to AdamW. Named pairs let the optimizers name parameters.
        matrices, rest = muon_param_groups(model, exclude=("tok_embeddings", "output"))
        return [Muon(matrices, lr=args.muon_lr, weight_decay=wd, ns_dtype=torch.float32),
                torch.optim.AdamW(rest, lr=args.lr, betas=(0.9, 0.95), weight_decay=wd)]
    if args.optimizer == "shampoo":
        return [Shampoo(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=wd,
                        max_preconditioner_dim=args.shampoo_dim, precondition_frequency=args.shampoo_every)]
    return [AdamW8bit(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=wd)]


def describe_optimizer(opt: torch.optim.Optimizer) -> str:
    params = [p for g in opt.param_groups for p in g["params"]]
    return f"{type(opt).__name__} ({len(params)} tensors, {sum(p.numel() for p in params):,} elements)"


def lr_at(step: int, args) -> float:
    """Linear warmup to 1, then cosine decay to 0.1 (a factor on --lr)."""
    if step < args.warmup:
        return (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))


@torch.no_grad()
def evaluate(compiled, held: torch.Tensor, args, d: Dist) -> float:
    """Mean loss over --eval-batches fixed held-out global batches, averaged over ranks."""
    per_rank = args.global_batch // d.world
    total = torch.zeros((), dtype=torch.float64, device=d.device)
    for i in range(args.eval_batches):
        batch = global_batch(held, args.global_batch, args.seq_len, seed=10_000_000 + i)
        mine = batch[d.rank * per_rank:(d.rank + 1) * per_rank].to(d.device)
        total += lm_loss(compiled(mine[:, :-1]), mine[:, 1:]).double()
    if d.on:
        dist.all_reduce(total)
    return total.item() / (args.eval_batches * d.world)


@torch.no_grad()
def generate(model: nn.Module, prompt: str, n: int, seq_len: int, device: torch.device) -> str:
    """Greedy byte-by-byte continuation of ``prompt``, run eagerly on the sharded ``model`` (every rank)."""
    tokens = torch.tensor([list(prompt.encode())], dtype=torch.long, device=device)
    for _ in range(n):
        logits = model(tokens[:, -seq_len:])
        tokens = torch.cat([tokens, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    return bytes(tokens[0].tolist()).decode("utf-8", errors="replace")


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    d = setup(args)
    log = (lambda *a, **k: tqdm.write(" ".join(map(str, a)), file=sys.stdout)) if d.rank == 0 else (lambda *a, **k: None)
    if args.global_batch % d.world:
        raise SystemExit(f"--global-batch {args.global_batch} must be a multiple of the world size {d.world}")
    per_rank = args.global_batch // d.world
    mesh = make_mesh(args.mesh, d)

    train, held, data_info = load_corpus(max_bytes=args.max_data_bytes)
    cfg = ModelConfig(dim=args.dim, layers=args.layers, heads=args.heads, kv_heads=args.kv_heads,
                      ffn=args.ffn, seq=args.seq_len)
    torch.manual_seed(args.seed)  # the same initial model on every rank
    model = Llama(cfg).to(d.device)
    n_params = sum(p.numel() for p in model.parameters())

    # Build the optimizers BEFORE the model is sharded (the first call of the compiled model): Muon, Shampoo
    # and AdamW8bit annotate the blocks their math needs whole (set_block), the planner keeps those blocks
    # on one rank, and their steps need no communication. (AdamW and SGD work either way: sharding swaps
    # the parameters in place.)
    opts = build_optimizers(model, args)
    scheds = [torch.optim.lr_scheduler.LambdaLR(o, lambda step: lr_at(step, args)) for o in opts]

    reshard = not args.no_reshard
    if args.reshard_within_node and ranks_per_node(d) < d.world:  # on one node, within the node is True
        reshard = ranks_per_node(d)
    options = {"compiler": args.compiler, "reshard_after_forward": reshard}
    if mesh is not None:
        options["mesh"] = mesh
    if args.mp == "bf16":
        options["mp_policy"] = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32}
    if args.bucket_size:
        options["bucket_size"] = args.bucket_size
    if args.fp8:
        options["fp8_all_gather"] = True
    if args.quantized_reduce:
        options["quantized_reduce"] = {"bits": 8, "block": 128, "rounding": args.quantized_reduce}
    compiled = torch.compile(model, backend="vescale", options=options)

    mesh_text = "none (1 process)" if mesh is None else "x".join(map(str, mesh.shape)) + f" {mesh.mesh_dim_names}"
    log(f"fsdp_pass example: {d.world} rank(s) on {d.device.type}, mesh {mesh_text}, compiler {args.compiler}, "
        f"mp {args.mp}, reshard_after_forward {reshard}")
    log(f"model: llama dim {cfg.dim} layers {cfg.layers} heads {cfg.heads}/{cfg.kv_heads} ffn {cfg.ffn} "
        f"seq {cfg.seq} vocab {cfg.vocab}: {n_params:,} parameters")
    log(f"data: {data_info['train_files']} train / {data_info['held_out_files']} held-out stdlib files "
        f"({data_info['train_bytes']:,} / {data_info['held_out_bytes']:,} bytes) from {data_info['root']}")
    log(f"batch: {args.global_batch} x {args.seq_len} tokens per step, {per_rank} sequences per rank")
    log("optimizer: " + " + ".join(describe_optimizer(o) for o in opts))

    tokens_per_step = args.global_batch * args.seq_len
    step_times: list[float] = []
    losses: list[float] = []
    evals: list[tuple[int, float]] = []
    mem = torch.zeros(d.world, dtype=torch.float64)
    bar = tqdm(total=args.steps, disable=d.rank != 0 or args.no_progress, desc="train", unit="step",
               dynamic_ncols=True, mininterval=0.5, file=sys.stderr)
    t_start = time.perf_counter()
    for step in range(args.steps):
        t0 = time.perf_counter()
        batch = global_batch(train, args.global_batch, args.seq_len, seed=args.seed * 1_000_003 + step)
        mine = batch[d.rank * per_rank:(d.rank + 1) * per_rank].to(d.device, non_blocking=True)
        loss = lm_loss(compiled(mine[:, :-1]), mine[:, 1:])
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.clip) if args.clip > 0 else None
        for o, sched in zip(opts, scheds):
            o.step()
            sched.step()
            o.zero_grad()
        # One small all-reduce per step: every rank's loss and memory (the .item() also syncs for timing).
        stats = gather_scalars([loss.item(), memory_bytes(d)], d)
        step_times.append(time.perf_counter() - t0)
        losses.append(stats[:, 0].mean().item())
        mem = torch.maximum(mem, stats[:, 1])

        if step == 0:
            log(f"first step (compile included): {step_times[0]:.1f}s; the plan:")
            log(fsdp_pass.explain(model, print_output=False).plan_text())
        recent = step_times[1:][-20:] or step_times
        postfix = {"loss": f"{losses[-1]:.3f}", "tok/s": f"{tokens_per_step / statistics.mean(recent):,.0f}",
                   "mem": "/".join(mib(m) for m in mem.tolist())}
        if grad_norm is not None:
            postfix["gnorm"] = f"{grad_norm.item():.2f}"
        bar.set_postfix(postfix, refresh=False)
        bar.update(1)
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            evals.append((step + 1, evaluate(compiled, held, args, d)))
            log(f"step {step + 1}: train loss {losses[-1]:.4f}, held-out loss {evals[-1][1]:.4f}")
    bar.close()
    train_time = time.perf_counter() - t_start
    evals.append((args.steps, evaluate(compiled, held, args, d)))

    # The summary: measured after the first step (which includes compilation).
    timed = step_times[1:] or step_times
    explanation = fsdp_pass.explain(model, print_output=False)
    padding = sum(b.layout.padding for b in explanation.buffers)
    global_elems = sum(b.layout.global_size for b in explanation.buffers)
    shard_elems = sum(b.layout.shard_size for b in explanation.buffers)
    local_params = sum(p.to_local().numel() if isinstance(p, fsdp_pass.RaggedShardTensor) else p.numel()
                       for p in model.parameters())
    per_rank_params = gather_scalars([local_params, memory_bytes(d)], d)
    mem = torch.maximum(mem, per_rank_params[:, 1])
    result = {
        "world_size": d.world,
        "mesh": None if mesh is None else list(mesh.shape),
        "reshard_after_forward": reshard,
        "compiler": args.compiler,
        "steps": args.steps,
        "first_loss": losses[0],
        "final_train_loss": statistics.mean(losses[-10:]),
        "last_loss": losses[-1],
        "eval_loss": evals[-1][1],
        "evals": evals,
        "tokens_per_s": tokens_per_step * len(timed) / sum(timed),
        "step_time_median_s": statistics.median(timed),
        "first_step_s": step_times[0],
        "train_time_s": train_time,
        "peak_memory_bytes": mem.tolist(),
        "padding_elements": padding,
        "padding_fraction": padding / max(global_elems, 1),
        "parameters": n_params,
        "parameters_per_rank": [int(x) for x in per_rank_params[:, 0].tolist()],
        "shard_elements_per_rank": shard_elems,
        "buckets": len(explanation.buffers),
        "optimizer": args.optimizer,
    }

    if args.sample_bytes:
        # The original module, called without torch.compile: its sharded parameters are gathered bucket by
        # bucket for each call (the eager path), so this is a collective every rank runs.
        result["sample"] = generate(model, args.prompt, args.sample_bytes, args.seq_len, d.device)

    if args.checkpoint_dir:
        state = fsdp_pass.get_full_state_dict(model)  # every rank takes part in the gathers; rank 0 gets it
        if d.rank == 0:
            os.makedirs(args.checkpoint_dir, exist_ok=True)
            path = os.path.join(args.checkpoint_dir, "model.pt")
            torch.save({"model": state, "config": asdict(cfg), "args": vars(args), "step": args.steps}, path)
            result["checkpoint"] = path
            log(f"saved the full model ({len(state)} tensors) to {path}")

    if d.rank == 0:
        rows = [
            ("steps", f"{args.steps} ({d.world} rank(s), {tokens_per_step:,} tokens/step)"),
            ("final train loss", f"{result['final_train_loss']:.4f} (mean of last 10; first step {losses[0]:.4f})"),
            ("eval loss", f"{result['eval_loss']:.4f} ({args.eval_batches} held-out batches)"),
            ("tokens/s", f"{result['tokens_per_s']:,.0f} (all ranks, after the first step)"),
            ("step time median", f"{result['step_time_median_s'] * 1000:.1f} ms (first step {step_times[0]:.1f} s)"),
            ("peak memory per rank", " ".join(f"r{r}:{mib(m)}" for r, m in enumerate(result["peak_memory_bytes"]))
             + (" (CUDA allocator)" if d.device.type == "cuda" else " (RSS)")),
            ("padding", f"{padding:,} elements ({result['padding_fraction']:.2%}) in {len(explanation.buffers)} buckets"),
            ("parameters per rank", " ".join(f"r{r}:{n:,}" for r, n in enumerate(result["parameters_per_rank"]))
             + f" of {n_params:,} (shard {shard_elems:,} elements incl. padding)"),
        ]
        width = max(len(k) for k, _ in rows)
        line = "-" * (width + 3 + max(len(v) for _, v in rows))
        print("\n".join(["", "summary", line] + [f"{k:<{width}} | {v}" for k, v in rows] + [line]), flush=True)
        if args.sample_bytes:
            print(f"\nsample (greedy, {args.sample_bytes} bytes after {args.prompt!r}):\n{result['sample']}\n", flush=True)
        print("RESULT " + json.dumps(result), flush=True)
        if args.log_json:
            with open(args.log_json, "w") as f:
                json.dump({**result, "losses": losses, "step_times_s": step_times, "args": vars(args)}, f)
    if d.on:
        dist.barrier()
        dist.destroy_process_group()
    return result


if __name__ == "__main__":
    main()
