"""Where a person reads a run: the tracking URI a config resolves to, the experiment MLflow's UI opens in
model-training mode with eagleops' runs-table view, and the links eagleops prints (MLflow and Prefect).

MLflow 3.17's UI does not open an experiment by its `mlflow.experimentKind` tag: it decides GenAI vs
model training by a `workflowType` query parameter, else the browser's localStorage
(`mlflow.workflowType`, default `genai`: a fresh browser lands on the traces overview). So every
link eagleops prints (`experiment_runs_url`, `experiment_charts_url`, `run_url`, `model_version_url`)
carries `workflowType=machine_learning`, and the experiment carries what its runs table and chart
view read: a shared view (`mlflow.sharedViewState.<key>`, opened by the link's `viewStateShareKey`)
whose columns and charts are the headline metrics, and `mlflow.experiment.primaryMetric.name` (the
chart view's first chart). The kind tag is still set for MLflow versions and tools that read it.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import quote, urlsplit

import requests
from mlflow.tracking import MlflowClient

from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.tracking.store import sqlite_uri_under

# MLflow UI: "custom_model_development" opens the runs table; checked in mlflow 3.17.2's UI bundle
# (enum CUSTOM_MODEL_DEVELOPMENT, tag key "mlflow.experimentKind", set by its experiment-kind selector).
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"


EXPERIMENT_KIND = "custom_model_development"


# What MLflow 3.17.2's UI keys on (its JS bundle, server/js/build/static/js): the `workflowType` query parameter
# (genai | machine_learning; without it the browser's localStorage `mlflow.workflowType`, default genai), a shared
# runs-table view read from the experiment tag `mlflow.sharedViewState.<key>` when the URL has
# `viewStateShareKey=<key>` (plain JSON of search facets + UI state: selectedColumns, compareRunCharts ...), and the
# experiment tag `mlflow.experiment.primaryMetric.name`, the chart view's first chart.
WORKFLOW_TYPE = "machine_learning"


SHARED_VIEW_TAG_PREFIX = "mlflow.sharedViewState."


RUNS_VIEW_KEY = "eagleops-headline"


PRIMARY_METRIC_TAG = "mlflow.experiment.primaryMetric.name"


# MLflow's Dataset column (its id for the attribute "Dataset"): wide enough for "name (digest) Training".
DATASET_COLUMN = "attributes.`Dataset`"
DATASET_COLUMN_WIDTH = 340


# The parent run's headline metrics, as the runs table, its charts and `eagleops runs` show them.
HEADLINE_METRICS = ("run_benchmark.best_tok_s", "run_benchmark.speedup", "run_benchmark.accept_length_online",
                    "run_benchmark.accept_length_offline", "run_benchmark.baseline_tok_s")


def default_tracking_uri(runs_root: str | Path) -> str:
    return f"sqlite:///{Path(runs_root).resolve() / 'mlflow.db'}"


def tracking_uri_for(cfg: ExperimentConfig) -> str:
    """tracking.uri, a relative `sqlite:///` path taken under runs_root (never the caller's cwd); default the runs root's store."""
    return sqlite_uri_under(cfg.tracking.uri, cfg.runs_root) if cfg.tracking.uri else default_tracking_uri(cfg.runs_root)


def ensure_experiment(client: MlflowClient, name: str, runs_root: str | Path, local_store: bool) -> str:
    """Experiment id for `name`, created (artifacts beside a local store) or restored, marked as model training,
    with the runs-table view eagleops' links open (`experiment_view_tags`)."""
    found = client.get_experiment_by_name(name)
    if found is None:
        location = (Path(runs_root).resolve() / "mlartifacts").as_uri() if local_store else None
        return client.create_experiment(name, artifact_location=location,
                                        tags={EXPERIMENT_KIND_TAG: EXPERIMENT_KIND, **experiment_view_tags()})
    if found.lifecycle_stage == "deleted":
        client.restore_experiment(found.experiment_id)
    if EXPERIMENT_KIND_TAG not in found.tags:  # an experiment made before this tag existed; a user's choice stays
        client.set_experiment_tag(found.experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    for key, value in experiment_view_tags().items():  # this version's view (a user's primary metric stays)
        if found.tags.get(key) != value and not (key == PRIMARY_METRIC_TAG and key in found.tags):
            client.set_experiment_tag(found.experiment_id, key, value)
    return found.experiment_id


def runs_view_state() -> dict[str, Any]:
    """The shared runs-table view: headline metrics, the speculative setting and the training data (the parent's
    dataset input: tasks/stages/train/dataset_input.py) as columns (then MLflow's defaults), newest first, and the
    chart view opening on tok/s, speedup and the accept lengths."""
    columns = [f"metrics.`{m}`" for m in HEADLINE_METRICS] + ["tags.`eagleops.best_setting`", DATASET_COLUMN]
    charts = [{"uuid": f"eagleops-{m}", "type": "BAR", "runsCountToCompare": 10, "metricSectionId": "eagleops-headline",
               "deleted": False, "isGenerated": False, "metricKey": m, "displayName": m} for m in HEADLINE_METRICS]
    widths = {c: DATASET_COLUMN_WIDTH if c == DATASET_COLUMN else header_width(c) for c in columns}
    return {"selectedColumns": columns, "columnOrder": columns, "columnWidths": widths,
            "orderByKey": "attributes.start_time", "orderByAsc": False,
            "compareRunCharts": charts,
            "compareRunSections": [{"uuid": "eagleops-headline", "name": "eagleops headline", "display": True,
                                    "isReordered": False}],
            "isAccordionReordered": False, "hideEmptyCharts": True}


def header_width(column: str) -> int:
    """Pixels for a runs-table column whose header shows its whole name (`metrics.`run_benchmark.speedup``
    shows `run_benchmark.speedup`): MLflow's default metric width (100 px) cuts every headline name to
    "run_benchmark...". ~7 px a character in the UI's 13 px font, plus the sort and menu icons."""
    name = column.split("`")[1] if "`" in column else column
    return max(100, round(7 * len(name)) + 28)


def experiment_view_tags() -> dict[str, str]:
    return {SHARED_VIEW_TAG_PREFIX + RUNS_VIEW_KEY: json.dumps(runs_view_state(), separators=(",", ":")),
            PRIMARY_METRIC_TAG: HEADLINE_METRICS[0]}


def mlflow_ui_base(tracking_uri: str) -> str | None:
    """The UI's address for an http(s) tracking server (credentials left out), None for a local store."""
    if not tracking_uri.startswith(("http://", "https://")):
        return None
    parts = urlsplit(tracking_uri)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    netloc += f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{netloc}{parts.path.rstrip('/')}"


def experiment_runs_url(base: str, experiment_id: str) -> str:
    """The experiment's runs table with the headline columns, in model-training mode in any browser."""
    return (f"{base}/#/experiments/{experiment_id}/runs?workflowType={WORKFLOW_TYPE}"
            f"&viewStateShareKey={RUNS_VIEW_KEY}")


def run_url(base: str, experiment_id: str, run_id: str) -> str:
    return f"{base}/#/experiments/{experiment_id}/runs/{run_id}?workflowType={WORKFLOW_TYPE}"


def experiment_charts_url(base: str, experiment_id: str) -> str:
    """The experiment's chart view (`compareRunsMode=CHART`), opening on the shared view's headline charts: where
    MLflow 3.17 compares runs by tok/s and speedup. Its older compare-runs page (`#/compare-runs`) cannot be told:
    it sorts metric rows alphabetically and plots the first metric key (CompareRunUtil.getKeys,
    ParallelCoordinatesPlotPanel in the UI bundle), so `check_environment.*` comes first there."""
    return f"{experiment_runs_url(base, experiment_id)}&compareRunsMode=CHART"


def model_version_url(base: str, name: str, version: str) -> str:
    """A registered model version's page in MLflow's model registry."""
    return f"{base}/#/models/{quote(name, safe='')}/versions/{version}?workflowType={WORKFLOW_TYPE}"


# Set by `eagleops run` while it runs the flow against its own temporary Prefect server: no UI outlives the run.
NO_PREFECT_UI_ENV = "EAGLEOPS_NO_PREFECT_UI"


def prefect_flow_run_url(flow_run_id: str, timeout_s: float = 2.0) -> str | None:
    """The Prefect UI page of a flow run, when a UI serves it: under PREFECT_UI_URL as set by the user, else under the
    address Prefect derives from PREFECT_API_URL if that server answers `/ui-settings` (a server started without its
    UI, such as `eagleops run`'s temporary one, does not), in the UI it opens by default. None otherwise."""
    from prefect.settings import PREFECT_API_URL, PREFECT_UI_URL

    if os.environ.get(NO_PREFECT_UI_ENV):  # a server that dies with this process (`eagleops run`'s temporary one)
        return None
    if not flow_run_id or flow_run_id == "unknown":
        return None
    ui = (os.environ.get("PREFECT_UI_URL") or "").rstrip("/")
    if not ui and PREFECT_API_URL.value():
        ui = _default_prefect_ui((PREFECT_UI_URL.value() or "").rstrip("/"), timeout_s) or ""
    return f"{ui}/runs/flow-run/{flow_run_id}" if ui else None


def default_prefect_ui(server: str, timeout_s: float = 10.0) -> str | None:
    """The base address of the UI a Prefect server (`http://host:port`) opens by default; None when none answers."""
    return _default_prefect_ui(server, timeout_s)


def _default_prefect_ui(server: str, timeout_s: float) -> str | None:
    """Where `server`'s default UI lives, from its `/ui-settings`; None when no UI answers there.

    Prefect 3.9.1 serves two UIs: v1 at `/` and v2 (`default_ui`, unless PREFECT_SERVER_UI_V2_ENABLED=false) at
    `v2_base_url`; only `/` itself redirects to the default one, so a deep link names its UI's base.
    """
    try:
        answered = requests.get(f"{server}/ui-settings", timeout=timeout_s, allow_redirects=False)
        settings = answered.json() if answered.status_code == 200 else {}
    except (requests.RequestException, ValueError):
        return None
    if not isinstance(settings, dict):
        return None
    base = settings.get(f"{settings.get('default_ui')}_base_url") or settings.get("v1_base_url") or settings.get("v2_base_url")
    return f"{server}{base.rstrip('/')}" if isinstance(base, str) else None


def local_ui_hint(tracking_uri: str, port: int = 5000) -> str:
    """How to open a local store's UI: the command, then the address it serves."""
    return f"mlflow ui --backend-store-uri {redact(tracking_uri)} --host 127.0.0.1 --port {port}"


def ui_base(tracking_uri: str) -> str:
    """The MLflow UI address for a tracking URI: the server's own, or `mlflow ui`'s default for a local store."""
    return mlflow_ui_base(tracking_uri) or "http://127.0.0.1:5000"


def run_links(tracking_uri: str, run_id: str) -> dict[str, str]:
    """{experiment, charts, run} UI addresses of a run (under `mlflow ui`'s default address for a local store, with
    the command that serves it as `serve`); raises as MLflow does when the store does not know the run."""
    experiment_id = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
    base = ui_base(tracking_uri)
    links = {} if mlflow_ui_base(tracking_uri) else {"serve": local_ui_hint(tracking_uri)}
    return {**links, "experiment": experiment_runs_url(base, experiment_id),
            "charts": experiment_charts_url(base, experiment_id), "run": run_url(base, experiment_id, run_id)}
