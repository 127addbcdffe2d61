#!/usr/bin/env bash
# BENCHMARKS.md's accelerator sections on one GPU host: the fused kernel checked against XLA on the device,
# FAVOR+ against softmax (cuDNN flash attention) over L = 1K … 128K, every kind at 8K with head dims 64 and
# 128, and a decoder training step at 4K–32K tokens. Compiling is most of the time; with each
# configuration's programs compiled in parallel threads, the check and ten configurations of four
# programs (L = 4K–128K) took 3.5 minutes on an H200; the whole script has not been run in one go.
#   launch/bench_accel.sh [OUT]     (OUT: where BENCHMARKS.md and bench/*.json go; default: here)
# Each part stops starting new configurations when its budget (seconds) is spent and writes what it has
# measured as it goes; PYTHON picks the interpreter (default python3).
set -u
out=${1:-.}
py=${PYTHON:-python3}
bench() { timeout "$1" "$py" -m favor.bench accel --out "$out" "${@:2}"; }
# the kernels' candidate cuts against fused.TUNING's (its section says which was fastest; TUNING is edited
# by hand from it, so on a new device type run this first and the grid after the edit)
timeout 900 "$py" -m favor.bench tune --out "$out"
bench 1800 --check --kinds favor+ --kernel-precisions tf32x3,bf16 --dtypes bfloat16 --head-dims 64 \
  --rounds 3 --budget "${BUDGET_MAIN:-1500}" --max-ms 3000
bench 900 --kinds favor+,favor++,favor#,simrf,favor,hrf,relu,elu --dtypes bfloat16,float32 --head-dims 64,128 \
  --lengths 8192 --modes causal --passes grad --rounds 3 --budget "${BUDGET_KINDS:-600}" \
  --decoder-lengths 4096,16384,32768 --decoder-kinds favor+ --section-suffix=-kinds
