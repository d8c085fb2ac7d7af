#!/usr/bin/env bash
# The CPU-scale reproduction (docs/RESULTS.md): train the `tiny` model at 128 tokens on the stdlib
# corpus with Origin, ALiBi, CoCA (slack) and CoCA (strict) attention (conf/experiment/tiny_*.yaml,
# about 30 minutes each on 2 cores), then evaluate perplexity and passkey from 1x to 32x the
# training length, with and without dynamic NTK (2, 4, 8), and write the comparison report.
#
#   launch/reproduce_tiny.sh                       # the full study, results in runs/tiny_study
#   STEPS=300 launch/reproduce_tiny.sh             # shorter training
#   launch/reproduce_tiny.sh logger.wandb=disabled # extra arguments: Hydra overrides for training
#
# Environment: RUNS (default runs/tiny_study), VARIANTS (default "origin alibi coca coca_strict"),
# STEPS (max_steps), EVAL (extra evaluation overrides, space separated; default: the study's
# lengths). A finished variant is skipped; an interrupted one resumes from its newest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/tiny_study}
VARIANTS=${VARIANTS:-"origin alibi coca coca_strict"}
# 1x .. 32x the training length of 128 (passkey from 256: the prompt without filler needs ~170 tokens).
EVAL=${EVAL:-"ppl.lengths=[128,256,512,1024,2048,4096] passkey.lengths=[256,512,1024,2048,4096] ppl.n_docs=8 passkey.n_cases=50"}

for v in $VARIANTS; do
  run_dir="$RUNS/$v"
  if [ -f "$run_dir/DONE" ]; then
    echo "== $v: trained already ($run_dir)"; continue
  fi
  echo "== train $v -> $run_dir"
  python -m train experiment="tiny_$v" run_dir="$run_dir" resume=auto ${STEPS:+max_steps=$STEPS} "$@"
  touch "$run_dir/DONE"
done

# shellcheck disable=SC2086  # EVAL is a list of overrides
launch/evaluate_runs.sh "$RUNS" "$VARIANTS" $EVAL
