#!/usr/bin/env bash
# The perplexity study's dose-response (docs/RESULTS.md), as pre-registered in conf/study/dose.yaml:
# the perplexity study's model (conf/experiment/study_ppl.yaml, the design by one override) trained
# for several doses of steps under a warmup-stable-decay schedule (optim.decay=wsd). Each design and
# seed is one chain: the lowest dose from scratch, each higher dose a cooldown branch (branch_from)
# from the previous dose's last stable checkpoint, so doses 750, 1500, 3000 cost 750 + 900 + 1800
# steps instead of 5250 (a branch is bitwise the run its schedule would train from scratch:
# tests/test_train_wsd.py). A design in the file's `top_only` trains its top dose alone, from
# scratch; one in its `one_dose` ({design: steps}) that dose alone. Every run is evaluated as the
# perplexity study evaluates (sliding-window perplexity on the same 20 held-out documents at 1x ..
# 32x, as trained and with dynamic NTK 8 where the design has RoPE; then, with the family's
# `attention_eval` overrides, its attention statistics, `python -m eval task=attention`) and
# published as <design>_d<steps>_s<seed> with its config, results, training log (metrics.jsonl.gz),
# machine.txt and cost.json (wall seconds of training, every start of it, and of evaluation); then
# `python -m eval.dose` writes the report (the pre-registered family first when FAMILY is given).
#
#   RESULTS=docs/results/dose FAMILY=conf/study/dose.yaml \
#     REFERENCE="$(echo docs/results/perplexity/{origin,coca,alibi,fire}_s[0-9]*)" launch/reproduce_dose.sh
#   DESIGNS="origin coca" SEEDS="101 102" DOSES="750 1500 3000" RESULTS=docs/results/dose/pilot \
#     launch/reproduce_dose.sh                                                      # its pilot
#
# Environment: RUNS (default runs/dose; a chain whose next dose needs a checkpoint that is no longer
# there retrains the dose below it, unpublished), FAMILY (the pre-registration: its doses,
# decay_fraction, seeds per design, top_only, one_dose and attention_eval), DESIGNS, SEEDS, DOSES,
# FRACTION, TOP_ONLY (override the file's, or stand alone without it), JOBS (chains at once,
# default 2, one thread each), RESULTS (where finished runs and the report are published; commit
# it, and the study continues on another machine where it stopped), TRAIN and EVAL (training and
# evaluation overrides, space separated; a shortened trial: TRAIN="optim.warmup_steps=2" DOSES="10 20"),
# LENGTH (the report figure's length, default 4096: 16x), REFERENCE (published runs of other
# schedules placed beside these in the report, `--reference`;
# the study's: the perplexity study's cosine runs of the same designs), FIT_TO (a whole number of
# tokens per non-embedding parameter: the report's exploratory power-law fit, extrapolated there,
# `--fit-to`; the dose extension's: 165, the paper's).
# Resumable: a published run is skipped, a finished training (DONE) or evaluation (eval/DONE) too,
# and an interrupted one continues from its newest checkpoint (resume=auto).
set -euo pipefail
cd "$(dirname "$0")/.."

FAMILY=${FAMILY:-}
RUNS=${RUNS:-runs/dose}
JOBS=${JOBS:-2}
RESULTS=${RESULTS:-}
REFERENCE=${REFERENCE:-}
LENGTH=${LENGTH:-4096}
FIT_TO=${FIT_TO:-}
TRAIN=${TRAIN:-}
EVAL=${EVAL:-"ppl.lengths=[256,512,1024,2048,4096,8192] ppl.stride=2048 ppl.n_docs=20"}
SCALINGS="[none,dynamic:8]"
# Every setting checked before anything trains (one `error:` line, exit 2; a bad FAMILY file, 1): the
# doses sorted, where each one's decay starts (its next dose branches from that checkpoint), the
# checkpoint interval that lands on every such step, enough kept checkpoints to keep them all, and
# each design's seeds (SEEDS, else the family file's count): launch/dose_plan.py.
# shellcheck source=launch/study_lib.sh
source launch/study_lib.sh  # training_args, scalings_of, machine, whole_number, cause_of
whole_number JOBS "$JOBS"
whole_number LENGTH "$LENGTH"
if [ -n "$FIT_TO" ]; then whole_number FIT_TO "$FIT_TO"; fi
settings=$(FAMILY="$FAMILY" python launch/dose_plan.py) || exit $?
eval "$settings"
export PRESET=study_ppl SCALINGS
mkdir -p "$RUNS/logs"
if [ "$JOBS" -gt 1 ]; then export OMP_NUM_THREADS=1; fi

