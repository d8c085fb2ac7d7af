#!/usr/bin/env bash
# The perplexity study (docs/RESULTS.md), as pre-registered in conf/study/perplexity.yaml: every design
# of the registry (model/designs/registry.py) trained on standard-library text alone at 256 tokens
# (conf/experiment/study_ppl.yaml, the design by one override), with the file's seeds (training seed
# = data-order seed), then sliding-window perplexity on the same 20 held-out documents at 1x .. 32x
# the training length, designs with RoPE as trained and with dynamic NTK 8, and one seed report with
# the pre-registered family first. launch/reproduce_study.sh runs it with these settings; its
# environment applies (RUNS, default runs/perplexity; DESIGNS; SEEDS; STEPS; JOBS; RESULTS; EVAL).
#
#   RESULTS=docs/results/perplexity launch/reproduce_perplexity.sh   # the whole study, published as it lands
#   DESIGNS="origin nope" SEEDS="1 2" STEPS=100 launch/reproduce_perplexity.sh
set -euo pipefail
cd "$(dirname "$0")/.."
# 31 stdlib test documents reach 8193 tokens with the study's tokenizer, so 8192 (32x) is the longest
# length with 20 documents; stride 2048, as the retrieval study.
export RUNS=${RUNS:-runs/perplexity} FAMILY=${FAMILY:-conf/study/perplexity.yaml} PRESET=study_ppl TASK=ppl \
  TEXT_ONLY=0 EVAL=${EVAL:-"ppl.lengths=[256,512,1024,2048,4096,8192] ppl.stride=2048 ppl.n_docs=20"}
DESIGNS=${DESIGNS:-$(python -c 'from model.designs.registry import DESIGNS; print(*DESIGNS)')}
export DESIGNS
exec launch/reproduce_study.sh "$@"
