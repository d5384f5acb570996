#!/usr/bin/env bash
# GPU check, for a machine with one CUDA GPU: the paths of fsdp_pass that run differently on CUDA than on CPU
# (docs/reliability.md, "What runs differently on GPU"), in under 8 minutes. Steps, each a fresh launch with
# its own time limit (`timeout`), each printing PASS/FAIL with a reason (and the items it checked):
#
#   environment      torch, CUDA, the GPU, NCCL, Triton (Inductor's GPU code generator)
#   nccl             1 rank, NCCL, init_process_group(device_id=cuda:0): split_group, shard rows over NCCL,
#                    Inductor (Triton) on a compiled llama against eager, a non_blocking copy from pinned
#                    memory, a meta-device model sharded onto the GPU, CUDA graphs refused
#   nccl-shared-gpu  2 ranks, one GPU, NCCL: informational (NCCL is expected to refuse it)
#   gloo-cuda        2 ranks on the GPU, gloo for CUDA tensors: do the collectives fsdp_pass issues give the
#                    right values? Informational; step nodes runs only if they do
#   cuda-only        2 ranks on the GPU, a default group with a backend for CUDA tensors only (cuda:gloo, as
#                    nccl): group split, shard rows, the compile's agreement check must use CUDA tensors;
#                    fully_shard(meta model) without a mesh
#   nodes            4 ranks on one GPU as 2 nodes of 2 (two torchrun agents: GROUP_RANK, LOCAL_WORLD_SIZE),
#                    the default group bound to the GPU: two-level collectives, reshard_after_forward=2 node
#                    groups, compiled training against one process, FP8 all-gather, quantized reduction
#                    (needs step gloo-cuda to pass: otherwise it is reported as not run, with the reason)
#   bench            1 rank, NCCL: fsdp_pass (Inductor, bf16) against FSDP2, step time and peak memory
#
# One GPU limits what runs: NCCL refuses two ranks on one device ("Duplicate GPU detected"; the
# nccl-shared-gpu step shows what this machine's NCCL does), so the NCCL steps run one rank, and the
# multi-rank steps run gloo for their CUDA tensors (cuda-only: cuda:gloo, nodes: cpu:gloo,cuda:gloo). NCCL's
# collectives between ranks, its split of a communicator of several ranks and several GPUs are NOT covered
# here: they need 2+ GPUs.
#
# Usage:
#   bash benchmarks/gpu_check.sh                  # on a machine with a CUDA GPU
#   bash benchmarks/gpu_check.sh --cpu-dry-run    # the same steps on CPU/gloo, small: the script's plumbing
#   bash benchmarks/gpu_check.sh --layers 8       # arguments after the options above go to the bench step
#   GPU_CHECK_STEPS="nccl nodes" bash benchmarks/gpu_check.sh   # only these steps (a rerun)
# Exit status: 0 all steps run passed (or no GPU here: nothing was checked, and it says so), 1 a step failed.
# Logs and a summary go to benchmarks/results/gpu_check/ (bench's JSON to benchmarks/results/gpu_check.json).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

DEVICE=cuda
if [[ "${1:-}" == "--cpu-dry-run" ]]; then
    DEVICE=cpu
    shift
fi
BENCH_ARGS=("$@")

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"  # NCCL's own reason when it refuses something lands in the logs

if ! probe=$(python -c 'import torch; print(int(torch.cuda.is_available()), torch.__version__, torch.version.cuda)' 2>&1); then
    echo "FAIL environment: python cannot import torch: ${probe##*$'\n'}"
    exit 1
fi
read -r has_gpu torch_version cuda_build <<<"${probe##*$'\n'}"
if [[ "$DEVICE" == cuda && "$has_gpu" != 1 ]]; then
    echo "gpu_check: no CUDA GPU on this machine (torch $torch_version, CUDA build: $cuda_build): nothing was" \
         "checked. Run it where a GPU is lent; 'bash benchmarks/gpu_check.sh --cpu-dry-run' runs the same steps" \
         "on CPU/gloo to check the script itself."
    exit 0
fi

