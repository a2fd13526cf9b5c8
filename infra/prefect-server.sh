#!/usr/bin/env bash
# Prefect server (API + UI) on PostgreSQL.
#   infra/prefect-server.sh serve [PORT]   foreground (systemd: eagleops-prefect-server.service)
#   infra/prefect-server.sh start [PORT]   background, waits until healthy; pid and log in $EAGLEOPS_STATE_DIR
# Creates the database $EAGLEOPS_PREFECT_DB if missing; the server migrates it on start.
# Binds EAGLEOPS_BIND (default 127.0.0.1): put a TLS reverse proxy in front for a team.
set -euo pipefail
source "$(dirname "$0")/env.sh"
mode="${1:?usage: $0 serve|start [PORT]}"
port="${2:-4200}"
case "$mode" in
serve)
    "$(dirname "$0")/pg-database.sh" "$EAGLEOPS_PREFECT_DB"
    export PREFECT_API_DATABASE_CONNECTION_URL="$(pg_url postgresql+asyncpg "$EAGLEOPS_PREFECT_DB")"
    # The API address the UI's JavaScript calls: without it the UI calls the default port 4200
    # whatever --port says. Behind a reverse proxy, preset it to the public https://.../api.
    export PREFECT_UI_API_URL="${PREFECT_UI_API_URL:-http://127.0.0.1:$port/api}"
    mkdir -p "$PREFECT_HOME"
    exec prefect server start --host "${EAGLEOPS_BIND:-127.0.0.1}" --port "$port" --analytics-off
    ;;
start)
    start_in_background prefect-server "$0" serve "$port"
    wait_healthy "prefect server" "http://127.0.0.1:$port/api/health" "$(cat "$EAGLEOPS_STATE_DIR/prefect-server.pid")" \
        "$EAGLEOPS_STATE_DIR/prefect-server.log"
    ;;
*) echo "usage: $0 serve|start [PORT]" >&2; exit 2 ;;
esac
