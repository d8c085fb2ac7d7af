#!/usr/bin/env bash
# The CPU-scale extrapolation study (docs/RESULTS.md): Origin, ALiBi, CoCA slack and CoCA strict,
# each trained with several seeds on the retrieval mix (conf/experiment/study_*.yaml), plus one
# text-only Origin model for the zero-shot passkey row; each run evaluated at 1x .. 32x the
# training length (perplexity, passkey, recall; RoPE as trained and with dynamic NTK 2/4/8;
# attention statistics at 4x); then one seed-aggregated report (mean, 95% CI, Welch's tests).
#
#   launch/reproduce_study.sh                          # the full study, results in runs/study
#   SEEDS="1 2" STEPS=100 launch/reproduce_study.sh    # shorter
#   launch/reproduce_study.sh logger.wandb=disabled    # extra arguments: Hydra overrides for training
#
# Environment: RUNS (default runs/study), DESIGNS (default "origin alibi coca coca_strict"),
# SEEDS (default "1 2 3"), TEXT_ONLY (1: also the text-only run, seed 1), STEPS (max_steps),
# JOBS (runs at once, default 2, each on one thread: on a small CPU two one-thread jobs train
# faster than one two-thread job), EVAL (evaluation overrides replacing the study's, space separated).
# RESULTS (default: none): a folder path where each finished run's evaluation JSON and passkey-progress
# table (passkey at 1x of every checkpoint: the steps it took to the bar) are copied, and the report
# is written; commit it, and the study continues on another machine where it stopped.
# Resumable: a run published in RESULTS, a finished run (DONE) or evaluation (eval/DONE) is
# skipped, an interrupted training continues from its newest checkpoint.
# Logs: RUNS/logs/<design>_s<seed>.log.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/study}
DESIGNS=${DESIGNS:-"origin alibi coca coca_strict"}
SEEDS=${SEEDS:-"1 2 3"}
TEXT_ONLY=${TEXT_ONLY:-1}
JOBS=${JOBS:-2}
RESULTS=${RESULTS:-}
# 1x .. 32x of the training length 256
# (measured: 4 documents at stride 1024 and 20 cases per length took 4 + 4 minutes for ppl and
# passkey on one thread; these settings take about a third of that)
EVAL=${EVAL:-"ppl.lengths=[256,512,1024,2048,4096,8192] ppl.stride=2048 ppl.n_docs=3 \
passkey.lengths=[256,512,1024,2048,4096,8192] passkey.n_cases=16 \
recall.lengths=[256,512,1024,2048,4096,8192] recall.n_cases=8"}
mkdir -p "$RUNS/logs"
if [ "$JOBS" -gt 1 ]; then export OMP_NUM_THREADS=1; fi

one_run() {  # design seed [training overrides...]; runs in a `|| echo` list, where set -e is off
  local design=$1 seed=$2 run_dir="$RUNS/$1_s$2" published="${RESULTS:+$RESULTS/$1_s$2}"
  shift 2
  if [ -n "$published" ] && [ -f "$published/DONE" ]; then return 0; fi
  if [ ! -f "$run_dir/DONE" ]; then
    python -m train experiment="study_$design" run_dir="$run_dir" name="study_${design}_s$seed" seed="$seed" \
      data.seed="$seed" resume=auto logger.progress=false ${STEPS:+max_steps=$STEPS} "$@" || return 1
    touch "$run_dir/DONE"
  fi
  if [ ! -f "$run_dir/eval/DONE" ]; then
    local scalings="[none,dynamic:2,dynamic:4,dynamic:8]"
    if [ "$design" = alibi ]; then scalings="[none]"; fi
    # shellcheck disable=SC2086  # EVAL is a list of overrides
    python -m eval run="$run_dir" task=all scalings="$scalings" progress=false $EVAL || return 1
    python -m bench.passkey_progress "$run_dir"/checkpoints/step_* --cases 60 \
      > "$run_dir/eval/passkey_progress.md" || return 1
    touch "$run_dir/eval/DONE"
  fi
  if [ -n "$published" ]; then
    mkdir -p "$published"
    cp "$run_dir"/eval/*.json "$run_dir"/eval/*.npz "$run_dir/eval/passkey_progress.md" "$run_dir/config.yaml" \
      "$published/"
    touch "$published/DONE"
  fi
}

plan=()
for seed in $SEEDS; do for design in $DESIGNS; do plan+=("$design $seed"); done; done
if [ "$TEXT_ONLY" = 1 ]; then plan+=("text 1"); fi

for item in "${plan[@]}"; do
  read -r design seed <<< "$item"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  echo "== $design seed $seed -> $RUNS/${design}_s$seed (log: $RUNS/logs/${design}_s$seed.log)"
  ( one_run "$design" "$seed" "$@" > "$RUNS/logs/${design}_s$seed.log" 2>&1 \
      || echo "== FAILED: $design seed $seed (see $RUNS/logs/${design}_s$seed.log)" ) &
done
wait

runs=()
failed=0
for item in "${plan[@]}"; do
  read -r design seed <<< "$item"
  if [ -n "$RESULTS" ] && [ -f "$RESULTS/${design}_s$seed/DONE" ]; then runs+=("$RESULTS/${design}_s$seed")
  elif [ -f "$RUNS/${design}_s$seed/eval/DONE" ]; then runs+=("$RUNS/${design}_s$seed")
  else failed=1; fi
done
report=${RESULTS:-$RUNS/report}
echo "== report -> $report"
python -m eval.report "${runs[@]}" --out "$report"
exit $failed
