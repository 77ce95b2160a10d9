#!/usr/bin/env bash
# This tree's train step against another revision's, side by side in one run on one GPU: each
# tree is built (not editable, into a folder of its own, against the installed jaxlib), then
# `python -m benchmarks.train ARGS --ops ffi --dtype bf16` runs in the baseline and in this tree
# in turn, for each ARGS given, and a table of both and their ratio is printed last.
#
#   mkdir -p .ab/base && git archive REV | tar -x -C .ab/base     # the baseline's files
#   scripts/ab_train.sh .ab/base "--model gpt2 --batch 64" \
#       "--model llama-1b --seq 2048 --batch 8"
#
# Environment: WORK (default .ab/work) holds the two builds and the rows (ab.jsonl), and keeps
# them for a second call on the same machine; BLUJAX_CUDA_ARCHITECTURES (default 90a) the GPU
# code built; STEPS (default 20) the timed steps of each configuration.
set -euo pipefail
base=$(cd "${1:?usage: scripts/ab_train.sh BASE_TREE ARGS...}" && pwd)
shift
[ $# -gt 0 ] || { echo "give at least one set of benchmarks.train arguments" >&2; exit 2; }
cd "$(dirname "$0")/.."
new=$(pwd)
work=${WORK:-$new/.ab/work}
mkdir -p "$work"
work=$(cd "$work" && pwd)
py=$(command -v "${PYTHON:-python3}")  # absolute: the runs below start elsewhere
export PYTHONUNBUFFERED=1 BLUJAX_CUDA=${BLUJAX_CUDA:-ON}
export BLUJAX_CUDA_ARCHITECTURES=${BLUJAX_CUDA_ARCHITECTURES:-90a}

for side in base new; do
  tree=$base
  [ "$side" = new ] && tree=$new
  if [ ! -f "$work/$side/blujax/_cuda.stamp" ]; then
    start=$(date +%s)
    rm -rf "$work/$side"
    "$py" -m pip install -q --no-build-isolation --no-deps --no-index --target "$work/$side" \
      "$tree" >"$work/build-$side.log" 2>&1 || { tail -30 "$work/build-$side.log"; exit 1; }
    touch "$work/$side/blujax/_cuda.stamp"
    echo "built $side in $(( $(date +%s) - start )) s"
  fi
done

run='import runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "_editable" not in type(f).__module__]
import blujax
print("blujax from", blujax.__file__, flush=True)
runpy.run_module("benchmarks.train", run_name="__main__", alter_sys=True)'
rows="$work/ab.jsonl"
rm -f "$rows"
for args in "$@"; do
  for side in base new; do
    tree=$base
    [ "$side" = new ] && tree=$new
    # From the work folder: the build's blujax (with its kernels) before the tree's sources,
    # and no editable install's import hook (it would map blujax to its own tree).
    # shellcheck disable=SC2086  # $args is a list of arguments
    (cd "$work" && PYTHONPATH="$work/$side:$tree" "$py" -c "$run" $args --ops ffi \
      --dtype bf16 --steps "${STEPS:-20}" --json "$work/$side.jsonl") >"$work/$side.log" 2>&1 \
      || { tail -30 "$work/$side.log"; exit 1; }
    "$py" -c 'import json, sys
for line in open(sys.argv[1]):
    print(json.dumps({**json.loads(line), "side": sys.argv[2], "args": sys.argv[3]}))' \
      "$work/$side.jsonl" "$side" "$args" >>"$rows"
    rm -f "$work/$side.jsonl"
  done
done

"$py" - "$rows" <<'EOF'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
print("| benchmarks.train | batch x seq | base tokens/s | this tree tokens/s | this / base |")
print("|---|---|---|---|---|")
for args in dict.fromkeys(r["args"] for r in rows):
    side = {r["side"]: r for r in rows if r["args"] == args}
    b, n = side["base"], side["new"]
    if "error" in b or "error" in n:
        print(f"| {args} | | {b.get('error', '')} | {n.get('error', '')} | failed |")
        continue
    print(f"| {args} | {n['batch']} x {n['seq']} | {b['tokens_per_s']:,.0f} | "
          f"{n['tokens_per_s']:,.0f} | {n['tokens_per_s'] / b['tokens_per_s']:.3f} |")
EOF
