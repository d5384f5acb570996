#!/usr/bin/env bash
# GPU check, for a machine with one CUDA GPU: NCCL at world size 1, Inductor on CUDA, bf16,
# fsdp_pass against FSDP2 (step time, peak memory). Prints a table; JSON in benchmarks/results/.
set -euo pipefail
cd "$(dirname "$0")/.."
python -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; print(torch.__version__, torch.cuda.get_device_name())"
timeout 480 torchrun --standalone --nproc-per-node 1 benchmarks/gpu_check.py --device cuda "$@"