LOGS="$ROOT/benchmarks/results/gpu_check"
rm -rf "$LOGS"
mkdir -p "$LOGS"
export TORCHINDUCTOR_CACHE_DIR="$LOGS/inductor_cache"  # a cold cache: Inductor generates every kernel here
SUMMARY="$LOGS/summary.txt"
if [[ "$DEVICE" == cuda ]]; then
    TOTAL_S=${GPU_CHECK_TOTAL_S:-465}  # every step together, under 8 minutes with the launches' slack
    COMPILER=inductor
    BENCH_DEFAULTS=(--layers 4)  # 4 of the bench's 8 default layers: its two Inductor compiles fit the time
else
    TOTAL_S=${GPU_CHECK_TOTAL_S:-900}  # 2 CPU cores compile slowly; the dry run checks plumbing, not time
    COMPILER=aot_eager
    BENCH_DEFAULTS=(--dim 64 --layers 1 --heads 4 --vocab 128 --batch 2 --seq 16 --warmup 1 --steps 2)
fi
START=$SECONDS
FAILED=()
SKIPPED=()
{
    echo "gpu_check $(date -u +%Y-%m-%dT%H:%M:%SZ) commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    echo "device $DEVICE, torch $torch_version, CUDA build $cuda_build"
} >"$SUMMARY"

verdict() {  # verdict PASS|FAIL|INFO STEP REASON
    echo "$1 $2: $3"
    echo "$1 $2: $3" >>"$SUMMARY"
    if [[ "$1" == FAIL ]]; then
        FAILED+=("$2")
    fi
}

