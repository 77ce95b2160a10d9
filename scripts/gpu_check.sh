#!/usr/bin/env bash
# On a machine with an NVIDIA GPU and no network: build blujax with its CUDA kernels against the
# installed jax/jaxlib, run the whole test suite on the GPU (and the emulated-CPU-mesh tests),
# run the kernel benchmarks, and print a short table last. Logs go to OUT_DIR.
#
#   scripts/gpu_check.sh OUT_DIR [--quick] [--sanitize] [--ops layernorm,...] [--tests "SEL"]
#                        [--no-reruns] [--no-kernels] [--train "ARGS"] [--parallel "ARGS"]...
#
# --quick       one benchmark shape per op
# --sanitize    also run the CUDA tests under compute-sanitizer (memcheck), slower
# --ops LIST    benchmark only these ops (benchmarks/cases/<op>.py)
# --tests SEL   what pytest runs on the GPU (default: tests), e.g. "tests/test_attention.py";
#               "" runs no tests
# --no-reruns   skip the reruns without CUDA graphs and on 8 emulated CPU devices
# --no-kernels  skip the kernel benchmarks (benchmarks.kernels, and without --quick
#               benchmarks.device_time)
# --train ARGS  also run python -m benchmarks.train ARGS (GPT-2 step throughput)
# --parallel ARGS  also run python -m benchmarks.parallel ARGS (steps on several GPUs); repeatable,
#               the rows of all of them make one table
# A machine lent for a few minutes at a time can run the whole check in several calls, each with
# a part of it.
# Needs: python3 with jax[cuda] installed, nanobind, scikit-build-core, cmake, ninja, nvcc.
set -euo pipefail

out=${1:?usage: scripts/gpu_check.sh OUT_DIR [--quick] [--sanitize] [--ops LIST]}
shift
quick="" sanitize="" ops="" tests="tests" reruns=1 kernels=1 train="" parallel=()
while [ $# -gt 0 ]; do
  case "$1" in
    --quick) quick="--quick" ;;
    --sanitize) sanitize=1 ;;
    --ops) ops="--ops $2"; shift ;;
    --tests) tests="$2"; shift ;;
    --no-reruns) reruns="" ;;
    --no-kernels) kernels="" ;;
    --train) train="$2"; shift ;;
    --parallel) parallel+=("$2"); shift ;;
    *) echo "unknown option $1" >&2; exit 2 ;;
  esac
  shift
done
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
# The tests that compare each kernel with its spec (by name), rerun under the sanitizer and without graphs.
kernel_tests="values or large or matches or sized"
export PYTHONUNBUFFERED=1

step() { printf '\n== %s\n' "$*"; }

step "device"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$out/device.txt"
"$py" -c "import jax; print('jax', jax.__version__, jax.devices())" | tee -a "$out/device.txt"

step "build (no network: against the installed jaxlib, without build isolation)"
start=$(date +%s)
BLUJAX_CUDA=ON BLUJAX_CUDA_ARCHITECTURES=${BLUJAX_CUDA_ARCHITECTURES:-80;90a} \
  "$py" -m pip install --no-build-isolation --no-deps --no-index -e . >"$out/build.log" 2>&1 \
  || { tail -40 "$out/build.log"; exit 1; }
echo "built in $(( $(date +%s) - start )) s"
"$py" -c "import blujax; print('kernel backends:', blujax.kernel_backends())"

gpu_status=skipped nographs_status=skipped portable_status=skipped cpu_status=skipped
for f in tests_gpu tests_gpu_nographs tests_gpu_portable tests_cpu; do echo "skipped" >"$out/$f.log"; done
set +e
if [ -n "$tests" ]; then
  step "tests on the GPU"
  # shellcheck disable=SC2086  # $tests is a list of pytest arguments
  "$py" -m pytest -q -rs $tests 2>&1 | tail -30 | tee "$out/tests_gpu.log"
  gpu_status=${PIPESTATUS[0]}
