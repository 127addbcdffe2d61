#!/usr/bin/env bash
# Run a favor job on every host of a Cloud TPU pod slice (one process per host).
#
#   launch/tpu_pod.sh TPU_NAME ZONE WORKDIR -- --config configs/bert_pretrain.py [--config.x=y ...]
#
# A sweep (the config's sweep(), favor.sweeps) runs its runs one after another, each on the whole
# slice; rerunning the same command skips the finished runs and resumes the others. It needs a
# WORKDIR on a filesystem every host mounts (each host's launcher reads the runs' status files):
#
#   launch/tpu_pod.sh --sweep TPU_NAME ZONE WORKDIR -- --config configs/bert_glue.py [--config.x=y ...]
#   python -m favor.tools.report WORKDIR --plot WORKDIR/report.png
#
# The accelerator benchmark (launch/bench_accel.sh's grid and kinds parts: the fused kernels, Mosaic's on a
# TPU, against XLA and softmax) on the slice's first host, its BENCHMARKS.md sections and bench/*.json
# copied back into OUT; what `impl="auto"` on a TPU waits for (kinds.AUTO_FUSED lists no TPU until then):
#
#   launch/tpu_pod.sh --bench TPU_NAME ZONE OUT
#
# WORKDIR must be storage every host sees (a gs:// bucket or a shared filesystem): orbax writes each
# host's shards of a checkpoint there and process 0 commits it. The repository's committed tree (HEAD)
# is copied to every host and installed into a venv there. `--multihost` makes train.py call
# jax.distributed.initialize(), which finds the pod's coordinator by itself on TPU VMs.
set -euo pipefail
sweep=0
if [ "${1:-}" = "--bench" ]; then
  if [ $# -ne 4 ]; then
    echo "usage: $0 --bench TPU_NAME ZONE OUT" >&2
    exit 2
  fi
  tpu=$2 zone=$3 out=$4
  repo=$(cd "$(dirname "$0")/.." && pwd)
  archive=$(mktemp --suffix=.tar.gz)
  trap 'rm -f "$archive"' EXIT
  git -C "$repo" archive --format=tar.gz -o "$archive" HEAD
  gcloud compute tpus tpu-vm scp --zone "$zone" --worker=0 "$archive" "$tpu":~/favor-bench.tar.gz
  gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=0 --command "
    set -e; rm -rf ~/favor-bench && mkdir ~/favor-bench && tar -xzf ~/favor-bench.tar.gz -C ~/favor-bench
    cd ~/favor-bench && [ -x ~/favor-venv/bin/python ] || python3 -m venv ~/favor-venv
    ~/favor-venv/bin/pip install -q -e . 'jax[tpu]'
    PYTHON=~/favor-venv/bin/python launch/bench_accel.sh ~/favor-bench grid kinds"
  mkdir -p "$out"
  gcloud compute tpus tpu-vm scp --zone "$zone" --worker=0 "$tpu":~/favor-bench/BENCHMARKS.md "$out/BENCHMARKS.tpu.md"
  gcloud compute tpus tpu-vm scp --zone "$zone" --worker=0 --recurse "$tpu":~/favor-bench/bench "$out/bench-tpu"
  echo "the TPU's sections: $out/BENCHMARKS.tpu.md and $out/bench-tpu/ (merge them into BENCHMARKS.md and bench/)"
  exit 0
fi
if [ "${1:-}" = "--sweep" ]; then
  sweep=1
  shift
fi
if [ $# -lt 4 ] || [ "$4" != "--" ] || { [ "$sweep" = 1 ] && { [ "${5:-}" != "--config" ] || [ $# -lt 6 ]; }; }; then
  echo "usage: $0 TPU_NAME ZONE WORKDIR -- TRAIN_ARGS..." >&2
  echo "       $0 --sweep TPU_NAME ZONE WORKDIR -- --config CONFIG [TRAIN_ARGS...]" >&2
  exit 2
fi
tpu=$1 zone=$2 workdir=$3
shift 4
repo=$(cd "$(dirname "$0")/.." && pwd)
quoted() { [ $# -eq 0 ] || printf ' %q' "$@"; }      # printf with no arguments would still print ''
if [ "$sweep" = 1 ]; then
  # every host runs the same launcher over the same runs in the same order: the hosts' train.py
  # processes of one run form one multi-host job
  config=$2
  shift 2
  job="launch/sweep_local.py --config $(printf %q "$config") --workdir $(printf %q "$workdir") -- --multihost$(quoted "$@")"
else
  job="train.py --multihost --workdir $(printf %q "$workdir")$(quoted "$@")"
fi

# the committed tree only (no .venv, runs/ or .git), unpacked over a clean copy: a relaunch never runs
# stale code; the venv lives beside the code and survives relaunches
archive=$(mktemp --suffix=.tar.gz)
trap 'rm -f "$archive"' EXIT
git -C "$repo" archive --format=tar.gz -o "$archive" HEAD
gcloud compute tpus tpu-vm scp --zone "$zone" --worker=all "$archive" "$tpu":~/favor-job.tar.gz
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  set -e; rm -rf ~/favor-job && mkdir ~/favor-job && tar -xzf ~/favor-job.tar.gz -C ~/favor-job && cd ~/favor-job
  [ -x ~/favor-venv/bin/python ] || python3 -m venv ~/favor-venv
  ~/favor-venv/bin/pip install -q -e . 'jax[tpu]'
  ln -sfn ~/favor-venv .venv
  .venv/bin/python $job"
