#!/usr/bin/env bash
# The GPU check for a session that is lent one GPU (an H100 or H200 for 15 minutes of device time, all
# tries together, start-up included): a first call of at most BUDGET_S=330 s whose stages run in order of
# value, each one's row in $OUT/summary.md (and its table in $OUT/bench.md) the moment it finishes, then,
# in the same lease, a rerun of what failed or did not fit (summary.md's last line names it, e.g.
# STAGES="env z2_fire generation" BUDGET_S=300): 330 + 300 s of commands, ~2 min of start-up and
# transfers, inside the 15 minutes (docs/GPU.md, "The GPU check").
#
#   bash bench/make_wheels.sh                   # here, once: .whl/ (git-ignored), what the image lacks
#   bash bench/gpu_check.sh                     # there: OUT=<dir> (default gpu_check/) gets the results
#   DRY_RUN=1 bash bench/gpu_check.sh           # every stage's CPU stand-in (CI: tests/test_gpu_check.py)
#
# First it prints its time estimate per stage (bench/gpu_check.py estimate: model FLOPs at 30% of the
# dense bf16 peak, plus each process's fixed costs, stated there) into $OUT/estimate.md, with the disk
# plan; each stage then prints its own estimate as it starts, and a stage whose estimate no longer fits
# in what is left of the budget is skipped, saying so (each also has its own time limit, so one hang does
# not lose the rest). Stages, in order of value:
#   env           install the carried wheels into $SITE (no network there), print versions
#   z2_origin     the real trainer (`python -m train`) on the paper's 350M preset (512 tokens, bf16,
#                 activation checkpointing, stdlib corpus, ZeRO 2), $STEPS steps (15) logged every step;
#                 alone (it trains the tokenizer), checkpointing at $RESUME_AT and the end
#   z2_alibi z2_coca  the paper's two other designs, at once
#   resume        a new run from z2_origin's step-$RESUME_AT checkpoint: its first step must be
#                 $RESUME_AT + 1 with the uninterrupted run's loss (relative 2e-3 in bf16)
#   bench_train   python -m bench.train: ours vs HF GPT-NeoX at 125m (vocabulary 50304): tokens/s, MFU
#   z2_<variant>  every other design of the registry and one modifier row ($VARIANTS, `preset` below),
#                 $PARALLEL at a time on the one GPU (memory and the disk budget decide how many: below)
#   generation    python -m bench.generation: every variant's 350M model, fp32 and bf16 autocast, a
#                 512-token prompt and 32 greedy tokens over the KV cache; the last cached step's
#                 logits must equal a full forward's (the KV-cache bias path)
#   bench_attention  python -m bench.attention at 2K and 8K tokens, every design of the registry
#   bench_doc_mask   python -m bench.doc_mask: document-masked vs unmasked attention at 2K and 8K
#   bench_sequence_parallel  python -m bench.sequence_parallel: one row at 16K-64K tokens on one GPU vs
#                 two (NCCL); skipped, saying so, on a machine with one GPU
#   gpu_path      dry run only: python -m bench.gpu_path, the GPU path forced on the CPU (every
#                 op it dispatches has a CUDA kernel; compiled FlexAttention equals the CPU kernels)
#   bench_train_compiled  bench_train with our blocks compiled (GPU only)
# Every trainer run checks the loss falls by 5% and every value is finite. tokens/s and MFU are the
# medians of the trainer's own per-step metrics after step 5 (runs trained at once share the GPU: their
# tokens/s are not each one's alone; bench_train's MFU is); peak memory is torch.cuda.max_memory_allocated.
# Disk: every trainer run writes a checkpoint at its last step (a 350M ZeRO 2 checkpoint is ~4.3 GB:
# bench/gpu_check.py checkpoint_gb), removed as soon as the run is judged; z2_origin keeps only its
# step-$RESUME_AT one for resume. Before the trainer starts, `df` on $WORK gives the free space; the disk
# budget (DISK_GB, default: free space less 5 GB) caps the runs at once (one checkpoint each) and drops
# resume (two checkpoints at once) if it cannot hold them.
#
# $OUT gets 7 small files: estimate.md, summary.md (the table), results.jsonl (one line per stage),
# metrics.jsonl (every trainer record, with its stage), bench.md (the benchmark tables), env.txt
# (versions, install plan), log.txt (the end of every stage's output).
# Environment: OUT, BUDGET_S (seconds for the whole call: 330), STAGES (a space-separated subset to
# rerun, e.g. "env z2_alibi generation"), VARIANTS, PARALLEL, STEPS, RESUME_AT, DISK_GB, WHEELS (.whl),
# SITE (/tmp/coca_site), WORK (scratch for runs and the tokenizer: /tmp/coca_gpu_check), CAPS (each kind
# of stage's own time limit, e.g. "env=90 train=150 bench=150", the GPU's).
set -uo pipefail
cd "$(dirname "$0")/.."
dry=${DRY_RUN:-0}
out=${OUT:-gpu_check}
work=${WORK:-${TMPDIR:-/tmp}/coca_gpu_check}
wheels=${WHEELS:-.whl}
site=${SITE:-/tmp/coca_site}
# Every design of the registry: the paper's three first (Origin, resumed, then ALiBi and CoCA: the
# check's most valuable rows), then the FlexAttention ones (their compiles overlap in one wave), then the
# rest; last one modifier row, `<design>+<modifier>...`: Origin with attention sinks, SSMax and QK-norm at
# once. Each is GPU code of its own (sinks: the explicit sink chunks, as FlexAttention cannot add their
# column; SSMax: q scaled by each query's key count; QK-norm: RMSNorm of q and k) and they compose in one
# layer, so one run covers the three for one process's cost (tests/test_model_modifiers.py checks each
# alone and all three against their definitions on a CPU).
# Not here: the hybrid with RoPE global layers (Gemma 3's layout), whose kernels are the hybrid's
# (FlexAttention windows, SDPA global layers); only its global layers' RoPE base differs, which the CPU
# tests check (tests/test_model_hybrid_global.py).
variants=${VARIANTS:-"origin alibi coca kerple fire fox fox_pro hybrid coca_strict nope prope pope stick_breaking origin+sinks+ssmax+qk_norm"}
first=${variants%% *}
# The variants trained right after the first, before resume and MFU: the paper's designs among $variants.
paper=(); others=()
for v in ${variants#"$first"}; do
  case "$v" in alibi|coca) paper+=("$v") ;; *) others+=("$v") ;; esac
