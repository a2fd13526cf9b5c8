"""MLflow tracking: one parent run per experiment run, one nested child run per stage; survives an outage.

Everything goes through `MlflowClient` with explicit run ids rather than MLflow's fluent
active-run stack, which is per thread: Prefect may run a task in another thread than the
flow, and a stage's child run must not depend on which thread logs to it.

Default store: `sqlite:///<runs_root>/mlflow.db` with artifacts in `<runs_root>/mlartifacts`
(the experiment is created with that artifact location). An `http://` URI works the same.
MLflow 3.17's UI does not open an experiment by its `mlflow.experimentKind` tag: it decides GenAI vs
model training by a `workflowType` query parameter, else the browser's localStorage
(`mlflow.workflowType`, default `genai`: a fresh browser lands on the traces overview). So every
link eagleops prints (`experiment_runs_url`, `experiment_charts_url`, `run_url`, `model_version_url`)
carries `workflowType=machine_learning`, and the experiment carries what its runs table and chart
view read: a shared view (`mlflow.sharedViewState.<key>`, opened by the link's `viewStateShareKey`)
whose columns and charts are the headline metrics, and `mlflow.experiment.primaryMetric.name` (the
chart view's first chart). The kind tag is still set for MLflow versions and tools that read it.

Outage: a run never fails because the tracking server is down. A `RunLogger` given a journal
(`<run_dir>/mlflow-journal.jsonl`, see `tasks.mlflow_journal`) writes through to the server
while it answers; the start of a run probes `<uri>/health` (PROBE_TIMEOUT_S), and when the
probe or a write fails with a connection error, timeout or repeated 5xx (never a 4xx), the URI
is offline for the rest of this process's run: one warning line says so, and every write is
appended to the journal; runs created meanwhile get `offline-<uuid>` ids. `sync_journal`
(`eagleops sync RUN_DIR`, and the start of the next `eagleops run --run-dir RUN_DIR`) replays
the journal in order. MLflow's own HTTP retries are bounded below (its defaults spend ~265 s
on a refused connection before raising). Redaction (`tasks.secrets`) is applied before every
write, online or journaled. Risk: a write path that calls `MlflowClient` directly instead of
going through `RunLogger` fails the run in an outage, and sends an `offline-` id to the server once
the run has one; so RunLogger has a method for each write the stages make (tables and model
versions included) and exposes no client.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import json
import logging
import os
import re
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator
from urllib.parse import quote, urlsplit

os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
# MLflow prints "View run ... at: <tracking uri>" to stdout, credentials of the URI included.
os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
# MLflow's defaults (7 retries, backoff factor 2, 120 s read timeout) wait ~265 s on a refused
# connection; the journal is the fallback here, so 2 retries (~3 s) are enough. A user's own
# setting wins. Read by MLflow at each request, so setting them at import is in time.
HTTP_RETRY_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "20",
}
for _key, _value in HTTP_RETRY_DEFAULTS.items():
    os.environ.setdefault(_key, _value)

import requests  # noqa: E402
from mlflow.entities import Metric, Param, RunTag  # noqa: E402
from mlflow.exceptions import MlflowException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from tasks.config import ExperimentConfig, flatten, masked_dict, masked_yaml  # noqa: E402
from tasks.mlflow_journal import (  # noqa: E402
    Journal,
    JournalState,
    is_placeholder,
    journal_path,
    new_placeholder_id,
    replace_ids,
)
from tasks.mlflow_store import sqlite_uri_under  # noqa: E402
from tasks.rundir import MANIFEST, RunDirectory, write_json_atomic  # noqa: E402
from tasks.secrets import redact, redact_obj  # noqa: E402

MAX_PARAM_LENGTH = 6000
BATCH = 100
PROBE_TIMEOUT_S = 3.0
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
# The parent run's headline metrics, as the runs table, its charts and `eagleops runs` show them.
HEADLINE_METRICS = ("run_benchmark.best_tok_s", "run_benchmark.speedup", "run_benchmark.accept_length_online",
                    "run_benchmark.accept_length_offline", "run_benchmark.baseline_tok_s")
# Shown on the registry page of a model eagleops registers first (a model made by hand keeps its own).
REGISTERED_MODEL_DESCRIPTION = (
    "EAGLE-3 draft checkpoints registered by eagleops' export_checkpoint, one version per run (the SGLang checkpoint "
    "folder). Deploys fetch `models:/<name>@champion`; `eagleops nightly` moves `champion` to a new version only when "
    "it wins the gate against the current one, which it keeps as `previous`."
)
# The run tag MlflowClient.log_table keeps its tables in (mlflow.utils.mlflow_tags.MLFLOW_LOGGED_ARTIFACTS).
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"

# Tracking URIs that stopped answering in this process, with why; a probe at the next run start clears them.
_offline: dict[str, str] = {}
_offline_lock = threading.Lock()
# The journal of every run opened with one, so `RunLogger(uri, run_id)` built anywhere (a stage's
# ctx.mlflow, the report's parent logger) journals to the same file without each call site passing it.
_journal_of_run: dict[str, Path] = {}


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
    """The shared runs-table view: headline metrics and the speculative setting as columns (then MLflow's
    defaults), newest first, and the chart view opening on tok/s, speedup and the accept lengths."""
    columns = [f"metrics.`{m}`" for m in HEADLINE_METRICS] + ["tags.`eagleops.best_setting`"]
    charts = [{"uuid": f"eagleops-{m}", "type": "BAR", "runsCountToCompare": 10, "metricSectionId": "eagleops-headline",
               "deleted": False, "isGenerated": False, "metricKey": m, "displayName": m} for m in HEADLINE_METRICS]
    return {"selectedColumns": columns, "columnOrder": columns, "columnWidths": {c: header_width(c) for c in columns},
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


def run_tags(cfg: ExperimentConfig) -> dict[str, str]:
    """Tags every parent run carries, so runs filter and compare by target, layers, speculation and host.

    `eagleops.speculative` is `num_steps/eagle_topk/num_draft_tokens` as asked (`auto` = SGLang chooses);
    `eagleops.layer_ids` the aux layer ids as asked, else SGLang's default for the target (`default`
    when its depth is not known here); `eagleops.architecture` only when known.
    """
    from tasks.launch import target_architecture

    spec = cfg.deploy.speculative
    tags = {
        "eagleops.target": "tiny" if cfg.target.kind == "tiny" else str(cfg.target.model_path),
        "eagleops.layer_ids": ",".join(map(str, _layer_ids(cfg))) or "default",
        "eagleops.speculative": "/".join(
            "auto" if v is None else str(v) for v in (spec.num_steps, spec.eagle_topk, spec.num_draft_tokens)
        ),
        "eagleops.host": cfg.deploy.host,
    }
    architecture = target_architecture(cfg)
    if architecture:
        tags["eagleops.architecture"] = architecture
    return tags


def _layer_ids(cfg: ExperimentConfig) -> list[int]:
    """The aux layer ids as asked, else SGLang's default when the target's depth is known here, else []."""
    from eagle3.data.capture import default_aux_layer_ids
    from tasks.launch import target_architecture

    if cfg.target.aux_layer_ids:
        return list(cfg.target.aux_layer_ids)
    architecture = target_architecture(cfg)
    config_file = Path(cfg.target.model_path or "", "config.json")
    if cfg.target.kind == "tiny":
        layers = cfg.target.tiny.num_hidden_layers
    elif cfg.target.shape:
        layers = cfg.target.shape.num_hidden_layers
    elif cfg.target.model_path and config_file.is_file():
        layers = json.loads(config_file.read_text()).get("num_hidden_layers")
    else:
        layers = None
    if not (architecture and layers):
        return []
    try:
        return default_aux_layer_ids(architecture, layers)
    except ValueError:  # no capture rule for this architecture: a tag is no place to fail the run
        return []


# --------------------------------------------------------------------------- reachability


class TrackingUnavailable(RuntimeError):
    """The tracking server did not answer (connection refused/reset, timeout, repeated 5xx)."""


def is_outage(err: BaseException) -> bool:
    """True when the server did not answer, anywhere in the exception chain; False for its 4xx answers.

    MLflow re-raises transport errors as a plain MlflowException whose context holds the
    requests error, so the chain is walked rather than the outer type checked.
    """
    seen: set[int] = set()
    current: BaseException | None = err
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, (requests.ConnectionError, requests.Timeout, requests.exceptions.RetryError,
                                ConnectionError, TimeoutError)):
            return True
        current = current.__cause__ or current.__context__
    return False


def _short_reason(err: BaseException) -> str:
    """`Connection refused` rather than three lines of urllib3 pool text."""
    text = str(err)
    errno = re.search(r"\[Errno -?\d+\] ([^'\")]+)", text)
    if errno:
        return errno.group(1).strip()
    if "timed out" in text.lower() or "timeout" in type(err).__name__.lower():
        return "no answer before the timeout"
    if "RemoteDisconnected" in text or "Connection aborted" in text:
        return "connection closed without an answer"
    return f"{type(err).__name__}: {redact(text)[:200]}"


def probe_tracking_server(uri: str, timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why `GET <uri>/health` gets no answer (refused, timeout, 5xx), or None: it answers, or the store is local.

    One request, no retries: the point is to learn in seconds. Any 2xx-4xx answer counts as
    reachable (a proxy may not route /health; MLflow's own calls will tell).
    """
    if not uri.startswith(("http://", "https://")):
        return None
    try:
        response = requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s, allow_redirects=False)
    except requests.RequestException as err:
        return _short_reason(err)
    if response.status_code >= 500:
        return f"GET /health answered HTTP {response.status_code}"
    return None


