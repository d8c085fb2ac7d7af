#!/usr/bin/env bash
# The GPU check for a session that is lent one GPU (an H200 for 15 minutes, all tries together):
# one call of at most 8 minutes (BUDGET_S=480) that runs the path a user takes, then the benchmarks.
#
#   bash bench/make_wheels.sh                   # here, once: .whl/ (git-ignored), what the image lacks
#   bash bench/gpu_check.sh                     # there: OUT=<dir> (default gpu_check/) gets the results
#   DRY_RUN=1 bash bench/gpu_check.sh           # the same stages on CPU, about 2 minutes (CI: tests/test_gpu_check.py)
#
# Stages, in order (each with its own time limit, so one hang does not lose the rest; the results
# are rewritten after every stage):
#   env           install the carried wheels into $SITE (no network there), print versions
#   z2_<variant>  the real trainer (`python -m train`), experiment=paper_350m_<variant> (350m, 512
#                 tokens, bf16, activation checkpointing) on the stdlib corpus under ZeRO 2, for
#                 origin, alibi, coca (slack), coca_strict: $STEPS steps (30), logged every step,
#                 a checkpoint at the end; checks the loss falls by 5% and every value is finite
#   z3_<variant>  the same under ZeRO 3 through the deepspeed launcher, for $Z3_VARIANTS (coca),
#                 with a checkpoint at step $RESUME_AT (20) and at the end
#   resume        a new run from that step-20 checkpoint (deepspeed launcher, ZeRO 3): its first
#                 step must be 21 and its loss the uninterrupted run's (relative 2e-3 in bf16)
#   bench_train   python -m bench.train: ours vs HF GPT-NeoX at 125m (vocabulary 50304), 350m MFU
#   bench_attention  python -m bench.attention at 2K, 8K, 16K tokens, every design of the registry
#                 (the bias designs ALiBi, KERPLE, FIRE, FoX on FlexAttention with captured parameters)
#   bench_doc_mask   python -m bench.doc_mask: document-masked vs unmasked attention at 2K and 8K
#   bench_sequence_parallel  python -m bench.sequence_parallel: per-rank peak memory and step time
#                 of one row at 16K, 32K, 64K tokens, one GPU (P=1) vs two (P=2, NCCL); skipped,
#                 saying so, on a machine with one GPU
#   bench_train_compiled  the same as bench_train with our blocks compiled, if time is left
# tokens/s and MFU are the medians of the trainer's own per-step metrics after step 5; peak memory
# is the trainer's (torch.cuda.max_memory_allocated).
#
# $OUT gets at most 6 small files: summary.md (the table), results.jsonl (one line per stage),
# metrics.jsonl (every trainer record, with its stage), bench.md (the benchmark tables), env.txt
# (versions, install plan), log.txt (the end of every stage's output).
# Environment: OUT, BUDGET_S (seconds for the whole call: 480; stages that no longer fit are
# skipped), STAGES (a space-separated subset to rerun, e.g. "env z2_alibi bench_attention"),
# VARIANTS, Z3_VARIANTS ("origin alibi coca coca_strict" for all four: about 3 minutes more), STEPS,
# WHEELS (.whl), SITE (/tmp/coca_site), WORK (scratch for runs and the tokenizer: /tmp/coca_gpu_check),
# CAPS (each kind of stage's own time limit, e.g. "env=90 train=150 bench=150", the GPU's).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${DRY_RUN:-0}
out=${OUT:-gpu_check}
work=${WORK:-${TMPDIR:-/tmp}/coca_gpu_check}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/coca_site}
variants=${VARIANTS:-"origin alibi coca coca_strict"}
z3s=${Z3_VARIANTS:-coca}  # ZeRO 3 runs; the first is the one resumed
z3=${z3s%% *}
only=${STAGES:-}
py=python3
export PYTHONUNBUFFERED=1 TRAIN_TRACEBACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$out"
rm -f "$out"/{summary.md,results.jsonl,metrics.jsonl,bench.md,env.txt,log.txt}
rm -rf "$work/runs" "$work/logs"  # the tokenizer cache ($work/cache) may stay: it is keyed by its spec
mkdir -p "$work/logs" "$work/runs"

if [ "$dry" = 1 ]; then
  # CPU: the presets' attention and training path, the tiny model at 64 tokens, fp32, 8 steps.
  budget=${BUDGET_S:-600}; steps=${STEPS:-8}; resume_at=${RESUME_AT:-5}; tol=1e-5; min_stage=5
  size=(model=tiny model.max_seq_len=64 deepspeed.precision=fp32 data.tokenizer.vocab_size=512
        data.tokenizer.sample_docs=60 data.num_workers=0 data.shuffle_buffer=16
        batch_size=4 micro_batch_size=2 optim.lr=3e-3 optim.warmup_steps=2)
  bench_train=(--flavors tiny --steps 2)
  bench_attention=(--lengths 128 --repeats 1 --heads 2 --variants origin alibi)
  bench_doc_mask=(--lengths 128 --repeats 1 --heads 2 --tokens 256 --attentions origin alibi --vocab-size 512 --memory-repeats 1
                --sample-docs 60)
  bench_sp=(--lengths 256 512 --width 64 --heads 2)
  caps=(env=90 train=180 bench=180)  # generous: only a hang should reach them on a busy CPU