done
only=${STAGES:-}
py=python3
export PYTHONUNBUFFERED=1 TRAIN_TRACEBACK=1 WANDB_MODE=disabled HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
mkdir -p "$out"
rm -f "$out"/{estimate.md,summary.md,results.jsonl,metrics.jsonl,bench.md,env.txt,log.txt}
rm -rf "$work/runs" "$work/logs"  # the tokenizer cache ($work/cache) may stay: it is keyed by its spec
mkdir -p "$work/logs" "$work/runs"
# The GPUs here and the first one's memory in GiB (0 0 on a CPU).
read -r gpus gpu_gib < <("$py" -c "import torch; n = torch.cuda.device_count()
print(n, n and torch.cuda.get_device_properties(0).total_memory >> 30)" 2>/dev/null || echo 0 0)

if [ "$dry" = 1 ]; then
  # CPU: the presets' attention and training path, the tiny model at 64 tokens, fp32, 8 steps, one at a time.
  budget=${BUDGET_S:-1500}; steps=${STEPS:-8}; resume_at=${RESUME_AT:-5}; tol=1e-5
  parallel=${PARALLEL:-1}
  ckpt_gb=0.05  # the tiny model's ZeRO 2 checkpoint is ~20 MB
  size=(model=tiny model.max_seq_len=64 deepspeed.precision=fp32 data.tokenizer.vocab_size=512
        data.tokenizer.sample_docs=60 data.num_workers=0 data.shuffle_buffer=16
        batch_size=4 micro_batch_size=2 optim.lr=3e-3 optim.warmup_steps=2)
  generation=(--flavor tiny --prompt 48 --new 4 --vocab-size 512)
  bench_train=(--flavors tiny --steps 2)
  bench_attention=(--lengths 128 --repeats 1 --heads 2 --variants origin alibi)
  bench_doc_mask=(--lengths 128 --repeats 1 --heads 2 --tokens 256 --attentions origin alibi --vocab-size 512 --memory-repeats 1
                --sample-docs 60)
  bench_sp=(--lengths 256 512 --width 64 --heads 2)
  gpu_path=(--designs alibi --flex)  # the stage itself, on one design (every design: tests/test_gpu_path.py)
  caps=(env=90 train=180 bench=300)  # generous: only a hang should reach them on a busy CPU
else
  # The preset's model (350m, 512 tokens, bf16, activation checkpointing) and micro batch of 16,
  # 2 micro-batches per optimizer step (32 x 512 = 16,384 tokens).
  budget=${BUDGET_S:-330}; steps=${STEPS:-15}; resume_at=${RESUME_AT:-10}; tol=2e-3
  # Trainer processes at a time: as many as the GPU's memory holds at 10 GiB each. One 350M process
  # (306M parameters) under ZeRO 2 on one rank holds ~7.7 GB of model states: bf16 weights 0.6, fp32
  # master weights 1.2, Adam's moments 2.5, the gradient partition 1.2 (fp32: train/engine.py's
  # bf16_gradient_dtypes sets data_types.grad_accum_dtype=fp32; DeepSpeed's default would keep it in
  # bf16, 0.6), DeepSpeed's reduce bucket of 5e8 bf16 elements 1.0 and, with communication_data_type
  # fp32, its fp32 copy while reducing (up to the model's 306M elements, 1.2); ~1 GB of activations
  # (the checkpointed layer inputs 0.4, one layer recomputed in backward, a 64 MB chunk of logits) and
  # its CUDA context (~0.5): ~9.2 GB, 10 GiB with the caching allocator's slack (none of it measured
  # yet). An H200 (~139 GiB) holds 13, an H100 (~79 GiB) 7; the disk budget may allow fewer.
  parallel=${PARALLEL:-$(( gpu_gib >= 20 ? gpu_gib / 10 : 1 ))}
  ckpt_gb=$("$py" bench/gpu_check.py checkpoint-gb)
  # Four loader workers (of 16 CPUs) so that tokenizing never limits tokens/s.
  size=(batch_size=32 micro_batch_size=16 optim.warmup_steps=5 data.num_workers=4)
  generation=(--flavor 350m --prompt 512 --new 32)
  bench_train=(--flavors 125m --steps 10 --vocab-size 50304)
  bench_attention=(--lengths 2048 8192 --repeats 3)
  bench_doc_mask=(--lengths 2048 8192 --repeats 3)
  bench_sp=(--device cuda --lengths 16384 32768 65536 --layers 4 --width 1024 --heads 16 --repeats 3)
  caps=(env=90 train=150 bench=150)
fi
[ -n "${CAPS:-}" ] && read -ra caps <<< "$CAPS"  # e.g. CAPS="env=600 train=900 bench=900" on a busy CPU
cap() { local kv; for kv in "${caps[@]}"; do [ "${kv%%=*}" = "$1" ] && echo "${kv#*=}"; done; }
common=(data=stdlib logger=none logger.progress=false logger.log_every=1 "data.cache_dir=$work/cache"
        "max_steps=$steps" "eval_every=$steps" eval_batches=2 keep_last=2 deepspeed=zero2 "${size[@]}")
t0=$SECONDS
reserve=10
failed=0

report() { "$py" bench/gpu_check.py record "$out" "$@" >> "$out/log.txt" 2>&1 || true; tail -n 1 "$out/log.txt"; }
wanted() { [ -z "$only" ] || [ "$1" = env ] || [[ " $only " == *" $1 "* ]]; }

# ---- the disk budget, then the estimate, before anything runs -------------------------------------------
# df's free space where the runs write; the budget caps the trainer runs at once and decides resume.
free_gb=$(df -Pk "$work" | awk 'NR == 2 {printf "%.1f", $4 / 1048576}')
disk_args=(--free-gb "$free_gb" --ckpt-gb "$ckpt_gb" --parallel "$parallel")
[ -n "${DISK_GB:-}" ] && disk_args+=(--budget-gb "$DISK_GB")
"$py" bench/gpu_check.py disk "${disk_args[@]}" > "$work/disk.txt"
read -r parallel disk_resume < "$work/disk.txt"
disk_note=$(tail -n 1 "$work/disk.txt")

# Of the GPU run (the dry run's own steps and budget are the CPU stand-ins').
est=(--steps "$steps" --resume-at "$resume_at" --parallel "$parallel" --budget "$budget")
[ "$dry" = 1 ] && est=(--steps 15 --resume-at 10 --parallel 7 --budget 330)  # on an H100
"$py" bench/gpu_check.py estimate --designs "$variants" --batch 32 --gpus "$gpus" "${est[@]}" \
  --tsv "$work/estimate.tsv" | tee "$out/estimate.md"
echo "disk: $disk_note" | tee -a "$out/estimate.md"
[ "$dry" = 1 ] && echo "(dry run: the estimate is of the GPU run; this CPU runs the stand-ins below)" | tee -a "$out/estimate.md"
# A stage's estimated seconds (the GPU's; 0 for one the estimate has no row for).
estimate_of() { awk -v s="$1" '$1 == s {print $2; f = 1} END {if (!f) print 0}' "$work/estimate.tsv"; }

# launch NAME LIMIT command...: start a stage in the background with a time limit (whole process
# group), its output in $work/logs/NAME.log; `finish NAME` waits for it and sets $rc and $secs.
# Returns 1 (and reports the stage skipped) when its estimate no longer fits in the budget (on the GPU;
# the dry run's stand-ins only need a few seconds left).
declare -A pids
launch() {
  local name=$1 limit=$2; shift 2
  local left=$(( budget - (SECONDS - t0) - reserve )) need
  need=$(estimate_of "$name"); [ "$dry" = 1 ] && need=5
  if (( left < need || left < 5 )); then
    report --stage "$name" --skipped "out of time (needs ~${need} s, ${left} s of the ${budget} s budget left)"
    return 1
  fi
  (( limit > left )) && limit=$left
  local said; said=$(estimate_of "$name"); [ "$said" = 0 ] && said="no GPU estimate" || said="estimate ~$said s on the GPU"
  echo "== $name ($said, limit ${limit} s): $*" | tee -a "$out/log.txt"
  ( start=$(date +%s.%N); timeout -k 10 "$limit" "$@" > "$work/logs/$name.log" 2>&1; code=$?
    echo "$code $(awk "BEGIN {print $(date +%s.%N) - $start}")" > "$work/logs/$name.rc" ) &
  pids[$name]=$!
}
finish() {
  local name=$1
  wait "${pids[$name]}"
  read -r rc secs < "$work/logs/$name.rc"
  local keep=60; [ "$rc" = 0 ] || keep=300
  { echo "-- $name: exit $rc after ${secs%.*} s; last $keep lines:"; tail -n "$keep" "$work/logs/$name.log"; } >> "$out/log.txt"
}
stage() { launch "$@" || return 1; finish "$1"; }

# The overrides that train variant $1 (a design's registry key, then any +modifiers) on its 350M preset:
# the paper's own where it has one, else paper_350m_origin with the design's attention (and FoX Pro's form).
preset() {
  local design=${1%%+*} modifier
  case "$design" in
    origin|alibi|coca|coca_strict) printf '%s' "experiment=paper_350m_$design" ;;
    fox_pro) printf '%s' "experiment=paper_350m_origin model.attention=fox model.design_params.fox.form=pro" ;;
    *) printf '%s' "experiment=paper_350m_origin model.attention=$design" ;;
  esac
  for modifier in $(tr + ' ' <<< "${1#"$design"}"); do printf ' %s' "model.$modifier=true"; done
  echo " name=paper_350m_${1//+/_}"
}

