#!/usr/bin/env bash
# The torch range requirements.txt admits, tested at both ends: builds one venv per torch release
# (the oldest and the newest by default) and runs the model, GPU-path and training tests in each.
#
#   bash bench/torch_range.sh                       # 2.11.0 and 2.15.0 -> $ROOT/table.md
#   TORCHES="2.13.0" bash bench/torch_range.sh      # any releases (`pip index versions torch`)
#   TESTS="tests/test_gpu_path.py" bash bench/torch_range.sh
#   INSTALL_ONLY=1 bash bench/torch_range.sh        # the downloads only (start early: GBs)
#   REPORT_ONLY=1 bash bench/torch_range.sh         # the table again from the last runs' reports
#
# Each venv sees the system site-packages (deepspeed, hydra, pytest... as installed here) and gets
# its own torch from the registry: the CPU build where one is at hand (pip's find-links, /opt/wheels
# on the machine this was written on, has 2.13.0+cpu), otherwise PyPI's regular build, CUDA
# libraries and all (about 3 GB a release), whose CPU path the tests run the same way. A machine-wide
# pip constraint capping torch (/etc/xdg/pip/constraints.txt here) is lifted for these venvs only
# (PIP_CONSTRAINT=/dev/null). DeepSpeed's just-in-time ops are built per venv (TORCH_EXTENSIONS_DIR),
# never one release's build loaded by another.
# Each test file runs in a pytest process of its own, one worker, one thread; the table (torch
# release x test file: passed/failed/skipped) goes to $ROOT/table.md, each file's output to
# $ROOT/<release>/<file>.log. Exit status 1 if any test failed or errored.
# Environment: ROOT (/tmp/coca_torch_range), TORCHES, TESTS, MARK (pytest -m: "not slow"), TIMEOUT (seconds
# per test file: 1800).
set -uo pipefail
cd "$(dirname "$0")/.."
root=${ROOT:-/tmp/coca_torch_range}
torches=${TORCHES:-"2.11.0 2.15.0"}
# The model (every design's attention and its documents), the forced GPU path (FlexAttention
# compiled, mixed-dtype inputs under autocast), the trainer's units and DeepSpeed's engine.
tests=${TESTS:-"tests/test_model_attention.py tests/test_model_documents.py tests/test_model_hybrid_global.py
  tests/test_gpu_path.py tests/test_train_units.py tests/test_grad_accum_dtype.py"}
# Tests marked slow (the fake-CUDA sweeps and compiled forwards of every design: over 30 minutes for
# tests/test_gpu_path.py alone on a busy 2-core machine) are left out unless MARK="" asks for them.
mark=${MARK-"not slow"}
limit=${TIMEOUT:-1800}
export OMP_NUM_THREADS=1 PIP_CONSTRAINT=/dev/null
mkdir -p "$root"
failed=0
for v in $torches; do
  [ "${REPORT_ONLY:-0}" = 1 ] && break
  venv=$root/venv-$v
  [ -x "$venv/bin/python" ] || python3 -m venv --system-site-packages "$venv"
  have=$("$venv/bin/python" -c 'import torch; print(torch.__version__.split("+")[0])' 2>/dev/null)
  if [ "$have" != "$v" ] || [ "$("$venv/bin/python" -c 'import sys; print(sys.prefix)')" != "$venv" ]; then
    echo "== $v: pip install torch==$v into $venv"
    "$venv/bin/python" -m pip install -q "torch==$v" > "$root/install-$v.log" 2>&1 \
      || { echo "install of torch $v failed: $root/install-$v.log"; failed=1; continue; }
  fi
  # torch must be the venv's own, not the system's (the system site-packages come after the venv's).
  "$venv/bin/python" -c "import torch, sys; assert torch.__file__.startswith('$venv'), torch.__file__; \
print('torch', torch.__version__, torch.__file__)" || { failed=1; continue; }
  [ "${INSTALL_ONLY:-0}" = 1 ] && continue
  mkdir -p "$root/$v"
  for t in $tests; do
    [ -f "$t" ] || { echo "$t: no such file"; continue; }
    log=$root/$v/$(basename "$t" .py).log
    echo "== torch $v: $t"
    TORCH_EXTENSIONS_DIR=$root/ext-$v timeout -k 10 "$limit" "$venv/bin/python" -m pytest -q -n 0 -p no:cacheprovider \
      -m "$mark" --junitxml "$root/$v/$(basename "$t" .py).xml" "$t" > "$log" 2>&1
    tail -n 1 "$log"
  done
done
[ "${INSTALL_ONLY:-0}" = 1 ] && exit $failed
# The table: one row per test file, one column per release, from pytest's JUnit reports.
python3 - "$root" "$torches" "$tests" > "$root/table.md" <<'EOF' || failed=1
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

root, torches, tests = Path(sys.argv[1]), sys.argv[2].split(), sys.argv[3].split()
bad = False
print("| test file | " + " | ".join(f"torch {v}" for v in torches) + " |")
print("|---|" + "---|" * len(torches))
for t in tests:
    cells = []
    for v in torches:
        xml = root / v / f"{Path(t).stem}.xml"
        if not xml.exists():
            cells.append("not run")
            bad = True
            continue
        suite = ET.parse(xml).getroot().find("testsuite")
        n, fail, err, skip = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
        bad |= fail + err > 0
        cells.append(f"{n - fail - err - skip} passed / {fail + err} failed / {skip} skipped")
    print(f"| {t} | " + " | ".join(cells) + " |")
sys.exit(1 if bad else 0)
EOF
cat "$root/table.md"
exit $failed
