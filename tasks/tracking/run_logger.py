"""MLflow runs by id: one parent run per experiment run, one nested child run per stage attempt, every write
through `RunLogger`, online while the server answers and journaled while it does not.

Everything goes through `MlflowClient` with explicit run ids rather than MLflow's fluent
active-run stack, which is per thread: Prefect may run a task in another thread than the
flow, and a stage's child run must not depend on which thread logs to it. Risk: a write path that
calls `MlflowClient` directly instead of going through `RunLogger` fails the run in an outage, and
sends an `offline-` id to the server once the run has one; so RunLogger has a method for each write
the stages make (tables and the model-registry writes included: tasks.tracking.registry_ops) and exposes
no client.
"""
from __future__ import annotations

import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from mlflow.entities import Dataset, DatasetInput, InputTag, Metric, Param, RunTag
from mlflow.tracking import MlflowClient

from tasks.config.masked import flatten, masked_dict, masked_yaml
from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact, redact_obj
from tasks.tracking.journal import (
    Journal,
    is_placeholder,
    new_placeholder_id,
)
from tasks.tracking.outage import (
    call_online,
    check_tracking_server,
    go_offline,
    is_offline,
)
from tasks.tracking.registry_ops import move_champion, register_version, set_version_tags
from tasks.tracking.views import ensure_experiment, tracking_uri_for

MAX_PARAM_LENGTH = 6000
MAX_TAG_LENGTH = 5000  # MLflow's limit on a tag value


BATCH = 100
METRICS_BATCH = 1000  # MLflow's log_batch limit on metrics per call (params: 100)


# The run tag MlflowClient.log_table keeps its tables in (mlflow.utils.mlflow_tags.MLFLOW_LOGGED_ARTIFACTS).
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"
MLFLOW_DATASET_CONTEXT = "mlflow.data.context"  # mlflow.utils.mlflow_tags.MLFLOW_DATASET_CONTEXT


# The journal of every run opened with one, so `RunLogger(uri, run_id)` built anywhere (a stage's
# ctx.mlflow, the report's parent logger) journals to the same file without each call site passing it.
_journal_of_run: dict[str, Path] = {}


def _now_ms() -> int:
    return int(time.time() * 1000)


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

    def log_metric_rows(self, rows: list[tuple[int, int, dict[str, float]]]) -> None:
        """Rows of (step, time in ms, metrics), in order, as few log_batch calls as MLflow's limit allows: what
        `tasks.tracking.handoff` sends for a training loop (each row keeps the time the loop produced it)."""
        items = [[k, float(v), ms, step] for step, ms, metrics in rows for k, v in metrics.items() if _is_number(v)]
        for start in range(0, len(items), METRICS_BATCH):
            self._write("log_batch", {"metrics": items[start : start + METRICS_BATCH]})

    def log_dataset(self, dataset: dict[str, str], context: str = "training") -> None:
        """One MLflow dataset input (`name`, `digest`, `source_type`, `source`, `profile`, optional `schema`) with
        its `mlflow.data.context` tag: the run's Datasets column, and what the runs table groups by. Logging the
        same name and digest twice (a resume, a replay) adds nothing: MLflow keeps one input per run."""
        self._write("log_inputs", {"datasets": [{**dataset, "context": context}]})

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

    def register_version(self, name: str, artifact_path: str, tags: dict[str, str] | None = None) -> str:
        """Register `<this run's artifacts>/<artifact_path>` as a version of model `name` (once per run and path).

        Returns the version, or, when the call was journaled, a placeholder (`offline-version-...`, see
        `is_placeholder`) that `sync_journal` maps to the version it registers, in the journal state and
        wherever the manifest records it (alone or as `name/<placeholder>`).
        """
        args = {"name": name, "artifact_path": artifact_path, "tags": {k: redact(str(v)) for k, v in (tags or {}).items()}}
        versions: list[str] = []
        if self._try_online(lambda c: versions.append(register_version(c, self.run_id, args))):
            return versions[0]
        args["placeholder"] = new_placeholder_id("version-")
        Journal(self.journal).append("register_version", self.run_id, _now_ms(), args)
        return args["placeholder"]

    def set_version_tags(self, name: str, version: str, tags: dict[str, Any]) -> None:
        """Tags on a model version, in order (journaled like any write of this run)."""
        self._write("set_version_tags", {"name": name, "version": version,
                                         "tags": {k: redact(str(v))[:MAX_TAG_LENGTH] for k, v in tags.items()}})

    def move_champion(self, name: str, challenger: str, measured_against: str | None) -> None:
        """`champion` -> `challenger`, the old one kept as `previous`, only if the champion is still `measured_against`
        when the write is made (live, or at replay: tasks.tracking.registry_ops.move_champion)."""
        self._write("move_champion", {"name": name, "challenger": challenger, "measured_against": measured_against})

    def finish(self, status: str) -> None:
        self._write("set_terminated", {"status": status, "end_time": _now_ms()})

    def reopen(self) -> None:
        self._write("update_run", {"status": "RUNNING"})

    def _try_online(self, call: Callable[[MlflowClient], Any]) -> bool:
        return not self.offline and call_online(self.tracking_uri, self.journal, call)

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


def apply_op(client: MlflowClient, op: str, run_id: str, args: dict[str, Any]) -> str | None:
    """One write as the journal records it, made against the server (live and at replay); a registered version's
    number for `register_version`."""
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
        return register_version(client, run_id, args)
    elif op == "set_version_tags":
        set_version_tags(client, args)
    elif op == "move_champion":
        move_champion(client, args)
    elif op == "log_table":
        _log_table(client, run_id, args["table"], args["artifact_file"])
    elif op == "log_inputs":
        client.log_inputs(run_id, datasets=[_dataset_input(d) for d in args["datasets"]])
    else:
        raise ValueError(f"unknown MLflow journal op '{op}'")


def _dataset_input(dataset: dict[str, str]) -> DatasetInput:
    entity = Dataset(dataset["name"], dataset["digest"], dataset["source_type"], dataset["source"],
                     schema=dataset.get("schema"), profile=dataset.get("profile"))
    return DatasetInput(entity, tags=[InputTag(MLFLOW_DATASET_CONTEXT, dataset["context"])])


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
    if not local_parent and not (journal is not None and is_offline(uri)) and call_online(uri, journal, create):
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

    `journal`: `tasks.tracking.journal.journal_path(run_dir)`; with it the server is probed first
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
            go_offline(tracking_uri, f"{pending} earlier MLflow calls of this run folder are not synced yet", journal)
    logger = RunLogger(tracking_uri, run_id, journal)
    logger.reopen()
    return logger


def start_child_run(parent: RunLogger, stage: str, tags: dict[str, str]) -> RunLogger:
    """A nested run for one stage (MLflow's UI nests it under the parent via mlflow.parentRunId)."""
    return create_run(parent.tracking_uri, parent.journal, stage,
                      {**tags, "eagleops.stage": stage, "eagleops.kind": "stage"}, parent=parent)


def log_json_file(logger: RunLogger, data: Any, artifact_file: str) -> None:
    """Log JSON that may hold non-dict roots; written through a temp file to keep key order."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / Path(artifact_file).name
        path.write_text(json.dumps(data, indent=2, default=str))
        parent = str(Path(artifact_file).parent)
        logger.log_artifact(path, None if parent == "." else parent)
