#!/usr/bin/env bash
# Evaluate several training runs the paper's way, then write the comparison report.
#   launch/evaluate_runs.sh RUNS "VARIANTS" [eval overrides...]
# Each run RUNS/<variant> gets `python -m eval task=all` with RoPE as trained and dynamic NTK at
# factors 2, 4, 8 (ALiBi, which has no RoPE, as trained only); the report goes to RUNS/report.
set -euo pipefail
cd "$(dirname "$0")/.."
runs=$1 variants=$2
shift 2

for v in $variants; do
  if [ "$v" = alibi ]; then scalings="[none]"; else scalings="[none,dynamic:2,dynamic:4,dynamic:8]"; fi
  echo "== evaluate $v"
  python -m eval run="$runs/$v" task=all scalings="$scalings" "$@"
done

echo "== report -> $runs/report"
python -m eval.report $(for v in $variants; do echo "$runs/$v"; done) --out "$runs/report"
