#!/usr/bin/env bash
# Train with one torchrun per node: run this script on every node, each with its own NODE_RANK
# (launch/slurm.sbatch does that through srun; launch/train_single_node.sh is the one-node case).
# Arguments are Hydra overrides. The nodes meet through torchrun's c10d rendezvous on node 0: no
# ssh and no hostfile. They need this repository at the same path and run_dir on a shared
# filesystem (every rank writes its part of each checkpoint).
#   node 0: NNODES=2 NODE_RANK=0 MASTER_ADDR=node-001 launch/train_multi_node.sh experiment=<preset>
#   node 1: NNODES=2 NODE_RANK=1 MASTER_ADDR=node-001 launch/train_multi_node.sh experiment=<preset>
# Environment: NNODES (default 1), NODE_RANK (default 0), MASTER_ADDR (node 0's address, required
# when NNODES > 1), MASTER_PORT (default 29500), RDZV_ID (default coca-train; one per job),
# NPROC_PER_NODE (default: this node's GPUs, or 1 CPU rank without GPUs), OMP_NUM_THREADS
# (default: this node's cores shared among its ranks).
#
# Preemption: SIGTERM, SIGINT or SIGHUP to this script (alone or with its process group) is passed
# to the ranks only. Each rank finishes its step, they write one complete checkpoint and exit
# 128 + signal; so does this script (143 for SIGTERM). torchrun runs in its own session so that a
# signal to our process group never reaches it: signalled itself, torchrun kills its ranks 30 s
# later, which a large checkpoint may not survive. Continue with the same command plus resume=auto.
# Started in the background of another script (`nohup ... &`), this script ignores SIGINT: a shell
# cannot trap a signal ignored when it started (POSIX). Stop it with SIGTERM there.
set -euo pipefail
cd "$(dirname "$0")/.."

# shellcheck source=launch/study_lib.sh
source launch/study_lib.sh  # whole_number
NNODES=${NNODES:-1}
whole_number NNODES "$NNODES"
if [[ -z "${NPROC_PER_NODE:-}" ]]; then
  NPROC_PER_NODE=$(python3 -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
whole_number NPROC_PER_NODE "$NPROC_PER_NODE"
if (( NNODES > 1 )); then
  : "${MASTER_ADDR:?MASTER_ADDR (the address of node 0) is required when NNODES > 1}"
  rendezvous=(--nnodes "$NNODES" --node_rank "${NODE_RANK:-0}" --rdzv_backend c10d
              --rdzv_id "${RDZV_ID:-coca-train}" --rdzv_endpoint "$MASTER_ADDR:${MASTER_PORT:-29500}")
else
  rendezvous=(--standalone)  # a free local port
fi
# torchrun would set 1 thread per rank; CPU ranks train much faster with their share of the cores.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( $(nproc) / NPROC_PER_NODE > 0 ? $(nproc) / NPROC_PER_NODE : 1 ))}

# torchrun's stderr passes through a filter that folds its own failure report (a rank's error is
# one line: launch/fold_torchrun_report.awk) and records the failed rank's exit code for ours. The
# filter ignores the stop signals (it is in our process group): it ends when the ranks' output does.
root_cause=$(mktemp)
trap 'rm -f "$root_cause"' EXIT
setsid torchrun "${rendezvous[@]}" --nproc_per_node "$NPROC_PER_NODE" -m train "$@" \
  2> >(trap '' INT TERM HUP; exec awk -v codefile="$root_cause" -f launch/fold_torchrun_report.awk >&2) &
launcher=$!
stop_signal=0

forward() {  # forward <signal number>: to the ranks (torchrun's children), or to torchrun before they start
  (( stop_signal )) || stop_signal=$1
  local ranks
  ranks=$(pgrep -P "$launcher" || true)
  # shellcheck disable=SC2086  # one pid per word
  kill -s "$1" ${ranks:-$launcher} 2>/dev/null || true
}
trap 'forward 15' TERM
trap 'forward 2' INT
trap 'forward 15' HUP

# `wait` returns early when a trapped signal arrives: wait again until torchrun has exited.
while :; do
  status=0
  wait "$launcher" || status=$?
  kill -0 "$launcher" 2>/dev/null || break
done
if (( status != 0 && stop_signal )); then
  exit $(( 128 + stop_signal ))  # torchrun reports its stopped ranks as a failure (exit 1)
fi
if (( status != 0 )); then  # the failed rank's own status (2: a refused setting), once the filter is done
  for _ in $(seq 50); do [[ -s "$root_cause" ]] && break; sleep 0.1; done
  code=$(cat "$root_cause" 2>/dev/null || true)
  if [[ "$code" =~ ^[0-9]+$ ]] && (( code > 0 && code < 256 )); then exit "$code"; fi
fi
exit "$status"
