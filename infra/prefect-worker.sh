#!/usr/bin/env bash
# One Prefect process worker in the foreground: infra/prefect-worker.sh POOL [QUEUE]
#   cpu pool: orchestration and the embedded CPU default   -> infra/prefect-worker.sh cpu
#   gpu pool: one worker per GPU host, on its own queue    -> infra/prefect-worker.sh gpu gpu-1
# The pools, the per-host queues (concurrency limit 1) and the deployments come from
# `eagleops deploy-flows`. Needs PREFECT_API_URL (e.g. http://127.0.0.1:4200/api).
# Stopping: the worker needs two signals (the first only asks its runs to stop); systemd's
# TimeoutStopSec + SIGKILL does the second, by hand send SIGTERM then SIGINT.
set -euo pipefail
source "$(dirname "$0")/env.sh"
: "${PREFECT_API_URL:?set PREFECT_API_URL to the Prefect server, e.g. http://127.0.0.1:4200/api}"
pool="${1:?usage: $0 POOL [QUEUE]}"
queue="${2:-}"
cd "$EAGLEOPS_PROJECT_DIR"
# A gpu worker's runs name this machine by its queue: their GPU stages take the global concurrency limit
# gpu-host-<queue> (tasks/runner/host_slots.py), as a run from any other source on this host does.
if [ "$pool" = gpu ] && [ -n "$queue" ]; then export EAGLEOPS_GPU_HOST="${EAGLEOPS_GPU_HOST:-$queue}"; fi
exec prefect worker start --pool "$pool" ${queue:+--work-queue "$queue"} \
    --name "eagleops-$pool-$(hostname)" --install-policy never
