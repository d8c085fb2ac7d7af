#!/usr/bin/env bash
# The miniature extension experiment (docs/RESULTS.md), as pre-registered in conf/study/extension.yaml:
# the study's Origin models (256 tokens, runs/study/origin_s<seed>: launch/reproduce_study.sh trains
# them) continued with the same budget by five recipes, each with seeds 1..5 (seed s from origin_s<s>,
# data seed 100 + s):
#   extend_pi, extend_yarn, extend_abf   at 1024 tokens (conf/experiment/extend_*.yaml), evaluated at
#                                        1024 .. 8192 as trained (their training-time scaling);
#   dropin_coca                          converted to CoCA slack, trained on at 256 (dropin_coca.yaml);
#   continue_origin                      trained on at 256 unchanged, the equal-compute control;
#   the 256-token arms evaluated at 256 .. 8192, as trained and with dynamic NTK 8.
# Passkey on 100 cases per length from each run's own prompt stream (the seed's), perplexity on the
# study's 20 held-out documents. First a pilot (one run per recipe and t_init option from origin_s1,
# data seed 1001, 300 steps: `python -m eval.budget`) fixes the budget and t_init by the file's
# rule; then the family runs; then one seed report with the study's coca and origin seeds 1..5
# beside them, the pre-registered family first.
#
#   RESULTS=docs/results/extension launch/reproduce_extension.sh   # the whole experiment, published as it lands
#   SEEDS="1 2" launch/reproduce_extension.sh                      # these seeds only
#   launch/reproduce_extension.sh logger.wandb=disabled            # extra arguments: Hydra overrides for
#                                                                  # every training (pilot and arms)
#
# Environment: RUNS (default runs/extension), SOURCES (the study's runs, default runs/study; its
# published results: STUDY_RESULTS, default docs/results/study), ARMS (the recipes piloted and run,
# default all five), SEEDS (default 1..5), JOBS (runs at once, default 2, one thread each), FAMILY
# (the pre-registration, default conf/study/extension.yaml: its budget_rule sizes the pilot), EVAL
# (evaluation overrides, space separated), SHORT and LONG (the lengths evaluated for the 256- and
# the 1024-token arms), RESULTS (default: none): a folder where the pilot's choice, each finished
# run's evaluation JSON and the report are written; commit it, and the experiment continues on
# another machine where it stopped.
# Resumable: a published run, a finished run (DONE) or evaluation (eval/DONE) is skipped, and an
# interrupted training continues from its newest checkpoint. Logs: RUNS/logs/<arm>_s<seed>.log.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/extension}
SOURCES=${SOURCES:-runs/study}
STUDY_RESULTS=${STUDY_RESULTS:-docs/results/study}
ARMS=${ARMS:-"extend_pi extend_yarn extend_abf dropin_coca continue_origin"}
SEEDS=${SEEDS:-"1 2 3 4 5"}
JOBS=${JOBS:-2}
RESULTS=${RESULTS:-}
FAMILY=${FAMILY:-conf/study/extension.yaml}
OUT=${RESULTS:-$RUNS/report}
EVAL=${EVAL:-"ppl.stride=2048 ppl.n_docs=20 passkey.n_cases=100"}
SHORT=${SHORT:-"[256,512,1024,2048,4096,8192]"}  # the 256-token arms: 1x .. 32x
LONG=${LONG:-"[1024,2048,4096,8192]"}            # the 1024-token arms: 1x .. 8x
OVERRIDES=("$@")                                 # for every training, after the arm's own
# shellcheck source=launch/study_lib.sh
source launch/study_lib.sh  # whole_number, cause_of
whole_number JOBS "$JOBS"
for seed in $SEEDS; do whole_number SEEDS "$seed"; done
mkdir -p "$RUNS/logs" "$OUT"
if [ "$JOBS" -gt 1 ]; then export OMP_NUM_THREADS=1; fi
read -r PILOT_STEPS PILOT_EVERY < <(python -c 'import sys, yaml
r = yaml.safe_load(open(sys.argv[1]))["budget_rule"]; print(r["pilot_steps"], r["every"])' "$FAMILY")

source_of() {  # seed: the study's Origin run, or one line and exit 2
  local src="$SOURCES/origin_s$1"
  if [ ! -f "$src/DONE" ]; then
    echo "error: $src is not a finished study run: train it first (SEEDS=$1 DESIGNS=origin launch/reproduce_study.sh)" >&2
    return 2
  fi
  echo "$src"
}

train() {  # run_dir seed data_seed recipe [overrides...]: from the source, or on from a checkpoint
  local run_dir=$1 seed=$2 data_seed=$3 recipe=$4 src start
  shift 4
  src=$(source_of "$seed") || return 2
  if [ -f "$run_dir/DONE" ]; then return 0; fi
  if compgen -G "$run_dir/checkpoints/step_*" > /dev/null; then start=resume=auto
  else rm -rf "$run_dir"; start=init_from="$src"; fi  # nothing saved yet: start again
  python -m train experiment="$recipe" "$start" run_dir="$run_dir" name="ext_$(basename "$run_dir")" \
    seed="$seed" data.seed="$data_seed" logger.progress=false "$@" "${OVERRIDES[@]}" || return 1
  touch "$run_dir/DONE"
}

pilot_run() {  # name recipe [overrides...]
  local name=$1 recipe=$2
  shift 2
  train "$RUNS/pilot/$name" 1 1001 "$recipe" max_steps="$PILOT_STEPS" eval_every="$PILOT_EVERY" \
    ckpt_every="$PILOT_STEPS" keep_last=1 "$@"
}

# 1. The pilot (one run per arm, the drop-in once per t_init), unless its choice is already there.
if [ ! -f "$OUT/pilot.json" ]; then
  pilots=()
  for arm in $ARMS; do
    if [ "$arm" = dropin_coca ]; then pilots+=("dropin_from_k dropin_coca model.design_params.coca.t_init=from_k" "dropin_fresh dropin_coca model.design_params.coca.t_init=fresh")
    else pilots+=("$arm $arm"); fi
  done
  for item in "${pilots[@]}"; do
    read -r name recipe extra <<< "$item"
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    echo "== pilot $name"
    ( pilot_run "$name" "$recipe" ${extra:+"$extra"} > "$RUNS/logs/pilot_$name.log" 2>&1 \
        || echo "== FAILED: pilot $name (see $RUNS/logs/pilot_$name.log)" ) &
  done
  wait
  for item in "${pilots[@]}"; do  # the budget needs every pilot: else the first failure's cause, last
    read -r name _ <<< "$item"
    if [ ! -f "$RUNS/pilot/$name/DONE" ]; then
      echo "error: pilot $name did not finish: $(cause_of "$RUNS/logs/pilot_$name.log")" >&2
      exit 1
    fi
  done
  python -m eval.budget "$RUNS/pilot" --out "$OUT" --family "$FAMILY"
fi
read -r BUDGET T_INIT < <(python -c 'import json, sys; c = json.load(open(sys.argv[1])); print(c["budget"], c["t_init"])' "$OUT/pilot.json")
echo "== budget $BUDGET steps, t_init $T_INIT ($OUT/pilot.md)"

# 2. The family's runs.
one_run() {  # arm seed
  local arm=$1 seed=$2 run_dir="$RUNS/$1_s$2" published="${RESULTS:+$RESULTS/$1_s$2}" extra=() lengths scalings
  if [ -n "$published" ] && [ -f "$published/DONE" ]; then return 0; fi
  if [ "$arm" = dropin_coca ]; then extra=(model.design_params.coca.t_init="$T_INIT"); fi
  train "$run_dir" "$seed" $((100 + seed)) "$arm" max_steps="$BUDGET" eval_every=$((BUDGET / 2)) \
    ckpt_every=$((BUDGET / 2)) keep_last=1 "${extra[@]}" || return $?
  case $arm in
    extend_*) lengths=$LONG scalings="[none]" ;;
    *) lengths=$SHORT scalings="[none,dynamic:8]" ;;
  esac
  if [ ! -f "$run_dir/eval/DONE" ]; then
    for task in ppl passkey; do
      # shellcheck disable=SC2086  # EVAL is a list of overrides
      python -m eval run="$run_dir" task=$task scalings="$scalings" ppl.lengths="$lengths" \
        passkey.lengths="$lengths" progress=false $EVAL || return 1
    done
    touch "$run_dir/eval/DONE"
  fi
  if [ -n "$published" ]; then
    mkdir -p "$published"
    # JSON and the training log (metrics.jsonl) gzip-compressed
    python -m eval.publish "$published" "$run_dir"/eval/*.json "$run_dir/config.yaml" "$run_dir/metrics.jsonl"
    touch "$published/DONE"
  fi
}

for seed in $SEEDS; do
  for arm in $ARMS; do
    if [ -n "$RESULTS" ] && [ -f "$RESULTS/${arm}_s$seed/DONE" ]; then continue; fi  # published: keep its log
    while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
    echo "== $arm seed $seed -> $RUNS/${arm}_s$seed (log: $RUNS/logs/${arm}_s$seed.log)"
    ( one_run "$arm" "$seed" > "$RUNS/logs/${arm}_s$seed.log" 2>&1 \
        || echo "== FAILED: $arm seed $seed (see $RUNS/logs/${arm}_s$seed.log)" ) &
  done
done
wait

# 3. The seed report: the family's runs beside the study's from-scratch Origin and CoCA.
runs=()
failed=""  # the first unfinished run (or missing study run) and the line that says why
for seed in $SEEDS; do
  for arm in $ARMS; do
    if [ -n "$RESULTS" ] && [ -f "$RESULTS/${arm}_s$seed/DONE" ]; then runs+=("$RESULTS/${arm}_s$seed")
    elif [ -f "$RUNS/${arm}_s$seed/eval/DONE" ]; then runs+=("$RUNS/${arm}_s$seed")
    elif [ -z "$failed" ]; then failed="${arm}_s$seed did not finish: $(cause_of "$RUNS/logs/${arm}_s$seed.log")"; fi
  done
  for design in origin coca; do
    if [ -f "$STUDY_RESULTS/${design}_s$seed/DONE" ]; then runs+=("$STUDY_RESULTS/${design}_s$seed")
    else
      echo "== missing from the study: $STUDY_RESULTS/${design}_s$seed"
      if [ -z "$failed" ]; then failed="$STUDY_RESULTS/${design}_s$seed is not published (the study's runs compared)"; fi
    fi
  done
done
if [ "${#runs[@]}" -gt 0 ]; then
  echo "== report -> $OUT"
  python -m eval.report "${runs[@]}" --family "$FAMILY" --out "$OUT" || status=$?
fi
if [ -n "$failed" ]; then echo "error: $failed" >&2; exit 1; fi  # the cause, last
exit "${status:-0}"
