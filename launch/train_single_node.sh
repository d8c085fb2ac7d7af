#!/usr/bin/env bash
# Train on every GPU of this machine with the DeepSpeed launcher; arguments are Hydra overrides.
#   launch/train_single_node.sh experiment=<preset> deepspeed=zero3 max_steps=20000
#   NUM_GPUS=2 launch/train_single_node.sh model=125m          # a subset of the GPUs
# Without GPUs it starts NUM_GPUS (default 1) CPU ranks over gloo. A stopped run continues with
# the same command plus resume=auto.
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z "${NUM_GPUS:-}" ]]; then
  NUM_GPUS=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
exec deepspeed --num_gpus "${NUM_GPUS}" --master_port "${MASTER_PORT:-29500}" --module train "$@"