# ---- env -----------------------------------------------------------------------------------------
trainer_ok=1
if wanted env; then
  plan=(); [ "$dry" = 1 ] && plan=(--plan)
  if stage env "$(cap env)" "$py" bench/gpu_check.py env "$wheels" "$site" "${plan[@]}"; then
    cp "$work/logs/env.log" "$out/env.txt"
    device=$(grep -m1 '^cuda' "$work/logs/env.log" || true)
    "$py" bench/gpu_check.py meta "$out" "date=$(date -u '+%Y-%m-%d %H:%M UTC')" \
      "mode=$([ "$dry" = 1 ] && echo 'DRY_RUN (CPU, tiny model, fp32)' || echo 'GPU (350m, 512 tokens, bf16)')" \
      "device=${device:-unknown}" "torch=$(grep -m1 '^torch ' "$work/logs/env.log" | cut -d' ' -f2)" \
      "budget_s=$budget" "disk=$disk_note" "command=DRY_RUN=$dry STAGES='$only' bash bench/gpu_check.sh"
    report --stage env --rc "$rc" --seconds "$secs" \
      --note "$(grep -c '^install ' "$work/logs/env.log") wheels $([ "$dry" = 1 ] && echo planned || echo installed)"
    if [ "$dry" != 1 ] && [ "$device" = "cuda: none" ]; then echo "no GPU here: use DRY_RUN=1" | tee -a "$out/log.txt"; exit 1; fi
    # Without the training stack, the benchmarks (torch and transformers only) still run.
    [ "$rc" = 0 ] || { trainer_ok=0; failed=1; }
  fi
