#!/usr/bin/env bash
# On one machine with 2 or more GPUs: `gpt2.py train --dp 2` in one process over two GPUs, then
# the same run as two processes of one GPU each (jax.distributed, as on two hosts), then the
# second run resumed; prints both runs' losses side by side and their largest difference.
# Needs blujax built with CUDA (scripts/gpu_check.sh builds it) and a corpus: BLUJAX_CORPUS.
#
#   scripts/multi_gpu_cli_check.sh OUT_DIR [STEPS] [EXTRA TRAIN ARGS...]
set -euo pipefail
out=${1:?usage: scripts/multi_gpu_cli_check.sh OUT_DIR [STEPS] [TRAIN ARGS...]}
steps=${2:-40}
shift $(( $# < 2 ? $# : 2 ))
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
run=("$py" examples/gpt2.py train --dp 2 --steps "$steps" --batch 32 --eval-every 20
     --sample-tokens 32 --no-progress "$@")

echo "== one process, two GPUs"
"${run[@]}" --out "$out/one" 2>&1 | tail -4

echo "== two processes, one GPU each (stopping after step $(( steps / 2 )), then resumed)"
port=$(( 20000 + RANDOM % 20000 ))
for phase in first resume; do
  extra=(--stop-after "$(( steps / 2 ))")
  [ "$phase" = resume ] && extra=(--resume)
  pids=()
  for i in 0 1; do
    CUDA_VISIBLE_DEVICES=$i "${run[@]}" --out "$out/two" "${extra[@]}" --num-processes 2 \
      --process-id "$i" --coordinator "localhost:$port" >"$out/two_${phase}_$i.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1; do
    wait "${pids[$i]}" || { echo "process $i ($phase) failed:"; tail -5 "$out/two_${phase}_$i.log"; exit 1; }
  done
  port=$(( port + 1 ))
  tail -3 "$out/two_${phase}_0.log"
done

"$py" - "$out/one/metrics.jsonl" "$out/two/metrics.jsonl" <<'EOF'
import json, sys
one, two = ([json.loads(line) for line in open(p)] for p in sys.argv[1:])
print("| step | loss, 1 process | loss, 2 processes | val, 1 | val, 2 |")
print("|---|---|---|---|---|")
worst = 0.0
for a, b in zip(one, two):
    worst = max(worst, abs(a["loss"] - b["loss"]) / abs(a["loss"]))
    if a.get("val_loss") is not None or a["step"] in (1, len(one)):
        print(f"| {a['step']} | {a['loss']:.4f} | {b['loss']:.4f} | {a.get('val_loss') or ''} "
              f"| {b.get('val_loss') or ''} |")
print(f"steps: {len(one)} and {len(two)}; largest relative loss difference {worst:.2e}")
sys.exit(0 if len(one) == len(two) and worst < 1e-2 else 1)
EOF
