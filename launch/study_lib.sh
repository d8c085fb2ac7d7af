# Functions the study launchers share (sourced, not run): how a design is trained on a preset, which
# RoPE scalings it is evaluated with, and the line naming the machine a run trained on. A design is
# a registry key or a variant of the family file (launch/study_design.py says how both are read).
# training_args reads FAMILY, PRESET (study: conf/experiment/study_<design>.yaml where it exists, else
# study_origin with the design's settings; any other preset with the design's settings);
# scalings_of reads FAMILY and SCALINGS; source_of reads FAMILY. whole_number checks a launcher's count
# settings (JOBS: `wait -n` never returns with JOBS=0) before anything starts; cause_of finds why a
# run failed in its log, the line a launcher ends with. Each answer that needs Python (which imports
# torch: about 2 s a call) is computed once per launch, kept in a folder the launcher removes on exit.

STUDY_MEMO="${TMPDIR:-/tmp}/study_memo_$$_$RANDOM"  # named here, made by the first `memo`
trap 'rm -rf "$STUDY_MEMO"' EXIT

memo() {  # key command...: the command's output, run once per launch (a failure is not kept)
  local file="$STUDY_MEMO/$1" tmp="$STUDY_MEMO/.$1.$BASHPID"
  shift
  if [ ! -f "$file" ]; then
    mkdir -p "$STUDY_MEMO"
    "$@" > "$tmp" || { rm -f "$tmp"; return 1; }
    mv "$tmp" "$file"
  fi
  cat "$file"
}

training_args() {  # design: the experiment and the design's settings, one argument per line
  memo "args_$1" python launch/study_design.py args "${FAMILY:-}" "$PRESET" "$1"
}

scalings_of() {  # design: the RoPE scalings it is evaluated with (as trained only without RoPE)
  memo "scalings_$1" python launch/study_design.py scalings "${FAMILY:-}" "$1" "$SCALINGS"
}

source_of() {  # design: the design whose run of the same seed it continues, or nothing
  memo "source_$1" python launch/study_design.py source "${FAMILY:-}" "$1"
}

machine() {  # one line per training start (fp32 training differs by CPU), with the code it ran
  local cpu isa code
  cpu=$(grep -m1 "model name" /proc/cpuinfo 2>/dev/null | cut -d: -f2- | sed 's/^ *//')
  isa=$(grep -m1 -owE "avx2|avx512f|amx_tile" /proc/cpuinfo 2>/dev/null | tr '\n' ' ')
  code=$(git rev-parse --short=12 HEAD 2>/dev/null || echo unknown)
  if [ "$code" != unknown ] && [ -n "$(git status --porcelain --untracked-files=no 2>/dev/null)" ]; then
    code="$code with uncommitted changes"
  fi
  echo "$(date -u +%FT%TZ) ${cpu:-unknown CPU} (${isa% }; $(nproc --all) cores, $(nproc) threads), torch $(memo torch_version python -c 'import torch; print(torch.__version__)'), code $code"
}

whole_number() {  # NAME VALUE: a whole number >= 1, else one `error:` line and exit 2 (sourced: the launcher exits)
  if ! [[ "$2" =~ ^[0-9]+$ ]] || (( 10#$2 < 1 )); then
    echo "error: $1=$2 is not a whole number >= 1" >&2
    exit 2
  fi
}

cause_of() {  # log: the line that says why its run failed (its last `error:` line's cause, else its last line)
  local line
  line=$(grep -a "error: " "$1" 2>/dev/null | tail -n 1 || true)
  line=${line#*error: }
  if [ -z "$line" ]; then line=$(grep -a -v "^[[:space:]]*$" "$1" 2>/dev/null | tail -n 1 || true); fi
  echo "${line:-its log $1 is empty} (log: $1)"
}
