#!/usr/bin/env bash
# Submit `flexrl train` as a Ray job and wait for it; exits with the job's status (0: SUCCEEDED).
#   bash scripts/train_ray_job.sh CONFIG [flexrl train args: --model M --data D --out O ...]
# RAY_ADDRESS names the cluster's job server (e.g. http://head:8265). Without it, a local Ray head
# bound to 127.0.0.1 (FLEXRL_NODE_IP_ADDRESS to bind elsewhere, as `ray start --node-ip-address`) is
# started first and stopped after. The job's entrypoint runs in this folder on
# the head node with this checkout's Python (PYTHON to override), so relative paths resolve as here;
# on a remote cluster the paths must exist on the head node. SIGTERM or ^C stops the local head (and
# the job with it); a job on RAY_ADDRESS's cluster keeps running, and the launcher says how to stop it.
set -euo pipefail
if [ $# -lt 1 ]; then echo "usage: $0 CONFIG [flexrl train args]" >&2; exit 2; fi
root=$(cd "$(dirname "$0")/.." && pwd)
config=$1; shift
[ -f "$config" ] || { echo "$0: config $config not found" >&2; exit 2; }
python=${PYTHON:-$root/.venv/bin/python}
[ -x "$python" ] || { echo "$0: no Python at $python: run bash scripts/install.sh first, or set PYTHON" >&2; exit 2; }
ray_bin=${RAY_BIN:-$(dirname "$python")/ray}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}
if [ -z "${RAY_ADDRESS:-}" ]; then
  # Ports the OS picks for the GCS, the job server (unless FLEXRL_RAY_DASHBOARD_PORT names one), the
  # dashboard agent and the client server: Ray's fixed defaults (8265, 52365, 10001) are taken where
  # another Ray instance runs on this machine. A dashboard agent that cannot bind takes the head down;
  # a job server that cannot bind would leave `ray job submit` on that port reaching the other
  # instance's, so the dashboard is required (--include-dashboard true): the head fails instead.
  read -r gcs_port free_port agent_port client_port < <("$python" -c "
import socket
held = [socket.socket() for _ in range(4)]
for s in held: s.bind(('127.0.0.1', 0))
print(*(s.getsockname()[1] for s in held))")
  port=${FLEXRL_RAY_DASHBOARD_PORT:-$free_port}
  node_ip=${FLEXRL_NODE_IP_ADDRESS:-127.0.0.1}
  # Ray binds its core servers to the loopback only in its single-machine mode (otherwise it turns a
  # node IP of 127.0.0.1 into the machine's routable address and listens on every interface):
  # flexrl_ds/parallel/network.py. The job's driver inherits the head's environment.
  case "$node_ip" in 127.*|localhost|::1) export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=${RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER:-0};; esac
  echo "[train_ray_job] no RAY_ADDRESS: starting a local Ray head on $node_ip (job server :$port)"
  # A head of our own, held by `ray start --block` in the background: stopping that process stops
  # exactly this head (`ray stop` would stop every Ray cluster on the machine).
  ray_dir=$(mktemp -d /tmp/rayfx.XXXXXX)
  "$ray_bin" start --head --port "$gcs_port" --node-ip-address "$node_ip" --dashboard-host "$node_ip" \
    --include-dashboard true --dashboard-port "$port" --dashboard-agent-listen-port "$agent_port" \
    --ray-client-server-port "$client_port" --num-cpus "${FLEXRL_RAY_CPUS:-8}" --temp-dir "$ray_dir" \
    --disable-usage-stats --block >"$ray_dir/head.log" 2>&1 &
  head_pid=$!
  stop_head() {
    kill -TERM "$head_pid" 2>/dev/null || true
    wait "$head_pid" 2>/dev/null || true
    # the head's children may still write their logs there for a moment: retry, and never fail the job for it
    rm -rf "$ray_dir" 2>/dev/null || { sleep 2; rm -rf "$ray_dir" 2>/dev/null; } || true
  }
  trap stop_head EXIT
  trap 'exit 143' TERM  # a signal ends the script through its EXIT trap, so the head is stopped
  trap 'exit 130' INT
  for _ in $(seq 1 120); do
    timeout 30 "$ray_bin" job list --address "http://$node_ip:$port" >/dev/null 2>&1 && break
    kill -0 "$head_pid" 2>/dev/null || { cat "$ray_dir/head.log" >&2; echo "$0: the Ray head did not start" >&2; exit 1; }
    sleep 1
  done
  export RAY_ADDRESS=http://$node_ip:$port
fi
job=flexrl-train-$(date +%Y%m%d-%H%M%S)-$$
entry="cd $(printf %q "$PWD") && exec $(printf %q "$python") -m flexrl_ds train --config $(printf %q "$config")"
for arg in "$@"; do entry+=" $(printf %q "$arg")"; done
env_json="{\"env_vars\": {\"DS_ACCELERATOR\": \"${DS_ACCELERATOR:-}\", \"OMP_NUM_THREADS\": \"${OMP_NUM_THREADS:-1}\", \"TOKENIZERS_PARALLELISM\": \"false\", \"HF_HUB_OFFLINE\": \"1\", \"RAY_AUTH_MODE\": \"$RAY_AUTH_MODE\"}}"
echo "[train_ray_job] submitting $job to $RAY_ADDRESS"
# A head that has just started may not have its job agent up yet ("No available agent"): retry (up to
# ~3 min: on a loaded 2-core machine the agent has taken over a minute).
for attempt in $(seq 1 90); do
  if submitted=$(timeout 60 "$ray_bin" job submit --address "$RAY_ADDRESS" --submission-id "$job" --no-wait \
      --runtime-env-json "$env_json" -- bash -c "$entry" 2>&1); then
    break
  fi
  if [ "$attempt" = 90 ] || ! echo "$submitted" | grep -q "No available agent\|Connection refused\|try again"; then
    echo "$submitted" >&2
    echo "[train_ray_job] could not submit $job to $RAY_ADDRESS" >&2
    exit 1
  fi
  sleep 2
done
# The follower (flexrl_ds/runtime/ray_job_follow.py: the log as it comes, the job's status polled
# beside it, so it ends when the job does) runs in the background so that a signal is handled at once
# (bash runs a trap only after its foreground command ends): the local head stops with this script, a
# cluster's job keeps running. It exits 0 iff the job SUCCEEDED.
"$python" -m flexrl_ds.runtime.ray_job_follow "$RAY_ADDRESS" "$job" &
follower=$!
on_signal() {
  kill "$follower" 2>/dev/null || true
  if [ -z "${head_pid:-}" ]; then
    echo "[train_ray_job] interrupted: job $job keeps running on $RAY_ADDRESS (stop it: $ray_bin job stop --address $RAY_ADDRESS $job)" >&2
  fi
  exit "$1"
}
trap 'on_signal 143' TERM
trap 'on_signal 130' INT
wait "$follower"
