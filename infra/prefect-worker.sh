#!/usr/bin/env bash
# Create the process work pool if missing, register the deployments, start a worker.
# Needs PREFECT_API_URL (e.g. http://127.0.0.1:4200/api).
set -euo pipefail
source "$(dirname "$0")/env.sh"
: "${PREFECT_API_URL:?set PREFECT_API_URL to the Prefect server, e.g. http://127.0.0.1:4200/api}"
cd "$EAGLEOPS_PROJECT_DIR"
prefect work-pool inspect eagleops-local >/dev/null 2>&1 || prefect work-pool create eagleops-local --type process
prefect --no-prompt deploy --all --prefect-file infra/prefect.yaml
exec prefect worker start --pool eagleops-local --name "eagleops-$(hostname)" --install-policy never "$@"
