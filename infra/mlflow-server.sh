#!/usr/bin/env bash
# Start an MLflow tracking server on 127.0.0.1 (default port 5000) over a sqlite store, with
# artifacts served through it (clients upload over HTTP; no shared filesystem needed).
# Job execution is off: nothing here uses MLflow server jobs, and it costs ~1 GB of RAM.
set -euo pipefail
source "$(dirname "$0")/env.sh"
port="${1:-5000}"
store="${MLFLOW_STORE_DIR:-$EAGLEOPS_PROJECT_DIR/runs/mlflow-server}"
mkdir -p "$store"
MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false mlflow server \
  --backend-store-uri "sqlite:///$store/mlflow.db" --artifacts-destination "$store/artifacts" \
  --host 127.0.0.1 --port "$port" --workers 1 >"$store/server.log" 2>&1 &
echo $! >"$store/server.pid"
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/health" >/dev/null && { echo "mlflow server pid $(cat "$store/server.pid") on http://127.0.0.1:$port"; exit 0; }
  sleep 0.5
done
echo "mlflow server did not become healthy; see $store/server.log" >&2
exit 1