def offline_message(uri: str, reason: str, journal: Path) -> str:
    """The one warning line of an outage: which URI, why, where the calls go, how to get them uploaded."""
    port = urlsplit(uri).port or (443 if uri.startswith("https") else 80)
    return (
        f"MLflow tracking server {redact(uri)} is not usable ({reason}); the run goes on and records its MLflow "
        f"calls in {journal}. Start a server (e.g. mlflow server --backend-store-uri sqlite:///mlflow.db "
        f"--host 127.0.0.1 --port {port}) and upload them with: eagleops sync {journal.parent} "
        f"-- or set tracking.uri: null to track in the local store"
    )


def is_offline(uri: str) -> bool:
    return uri in _offline


def _go_offline(uri: str, reason: str, journal: Path) -> None:
    with _offline_lock:
        if uri in _offline:
            return
        _offline[uri] = reason
    _log().warning(offline_message(uri, reason, journal))


def check_tracking_server(uri: str, journal: Path | None) -> bool:
    """Probe at the start of a run: online again if it answers, else offline (one warning line)."""
    reason = probe_tracking_server(uri)
    with _offline_lock:
        _offline.pop(uri, None)
    if reason is not None and journal is not None:
        _go_offline(uri, reason, journal)
    return reason is None


def _call_online(uri: str, journal: Path | None, call: Callable[[MlflowClient], Any]) -> bool:
    """Make one MLflow call; False when the server did not answer and a journal can take it instead."""
    try:
        call(MlflowClient(uri))
    except Exception as err:
        if journal is None or not is_outage(err):
            raise
        _go_offline(uri, _short_reason(err), journal)
        return False
    return True