fi
[ "$dry" = 1 ] || export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
[ "$parallel" -ge 1 ] || { trainer_ok=0; echo "disk: $disk_note" | tee -a "$out/log.txt"; }

# ---- the trainer ----------------------------------------------------------------------------------
# train_launch NAME DESIGN OVERRIDES...: start one training run; train_finish NAME judges it from its
# metrics and removes its checkpoints (the first's step-$resume_at one stays for resume).
train_launch() {
  local name=$1 design=$2; shift 2
  wanted "$name" || return 1
  if [ "$trainer_ok" != 1 ]; then
    report --stage "$name" --skipped "$([ "$parallel" -ge 1 ] && echo "the env stage failed (see env.txt)" || echo "$disk_note")"
    return 1
  fi
  # shellcheck disable=SC2046  # the preset's overrides are words
  launch "$name" "$(cap train)" "$py" -m train $(preset "$design") "${common[@]}" "$@" "run_dir=$work/runs/$name"
}
train_finish() {
  finish "$1"
  report --stage "$1" --rc "$rc" --seconds "$secs" --run "$work/runs/$1" --meta "design=$2"
  [ "$rc" = 0 ] || failed=1
  if [ "$2" = "$first" ] && [ "$disk_resume" = 1 ]; then
    local keep c; keep=$(printf 'step_%08d' "$resume_at")
    for c in "$work/runs/$1"/checkpoints/*; do [ "${c##*/}" = "$keep" ] || rm -rf "$c"; done
  else
    rm -rf "$work/runs/$1/checkpoints"
  fi
}
# train_wave VARIANT...: $parallel at a time.
train_wave() {
  local wave=() v w
  for v in "$@" ""; do
    [ -n "$v" ] && train_launch "z2_$v" "$v" "ckpt_every=$steps" && wave+=("$v")
    if [ "${#wave[@]}" -ge "$parallel" ] || { [ -z "$v" ] && [ "${#wave[@]}" -gt 0 ]; }; then
      for w in "${wave[@]}"; do train_finish "z2_$w" "$w"; done
      wave=()
    fi
  done
}
first_ckpt=$([ "$disk_resume" = 1 ] && echo "$resume_at" || echo "$steps")
train_launch "z2_$first" "$first" "ckpt_every=$first_ckpt" && train_finish "z2_$first" "$first"
train_wave "${paper[@]}"

