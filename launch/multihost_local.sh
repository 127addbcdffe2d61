#!/usr/bin/env bash
# N processes on this machine through jax.distributed (CPU, gloo): the multi-host code path without a
# cluster. Each process gets an equal slice of every global batch; results match one process.
#
#   launch/multihost_local.sh 2 runs/mh --config configs/default.py:runlocal
set -euo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 NUM_PROCESSES WORKDIR TRAIN_ARGS..." >&2
  exit 2
fi
n=$1 workdir=$2
shift 2
cd "$(dirname "$0")/.."
mkdir -p "$(dirname "$workdir")"
py=${PYTHON:-.venv/bin/python}
port=$($py -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
pids=()
for ((i = 0; i < n; i++)); do
  "$py" train.py --workdir "$workdir" --coordinator_address "127.0.0.1:$port" --num_processes "$n" \
    --process_id "$i" "$@" > "$workdir.process$i.log" 2>&1 &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
tail -n 20 "$workdir.process0.log"
exit $status
