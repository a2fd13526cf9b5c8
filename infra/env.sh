# Source this for any eagleops server/worker: state under the project, PostgreSQL coordinates,
# telemetry off. Every value can be preset in the environment (a systemd EnvironmentFile, a test).
export EAGLEOPS_PROJECT_DIR="${EAGLEOPS_PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export EAGLEOPS_STATE_DIR="${EAGLEOPS_STATE_DIR:-$EAGLEOPS_PROJECT_DIR/runs/services}"   # pid + log files of `start`
export PREFECT_HOME="${PREFECT_HOME:-$EAGLEOPS_PROJECT_DIR/.prefect-home}"
# PostgreSQL (trust or ~/.pgpass auth): one server, one database per service.
export EAGLEOPS_PG_HOST="${EAGLEOPS_PG_HOST:-127.0.0.1}"
export EAGLEOPS_PG_PORT="${EAGLEOPS_PG_PORT:-5432}"
export EAGLEOPS_PG_USER="${EAGLEOPS_PG_USER:-postgres}"
export EAGLEOPS_PREFECT_DB="${EAGLEOPS_PREFECT_DB:-eagleops_prefect}"
export EAGLEOPS_MLFLOW_DB="${EAGLEOPS_MLFLOW_DB:-eagleops_mlflow}"
export EAGLEOPS_MLFLOW_ARTIFACTS="${EAGLEOPS_MLFLOW_ARTIFACTS:-$EAGLEOPS_PROJECT_DIR/runs/mlflow-artifacts}"
# Telemetry: the Prefect server's own (DO_NOT_TRACK does not cover it), Prefect's client, MLflow's
# (MLflow honours only the string "true").
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export DO_NOT_TRACK=true
export MLFLOW_DISABLE_TELEMETRY=true
export PATH="${EAGLEOPS_VENV:-$EAGLEOPS_PROJECT_DIR/.venv}/bin:$PATH"

pg_url() {  # $1: scheme (postgresql, postgresql+asyncpg), $2: database
    echo "$1://$EAGLEOPS_PG_USER@$EAGLEOPS_PG_HOST:$EAGLEOPS_PG_PORT/$2"
}

wait_healthy() {  # $1: name, $2: health URL, $3: pid, $4: log file; polls for up to 120 s
    for _ in $(seq 1 240); do
        if curl -sf "$2" >/dev/null; then
            echo "$1 pid $3 healthy at $2"
            return 0
        fi
        kill -0 "$3" 2>/dev/null || { echo "$1 exited before it was healthy; last lines of $4:" >&2; tail -n 30 "$4" >&2; return 1; }
        sleep 0.5
    done
    echo "$1 not healthy after 120 s; see $4" >&2
    return 1
}

start_in_background() {  # $1: name; rest: command. Own session (pid = process group), pid/log in the state dir.
    local name=$1
    shift
    mkdir -p "$EAGLEOPS_STATE_DIR"
    setsid "$@" >"$EAGLEOPS_STATE_DIR/$name.log" 2>&1 </dev/null &
    echo $! >"$EAGLEOPS_STATE_DIR/$name.pid"
}
