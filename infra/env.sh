# Source this for any eagleops server/worker: state under the project, telemetry off.
export EAGLEOPS_PROJECT_DIR="${EAGLEOPS_PROJECT_DIR:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}"
export PREFECT_HOME="${PREFECT_HOME:-$EAGLEOPS_PROJECT_DIR/.prefect-home}"
export PREFECT_SERVER_ANALYTICS_ENABLED=false
export DO_NOT_TRACK=true
export MLFLOW_DISABLE_TELEMETRY=true
export PATH="$EAGLEOPS_PROJECT_DIR/.venv/bin:$PATH"
