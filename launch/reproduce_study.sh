#!/usr/bin/env bash
# The CPU-scale extrapolation study (docs/RESULTS.md), as pre-registered in conf/study/comparisons.yaml:
# Origin and CoCA slack with seeds 1..10, CoCA strict and ALiBi with seeds 1..5 (the file's `seeds`),
# each trained on the retrieval mix (conf/experiment/study_*.yaml), plus one text-only Origin model
# (seed 1) for the zero-shot passkey row. Each run is evaluated at 1x .. 32x the training length 256:
# passkey on 100 cases per length and scaling from the run's own prompt stream (eval prompt_seed=run),
# perplexity on 20 held-out documents (the same for every run), recall at 1x .. 4x (exploratory: the
# study trains no recall rows), attention statistics at 4x; RoPE as trained and with dynamic NTK 8
# (the family's two scalings; ALiBi as trained only); and the training bar, passkey at 256 of every
# checkpoint on 60 cases of the bar's own stream (disjoint from the evaluation's). Then one
# seed-aggregated report: the pre-registered family first (Holm), the rest exploratory; and the same
# report on the runs whose final checkpoint passes the bar (bar_only/: a post hoc subset, exploratory).
# Evaluation cost: bench/study_eval.py (one run's evaluation before and after these settings).
#
#   RESULTS=docs/results/study launch/reproduce_study.sh   # the whole study, published as it lands
#   SEEDS="1 2" STEPS=100 launch/reproduce_study.sh        # shorter: these seeds for every design
#   launch/reproduce_study.sh logger.wandb=disabled        # extra arguments: Hydra overrides for training
#   launch/reproduce_study.sh --print-eval                 # print the evaluation settings and exit
#
# Environment: RUNS (default runs/study), DESIGNS (default "origin coca coca_strict alibi": keys of
# model/designs/registry.py, or variants the family file defines: launch/study_design.py; a
# continuation waits for its source run of the same seed, which must be trained in RUNS), FAMILY (the pre-registration whose `seeds` size each design and whose
# family the report tests, default conf/study/comparisons.yaml), PRESET (the training preset, default
# study: conf/experiment/study_<design>.yaml where it exists, else study_origin with the design's
# settings; any other preset, e.g. study_ppl, is trained with the design's settings), TASK (the
# evaluation task, default all: with it the training bar and the bar_only report; ppl for perplexity
# only), PUBLISHED (space-separated folders of runs already published elsewhere, e.g. the study's
# docs/results/study for a report that compares new designs with its Origin seeds: a run found there
# is reported, not retrained), SEEDS (default: each design's pre-registered seeds 1..n), TEXT_ONLY
# (1: also the text-only run, seed 1), STEPS (max_steps), JOBS (runs at once, default 2, each on one
# thread: on a small CPU two one-thread jobs train faster than one two-thread job), EVAL (evaluation
# overrides replacing the study's, space separated), SCALINGS (RoPE scalings evaluated, default
# [none,dynamic:8]; designs without RoPE: none).
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/study}
DESIGNS=${DESIGNS:-"origin coca coca_strict alibi"}
FAMILY=${FAMILY:-conf/study/comparisons.yaml}
PRESET=${PRESET:-study}
TASK=${TASK:-all}
PUBLISHED=${PUBLISHED:-}
SEEDS=${SEEDS:-}
TEXT_ONLY=${TEXT_ONLY:-1}
JOBS=${JOBS:-2}
RESULTS=${RESULTS:-}
# 1x .. 32x of the training length 256. Perplexity: 31 stdlib test documents reach 8193 tokens with
# the study's tokenizer (`python -m data.documents test tokenizer.digit_group=3`), 9 reach 16K, so
# 8192 is the longest length with 20 documents; stride 2048 as in the pilot.
EVAL=${EVAL:-"ppl.lengths=[256,512,1024,2048,4096,8192] ppl.stride=2048 ppl.n_docs=20 \
passkey.lengths=[256,512,1024,2048,4096,8192] passkey.n_cases=100 \
recall.lengths=[256,512,1024] recall.n_cases=20"}
SCALINGS=${SCALINGS:-"[none,dynamic:8]"}
if [ "${1:-}" = --print-eval ]; then printf '%s\n' "$EVAL" "$SCALINGS"; exit 0; fi
# shellcheck source=launch/study_lib.sh
source launch/study_lib.sh  # training_args, scalings_of, machine, whole_number, cause_of
whole_number JOBS "$JOBS"
if [ -n "${STEPS:-}" ]; then whole_number STEPS "$STEPS"; fi
mkdir -p "$RUNS/logs"
if [ "$JOBS" -gt 1 ]; then export OMP_NUM_THREADS=1; fi

published_run() {  # design seed: the folder of its published run (RESULTS, then PUBLISHED), or nothing
  local folder
  for folder in $RESULTS $PUBLISHED; do
    if [ -f "$folder/$1_s$2/DONE" ]; then echo "$folder/$1_s$2"; return; fi
  done
}

