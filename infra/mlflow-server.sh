#!/usr/bin/env bash
# MLflow tracking server on PostgreSQL, artifacts proxied through it: clients upload and download
# over HTTP (mlflow-artifacts:/ URIs), the files land in $EAGLEOPS_MLFLOW_ARTIFACTS on this host.
#   infra/mlflow-server.sh serve [PORT]   foreground (systemd: eagleops-mlflow-server.service)
#   infra/mlflow-server.sh start [PORT]   background, waits until healthy; pid and log in $EAGLEOPS_STATE_DIR
# Job execution is off: nothing here uses MLflow server jobs (GenAI evaluation), and they cost
# a job runner plus 7 huey consumers (~1 GB RSS). One uvicorn worker by default (MLflow's is 4).
# Behind a reverse proxy with a public name, set EAGLEOPS_MLFLOW_ALLOWED_HOSTS=mlflow.example.org
# (the security middleware answers 403 to any other Host header than localhost/private IPs).
# The driver is spelled out: SQLAlchemy 2.1 maps a bare postgresql:// to psycopg 3, not psycopg2.
set -euo pipefail
source "$(dirname "$0")/env.sh"
mode="${1:?usage: $0 serve|start [PORT]}"
port="${2:-5000}"
case "$mode" in
serve)
    "$(dirname "$0")/pg-database.sh" "$EAGLEOPS_MLFLOW_DB"
    mkdir -p "$EAGLEOPS_MLFLOW_ARTIFACTS"
    allowed=()
    [[ -n "${EAGLEOPS_MLFLOW_ALLOWED_HOSTS:-}" ]] && allowed=(--allowed-hosts "$EAGLEOPS_MLFLOW_ALLOWED_HOSTS")
    export MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
    exec mlflow server --backend-store-uri "$(pg_url postgresql+psycopg2 "$EAGLEOPS_MLFLOW_DB")" \
        --serve-artifacts --artifacts-destination "$EAGLEOPS_MLFLOW_ARTIFACTS" \
        --host "${EAGLEOPS_BIND:-127.0.0.1}" --port "$port" --workers "${EAGLEOPS_MLFLOW_WORKERS:-1}" "${allowed[@]}"
    ;;
start)
    start_in_background mlflow-server "$0" serve "$port"
    wait_healthy "mlflow server" "http://127.0.0.1:$port/health" "$(cat "$EAGLEOPS_STATE_DIR/mlflow-server.pid")" \
        "$EAGLEOPS_STATE_DIR/mlflow-server.log"
    ;;
*) echo "usage: $0 serve|start [PORT]" >&2; exit 2 ;;
esac
