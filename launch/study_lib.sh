# Functions the study launchers share (sourced, not run): how a design is trained on a preset, which
# RoPE scalings it is evaluated with, and the line naming the machine a run trained on.
# training_args reads PRESET (study: conf/experiment/study_<design>.yaml where it exists, else
# study_origin with the design's settings; any other preset with the design's settings);
# scalings_of reads SCALINGS.

training_args() {  # design: the experiment and the design's settings, one argument per line
  if [ "$PRESET" = study ] && [ -f "conf/experiment/study_$1.yaml" ]; then echo "experiment=study_$1"; return; fi
  if [ "$PRESET" = study ]; then echo "experiment=study_origin"; else echo "experiment=$PRESET"; fi
  python -c 'import sys
from model.designs.registry import DESIGNS
design = DESIGNS.get(sys.argv[1])
if design is None:
    sys.exit("error: unknown design " + sys.argv[1] + " (one of: " + ", ".join(DESIGNS) + ")")
print("\n".join(design.overrides()))' "$1"
}

scalings_of() {  # design: the RoPE scalings it is evaluated with (as trained only without RoPE)
  python -c 'import sys
from model.designs.registry import DESIGNS
design = DESIGNS.get(sys.argv[1], DESIGNS["origin"])  # a preset of its own (text): Origin
print(sys.argv[2] if design.rope else "[none]")' "$1" "$SCALINGS"
}

machine() {  # one line per training start (fp32 training differs by CPU)
  local cpu isa
  cpu=$(grep -m1 "model name" /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
  isa=$(grep -m1 -owE "avx2|avx512f|amx_tile" /proc/cpuinfo 2>/dev/null | tr '\n' ' ')
  echo "$(date -u +%FT%TZ) ${cpu:-unknown CPU} (${isa% }; $(nproc --all) cores, $(nproc) threads), torch $(python -c 'import torch; print(torch.__version__)')"
}
