#!/usr/bin/env bash
# The README's worked examples, run for real: each command's output goes to
# benchmarks/results/readme_examples/<name>.txt (stdout, then the last lines of stderr without the
# progress bar), which is what README.md quotes.
#   bash benchmarks/readme_examples.sh        # ~15 min on a loaded 2-core CPU
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=benchmarks/results/readme_examples
mkdir -p "$OUT"
rm -rf runs/first runs/zero2
TF=.venv/bin/trainfit
# One intra-op thread: on a shared, oversubscribed 2-core box two spinning OpenMP threads per process made
# a gpt-tiny step take ~70 s instead of ~3 s.
export OMP_NUM_THREADS=1

ex() {  # ex NAME CMD... : run, keep stdout + the final stderr lines (tqdm's carriage-return frames dropped)
  local name=$1; shift
  echo "\$ ${*/#.venv\/bin\//}" > "$OUT/$name.txt"
  "$@" > "$OUT/$name.out" 2> "$OUT/$name.err"
  local rc=$?
  tr '\r' '\n' < "$OUT/$name.err" | grep -v -E '^\s*[0-9]+%\||it/s\]|step/s\]|s/step\]|^\s*$' >> "$OUT/$name.txt"
  cat "$OUT/$name.out" >> "$OUT/$name.txt"
  echo "[exit $rc]" >> "$OUT/$name.txt"
  rm -f "$OUT/$name.out" "$OUT/$name.err"
}

ex train      $TF train --steps 20 --run-dir runs/first --report
ex memory     $TF memory --run-dir runs/first --report
ex memory_est $TF memory --estimate --model gpt2-small --seq 1024 --micro-batch 8 --precision bf16-mixed
ex profile    $TF profile --steps 8 --run-dir runs/first --report
ex plan       $TF plan --model llama-7b --seq 2048 --global-batch 512 --device-memory 80GiB --devices 8 --device h100 --top 6 --run-dir runs/first --report
ex verify     $TF verify --precision fp16-mixed --accumulation 4
ex report     $TF report runs/first
ex zero2      $TF train --strategy zero2 --precision bf16-mixed --devices 2 --steps 5 --run-dir runs/zero2
ex bad_input  $TF train --precision fp8
