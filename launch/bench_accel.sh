#!/usr/bin/env bash
# BENCHMARKS.md's accelerator sections on one GPU host, in three parts that each run alone:
#   tune   the kernels' candidate cuts against fused.TUNING's (its section says which was fastest; TUNING
#          is edited by hand from it, so on a new device type run this first and the grid after the edit)
#   grid   the fused kernel checked against XLA on the device, FAVOR+ against softmax (cuDNN flash
#          attention) over L = 1K … 128K
#   kinds  every kind at 8K with head dims 64 and 128, bf16 and float32, and a decoder training step at
#          4K–32K tokens
#   launch/bench_accel.sh [OUT] [PART ...]   (OUT: where BENCHMARKS.md and bench/*.json go, default here;
#                                            PART: default all three, in that order)
# Compiling is most of the time: with each configuration's programs compiled in parallel threads, the
# check and ten configurations of four programs (L = 4K–128K) took 3.5 minutes on an H200. Each part stops
# starting new configurations when its budget (seconds; BUDGET_TUNE, BUDGET_GRID, BUDGET_KINDS) is spent,
# writes what it has measured as it goes, and is ended by `timeout` 5 minutes after its budget: a short
# device loan runs one part with a smaller budget. PYTHON picks the interpreter (default python3).
set -u
out=${1:-.}
shift $(( $# > 0 ? 1 : 0 ))
parts=("$@")
[ ${#parts[@]} -gt 0 ] || parts=(tune grid kinds)
for part in "${parts[@]}"; do
  case $part in
    tune|grid|kinds) ;;
    *) echo "error: unknown part '$part'; valid: tune, grid, kinds" >&2; exit 2 ;;
  esac
done
py=${PYTHON:-python3}
bench() { timeout "$1" "$py" -m favor.bench accel --out "$out" "${@:2}"; }
status=0
for part in "${parts[@]}"; do
  case $part in
    tune)
      budget=${BUDGET_TUNE:-600}
      timeout $((budget + 300)) "$py" -m favor.bench tune --out "$out" --budget "$budget" || status=$? ;;
    grid)
      budget=${BUDGET_GRID:-1500}
      bench $((budget + 300)) --check --kinds favor+ --kernel-precisions tf32x3,bf16 --dtypes bfloat16 \
        --head-dims 64 --rounds 3 --budget "$budget" --max-ms 3000 || status=$? ;;
    kinds)
      budget=${BUDGET_KINDS:-600}
      bench $((budget + 300)) --kinds favor+,favor++,favor#,simrf,favor,hrf,relu,elu --dtypes bfloat16,float32 \
        --head-dims 64,128 --lengths 8192 --modes causal --passes grad --rounds 3 --budget "$budget" \
        --decoder-lengths 4096,16384,32768 --decoder-kinds favor+ --section-suffix=-kinds || status=$? ;;
  esac
done
exit $status