fi
if [ -n "$tests" ] && [ -n "$reruns" ]; then
  step "kernel value tests again with XLA's command buffers (CUDA graphs) off"
  XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" "$py" -m pytest -q -k "$kernel_tests" $tests \
    2>&1 | tail -5 | tee "$out/tests_gpu_nographs.log"
  nographs_status=${PIPESTATUS[0]}
  step "kernel value tests again with the portable kernels only (differs on Hopper)"
  BLUJAX_NO_WGMMA=1 "$py" -m pytest -q -k "$kernel_tests" $tests \
    2>&1 | tail -5 | tee "$out/tests_gpu_portable.log"
  portable_status=${PIPESTATUS[0]}
  step "tests on 8 emulated CPU devices (the CPU kernels)"
  JAX_PLATFORMS=cpu "$py" -m pytest -q $tests 2>&1 | tail -5 | tee "$out/tests_cpu.log"
  cpu_status=${PIPESTATUS[0]}
fi
sanitizer_status=skipped
if [ -n "$sanitize" ] && [ -n "$tests" ]; then
  step "compute-sanitizer memcheck over the GPU tests"
  timeout ${SANITIZER_TIMEOUT:-300} compute-sanitizer --tool memcheck --error-exitcode 9 --log-file "$out/sanitizer.log" \
    "$py" -m pytest -q -x -k "$kernel_tests" $tests >"$out/tests_sanitizer.log" 2>&1
  sanitizer_status=$?
  tail -3 "$out/tests_sanitizer.log"; tail -3 "$out/sanitizer.log"
fi
set -e

echo "(no kernel benchmarks)" >"$out/kernels.md"
if [ -n "$kernels" ]; then
  step "kernel benchmarks"
  "$py" -m benchmarks.kernels $quick $ops --out "$out" >"$out/bench.log" 2>&1 \
    || { tail -40 "$out/bench.log"; exit 1; }
fi
echo "(no device-time table)" >"$out/device_time.md"
if [ -n "$kernels" ] && [ -z "$quick" ]; then
  # The memory-bound ops again in device time (profiler spans): calls of tens of microseconds
  # are partly host-bound in kernels.py's timing.
  step "memory-bound kernels in device time"
  "$py" -m benchmarks.device_time $ops >"$out/device_time.md" 2>"$out/device_time.log" \
    || { tail -40 "$out/device_time.log"; exit 1; }
fi
echo "(no train benchmark)" >"$out/train.md"
if [ -n "$train" ]; then
  step "GPT-2 train-step benchmark"
  # shellcheck disable=SC2086
  train_status=0
  "$py" -m benchmarks.train $train --json "$out/train.jsonl" >"$out/train.log" 2>&1 || train_status=$?
  tail -20 "$out/train.log" | sed -n '/^| dtype/,$p' >"$out/train.md"
  [ "$train_status" = 0 ] || tail -30 "$out/train.log"
fi

echo "(no parallel benchmark)" >"$out/parallel.md"
if [ ${#parallel[@]} -gt 0 ]; then
  step "GPT-2 on several GPUs"
  rm -f "$out/parallel.jsonl"
  for args in "${parallel[@]}"; do
    # shellcheck disable=SC2086
    "$py" -m benchmarks.parallel $args --json "$out/parallel.jsonl" 2>&1 \
      | tee -a "$out/parallel.log" || true
  done
  "$py" -m benchmarks.parallel --report "$out/parallel.jsonl" >"$out/parallel.md" 2>&1 || true
fi

step "summary"
echo "tests on GPU:      $(tail -1 "$out/tests_gpu.log") (exit $gpu_status)"
echo "tests, no graphs:  $(tail -1 "$out/tests_gpu_nographs.log") (exit $nographs_status)"
echo "tests, portable:   $(tail -1 "$out/tests_gpu_portable.log") (exit $portable_status)"
echo "tests on CPU mesh: $(tail -1 "$out/tests_cpu.log") (exit $cpu_status)"
echo "compute-sanitizer: $sanitizer_status"
cat "$out/kernels.md"
cat "$out/device_time.md"
cat "$out/train.md"
cat "$out/parallel.md"
ok() { [ "$1" = 0 ] || [ "$1" = skipped ]; }
ok "$gpu_status" && ok "$nographs_status" && ok "$portable_status" && ok "$cpu_status" && ok "$sanitizer_status"
