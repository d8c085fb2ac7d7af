#!/usr/bin/env bash
# Train on every GPU of this machine (torchrun, one rank per GPU); arguments are Hydra overrides.
#   launch/train_single_node.sh experiment=<preset> deepspeed=zero3 max_steps=20000
#   NUM_GPUS=2 launch/train_single_node.sh model=125m          # a subset of the GPUs
# Without GPUs it starts NUM_GPUS (default 1) CPU ranks over gloo. The one-node case of
# launch/train_multi_node.sh: SIGTERM / SIGINT to this script save a checkpoint and exit
# 128 + signal (see there). A stopped run continues with the same command plus resume=auto.
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=launch/study_lib.sh
source launch/study_lib.sh  # whole_number
if [[ -n "${NUM_GPUS:-}" ]]; then whole_number NUM_GPUS "$NUM_GPUS"; fi
NPROC_PER_NODE=${NUM_GPUS:-${NPROC_PER_NODE:-}} NNODES=1 exec launch/train_multi_node.sh "$@"