if wanted resume; then
  ckpt=$(printf '%s/runs/z2_%s/checkpoints/step_%08d' "$work" "$first" "$resume_at")
  if [ "$disk_resume" != 1 ]; then
    report --stage resume --skipped "$disk_note"
  elif [ "$trainer_ok" != 1 ]; then
    report --stage resume --skipped "the env stage failed (see env.txt)"
  elif [ -f "$ckpt/COMPLETE" ]; then
    # shellcheck disable=SC2046
    if stage resume "$(cap train)" "$py" -m train $(preset "$first") "${common[@]}" "ckpt_every=$first_ckpt" \
        "resume=$ckpt" "run_dir=$work/runs/resume"; then
      report --stage resume --rc "$rc" --seconds "$secs" --run "$work/runs/resume" --reference "$work/runs/z2_$first" \
        --resume-step "$resume_at" --tol "$tol" --meta "design=$first"
      [ "$rc" = 0 ] || failed=1
    fi
  else
    report --stage resume --skipped "no complete checkpoint at step $resume_at of z2_$first"
  fi
fi
rm -rf "$work/runs/z2_$first/checkpoints" "$work/runs/resume/checkpoints"

# ---- MFU, the other designs, generation, the kernels ---------------------------------------------------
bench_stage() {
  local name=$1; shift
  wanted "$name" || return 0
  stage "$name" "$(cap bench)" "$@" || return 0
  { echo "## $name: $*"; echo; grep -v -E '^\s*$|Warning|warn\(' "$work/logs/$name.log" | tail -n 40; echo; } >> "$out/bench.md"
  report --stage "$name" --rc "$rc" --seconds "$secs"
  [ "$rc" = 0 ] || failed=1
}
bench_stage bench_train "$py" -m bench.train "${bench_train[@]}"
train_wave "${others[@]}"
# shellcheck disable=SC2086
bench_stage generation "$py" -m bench.generation "${generation[@]}" --designs $variants
bench_stage bench_attention "$py" -m bench.attention "${bench_attention[@]}"
bench_stage bench_doc_mask "$py" -m bench.doc_mask "${bench_doc_mask[@]}" --cache-dir "$work/cache"
if wanted bench_sequence_parallel; then
  if [ "$dry" != 1 ] && [ "${gpus:-0}" -lt 2 ]; then
    report --stage bench_sequence_parallel --skipped "sequence parallelism (P=2) needs 2 GPUs; this machine has $gpus"
  else
    bench_stage bench_sequence_parallel "$py" -m bench.sequence_parallel "${bench_sp[@]}"
  fi
fi
if [ "$dry" = 1 ]; then
  bench_stage gpu_path "$py" -m bench.gpu_path "${gpu_path[@]}"
  wanted bench_train_compiled && report --stage bench_train_compiled --skipped "dry run: compiling on a 2-core CPU takes minutes"
else
  wanted gpu_path && report --stage gpu_path --skipped "a CPU check (the GPU path forced on CPU tensors): the dry run runs it"
  bench_stage bench_train_compiled "$py" -m bench.train "${bench_train[@]}" --compile
fi

echo "== done in $(( SECONDS - t0 )) s" | tee -a "$out/log.txt"
cat "$out/summary.md"
grep -q '^RESULT: FAIL' "$out/summary.md" && exit 1
exit $failed