@contextlib.contextmanager
def store_errors_reported_by_caller() -> Iterator[None]:
    """For writes whose failure the caller reports in one line (a stage's failure path, where the disk
    holding a local SQLite store may be full): MLflow's SQL store would first log each failed write at
    ERROR with a full traceback (mlflow.store.db.utils), then raise it anyway."""
    store_logger = logging.getLogger("mlflow.store.db.utils")
    was_disabled, store_logger.disabled = store_logger.disabled, True
    try:
        yield
    finally:
        store_logger.disabled = was_disabled


def short_error(err: BaseException) -> str:
    """The first line of an error, secrets masked: SQLAlchemy appends the statement and its parameters."""
    return redact(str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__)


def _log() -> logging.Logger | logging.LoggerAdapter:
    from prefect import get_run_logger
    from prefect.exceptions import MissingContextError

    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("eagleops")


def _now_ms() -> int:
    return int(time.time() * 1000)


# --------------------------------------------------------------------------- runs


@dataclass
class RunLogger:
    """Logging into one MLflow run (a parent or a stage's child), by id.

    `journal`: the run folder's journal file; with one, writes go there while the server is
    offline or the run exists only locally (an `offline-` id). Without one (and not
    registered for this run id by an earlier logger), errors raise as MLflow raises them.
    """

    tracking_uri: str
    run_id: str
    journal: Path | None = field(default=None)

    def __post_init__(self) -> None:
        if self.journal is None:
            self.journal = _journal_of_run.get(self.run_id)
        else:
            self.journal = Path(self.journal)
            _journal_of_run[self.run_id] = self.journal

    @property
    def offline(self) -> bool:
        """Writes go to the journal: the run exists only locally so far, or its server stopped answering."""
        return self.journal is not None and (is_placeholder(self.run_id) or is_offline(self.tracking_uri))

    def log_params(self, params: dict[str, Any]) -> None:
        items = [[redact(k), redact(str(v))[:MAX_PARAM_LENGTH]] for k, v in params.items()]
        for start in range(0, len(items), BATCH):
            self._write("log_batch", {"params": items[start : start + BATCH]})

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        now = _now_ms()
        items = [[k, float(v), now, step] for k, v in metrics.items() if _is_number(v)]
        for start in range(0, len(items), BATCH):
            self._write("log_batch", {"metrics": items[start : start + BATCH]})

    def set_tags(self, tags: dict[str, Any]) -> None:
        self._write("log_batch", {"tags": [[k, redact(str(v))] for k, v in tags.items()]})

    def log_dict(self, data: dict | list, artifact_file: str) -> None:
        data = redact_obj(data)
        if not self._try_online(lambda c: c.log_dict(self.run_id, data, artifact_file)):
            self._journal_file(artifact_file, lambda path: _write_dict(data, path))

    def log_text(self, text: str, artifact_file: str) -> None:
        text = redact(text)
        if not self._try_online(lambda c: c.log_text(self.run_id, text, artifact_file)):
            self._journal_file(artifact_file, lambda path: path.write_text(text))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        path = Path(path)
        if not self._try_online(lambda c: _upload(c, self.run_id, path, artifact_path)):
            journal = Journal(self.journal)
            journal.append("log_artifact", self.run_id, _now_ms(),
                           {"path": journal.keep_copy(path), "artifact_path": artifact_path})

    def log_figure(self, figure: Any, artifact_file: str) -> None:
        if not self._try_online(lambda c: c.log_figure(self.run_id, figure, artifact_file)):
            self._journal_file(artifact_file, figure.savefig)

    def log_table(self, table: dict[str, list], artifact_file: str) -> None:
        """A table (column -> values) as MLflow's `log_table` stores it: a split-orient JSON artifact listed
        in the run's `mlflow.loggedArtifacts` tag (the UI shows it as a table); journaled like any write."""
        self._write("log_table", {"table": redact_obj(table), "artifact_file": artifact_file})

    def register_version(self, name: str, artifact_path: str, tags: dict[str, str] | None = None) -> str | None:
        """Register `<this run's artifacts>/<artifact_path>` as a new version of model `name`.

        Returns the version, or None when the call was journaled (the version number is known
        only once `sync_journal` registers it).
        """
        args = {"name": name, "artifact_path": artifact_path, "tags": {k: redact(str(v)) for k, v in (tags or {}).items()}}
        versions: list[str] = []
        if self._try_online(lambda c: versions.append(_register_version(c, self.run_id, args))):
            return versions[0]
        Journal(self.journal).append("register_version", self.run_id, _now_ms(), args)
        return None

    def finish(self, status: str) -> None:
        self._write("set_terminated", {"status": status, "end_time": _now_ms()})

    def reopen(self) -> None:
        self._write("update_run", {"status": "RUNNING"})

    def _try_online(self, call: Callable[[MlflowClient], Any]) -> bool:
        return not self.offline and _call_online(self.tracking_uri, self.journal, call)

    def _write(self, op: str, args: dict[str, Any]) -> None:
        if not self._try_online(lambda c: apply_op(c, op, self.run_id, args)):
            Journal(self.journal).append(op, self.run_id, _now_ms(), args)

    def _journal_file(self, artifact_file: str, write: Callable[[Path], Any]) -> None:
        """An artifact made from memory (text, dict, figure): written as a file, journaled as an upload."""
        journal = Journal(self.journal)
        target = journal.new_files_dir() / Path(artifact_file).name
        write(target)
        folder = str(Path(artifact_file).parent)
        journal.append("log_artifact", self.run_id, _now_ms(), {
            "path": str(target.relative_to(journal.run_dir)), "artifact_path": None if folder == "." else folder,
        })