free_port() {
    python -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# run_step STEP LIMIT_S KIND COMMAND...: COMMAND under a time limit (at most what is left of TOTAL_S), its
# output in $LOGS/STEP.log; prints the items' lines, then PASS/FAIL (KIND check) or INFO (KIND info).
# COMMAND reads the limit from $LIMIT.
run_step() {
    local step=$1 cap=$2 kind=$3
    shift 3
    if [[ -n "${GPU_CHECK_STEPS:-}" && " $GPU_CHECK_STEPS " != *" $step "* ]]; then
        echo "SKIP $step: not in GPU_CHECK_STEPS" | tee -a "$SUMMARY"
        return
    fi
    local left=$((TOTAL_S - (SECONDS - START) - 10))
    if ((left < 15)); then
        verdict FAIL "$step" "not run: ${TOTAL_S}s budget spent"
        return
    fi
    LIMIT=$((cap < left ? cap : left))
    local log="$LOGS/$step.log" began=$SECONDS rc
    echo "== $step (limit ${LIMIT}s)"
    "$@" >"$log" 2>&1
    rc=$?
    local took=$((SECONDS - began))
    grep -E '^(PASS|FAIL|SKIP|INFO) ' "$log" | sed 's/^/    /'
    if [[ "$kind" == info ]]; then
        verdict INFO "$step" "exit status $rc after ${took}s (informational; the lines above say what happened)"
        return
    fi
    if ((rc == 0)); then
        verdict PASS "$step" "${took}s"
        return
    fi
    local reason
    if ((rc == 124 || rc == 137)); then
        reason="timed out after ${LIMIT}s"
    else
        # the first failure that is not a rank losing its peers (those follow another rank's failure)
        reason=$( (grep -E '^FAIL ' "$log" | grep -v '/all' | grep -viE 'connection (closed|reset)' ;
                   grep -E '^FAIL ' "$log" | grep -v '/all') | head -n 1)
        reason="exit status $rc${reason:+; first: ${reason#FAIL }}"
    fi
    verdict FAIL "$step" "$reason (log: ${log#"$ROOT"/})"
    tail -n 25 "$log" | sed 's/^/    | /'
}

launch() {  # launch NPROC ARGS...: one torchrun agent, this machine alone, under the step's limit
    local nproc=$1
    shift
    timeout --kill-after=10 "$LIMIT" torchrun --standalone --nproc-per-node "$nproc" --max-restarts 0 \
        benchmarks/gpu_check.py --device "$DEVICE" "$@"
}

two_nodes() {  # the nodes step as a 2-node job launches it: two torchrun agents, node ranks 0 and 1, 2 ranks each
    local port pids=() rc=0 status
    port=$(free_port)
    for node in 0 1; do
        timeout --kill-after=10 "$LIMIT" torchrun --nnodes 2 --node-rank "$node" --nproc-per-node 2 \
            --master-addr 127.0.0.1 --master-port "$port" --max-restarts 0 \
            benchmarks/gpu_check.py --check nodes --device "$DEVICE" --compiler "$COMPILER" \
            >"$LOGS/nodes.node$node.log" 2>&1 &
        pids+=($!)
    done
    for _ in 0 1; do  # the first agent to fail ends the other (its ranks would wait for the dead ones)
        wait -n "${pids[@]}"
        status=$?
        if ((status != 0 && rc == 0)); then
            rc=$status
            kill -TERM "${pids[@]}" 2>/dev/null
        fi
    done
    cat "$LOGS/nodes.node0.log" "$LOGS/nodes.node1.log"
    return "$rc"
}

environment() {
    timeout "$LIMIT" python - "$DEVICE" <<'EOF'
import sys
import torch

device = sys.argv[1]
print(f"INFO environment/torch: {torch.__version__}, CUDA build {torch.version.cuda}")
if device != "cuda":
    print("SKIP environment/gpu: --cpu-dry-run")
    sys.exit(0)
major, minor = torch.cuda.get_device_capability()
print(f"INFO environment/gpu: {torch.cuda.get_device_name()} (compute capability {major}.{minor}), "
      f"{torch.cuda.device_count()} device(s), {torch.cuda.get_device_properties(0).total_memory / 2**30:.0f} GiB")
print(f"INFO environment/nccl: {'.'.join(map(str, torch.cuda.nccl.version()))}")
print(f"INFO environment/fp8: float8_e4m3fn {'present' if hasattr(torch, 'float8_e4m3fn') else 'missing'}; "
      f"compute capability {major}.{minor} {'has' if (major, minor) >= (8, 9) else 'lacks'} FP8 tensor cores")
try:
    import triton
except ImportError as error:
    print(f"FAIL environment/triton: cannot import triton ({error}): Inductor cannot generate GPU kernels")
    sys.exit(1)
print(f"PASS environment/triton: triton {triton.__version__}")
EOF
}

run_step environment 30 check environment
run_step nccl 110 check launch 1 --check nccl --compiler "$COMPILER"
run_step nccl-shared-gpu 25 info launch 2 --check nccl-shared-gpu
run_step gloo-cuda 35 info launch 2 --check gloo-cuda
run_step cuda-only 45 check launch 2 --check cuda-only
if [[ -f "$LOGS/gloo-cuda.log" ]] && ! grep -q '^PASS gloo-cuda/functional-collectives' "$LOGS/gloo-cuda.log"; then
    # the four ranks share the GPU through gloo: without its collectives on CUDA tensors there is nothing to run
    echo "SKIP nodes: gloo does not carry the functional collectives on CUDA tensors here (step gloo-cuda);" \
         "the two-level and node-group code on CUDA then needs 2+ GPUs with NCCL" | tee -a "$SUMMARY"
    SKIPPED+=(nodes)
else
    run_step nodes 150 check two_nodes
fi
run_step bench 200 check launch 1 --check bench "${BENCH_DEFAULTS[@]}" "${BENCH_ARGS[@]}"

echo "total $((SECONDS - START))s of a ${TOTAL_S}s budget" | tee -a "$SUMMARY"
if ((${#FAILED[@]})); then
    echo "FAIL gpu_check: ${FAILED[*]} (summary: ${SUMMARY#"$ROOT"/})" | tee -a "$SUMMARY"
    exit 1
fi
if ((${#SKIPPED[@]})); then
    echo "PASS gpu_check: every step run passed; not run: ${SKIPPED[*]} (summary: ${SUMMARY#"$ROOT"/})" | tee -a "$SUMMARY"
else
    echo "PASS gpu_check: every step passed (summary: ${SUMMARY#"$ROOT"/})" | tee -a "$SUMMARY"
fi
