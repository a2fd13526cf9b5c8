#!/usr/bin/env bash
# Start a Prefect server on 127.0.0.1 (default port 4200), wait until healthy, print its PID.
# Stop it with: kill "$(cat "$PREFECT_HOME/eagleops-server.pid")"
set -euo pipefail
source "$(dirname "$0")/env.sh"
port="${1:-4200}"
mkdir -p "$PREFECT_HOME"
prefect server start --host 127.0.0.1 --port "$port" >"$PREFECT_HOME/server.log" 2>&1 &
echo $! >"$PREFECT_HOME/eagleops-server.pid"
for _ in $(seq 1 240); do
  curl -sf "http://127.0.0.1:$port/api/health" >/dev/null && { echo "prefect server pid $(cat "$PREFECT_HOME/eagleops-server.pid") on http://127.0.0.1:$port"; exit 0; }
  sleep 0.5
done
echo "prefect server did not become healthy; see $PREFECT_HOME/server.log" >&2
exit 1