else
  # The preset's model (350m, 512 tokens, bf16, activation checkpointing) and micro batch of 16,
  # 4 micro-batches per optimizer step (64 x 512 = 32,768 tokens).
  budget=${BUDGET_S:-480}; steps=${STEPS:-30}; resume_at=${RESUME_AT:-20}; tol=2e-3; min_stage=20
  # Four loader workers (of 16 CPUs) so that tokenizing never limits tokens/s.
  size=(batch_size=64 micro_batch_size=16 optim.warmup_steps=5 data.num_workers=4)
  bench_train=(--flavors 125m --steps 10 --vocab-size 50304)
  bench_attention=(--lengths 2048 8192 16384 --repeats 3)
  bench_doc_mask=(--lengths 2048 8192 --repeats 3)
  bench_sp=(--device cuda --lengths 16384 32768 65536 --layers 4 --width 1024 --heads 16 --repeats 3)
  caps=(env=90 train=150 bench=150)
fi
[ -n "${CAPS:-}" ] && read -ra caps <<< "$CAPS"  # e.g. CAPS="env=600 train=900 bench=900" on a busy CPU
cap() { local kv; for kv in "${caps[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }
common=(data=stdlib logger=none logger.progress=false logger.log_every=1 "data.cache_dir=$work/cache"
        "max_steps=$steps" "eval_every=$steps" eval_batches=2 keep_last=2 "${size[@]}")
t0=$SECONDS
reserve=10
failed=0

report() { "$py" bench/gpu_check.py record "$out" "$@" >> "$out/log.txt" 2>&1 || true; tail -n 1 "$out/log.txt"; }
wanted() { [ -z "$only" ] || [ "$1" = env ] || [[ " $only " == *" $1 "* ]]; }

# stage NAME LIMIT command...: run with a time limit (whole process group), log to $work/logs/NAME.log,
# keep its last lines in $OUT/log.txt. Sets $rc and $secs; returns 1 if skipped for lack of time.
stage() {
  local name=$1 limit=$2; shift 2
  local left=$(( budget - (SECONDS - t0) - reserve ))
  if (( left < min_stage )); then
    report --stage "$name" --skipped "out of time (${left} s of the ${budget} s budget left)"
    return 1
  fi
  (( limit > left )) && limit=$left
  echo "== $name (limit ${limit} s): $*" | tee -a "$out/log.txt"
  local start; start=$(date +%s.%N)
  timeout -k 10 "$limit" "$@" > "$work/logs/$name.log" 2>&1
  rc=$?
  secs=$(awk "BEGIN {print $(date +%s.%N) - $start}")
  local keep=60; [ "$rc" = 0 ] || keep=300
  { echo "-- $name: exit $rc after ${secs%.*} s; last $keep lines:"; tail -n "$keep" "$work/logs/$name.log"; } >> "$out/log.txt"
  return 0
}

free_port() { "$py" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# train_stage NAME LAUNCHER(plain|deepspeed) OVERRIDES...: one training run, judged from its metrics.
trainer_ok=1
train_stage() {
  local name=$1 launcher=$2; shift 2
  wanted "$name" || return 0
  if [ "$trainer_ok" != 1 ]; then report --stage "$name" --skipped "the env stage failed (see env.txt)"; return 0; fi
  local cmd=("$py" -m train)
  [ "$launcher" = deepspeed ] && cmd=("$py" -m deepspeed.launcher.runner --num_gpus 1 --master_port "$(free_port)" --module train)
  stage "$name" "$(cap train)" "${cmd[@]}" "$@" "run_dir=$work/runs/$name" || return 0
  report --stage "$name" --rc "$rc" --seconds "$secs" --run "$work/runs/$name" --meta "launcher=$launcher"
  [ "$rc" = 0 ] || failed=1
}

# ---- env -----------------------------------------------------------------------------------------
if wanted env; then
  plan=(); [ "$dry" = 1 ] && plan=(--plan)
  if stage env "$(cap env)" "$py" bench/gpu_check.py env "$wheels" "$site" "${plan[@]}"; then
    cp "$work/logs/env.log" "$out/env.txt"
    device=$(grep -m1 '^cuda' "$work/logs/env.log" || true)
    "$py" bench/gpu_check.py meta "$out" "date=$(date -u '+%Y-%m-%d %H:%M UTC')" \
      "mode=$([ "$dry" = 1 ] && echo 'DRY_RUN (CPU, tiny model, fp32)' || echo 'GPU (350m, 512 tokens, bf16)')" \
      "device=${device:-unknown}" "torch=$(grep -m1 '^torch ' "$work/logs/env.log" | cut -d' ' -f2)" \
      "budget_s=$budget" "command=DRY_RUN=$dry STAGES='$only' bash bench/gpu_check.sh"
    report --stage env --rc "$rc" --seconds "$secs" \
      --note "$(grep -c '^install ' "$work/logs/env.log") wheels $([ "$dry" = 1 ] && echo planned || echo installed)"
    if [ "$dry" != 1 ] && [ "$device" = "cuda: none" ]; then echo "no GPU here: use DRY_RUN=1" | tee -a "$out/log.txt"; exit 1; fi
    # Without the training stack, the benchmarks (torch and transformers only) still run.
    [ "$rc" = 0 ] || { trainer_ok=0; failed=1; }
  fi
fi
[ "$dry" = 1 ] || export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"

# ---- the trainer ---------------------------------------------------------------------------------
for v in $variants; do
  train_stage "z2_$v" plain "experiment=paper_350m_$v" deepspeed=zero2 "${common[@]}" "ckpt_every=$steps"
  rm -rf "$work/runs/z2_$v/checkpoints"  # GBs each on the GPU
done
for v in $z3s; do
  train_stage "z3_$v" deepspeed "experiment=paper_350m_$v" deepspeed=zero3 "${common[@]}" "ckpt_every=$resume_at"
  [ "$v" = "$z3" ] || rm -rf "$work/runs/z3_$v/checkpoints"
done
if wanted resume; then
  ckpt=$(printf '%s/runs/z3_%s/checkpoints/step_%08d' "$work" "$z3" "$resume_at")
  if [ "$trainer_ok" != 1 ]; then
    report --stage resume --skipped "the env stage failed (see env.txt)"
  elif [ -f "$ckpt/COMPLETE" ]; then
    if stage resume "$(cap train)" "$py" -m deepspeed.launcher.runner --num_gpus 1 --master_port "$(free_port)" \
        --module train "experiment=paper_350m_$z3" deepspeed=zero3 "${common[@]}" "ckpt_every=$resume_at" \
        "resume=$ckpt" "run_dir=$work/runs/resume"; then
      report --stage resume --rc "$rc" --seconds "$secs" --run "$work/runs/resume" --reference "$work/runs/z3_$z3" \
        --resume-step "$resume_at" --tol "$tol" --meta "launcher=deepspeed"
      [ "$rc" = 0 ] || failed=1
    fi
  else
    report --stage resume --skipped "no complete checkpoint at step $resume_at of z3_$z3"
  fi
fi
rm -rf "$work/runs/z3_$z3/checkpoints" "$work/runs/resume/checkpoints"

# ---- the benchmarks ------------------------------------------------------------------------------
bench_stage() {
  local name=$1; shift
  wanted "$name" || return 0
  stage "$name" "$(cap bench)" "$@" || return 0
  { echo "## $name: $*"; echo; grep -v -E '^\s*$|Warning|warn\(' "$work/logs/$name.log" | tail -n 40; echo; } >> "$out/bench.md"
  report --stage "$name" --rc "$rc" --seconds "$secs"
  [ "$rc" = 0 ] || failed=1
}
bench_stage bench_train "$py" -m bench.train "${bench_train[@]}"
bench_stage bench_attention "$py" -m bench.attention "${bench_attention[@]}"
bench_stage bench_doc_mask "$py" -m bench.doc_mask "${bench_doc_mask[@]}" --cache-dir "$work/cache"
if wanted bench_sequence_parallel; then
  gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  if [ "$dry" != 1 ] && [ "${gpus:-0}" -lt 2 ]; then
    report --stage bench_sequence_parallel --skipped "sequence parallelism (P=2) needs 2 GPUs; this machine has $gpus"
  else
    bench_stage bench_sequence_parallel "$py" -m bench.sequence_parallel "${bench_sp[@]}"
  fi
fi
if [ "$dry" = 1 ]; then
  wanted bench_train_compiled && report --stage bench_train_compiled --skipped "dry run: compiling on a 2-core CPU takes minutes"
else
  bench_stage bench_train_compiled "$py" -m bench.train "${bench_train[@]}" --compile
fi

echo "== done in $(( SECONDS - t0 )) s" | tee -a "$out/log.txt"
cat "$out/summary.md"
grep -q '^RESULT: FAIL' "$out/summary.md" && exit 1
exit $failed