doses_of() {  # design: the indices of its doses (one alone for a top_only or one_dose design)
  if [ -n "${ONE_DOSE_OF[$1]:-}" ]; then echo "${ONE_DOSE_OF[$1]}"; else seq 0 $((${#DOSES[@]} - 1)); fi
}

name_of() { echo "$1_d$2_s$3"; }  # design dose seed
published() { [ -n "$RESULTS" ] && [ -f "$RESULTS/$(name_of "$@")/DONE" ]; }

train_dose() {  # design seed index first: train dose DOSES[index] (a branch unless it is the first)
  local design=$1 seed=$2 i=$3 first=$4 dose=${DOSES[$3]} run_dir start=() t0=$SECONDS
  run_dir="$RUNS/$(name_of "$design" "$dose" "$seed")"
  if [ -f "$run_dir/DONE" ]; then return 0; fi
  if [ "$i" != "$first" ]; then
    start=("branch_from=$RUNS/$(name_of "$design" "${DOSES[$i - 1]}" "$seed")/checkpoints/step_$(printf %08d "${STARTS[$i - 1]}")")
  fi
  mkdir -p "$run_dir/train_seconds.d" && machine >> "$run_dir/machine.txt"
  # This start's wall seconds, kept every 30 s, so a start killed with its machine still counts.
  local clock status=0 ticker
  clock="$run_dir/train_seconds.d/$(date +%s)"
  ( while sleep 30; do echo $((SECONDS - t0)) > "$clock"; done ) &
  ticker=$!
  # shellcheck disable=SC2046,SC2086  # one override per line; TRAIN is a list of overrides
  python -m train $(training_args "$design") run_dir="$run_dir" name="dose_$(basename "$run_dir")" \
    seed="$seed" data.seed="$seed" optim.decay=wsd optim.decay_fraction="$FRACTION" max_steps="$dose" \
    ckpt_every="$EVERY" keep_last="$KEEP" resume=auto logger.progress=false $TRAIN "${start[@]}" || status=1
  kill "$ticker" 2>/dev/null || true
  wait "$ticker" 2>/dev/null || true
  echo $((SECONDS - t0)) > "$clock"
  if [ "$status" != 0 ]; then return 1; fi
  touch "$run_dir/DONE"
}

evaluate_dose() {  # design seed dose: evaluate and publish
  local design=$1 seed=$2 dose=$3 run_dir published t0=$SECONDS
  run_dir="$RUNS/$(name_of "$design" "$dose" "$seed")"
  if [ ! -f "$run_dir/eval/DONE" ]; then
    # shellcheck disable=SC2086  # EVAL is a list of overrides
    python -m eval run="$run_dir" task=ppl scalings="$(scalings_of "$design")" progress=false $EVAL || return 1
    if [ -n "$ATTENTION" ]; then  # the family's attention statistics (sink share, ...): attention.json
      # shellcheck disable=SC2086  # ATTENTION is a list of overrides
      python -m eval run="$run_dir" task=attention progress=false $ATTENTION || return 1
    fi
    echo $((SECONDS - t0)) > "$run_dir/eval/seconds"
    touch "$run_dir/eval/DONE"
  fi
  if [ -n "$RESULTS" ]; then
    published="$RESULTS/$(name_of "$design" "$dose" "$seed")"
    mkdir -p "$published"
    python -m eval.publish "$published" "$run_dir"/eval/*.json "$run_dir/config.yaml" "$run_dir/machine.txt" \
      "$run_dir/metrics.jsonl"  # JSON and the training log gzip-compressed
    python -c 'import json, pathlib, sys
run = pathlib.Path(sys.argv[1])  # every start of its training (train_seconds: the launcher before 2026-12-04)
starts = [*run.glob("train_seconds.d/*")] + [run / "train_seconds"] * (run / "train_seconds").is_file()
train = sum(int(line) for path in starts for line in path.read_text().split())
print(json.dumps({"train_s": train, "eval_s": int((run / "eval" / "seconds").read_text())}))' \
      "$run_dir" > "$published/cost.json"
    touch "$published/DONE"
  fi
}

chain() {  # design seed: every dose of the chain, lowest first; a dose is (re)trained while it or
  local design=$1 seed=$2 indices i j needed first  # a later dose of the chain is unpublished
  read -r -a indices <<< "$(doses_of "$design" | tr '\n' ' ')"
  first=${indices[0]}
  for i in "${indices[@]}"; do
    needed=0
    for j in "${indices[@]}"; do
      if [ "$j" -ge "$i" ] && ! published "$design" "${DOSES[$j]}" "$seed"; then needed=1; fi
    done
    if [ "$needed" = 0 ]; then continue; fi
    train_dose "$design" "$seed" "$i" "$first" || return 1
    if ! published "$design" "${DOSES[$i]}" "$seed"; then evaluate_dose "$design" "$seed" "${DOSES[$i]}" || return 1; fi
  done
}

echo "== doses ${DOSES[*]} (WSD, decay fraction $FRACTION; branches at ${STARTS[*]:0:${#STARTS[@]}-1}), designs $DESIGNS"
plan=()  # seed by seed, so that every design has its first seeds published early
for seed_rank in $(seq 1 1000); do
  found=0
  for design in $DESIGNS; do
    read -r -a seeds <<< "${SEEDS_OF[$design]}"
    if [ "$seed_rank" -le "${#seeds[@]}" ]; then plan+=("$design ${seeds[$seed_rank - 1]}"); found=1; fi
  done
  if [ "$found" = 0 ]; then break; fi
done

for item in "${plan[@]}"; do
  read -r design seed <<< "$item"
  while [ "$(jobs -rp | wc -l)" -ge "$JOBS" ]; do wait -n || true; done
  echo "== $design seed $seed (log: $RUNS/logs/${design}_s$seed.log)"
  ( chain "$design" "$seed" >> "$RUNS/logs/${design}_s$seed.log" 2>&1 \
      || echo "== FAILED: $design seed $seed (see $RUNS/logs/${design}_s$seed.log)" ) &
done
wait

runs=()
failed=""  # the first unfinished chain's design, seed and the line that says why
for item in "${plan[@]}"; do
  read -r design seed <<< "$item"
  for i in $(doses_of "$design"); do
    name=$(name_of "$design" "${DOSES[$i]}" "$seed")
    if published "$design" "${DOSES[$i]}" "$seed"; then runs+=("$RESULTS/$name")
    elif [ -f "$RUNS/$name/eval/DONE" ]; then runs+=("$RUNS/$name")
    elif [ -z "$failed" ]; then failed="$name did not finish: $(cause_of "$RUNS/logs/${design}_s$seed.log")"; fi
  done
done
if [ "${#runs[@]}" -gt 0 ]; then
  report=${RESULTS:-$RUNS/report}
  echo "== report -> $report"
  # shellcheck disable=SC2086  # REFERENCE is a list of folders
  python -m eval.dose "${runs[@]}" ${FAMILY:+--family "$FAMILY"} ${REFERENCE:+--reference $REFERENCE} \
    ${FIT_TO:+--fit-to "$FIT_TO"} --length "$LENGTH" --out "$report" || status=$?
fi
if [ -n "$failed" ]; then echo "error: $failed" >&2; exit 1; fi  # the cause, last
exit "${status:-0}"
