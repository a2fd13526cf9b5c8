"""`eagleops ui`: the MLflow UI on a runs root's local store and a Prefect server on the demo's database, on free
ports, with the links that land right; both stopped on Ctrl-C.

After `make demo` the run's temporary Prefect server is gone, but its database (`$PREFECT_HOME/prefect.db`,
`.prefect-home` under make) still holds the flow run; and a bare `mlflow ui` opens in MLflow 3.17's GenAI mode (an
empty traces page for eagleops' experiment). Here both servers run in their own sessions (a terminal's Ctrl-C
reaches this process only, which stops them as groups) and die with this process (PR_SET_PDEATHSIG, even on
kill -9). The Prefect server's UI is told its own API (PREFECT_UI_API_URL): without it the page in the browser
calls :4200 whatever port the server listens on ("Unable to connect to Prefect server"). Risk: the commands and
settings are those of MLflow 3.17 (`mlflow server`) and Prefect 3.9 (`prefect server start`).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import httpx

from flows.runtime import _die_with_parent, _free_port, _stop, _tail

STARTUP_TIMEOUT_S = 240.0  # both servers boot at once; ~15 s each on an idle 2-core box, much more under load


@dataclass
class Servers:
    """The two servers `serve_ui` started: their processes, logs and addresses."""

    mlflow_url: str
    prefect_url: str
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    logs: dict[str, IO[bytes]] = field(default_factory=dict)


def mlflow_command(store: Path, port: int) -> list[str]:
    """MLflow's server on the store's database, artifacts beside it (`mlartifacts`, where eagleops' experiments put
    theirs), one worker and no job runner: a viewer, not a team server."""
    return [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{store}",
            "--artifacts-destination", str(store.parent / "mlartifacts"),
            "--host", "127.0.0.1", "--port", str(port), "--workers", "1"]


def prefect_command(port: int) -> list[str]:
    return [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]


def prefect_env(prefect_home: Path, port: int) -> dict[str, str]:
    """The Prefect server's environment: its database under `prefect_home`, its UI pointed at its own API."""
    api = f"http://127.0.0.1:{port}/api"
    env = {k: v for k, v in os.environ.items() if k not in ("PREFECT_UI_URL", "PREFECT_API_DATABASE_CONNECTION_URL")}
    return {**env, "PREFECT_HOME": str(prefect_home), "PREFECT_API_URL": api, "PREFECT_UI_API_URL": api,
            "PREFECT_UI_ENABLED": "true", "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true"}


@contextlib.contextmanager
def serve_ui(store: Path, prefect_home: Path, mlflow_port: int | None = None,
             prefect_port: int | None = None) -> Iterator[Servers]:
    """Start both servers and wait until they answer; stop both (process groups) however the block ends."""
    mlflow_port, prefect_port = mlflow_port or _free_port(), prefect_port or _free_port()
    servers = Servers(f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{prefect_port}")
    mlflow_env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true"}
    prefect_home.mkdir(parents=True, exist_ok=True)
    try:
        for name, command, env in (("MLflow", mlflow_command(store, mlflow_port), mlflow_env),
                                   ("Prefect", prefect_command(prefect_port), prefect_env(prefect_home, prefect_port))):
            servers.logs[name] = tempfile.TemporaryFile()
            servers.procs[name] = subprocess.Popen(command, env=env, cwd=store.parent, start_new_session=True,
                                                   preexec_fn=_die_with_parent, stdout=servers.logs[name],
                                                   stderr=subprocess.STDOUT)
        _wait_healthy(servers, {"MLflow": f"{servers.mlflow_url}/health",
                                "Prefect": f"{servers.prefect_url}/api/health"})
        yield servers
    finally:
        for proc in servers.procs.values():
            _stop(proc)
        for log in servers.logs.values():
            log.close()


def _wait_healthy(servers: Servers, health: dict[str, str]) -> None:
    deadline, waiting = time.monotonic() + STARTUP_TIMEOUT_S, dict(health)
    with httpx.Client(timeout=2.0) as client:
        while waiting and time.monotonic() < deadline:
            for name, url in list(waiting.items()):
                if servers.procs[name].poll() is not None:
                    raise RuntimeError(f"the {name} server exited with {servers.procs[name].returncode} before it "
                                       f"answered:\n{_tail(servers.logs[name])}")
                with contextlib.suppress(httpx.HTTPError):
                    if client.get(url).status_code == 200:
                        del waiting[name]
            time.sleep(0.3)
    if waiting:
        raise RuntimeError(f"{' and '.join(waiting)} did not answer within {STARTUP_TIMEOUT_S:.0f}s")


def exited(servers: Servers) -> str | None:
    """The first server that stopped on its own, with its log's tail; None while both run."""
    for name, proc in servers.procs.items():
        if proc.poll() is not None:
            return f"the {name} server exited with {proc.returncode}:\n{_tail(servers.logs[name])}"
    return None


def links(servers: Servers, tracking_uri: str) -> list[tuple[str, str]]:
    """(label, address) of what a person opens first: MLflow's experiments list and the newest run's runs table,
    charts and run page, all in model-training mode; Prefect's flow runs and the newest run's flow run page."""
    from tasks.tracking.runs import recent_runs
    from tasks.tracking.views import (WORKFLOW_TYPE, default_prefect_ui, experiment_charts_url, experiment_runs_url,
                                      model_version_url, run_url)

    found = [("MLflow experiments", f"{servers.mlflow_url}/#/experiments?workflowType={WORKFLOW_TYPE}")]
    newest = recent_runs(tracking_uri, None, 1)
    flow_run_id = None
    if newest:
        row = newest[0]
        experiment_id = _experiment_id(tracking_uri, row["run_id"])
        found += [("MLflow runs table", experiment_runs_url(servers.mlflow_url, experiment_id)),
                  ("MLflow charts", experiment_charts_url(servers.mlflow_url, experiment_id)),
                  (f"MLflow newest run ({row['run_name']})", run_url(servers.mlflow_url, experiment_id, row["run_id"]))]
        flow_run_id = row.get("flow_run_id")
        found += [(f"MLflow model {v.name} version {v.version}", model_version_url(servers.mlflow_url, v.name, v.version))
                  for v in _versions_of(tracking_uri, row["run_id"])]
    prefect_ui = default_prefect_ui(servers.prefect_url) or servers.prefect_url
    found.append(("Prefect flow runs", f"{prefect_ui}/runs"))
    if flow_run_id and _known_flow_run(servers.prefect_url, flow_run_id):
        found.append(("Prefect newest flow run", f"{prefect_ui}/runs/flow-run/{flow_run_id}"))
    return found


def _versions_of(tracking_uri: str, run_id: str) -> list:
    """The model versions registered by the experiment run `run_id`: their source run is its export stage's child run
    (the run that holds the checkpoint), or the run itself."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri)
    run = client.get_run(run_id)
    children = client.search_runs([run.info.experiment_id], f"tags.mlflow.parentRunId = '{run_id}'")
    return [version for source in [run_id, *(child.info.run_id for child in children)]
            for version in client.search_model_versions(f"run_id = '{source}'")]


def _experiment_id(tracking_uri: str, run_id: str) -> str:
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri).get_run(run_id).info.experiment_id


def _known_flow_run(prefect_url: str, flow_run_id: str) -> bool:
    """Whether this database holds the flow run (a run made with another PREFECT_HOME is not in it)."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(f"{prefect_url}/api/flow_runs/{flow_run_id}", timeout=10).status_code == 200
    return False
