#!/usr/bin/env bash
# Retrieval for the designs added after the study (docs/RESULTS.md), as pre-registered in
# conf/study/designs.yaml (with its amendment): Origin and each new design trained on the study's
# retrieval mix with the study's preset (study_origin with the design's attention), the file's seeds,
# seed by seed (every design of a seed on the same machine), evaluated as the study's runs are, and
# one seed report, the pre-registered family first. Origin is retrained here: the study's published
# runs came from another CPU, and fp32 training is not bitwise reproducible across CPUs (PUBLISHED=
# <folder> reports runs published there instead of retraining them).
# launch/reproduce_study.sh runs it with these settings; its environment applies (RUNS, default
# runs/designs; DESIGNS; SEEDS; STEPS; JOBS; RESULTS; EVAL).
#
#   RESULTS=docs/results/designs launch/reproduce_designs.sh   # the whole arm, published as it lands
#   DESIGNS=origin SEEDS=1 launch/reproduce_designs.sh          # retrain the study's origin_s1, then:
#   python -m eval.replicate docs/results/study/origin_s1 runs/designs/origin_s1/eval
set -euo pipefail
cd "$(dirname "$0")/.."
export RUNS=${RUNS:-runs/designs} FAMILY=${FAMILY:-conf/study/designs.yaml} TEXT_ONLY=0 \
  PUBLISHED=${PUBLISHED:-} DESIGNS=${DESIGNS:-"origin nope prope hybrid kerple fire fox"}
exec launch/reproduce_study.sh "$@"
