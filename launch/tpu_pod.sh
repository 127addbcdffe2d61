#!/usr/bin/env bash
# Run a favor job on every host of a Cloud TPU pod slice (one process per host).
#
#   launch/tpu_pod.sh TPU_NAME ZONE WORKDIR -- --config configs/bert_pretrain.py [--config.x=y ...]
#
# WORKDIR must be storage every host sees (a gs:// bucket or a shared filesystem): orbax writes each
# host's shards of a checkpoint there and process 0 commits it. The repository is copied to every host
# and installed into a venv there on first use. `--multihost` makes train.py call
# jax.distributed.initialize(), which finds the pod's coordinator by itself on TPU VMs.
set -euo pipefail
if [ $# -lt 4 ] || [ "$4" != "--" ]; then
  echo "usage: $0 TPU_NAME ZONE WORKDIR -- TRAIN_ARGS..." >&2
  exit 2
fi
tpu=$1 zone=$2 workdir=$3
shift 4
repo=$(cd "$(dirname "$0")/.." && pwd)
args=$(printf ' %q' "$@")

gcloud compute tpus tpu-vm scp --recurse --zone "$zone" --worker=all "$repo" "$tpu":~/favor-job
gcloud compute tpus tpu-vm ssh "$tpu" --zone "$zone" --worker=all --command "
  set -e; cd ~/favor-job
  [ -x .venv/bin/python ] || { python3 -m venv .venv && .venv/bin/pip install -q -e . 'jax[tpu]'; }
  .venv/bin/python train.py --multihost --workdir $(printf %q "$workdir")$args"
