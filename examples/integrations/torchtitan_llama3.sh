#!/usr/bin/env bash
# torchtitan's own trainer on its llama3 debug model, data parallel with fsdp_pass instead of FSDP2
# (docs/integrations.md, torchtitan). torchtitan 0.3.0 runs on GPUs, and its debug config reads the
# tokenizer and the c4_test data from its source tree: run this from a torchtitan 0.3.0 checkout, with
# fsdp_pass and torchtitan installed (pip install torchtitan==0.3.0):
#
#   NGPU=8 bash /path/to/fsdp_pass/examples/integrations/torchtitan_llama3.sh
#   NGPU=8 bash .../torchtitan_llama3.sh --checkpoint.enable --training.steps 10   # DCP: ./outputs/checkpoint/step-10
#   NGPU=8 bash .../torchtitan_llama3.sh --checkpoint.enable --training.steps 20   # resumes there: steps 11-20
#
# Extra arguments are torchtitan's own overrides (--section.key value). With --compile.no-enable the
# model runs eagerly; pass activation-checkpoint:none with it (fsdp_pass checkpoints the activations of
# compiled blocks only).
set -euo pipefail

torchrun --nproc_per_node "${NGPU:-8}" -m torchtitan.train \
    --module fsdp_pass.integrations.torchtitan --config llama3_debugmodel \
    --compile.enable "$@"
