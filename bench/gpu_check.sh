#!/usr/bin/env bash
# The GPU checks for a session that is lent one GPU (about 8 minutes on an H200), in one go:
# bf16 training throughput beside HF GPT-NeoX (eager, then our blocks compiled) with the 350m MFU
# at the paper's vocabulary, and the attention kernels (FlexAttention ALiBi, CoCA) at long lengths.
# Needs only torch and transformers, so it runs on a GPU image without the training stack.
#
#   bash bench/gpu_check.sh            # tables to stdout and to $OUT (default: gpu_check/)
set -euo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu_check}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python3 -c "import torch; assert torch.cuda.is_available(), 'no GPU here'; print(torch.cuda.get_device_name(), torch.__version__)"
python3 -m bench.train --flavors tiny 125m --steps 20 --vocab-size 50304 2>&1 | tee "$out/train_eager.md"
python3 -m bench.train --flavors 125m --steps 20 --vocab-size 50304 --compile 2>&1 | tee "$out/train_compiled.md"
python3 -m bench.attention --lengths 2048 8192 16384 --repeats 3 2>&1 | tee "$out/attention.md"
