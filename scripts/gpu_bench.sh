#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and no network: build blujax with its CUDA kernels (not
# editable, into a folder of its own, against the installed jaxlib), then run each benchmark
# given, one after another in this process's environment, and print every run's table (its
# lines that start with "|") last. Each run's whole output goes to OUT/<n>.log.
#
#   scripts/gpu_bench.sh OUT "benchmarks.fp8 --tokens 16384" \
#       "benchmarks.train --model llama-1b --seq 2048 --batch 8 --ops ffi --dtype bf16 --fp8 off,on" \
#       "benchmarks.torch_llama --model llama-1b --seq 2048 --batch 8 --float8 off,tensorwise"
#
# A run may be "pytest ARGS" instead of a module: the tests then run against the build;
# "sanitize pytest ARGS" runs them under compute-sanitizer's memcheck ("racecheck pytest ARGS"
# its shared-memory race check), its report in OUT/<n>.sanitizer.log. A run may start with
# NAME=VALUE words (no spaces in VALUE): that run's environment.
# Wheels in .whl/ (a contender not installed there, say torchao) are installed into a folder
# of their own first. Every run starts in the build's folder, so that the repo's own blujax
# (no CUDA kernels) is not the one imported; paths in a run's arguments are from there (write
# outputs under an absolute path). Environment: WORK (default /tmp/blujax-bench) holds the
# build, and a second call on the same machine keeps it where the kernels' sources are the same;
# BLUJAX_CUDA_ARCHITECTURES (default 90a) the GPU code built.
set -uo pipefail
out=${1:?usage: scripts/gpu_bench.sh OUT "MODULE ARGS"...}
shift
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
repo=$(pwd)
work=${WORK:-/tmp/blujax-bench}
py=$(command -v "${PYTHON:-python3}")
export PYTHONUNBUFFERED=1
mkdir -p "$work"
if ls .whl/*.whl >/dev/null 2>&1; then
  "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$work/site" .whl/*.whl || exit 1
fi
start=$(date +%s)
stamp=$(cat $(git ls-files xla_ext) pyproject.toml | sha1sum | cut -c1-12)
if [ -f "$work/build/.stamp-$stamp" ]; then  # the same kernels built on this machine already
  rm -rf "$work/build.py" && mkdir -p "$work/build.py" \
    && cp -r blujax/. "$work/build.py/" && cp -n "$work"/build/blujax/*.so "$work/build.py/" \
    && rm -rf "$work/build/blujax" && mv "$work/build.py" "$work/build/blujax"
  echo "build: kept (the Python files copied over)"
else
  BLUJAX_CUDA=ON BLUJAX_CUDA_ARCHITECTURES=${BLUJAX_CUDA_ARCHITECTURES:-90a} \
    "$py" -m pip install -q --no-build-isolation --no-deps --no-index --upgrade \
    --target "$work/build" . >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
  touch "$work/build/.stamp-$stamp"
  echo "build: $(( $(date +%s) - start )) s"
fi
# The build first (its blujax has the CUDA extension), then the repo (benchmarks, tests).
export PYTHONPATH="$work/build:$repo:$work/site${PYTHONPATH:+:$PYTHONPATH}"
n=0
for run in "$@"; do
  n=$((n + 1))
  echo "== $run"
  start=$(date +%s)
  envs=()
  while [[ "$run" == *" "* && "${run%% *}" == *=* ]]; do envs+=("${run%% *}"); run=${run#* }; done
  wrap=()
  case "${run%% *}" in
    sanitize|racecheck)
      tool=${run%% *}; [ "$tool" = sanitize ] && tool=memcheck
      wrap=(compute-sanitizer --tool "$tool" --error-exitcode 9 --log-file "$out/$n.sanitizer.log")
      run=${run#* } ;;
  esac
  if [ "${run%% *}" = pytest ]; then
    # From the build's folder, so that the repo's own blujax (no CUDA kernels) is not first.
    args=$(echo " ${run#pytest}" | sed "s# tests/# $repo/tests/#g")
    (cd "$work" && env "${envs[@]}" "${wrap[@]}" "$py" -m pytest -p no:cacheprovider \
      --rootdir "$repo" -c "$repo/pyproject.toml" $args) >"$out/$n.log" 2>&1
  else
    (cd "$work" && env "${envs[@]}" "$py" -m $run) >"$out/$n.log" 2>&1
  fi
  echo "   exit $?, $(( $(date +%s) - start )) s"
  tail -3 "$out/$n.log"
  [ -f "$out/$n.sanitizer.log" ] && tail -2 "$out/$n.sanitizer.log"
done
n=0
for run in "$@"; do
  n=$((n + 1))
  printf '\n## %s\n' "$run"
  grep -E '^\||passed|failed' "$out/$n.log" | tail -40
done