one_run() {  # design seed [training overrides...]; runs in a `|| echo` list, where set -e is off
  local design=$1 seed=$2 run_dir="$RUNS/$1_s$2" published="${RESULTS:+$RESULTS/$1_s$2}" preset scalings source start
  shift 2
  if [ -n "$(published_run "$design" "$seed")" ]; then return 0; fi
  if [ ! -f "$run_dir/DONE" ]; then
    preset=$(training_args "$design") || return 1
    source=$(source_of "$design") || return 1
    start=resume=auto
    if [ -n "$source" ] && ! compgen -G "$run_dir/checkpoints/step_*" > /dev/null; then
      # A continuation starts from its source run of this seed (trained here), then resumes itself.
      if [ ! -f "$RUNS/${source}_s$seed/DONE" ]; then
        echo "error: $design continues $RUNS/${source}_s$seed, which has not finished training here" >&2
        return 1
      fi
      rm -rf "$run_dir" && start=init_from="$RUNS/${source}_s$seed"
    fi
    mkdir -p "$run_dir" && machine >> "$run_dir/machine.txt"
    # shellcheck disable=SC2086  # one override per word
    python -m train $preset run_dir="$run_dir" name="${PRESET}_${design}_s$seed" seed="$seed" \
      data.seed="$seed" "$start" logger.progress=false ${STEPS:+max_steps=$STEPS} "$@" || return 1
    touch "$run_dir/DONE"
  fi
  if [ ! -f "$run_dir/eval/DONE" ]; then
    scalings=$(scalings_of "$design") || return 1
    # shellcheck disable=SC2086  # EVAL is a list of overrides
    python -m eval run="$run_dir" task="$TASK" scalings="$scalings" progress=false $EVAL || return 1
    if [ "$TASK" = all ]; then
      python -m bench.passkey_progress "$run_dir"/checkpoints/step_* --cases 60 \
        > "$run_dir/eval/passkey_progress.md" || return 1
    fi
    touch "$run_dir/eval/DONE"
  fi
  if [ -n "$published" ]; then
    mkdir -p "$published"
    # JSON and the training log (metrics.jsonl) gzip-compressed
    python -m eval.publish "$published" "$run_dir"/eval/*.json "$run_dir/config.yaml" "$run_dir/metrics.jsonl"
    if [ -f "$run_dir/machine.txt" ]; then cp "$run_dir/machine.txt" "$published/"; fi
    if [ "$TASK" = all ]; then cp "$run_dir"/eval/*.npz "$run_dir/eval/passkey_progress.md" "$published/"; fi
    touch "$published/DONE"
  fi
}

seeds_of() {  # design: $SEEDS, else 1 .. its pre-registered number of seeds (one line if it has none)
  if [ -n "$SEEDS" ]; then echo "$SEEDS"; return; fi
  python -c 'import sys, yaml
n = yaml.safe_load(open(sys.argv[1]))["seeds"].get(sys.argv[2])
sys.exit(f"error: design {sys.argv[2]} has no seeds in {sys.argv[1]}; set SEEDS") if n is None else print(*range(1, n + 1))' \
    "$FAMILY" "$1"
}

plan=()  # seed by seed, so that every design has its first seeds published early
pairs=""
for design in $DESIGNS; do
  seeds=$(seeds_of "$design") || exit 2
  for seed in $seeds; do pairs+="$seed $design"$'\n'; done
done
while read -r seed design; do plan+=("$design $seed"); done < <(printf '%s' "$pairs" | sort -s -n -k1,1)
if [ "$TEXT_ONLY" = 1 ]; then plan+=("text 1"); fi

for item in "${plan[@]}"; do
  read -r design seed <<< "$item"
  if [ -n "$(published_run "$design" "$seed")" ]; then continue; fi  # published: keep its log
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  source=$(source_of "$design") || exit 2  # a continuation waits for its source run of this seed
  while [ -n "$source" ] && [ ! -f "$RUNS/${source}_s$seed/DONE" ] && [ -n "$(jobs -rp)" ]; do wait -n || true; done
  echo "== $design seed $seed -> $RUNS/${design}_s$seed (log: $RUNS/logs/${design}_s$seed.log)"
  ( one_run "$design" "$seed" "$@" > "$RUNS/logs/${design}_s$seed.log" 2>&1 \
      || echo "== FAILED: $design seed $seed (see $RUNS/logs/${design}_s$seed.log)" ) &
done
wait

runs=()
failed=""  # the first unfinished run and the line that says why
for item in "${plan[@]}"; do
  read -r design seed <<< "$item"
  published=$(published_run "$design" "$seed")
  if [ -n "$published" ]; then runs+=("$published")
  elif [ -f "$RUNS/${design}_s$seed/eval/DONE" ]; then runs+=("$RUNS/${design}_s$seed")
  elif [ -z "$failed" ]; then failed="${design}_s$seed did not finish: $(cause_of "$RUNS/logs/${design}_s$seed.log")"; fi
done
if [ "${#runs[@]}" -gt 0 ]; then
  report=${RESULTS:-$RUNS/report}
  echo "== report -> $report"
  python -m eval.report "${runs[@]}" --family "$FAMILY" --out "$report" || status=$?
  if [ "$TASK" = all ]; then
    echo "== the report on the runs past the training bar (exploratory) -> $report/bar_only"
    python -m eval.report "${runs[@]}" --family "$FAMILY" --bar-only --out "$report/bar_only" || status=$?
  fi
fi
if [ -n "$failed" ]; then echo "error: $failed" >&2; exit 1; fi  # the cause, last
exit "${status:-0}"
