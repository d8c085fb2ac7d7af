#!/usr/bin/env bash
# Reproduce the CoCA paper's 350M / 512-token experiments (docs/RESULTS.md):
#   1. train Origin, ALiBi, CoCA (slack) and CoCA (strict), identical but for attention
#      (conf/experiment/paper_350m*.yaml: ~50B tokens of the paper's mixture, bf16, ZeRO-3);
#   2. evaluate each on PG-19 test: sliding-window perplexity and passkey retrieval at 512 .. 32K,
#      with RoPE as trained and with dynamic NTK at factors 2, 4, 8, plus attention statistics;
#   3. write the comparison report (one table and one figure per task).
#
#   launch/reproduce_paper.sh                  # one node, all local GPUs
#   SLURM=1 launch/reproduce_paper.sh          # each training as a SLURM job (launch/slurm.sbatch)
#   DRY_RUN=1 launch/reproduce_paper.sh        # the whole chain on CPU: tiny model, a few steps, stdlib
#
# Environment: RUNS (output root, default runs/paper), NGPU (default: all visible GPUs),
# VARIANTS (default "origin alibi coca coca_strict"). Extra arguments are Hydra overrides passed to
# every training run (e.g. max_steps=1000). A finished variant is skipped; an interrupted one
# resumes from its newest checkpoint (resume=auto).
set -euo pipefail
cd "$(dirname "$0")/.."

RUNS=${RUNS:-runs/paper}
VARIANTS=${VARIANTS:-"origin alibi coca coca_strict"}
DRY_RUN=${DRY_RUN:-0}

if [ "$DRY_RUN" = 1 ]; then
  # Same chain, CPU-sized: one process, tiny model at 64 tokens, 4 steps, the stdlib corpus.
  train_cmd=(python -m train)
  train_extra=(resume=auto model=tiny model.max_seq_len=64 data=stdlib data.tokenizer.vocab_size=512
               data.tokenizer.sample_docs=60 data.num_workers=0 data.shuffle_buffer=16
               deepspeed=zero0 deepspeed.precision=fp32 batch_size=4 micro_batch_size=4
               max_steps=4 eval_every=4 eval_batches=2 ckpt_every=4 optim.warmup_steps=1
               logger.wandb=disabled logger.progress=false)
  eval_extra=(ppl.lengths=[64,128] ppl.n_docs=2 passkey.lengths=[256,512] passkey.n_cases=4
              attention.length=128 attention.scalings=[none,dynamic:4] wandb.mode=disabled progress=false)
else
  if [ -z "${NGPU:-}" ]; then NGPU=$(python -c "import torch; print(torch.cuda.device_count())"); fi
  # shellcheck source=launch/study_lib.sh
  source launch/study_lib.sh  # whole_number
  whole_number NGPU "$NGPU"
  if [ "${SLURM:-0}" = 1 ]; then
    train_cmd=(sbatch --wait launch/slurm.sbatch)  # passes resume=auto itself
    train_extra=()
  else
    train_cmd=(env NUM_GPUS="$NGPU" launch/train_single_node.sh)  # signals reach the ranks (docs/DESIGN.md)
    train_extra=(resume=auto)
  fi
  # PG-19 test (hub), the paper's protocol: 100 documents cut to 32K tokens, stride 512, 100 cases.
  eval_extra=("sources=[{kind:hub,name:emozilla/pg19,split:'train,validation,test'}]"
              ppl.n_docs=100 ppl.stride=512 passkey.n_cases=100 device=cuda)
fi

for v in $VARIANTS; do
  run_dir="$RUNS/$v"
  if [ -f "$run_dir/DONE" ]; then
    echo "== $v: trained already ($run_dir)"; continue
  fi
  echo "== train $v -> $run_dir"
  "${train_cmd[@]}" experiment="paper_350m_$v" run_dir="$run_dir" "${train_extra[@]}" "$@"
  touch "$run_dir/DONE"
done

launch/evaluate_runs.sh "$RUNS" "$VARIANTS" "${eval_extra[@]}"
