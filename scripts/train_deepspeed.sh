#!/usr/bin/env bash
# The SPMD path: `deepspeed --hostfile` starts the policy ranks; rank 0 drives (metadata, planning,
# rewards), rollout is colocated in the ranks, the preprocessing actors run on the Ray cluster of
# RAY_ADDRESS or on a local one rank 0 starts.
#   bash scripts/train_deepspeed.sh HOSTFILE CONFIG [flexrl train args: --model M --data D --out O ...]
# HOSTFILE is DeepSpeed's ("host slots=N" per line); the slots are the policy ranks (they replace
# flexrl.trainer.num_policy_ranks). A file naming only localhost / 127.0.0.1 runs without ssh:
#   deepspeed --hostfile HOSTFILE --no_ssh --node_rank 0 --master_addr 127.0.0.1 \
#     --module flexrl_ds train --spmd --config CONFIG ...
# RAY_ADDRESS, if set, is the cluster's GCS address (host:port), not a job server's http:// URL.
set -euo pipefail
if [ $# -lt 2 ]; then echo "usage: $0 HOSTFILE CONFIG [flexrl train args]" >&2; exit 2; fi
root=$(cd "$(dirname "$0")/.." && pwd)
hostfile=$1 config=$2; shift 2
[ -f "$hostfile" ] || { echo "$0: hostfile $hostfile not found" >&2; exit 2; }
[ -f "$config" ] || { echo "$0: config $config not found" >&2; exit 2; }
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || { echo "$0: no Python at $python: run bash scripts/install.sh first, or set PYTHON" >&2; exit 2; }
bin=$(dirname "$python")
hosts=$(grep -vE '^\s*(#|$)' "$hostfile" | awk '{print $1}' | sort -u)
flags=()
if [ -z "$(echo "$hosts" | grep -vxE 'localhost|127\.0\.0\.1')" ]; then
  flags=(--no_ssh --node_rank 0 --master_addr 127.0.0.1)
fi
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled} TOKENIZERS_PARALLELISM=false
exec "$bin/deepspeed" --hostfile "$hostfile" "${flags[@]}" --master_port "${MASTER_PORT:-29511}" \
  --module flexrl_ds train --spmd --config "$config" "$@"
