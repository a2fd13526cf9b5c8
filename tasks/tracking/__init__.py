"""The tracking wing: everything eagleops writes to or reads from MLflow.

One parent run per experiment run and one nested child run per stage attempt (`run_logger`), written
through a journal while the server is down and replayed later (`outage`, `journal`, `sync`); the local
SQLite store that moves with its runs root (`store`); the links and runs-table view a person opens
(`views`); run tags and `eagleops runs`' listing (`runs`); the model registry and its aliases
(`registry`; its writes, journaled and replayed like the rest, in `registry_ops`); system metrics of
this machine (`system_metrics`) and, over SSH, of the hosts a stage works on (`host_metrics`); training
metrics handed off the training loop to a background sender (`handoff`). Default store: `sqlite:///<runs_root>/mlflow.db` with
artifacts in `<runs_root>/mlartifacts`; an `http://` URI works the same. Redaction
(`tasks.config.secrets`) is applied before every write, online or journaled.

Outage: a run never fails because the tracking server is down. A `RunLogger` given a journal
(`<run_dir>/mlflow-journal.jsonl`) writes through to the server while it answers; the start of a
run probes `<uri>/health`, and when the probe or a write fails with a connection error, timeout or
repeated 5xx (never a 4xx), the URI is offline for the rest of this process's run: one warning line
says so, and every write is appended to the journal; runs created meanwhile get `offline-<uuid>` ids.
`sync_journal` replays the journal in order.

Imports: the wings below (config, the run folder, hosts); never the runner or the stages.
"""

import os

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow prints "View run ... at: <tracking uri>" to stdout, credentials of the URI included.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
# MLflow's defaults (7 retries, backoff factor 2, 120 s read timeout) wait ~265 s on a refused
# connection; the journal is the fallback here, so 2 retries (~3 s) are enough. A user's own
# setting wins. Read by MLflow at each request; set when this package is first imported, before
# any of its modules imports mlflow.
HTTP_RETRY_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
for _key, _value in HTTP_RETRY_DEFAULTS.items():
    os.environ.setdefault(_key, _value)
