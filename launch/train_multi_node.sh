#!/usr/bin/env bash
# Train across the nodes of a DeepSpeed hostfile (see launch/hostfile.example); run it on the first
# host. Needs passwordless ssh between the hosts (pdsh, DeepSpeed's default), this repository at the
# same path on every host, and run_dir on a shared filesystem (checkpoints are written by every rank).
#   launch/train_multi_node.sh launch/hostfile experiment=<preset> deepspeed=zero3
# MASTER_ADDR defaults to the first host of the hostfile; LAUNCHER=openmpi|mvapich|... switches
# DeepSpeed's multi-node backend.
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${1:?usage: launch/train_multi_node.sh HOSTFILE [key=value ...]}
shift
MASTER_ADDR=${MASTER_ADDR:-$(grep -v '^\s*#' "${HOSTFILE}" | awk 'NF {print $1; exit}')}
exec deepspeed --hostfile "${HOSTFILE}" --launcher "${LAUNCHER:-pdsh}" \
  --master_addr "${MASTER_ADDR}" --master_port "${MASTER_PORT:-29500}" \
  --module train "$@"
