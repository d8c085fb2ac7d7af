#!/usr/bin/env bash
# Make the folder of wheels that a lent GPU machine lacks for the training path, for its Python 3.12
# on x86-64 Linux (manylinux); bench/gpu_check.sh installs them there (that machine has no network).
#
#   bash bench/make_wheels.sh            # -> .whl/ (git-ignored), its size printed at the end
#   WHEELS=dir bash bench/make_wheels.sh
#   WITH_PYARROW=1 bash bench/make_wheels.sh   # with the 47 MiB pyarrow wheel (see below; not carried by default)
#
# The GPU image (the device README's KINDS.md) has torch, transformers, sentencepiece, numpy,
# pandas, pyarrow, fsspec, huggingface-hub, tqdm, psutil, py-cpuinfo, msgpack, einops, ninja and
# pyyaml, but not deepspeed, hydra-core, omegaconf, datasets or torchdata. Versions are the ones
# this repository's tests run with. wandb is not carried: the check trains with logger=none.
#
# Two kinds of wheel:
#   - missing on the image: always installed;
#   - present on the image, but perhaps too old or too new for what we carry (listed with a version
#     range in CONDITIONS): installed only when the image's own version is outside that range
#     (decided there by bench/gpu_check_report.py install).
# deepspeed and antlr4-python3-runtime publish source distributions only: their wheels are built
# here, pure Python (DS_BUILD_OPS=0: no CUDA op is pre-compiled; DeepSpeed compiles an op just in
# time only if a run asks for one, and the trainer's path asks for none).
set -euo pipefail
cd "$(dirname "$0")/.."
dest=${WHEELS:-.whl}
mkdir -p "$dest"
rm -f "$dest"/*.whl "$dest/CONDITIONS"  # one version of each: two would stop the install there
pip=(python3 -m pip)

# Missing on the image (name==version: the versions this repository is tested with).
missing=(
  hydra-core==1.3.8 omegaconf==2.3.1
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19
  torchdata==0.11.0
  hjson==3.1.0 pydantic==2.13.4 pydantic-core==2.46.4 annotated-types==0.7.0 typing-inspection==0.4.2
)
# On the image, but our versions need a range: "name==version|range it must be in".
# pyarrow would be most of the folder's size (47 MiB of about 53) and the image has one: it is not carried
# (the device call's 64 MiB; bench/gpu_wheels.tsv records what is). datasets 5.2's metadata asks for
# pyarrow >= 24 but its import does not check; env.txt records the image's version. WITH_PYARROW=1
# carries datasets' oldest accepted release, for an image whose pyarrow the trainer cannot use.
conditional=(
  "fsspec==2026.9.0|>=2023.1.0,<=2026.9.0"     # datasets 5.2's range
  "typing-extensions==4.16.0|>=4.14.1"         # pydantic 2.13 needs >= 4.14.1
)
if [ "${WITH_PYARROW:-0}" = 1 ]; then
  conditional+=("pyarrow==24.0.0|>=24.0.0")    # datasets 5.2 needs pyarrow >= 24
fi
# Source-only on PyPI: built here into pure-Python wheels.
sdist_only=(antlr4-python3-runtime==4.9.3 deepspeed==0.19.8)

platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 \
         manylinux2014_x86_64 manylinux1_x86_64; do
  platforms+=(--platform "$p")
done
specs=("${missing[@]}")
for c in "${conditional[@]}"; do specs+=("${c%%|*}"); done
echo "== download ${#specs[@]} binary wheels for CPython 3.12, x86-64 manylinux"
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 \
  --abi abi3 --abi none "${platforms[@]}" -d "$dest" "${specs[@]}"

echo "== build ${sdist_only[*]} (pure Python, no CUDA ops pre-compiled)"
for spec in "${sdist_only[@]}"; do
  name=${spec%%==*}
  if ls "$dest/${name//-/_}-${spec##*==}-"*.whl >/dev/null 2>&1; then continue; fi
  DS_BUILD_OPS=0 DS_ACCELERATOR=cpu "${pip[@]}" wheel -q --no-deps --no-build-isolation --no-binary "$name" \
    -w "$dest" "$spec"
done
# A wheel with a compiled extension would tie itself to this machine's Python: both must be py3-none-any.
for spec in "${sdist_only[@]}"; do
  name=${spec%%==*}
  ls "$dest/${name//-/_}-${spec##*==}-py3-none-any.whl" >/dev/null \
    || { echo "error: $spec did not build as a pure-Python wheel" >&2; exit 1; }
done

printf '%s\n' "# name|range: installed on the GPU image only when its own version is outside the range" \
  "${conditional[@]}" | sed 's/==[^|]*|/|/' > "$dest/CONDITIONS"

echo "== $dest"
ls -l "$dest"
mib() { awk "BEGIN {printf \"%.1f MiB\", $1 / 2^20}"; }
bytes=$(du -cb "$dest"/* | tail -1 | cut -f1)
# What a device call carries: the tracked and untracked-but-not-ignored files, plus this folder.
tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 du -cb 2>/dev/null | awk '/\ttotal$/ {s += $1} END {print s + 0}')
echo "wheels: $bytes bytes ($(mib "$bytes")); with the working tree: $(mib $((bytes + tree))) of the device's 64 MiB"