def apply_op(client: MlflowClient, op: str, run_id: str, args: dict[str, Any]) -> None:
    """One write as the journal records it, made against the server (live and at replay)."""
    if op == "log_batch":
        client.log_batch(
            run_id,
            params=[Param(k, v) for k, v in args.get("params", [])],
            metrics=[Metric(k, v, ts, step) for k, v, ts, step in args.get("metrics", [])],
            tags=[RunTag(k, v) for k, v in args.get("tags", [])],
        )
    elif op == "update_run":
        client.update_run(run_id, status=args["status"])
    elif op == "set_terminated":
        client.set_terminated(run_id, status=args["status"], end_time=args["end_time"])
    elif op == "log_artifact":
        _upload(client, run_id, Path(args["path"]), args.get("artifact_path"))
    elif op == "register_version":
        _register_version(client, run_id, args)
    elif op == "log_table":
        _log_table(client, run_id, args["table"], args["artifact_file"])
    else:
        raise ValueError(f"unknown MLflow journal op '{op}'")


def _upload(client: MlflowClient, run_id: str, path: Path, artifact_path: str | None) -> None:
    if path.is_dir():
        client.log_artifacts(run_id, str(path), artifact_path)
    else:
        client.log_artifact(run_id, str(path), artifact_path)


def _log_table(client: MlflowClient, run_id: str, table: dict[str, list], artifact_file: str) -> None:
    """MlflowClient.log_table's file and tag, made idempotent for replay: the artifact is replaced (MLflow's
    own call appends rows to an existing one, so a replayed entry would double them) and the tag entry is
    added once."""
    import pandas as pd

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(artifact_file).name
        pd.DataFrame(table).to_json(path, orient="split", index=False, date_format="iso")
        folder = str(Path(artifact_file).parent)
        client.log_artifact(run_id, str(path), None if folder == "." else folder)
    logged = json.loads(client.get_run(run_id).data.tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
    entry = {"path": artifact_file, "type": "table"}
    if entry not in logged:
        client.set_tag(run_id, LOGGED_ARTIFACTS_TAG, json.dumps(logged + [entry]))


def _register_version(client: MlflowClient, run_id: str, args: dict[str, Any]) -> str:
    try:
        client.create_registered_model(args["name"], description=REGISTERED_MODEL_DESCRIPTION)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/{args['artifact_path']}"
    # No wait: MLflow's own stores create a version READY, and the wait logs a line into every run's output.
    return client.create_model_version(args["name"], source=source, run_id=run_id, tags=args["tags"],
                                       await_creation_for=0).version


def _write_dict(data: Any, path: Path) -> None:
    """As MlflowClient.log_dict serialises: YAML for .yaml/.yml, JSON (indent 2) otherwise."""
    if path.suffix in (".yaml", ".yml"):
        import yaml

        path.write_text(yaml.dump(data, indent=2, default_flow_style=False))
    else:
        path.write_text(json.dumps(data, indent=2, default=str))


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def create_run(
    uri: str,
    journal: Path | None,
    run_name: str,
    tags: dict[str, Any],
    *,
    experiment: str | None = None,
    parent: RunLogger | None = None,
    runs_root: str | Path = ".",
    local_store: bool = False,
) -> RunLogger:
    """A new run in `experiment` (a parent) or in `parent`'s experiment (a child, tagged with its parent).

    Offline (or under a parent that exists only locally) it gets an `offline-` id and a
    journal entry from which `sync_journal` creates it later.
    """
    tags = {k: redact(str(v)) for k, v in tags.items()}
    if parent is not None:
        tags["mlflow.parentRunId"] = parent.run_id
    start_time = _now_ms()
    created: list[str] = []

    def create(client: MlflowClient) -> None:
        experiment_id = (
            client.get_run(parent.run_id).info.experiment_id if parent is not None
            else ensure_experiment(client, experiment, runs_root, local_store)
        )
        created.append(client.create_run(experiment_id, start_time=start_time, tags=tags, run_name=run_name).info.run_id)

    local_parent = parent is not None and is_placeholder(parent.run_id)
    if not local_parent and not (journal is not None and is_offline(uri)) and _call_online(uri, journal, create):
        return RunLogger(uri, created[0], journal)
    placeholder = RunLogger(uri, new_placeholder_id(), journal)
    Journal(journal).append("create_run", placeholder.run_id, start_time, {
        "experiment": experiment, "parent": parent.run_id if parent else None, "run_name": run_name, "tags": tags,
        "start_time": start_time,
    })
    return placeholder


def start_parent_run(
    cfg: ExperimentConfig, run_name: str, tags: dict[str, str], config_path: str | Path, journal: Path | None = None
) -> RunLogger:
    """Create the experiment's parent run and log the validated config (params + YAML artifact).

    `journal`: `tasks.mlflow_journal.journal_path(run_dir)`; with it the server is probed first
    and an outage is journaled instead of raised.
    """
    uri = tracking_uri_for(cfg)
    if journal is not None:
        check_tracking_server(uri, journal)
    parent = create_run(uri, journal, run_name, {**tags, "eagleops.kind": "experiment"},
                        experiment=cfg.mlflow_experiment, runs_root=cfg.runs_root, local_store=cfg.tracking.uri is None)
    if cfg.description:
        parent.set_tags({"mlflow.note.content": cfg.description})
    parent.log_params(flatten(masked_dict(cfg)))
    parent.log_text(masked_yaml(cfg), "config/experiment.yaml")
    parent.set_tags({"eagleops.config_file": str(config_path)})
    return parent


def mark_run(tracking_uri: str, run_id: str, status: str, journal: Path | None = None) -> None:
    """Set a run's terminal status (e.g. KILLED for an attempt whose process died)."""
    RunLogger(tracking_uri, run_id, journal).finish(status)


def reopen_run(tracking_uri: str, run_id: str, journal: Path | None = None) -> RunLogger:
    """Set a parent run RUNNING again to resume it; with a journal, probe first and keep call order.

    While the journal holds entries not synced yet (the sync before resuming could not reach the
    server), writes keep going to the journal so they replay after the earlier ones.
    """
    if journal is not None and check_tracking_server(tracking_uri, journal):
        pending = Journal(journal).pending()
        if pending:
            _go_offline(tracking_uri, f"{pending} earlier MLflow calls of this run folder are not synced yet", journal)
    logger = RunLogger(tracking_uri, run_id, journal)
    logger.reopen()
    return logger


def start_child_run(parent: RunLogger, stage: str, tags: dict[str, str]) -> RunLogger:
    """A nested run for one stage (MLflow's UI nests it under the parent via mlflow.parentRunId)."""
    return create_run(parent.tracking_uri, parent.journal, stage,
                      {**tags, "eagleops.stage": stage, "eagleops.kind": "stage"}, parent=parent)


# --------------------------------------------------------------------------- sync


@dataclass
class SyncResult:
    """What one `sync_journal` call did."""

    replayed: int  # entries replayed now
    created: dict[str, str]  # placeholder -> real run id, runs created now
    refused: list[dict[str, Any]]  # entries the server refused now (4xx): recorded, skipped
    already_done: int  # entries an earlier sync had replayed


def sync_journal(run_dir: str | Path, tracking_uri: str) -> SyncResult:
    """Replay a run folder's journal entries not replayed yet, in order, against `tracking_uri`.

    Creates the runs that exist only locally (same names, tags, start times, parent links),
    maps their placeholder ids to the real ones (in the journal state and manifest.json) and
    records progress after each entry, so a second call is a no-op and an interrupted one
    resumes. An entry replayed twice (killed between the call and the state write) is harmless:
    a run is found again by its `eagleops.offline_id` tag, params and tags with equal values
    and artifacts overwrite, and MLflow keeps an identical metric point once. A refused entry
    (4xx) is recorded in the state and skipped. Raises TrackingUnavailable when the server does
    not answer (progress so far is kept).
    """
    run_dir = Path(run_dir)
    journal = Journal(journal_path(run_dir))
    entries, state = journal.entries(), journal.load_state()
    result = SyncResult(0, {}, [], min(state.done, len(entries)))
    if state.done >= len(entries):
        return result
    reason = probe_tracking_server(tracking_uri)
    if reason is not None:
        raise TrackingUnavailable(f"MLflow tracking server {redact(tracking_uri)} is not reachable ({reason})")
    client = MlflowClient(tracking_uri)
    try:
        for entry in entries[state.done:]:
            _replay_entry(client, journal, entry, state, result)
            state.done += 1
            result.replayed += 1
            journal.save_state(state)
    finally:
        rewrite_manifest_ids(run_dir, state.ids)
    return result


def _replay_entry(client: MlflowClient, journal: Journal, entry: dict, state: JournalState, result: SyncResult) -> None:
    op, placeholder = entry["op"], entry["run"]
    try:
        if op == "create_run":
            real = _replay_create(client, placeholder, replace_ids(entry["args"], state.ids))
            state.ids[placeholder] = result.created[placeholder] = real
            return
        run_id = state.ids.get(placeholder, placeholder)
        if is_placeholder(run_id):
            raise MlflowException(f"run {run_id} was never created on the server (its create_run entry was refused)")
        args = dict(entry["args"])
        if op == "log_artifact":
            args["path"] = str(journal.resolve(args["path"]))
        if op == "log_batch":
            args["tags"] = replace_ids(args.get("tags", []), state.ids)
        apply_op(client, op, run_id, args)
    except Exception as err:
        if is_outage(err):
            raise TrackingUnavailable(f"the tracking server stopped answering during sync ({_short_reason(err)}); "
                                      f"{state.done} entries are synced, run sync again") from err
        if not isinstance(err, MlflowException):
            raise
        refused = {"entry": state.done, "op": op, "run": placeholder, "error": redact(str(err))[:2000]}
        state.refused.append(refused)
        result.refused.append(refused)


def _replay_create(client: MlflowClient, placeholder: str, args: dict[str, Any]) -> str:
    """The real run for a placeholder: found by its offline-id tag (an earlier partial sync) or created."""
    if args.get("parent"):
        experiment_id = client.get_run(args["parent"]).info.experiment_id
    else:
        experiment_id = ensure_experiment(client, args["experiment"], ".", local_store=False)
    found = client.search_runs([experiment_id], f"tags.`eagleops.offline_id` = '{placeholder}'", max_results=1)
    if found:
        return found[0].info.run_id
    tags = {**args["tags"], "eagleops.offline_id": placeholder}
    return client.create_run(experiment_id, start_time=args["start_time"], tags=tags, run_name=args["run_name"]).info.run_id


def rewrite_manifest_ids(run_dir: Path, ids: dict[str, str]) -> None:
    """Replace placeholder run ids by real ones everywhere in the run folder's manifest.json."""
    path = run_dir / MANIFEST
    if not ids or not path.is_file():
        return
    manifest = json.loads(path.read_text())
    rewritten = replace_ids(manifest, ids)
    if rewritten != manifest:
        write_json_atomic(path, rewritten)


def sync_before_resume(run_dir: str | Path, tracking_uri: str) -> None:
    """At the start of `eagleops run --run-dir`: upload what an earlier offline run journaled, if the server answers.

    Only for the URI the run folder was tracked at (the manifest's); a failed sync is one
    warning, and the run then keeps journaling (see `reopen_run`).
    """
    run_dir = Path(run_dir)
    journal = Journal(journal_path(run_dir))
    if not journal.pending():
        return
    manifest_path = run_dir / MANIFEST
    # the store where the folder is now (a local one moves with its runs root), see tasks.rundir
    recorded = RunDirectory.open(run_dir).manifest.get("mlflow", {}).get("tracking_uri") if manifest_path.is_file() else None
    if recorded != tracking_uri:
        _log().warning(f"{journal.path}: {journal.pending()} MLflow calls not synced, recorded for {recorded}; "
                       f"upload them with: eagleops sync {run_dir} --tracking-uri URI")
        return
    try:
        result = sync_journal(run_dir, tracking_uri)
    except TrackingUnavailable as err:
        _log().warning(f"{journal.path}: earlier MLflow calls not synced: {err}")
        return
    _log().info(f"synced {result.replayed} journaled MLflow calls of {run_dir} ({len(result.created)} runs created)")
    for refused in result.refused:
        _log().warning(f"MLflow refused journaled {refused['op']} for run {refused['run']}: {refused['error']}")


# --------------------------------------------------------------------------- misc


def eagleops_version() -> str:
    try:
        return importlib.metadata.version("eagleops")
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


def git_commit(cwd: str | Path = ".") -> str:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    return out.stdout.strip() if out.returncode == 0 else "unknown"


def log_json_file(logger: RunLogger, data: Any, artifact_file: str) -> None:
    """Log JSON that may hold non-dict roots; written through a temp file to keep key order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(artifact_file).name
        path.write_text(json.dumps(data, indent=2, default=str))
        parent = str(Path(artifact_file).parent)
        logger.log_artifact(path, None if parent == "." else parent)


def recent_runs(tracking_uri: str, experiment: str | None, limit: int) -> list[dict[str, Any]]:
    """Parent runs, newest first, as small dicts for the `eagleops runs` table."""
    client = MlflowClient(tracking_uri)
    if experiment:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise LookupError(f"no MLflow experiment named {experiment!r}")
        experiments = [found]
    else:
        experiments = client.search_experiments()
    ids = [e.experiment_id for e in experiments]
    if not ids:
        return []
    names = {e.experiment_id: e.name for e in experiments}
    runs = client.search_runs(
        ids, filter_string="tags.`eagleops.kind` = 'experiment'", order_by=["attributes.start_time DESC"], max_results=limit
    )
    return [_run_row(r, names) for r in runs]


def _run_row(run: Any, names: dict[str, str]) -> dict[str, Any]:
    metrics = run.data.metrics
    return {
        "experiment": names.get(run.info.experiment_id, run.info.experiment_id),
        "run_name": run.info.run_name,
        "run_id": run.info.run_id,
        "status": run.info.status,
        "start_time": run.info.start_time,
        "config_hash": run.data.tags.get("eagleops.config_hash", ""),
        # the setting the headline figures are of (the benchmark's best), else the one the config asks for
        "setting": run.data.tags.get("eagleops.best_setting") or run.data.tags.get("eagleops.speculative", "-"),
        "stages": run.data.tags.get("eagleops.stages", ""),
        "metrics": {k: metrics[k] for k in sorted(metrics)},
    }

