"""The stage runner behind the experiment flow: selection, resume by real inputs, run folder, MLflow runs.

A stage is a Prefect task `fn(cfg, ctx) -> summary` (see `StageContext`). Its inputs are the
config fields it reads and the content digests of the upstream outputs it consumes
(`STAGE_SPECS`), hashed into a fingerprint. `Pipeline.run_stage` decides:
- a completed attempt with the same fingerprint exists -> reuse its outputs (no new work);
- the latest attempt ended unfinished with the same fingerprint -> resume it in place;
- otherwise -> a new attempt folder (earlier attempts are kept, never overwritten).
Stages that measure or touch other machines (`always_run`) run every time. So changing
`deploy.port` re-runs deploy and benchmark only, changing `train.lr` re-runs training and what
consumes the new checkpoint, and a changed secret re-runs nothing (secrets are masked before
hashing). A failure is recorded everywhere (manifest, child and parent run FAILED) and
re-raised so the flow stops; an interrupt (Ctrl-C, SIGTERM) is recorded as `interrupted`
and KILLED. Nothing a stage already wrote is deleted. A resumed folder uses the runs root it
lives in now, not the config's (`_settle_in`): a moved or copied run folder finds its
tiny-target cache and local MLflow store there, and output digests hold no absolute path,
so nothing re-runs because a path changed.
"""

from __future__ import annotations

import json
import logging
import os
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from prefect import get_run_logger
from prefect.exceptions import MissingContextError

from eagle3.training.trainer import RESUMABLE_FIELDS
from tasks.config import ExperimentConfig, config_hash, flatten, masked_dict, masked_yaml, secret_values
from tasks.config_reads import covered, recording_reads
from tasks.diskspace import describe_disk_full, disk_full_error
from tasks.mlflow_journal import is_placeholder, journal_path
from tasks.mlflow_store import has_run, relocate_local_store
from tasks.rundir import MANIFEST, RunDirectory, digest_json, digest_paths, elapsed_since, now_iso, write_json_atomic
from tasks.secrets import install_log_redaction, redact, register_secrets
from tasks.stages import STAGES, DiskFull, SelectionError, StageFailed
from tasks.system_metrics import system_metrics
from tasks.tracking import (
    RunLogger,
    eagleops_version,
    git_commit,
    mark_run,
    reopen_run,
    run_links,
    run_tags,
    short_error,
    start_child_run,
    start_parent_run,
    store_errors_reported_by_caller,
    sync_before_resume,
    tracking_uri_for,
)


@dataclass(frozen=True)
class Reads:
    """Fields a stage reads only when `when(cfg)` holds: `config` are then inputs, `operational` read but not."""

    when: Callable[[ExperimentConfig], bool]
    config: tuple[str, ...] = ()
    operational: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageSpec:
    """What a stage reads: its inputs (dotted config prefixes, minus `operational`), the fields it reads that
    never change its outputs (`operational`: how fast, from where, how often it reports), reads that depend on
    the config (`when`), and upstream stages. A field a stage reads is an input or operational, nothing else:
    `undeclared_reads` names the rest, and the pipeline checks every attempt against it."""

    config: tuple[str, ...] = ()
    operational: tuple[str, ...] = ()
    when: tuple[Reads, ...] = ()
    needs: tuple[str, ...] = ()  # upstream outputs it cannot run without
    uses: tuple[str, ...] = ()  # upstream outputs it reads when they exist (offline figures)
    always_run: bool = False  # a measurement or a side effect on another machine: never reused

    def inputs(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return self.config + tuple(f for extra in self.when if extra.when(cfg) for f in extra.config)

    def operational_fields(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return self.operational + tuple(f for extra in self.when if extra.when(cfg) for f in extra.operational)


def _regeneration_servers(cfg: ExperimentConfig) -> bool:
    """The data stage starts servers of the target (deploy.server, deploy.model_path, ...) to regenerate."""
    regen = cfg.data.regenerate
    return regen.enabled and regen.backend != "local" and regen.deploy is not None


def _speculators_verifier_from_paths(cfg: ExperimentConfig) -> bool:
    """The speculators export names its verifier after deploy.model_path or target.model_path."""
    return "speculators" in cfg.export.formats and cfg.export.verifier_name_or_path is None


def _streamed(cfg: ExperimentConfig) -> bool:
    """train_draft runs the stream's capture side (data.hidden_states: stream)."""
    return cfg.data.hidden_states == "stream"


# What the capture side of a stream is given (the data and target sections, tasks/stream.py): its content is
# decided upstream (the data stage's fingerprint and digest, an input), its pace by the budget.
_STREAM_CAPTURE = ("target.kind", "target.model_path", "target.shape", "target.tiny", "target.aux_layer_ids",
                   "target.engine", "target.trust_remote_code", "target.placement", "data.stream", "data.capture",
                   "data.capture_batch_size", "data.shard_size", "data.hidden_states_dtype", "data.max_length",
                   "data.regenerate", "data.prompts", "data.num_samples", "data.validation_fraction", "data.seed",
                   "data.host")
# Regeneration settings that change how fast answers arrive, not which answers.
_DATA_OPERATIONAL = tuple(f"data.regenerate.{k}" for k in (
    "concurrency", "retries", "timeout_s", "backoff_s", "api_key", "endpoint", "endpoints", "deploy", "max_failed_fraction"))
# How the SGLang capture runner batches and sizes its memory, where the HF engine places the target, and how
# much disk a stream may take: not which hidden states are written.
_CAPTURE_OPERATIONAL = ("data.capture.max_batch_tokens", "data.capture.mem_fraction_static", "target.placement",
                        "data.stream")
# Where the runs root and its tiny-target cache are (a moved run folder re-runs nothing), how many CPU
# threads build the tiny target, how the SSH inventory reaches a host.
_WHERE = ("runs_root", "target.tiny.num_threads", "hosts")
# A later stage finds the target the data stage recorded (by content, in the upstream digest).
_FINDS_TARGET = ("target.kind", "target.tiny", "target.model_path")
# How a server of the target is started: its port, environment, memory, patience (not what it serves).
_SERVER_OPERATIONAL = tuple(f"deploy.{k}" for k in (
    "port", "env", "tp", "mem_fraction_static", "max_running_requests", "enable_metrics", "startup_timeout_s",
    "preflight"))

STAGE_SPECS: dict[str, StageSpec] = {
    "check_environment": StageSpec(config=("target", "data", "train", "deploy", "hosts", "runs_root"), always_run=True),
    "generate_data": StageSpec(
        config=("target", "data"), operational=_DATA_OPERATIONAL + _CAPTURE_OPERATIONAL + _WHERE,
        # the servers it starts serve deploy.model_path (or the target) with deploy.server and deploy.extra_args
        when=(Reads(_regeneration_servers, config=("deploy.server", "deploy.model_path", "deploy.extra_args"),
                    operational=_SERVER_OPERATIONAL),),
    ),
    "train_draft": StageSpec(
        config=("train", "data.draft_vocab_size", "data.hidden_states", "target.dtype"),
        operational=tuple(f"train.{k}" for k in RESUMABLE_FIELDS) + _WHERE + _FINDS_TARGET, needs=("generate_data",),
        # the stream's capture side captures what the data stage's fingerprint (an input, upstream) decides
        when=(Reads(_streamed, operational=_STREAM_CAPTURE),
              Reads(lambda cfg: cfg.data.hidden_states == "online", operational=("target.placement",
                                                                                  "target.trust_remote_code"))),
    ),
    "export_checkpoint": StageSpec(
        config=("export",), operational=_WHERE + ("target.kind", "target.tiny"), needs=("train_draft",),
        # the verifier the speculators config names; the sglang format has none, so then they are only looked at
        when=(Reads(_speculators_verifier_from_paths, config=("deploy.model_path", "target.model_path")),
              Reads(lambda cfg: not _speculators_verifier_from_paths(cfg),
                    operational=("deploy.model_path", "target.model_path"))),
    ),
    "deploy_server": StageSpec(config=("deploy", "hosts", "target", "experiment", "runs_root"),
                               needs=("export_checkpoint",), always_run=True),
    "run_benchmark": StageSpec(config=("bench", "deploy", "hosts", "target", "data.max_length", "experiment",
                                       "runs_root"),
                               needs=("deploy_server",), uses=("generate_data", "train_draft", "export_checkpoint"),
                               always_run=True),
    "report": StageSpec(config=("experiment",), operational=("description",),  # the MLflow run's description
                        uses=("generate_data", "train_draft", "export_checkpoint", "deploy_server", "run_benchmark"),
                        always_run=True),
}
# Set (the test suite does) to fail a stage that read a field its spec does not declare, instead of a warning.
STRICT_READS_ENV = "EAGLEOPS_STRICT_STAGE_READS"
# Stages that run whatever --stages says: the report summarises whatever ran.
ALWAYS_SELECTED = {"report"}


class UndeclaredReads(RuntimeError):
    """A stage read a config field its StageSpec does not declare (see Pipeline._check_reads)."""


def _run_link(tracking_uri: str, run_id: str) -> str:
    """The run's page in MLflow's UI in model-training mode (a link to the UI's root opens GenAI mode in a fresh
    browser); empty when the store cannot say (its link then is whatever the user opens)."""
    from mlflow.exceptions import MlflowException

    try:
        return run_links(tracking_uri, run_id)["run"]
    except (MlflowException, OSError) as err:  # a link is a courtesy: no store error fails the run for it
        logger().debug(f"no MLflow link for run {run_id}: {err}")
        return ""


def logger() -> logging.Logger | logging.LoggerAdapter:
    try:
        return get_run_logger()
    except MissingContextError:
        return logging.getLogger("eagleops")


def is_interrupt(err: BaseException) -> bool:
    """Ctrl-C, SIGTERM (Prefect's TerminationSignal) or a SystemExit raised by a signal handler."""
    return not isinstance(err, Exception)


@dataclass
class StageContext:
    """What a stage task gets besides the config: where to write, where to log, what came before."""

    name: str
    stage_dir: Path
    run_dir: Path
    tracking_uri: str
    mlflow_run_id: str
    upstream: dict[str, dict[str, Any]] = field(default_factory=dict)
    attempt: int = 1
    upstream_digests: dict[str, str] = field(default_factory=dict)  # each upstream's output digest

    @property
    def mlflow(self) -> RunLogger:
        return RunLogger(self.tracking_uri, self.mlflow_run_id)

    def write_json(self, filename: str, data: Any) -> Path:
        path = self.stage_dir / filename
        write_json_atomic(path, data)
        return path

    def progress(self, label: str | None = None, every_s: float = 5.0) -> ProgressLog:
        return ProgressLog(label or self.name, every_s)


class ProgressLog:
    """`callback(what, done, total)` that logs `what: done/total (rate/s, ETA)` at most every `every_s`."""

    def __init__(self, label: str, every_s: float = 5.0):
        self.label, self.every_s = label, every_s
        self._started: dict[str, tuple[float, int]] = {}
        self._last_log = 0.0

    def __call__(self, what: str, done: int, total: int) -> None:
        now = time.monotonic()
        start, first = self._started.setdefault(what, (now, done))
        finished = total > 0 and done >= total
        if not finished and now - self._last_log < self.every_s:
            return
        self._last_log = now
        rate = (done - first) / max(now - start, 1e-9)
        eta = f", ETA {(total - done) / rate:.0f}s" if rate > 0 and total > done else ""
        logger().info(f"{self.label}: {what} {done}/{total} ({rate:.1f}/s{eta})")


def stage_inputs(cfg: ExperimentConfig, name: str, upstream_digests: dict[str, str | None], version: str) -> dict:
    """The config fields a stage reads (flattened, secrets masked) and its upstream digests."""
    spec = STAGE_SPECS[name]
    flat = flatten(masked_dict(cfg))
    inputs, operational = spec.inputs(cfg), spec.operational_fields(cfg)
    fields = {key: value for key, value in flat.items() if covered(key, inputs) and not covered(key, operational)}
    upstream = {u: upstream_digests.get(u) for u in spec.needs + spec.uses}
    if name == "train_draft" and cfg.train.init_checkpoint:  # a file input named by the config: its content counts
        start = Path(cfg.train.init_checkpoint)
        upstream["init_checkpoint"] = digest_paths([start]) if start.exists() else "missing"
    return {"config": fields, "upstream": upstream, "version": version}


def undeclared_reads(name: str, cfg: ExperimentConfig, reads: set[str], spec: StageSpec | None = None) -> list[str]:
    """The fields a stage read that its StageSpec (or `spec`) neither takes as inputs nor lists as operational."""
    spec = spec or STAGE_SPECS[name]
    declared = spec.inputs(cfg) + spec.operational_fields(cfg)
    return sorted(field for field in reads if not covered(field, declared))


def describe_changes(before: dict, after: dict) -> str:
    """`train.lr 0.001 -> 0.002, generate_data output changed` for a log line."""
    changes = []
    old_cfg, new_cfg = before.get("config", {}), after.get("config", {})
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if old_cfg.get(key) != new_cfg.get(key):
            changes.append(f"{key} {old_cfg.get(key, '(unset)')} -> {new_cfg.get(key, '(unset)')}")
    for name in sorted(set(before.get("upstream", {})) | set(after.get("upstream", {}))):
        if before.get("upstream", {}).get(name) != after.get("upstream", {}).get(name):
            changes.append(f"{name} output changed")
    if before.get("version") != after.get("version"):
        changes.append(f"eagleops {before.get('version')} -> {after.get('version')}")
    return ", ".join(changes) or "nothing recorded"


class Pipeline:
    """One experiment run: its run directory, MLflow parent run and the stages chosen for it."""

    active: Pipeline | None = None  # the pipeline of this process's running flow, for the CLI's interrupt line

    def __init__(
        self,
        cfg: ExperimentConfig,
        config_path: str,
        selected: list[str] | None,
        run_dir: str | None,
        flow_run_id: str,
    ):
        unknown = sorted(set(selected or []) - set(STAGES))
        if unknown:
            raise ValueError(f"unknown stage(s) {unknown}; stages are {STAGES}")
        register_secrets(secret_values(cfg))
        install_log_redaction()
        self.cfg, self.config_path, self.selected = cfg, config_path, selected
        # Where runs go is not what they run: a folder moved to another runs root (and a config edited to
        # name it) keeps its MLflow parent run.
        self.config_hash = config_hash(cfg.model_copy(update={"runs_root": ""}))
        self.version = eagleops_version()
        self.digests: dict[str, str] = {}
        self.results: dict[str, dict[str, Any]] = {}
        self.current_stage: str | None = None
        self.run = self._open_run_dir(config_path, run_dir)
        self._check_selection()
        self.parent = self._open_parent_run(config_path, flow_run_id)
        self._close_stale_attempts()
        Pipeline.active = self

    # ------------------------------------------------------------------ setup

    def _open_run_dir(self, config_path: str, run_dir: str | None) -> RunDirectory:
        header = {"config_path": str(Path(config_path).resolve()), "config_hash": self.config_hash,
                  "eagleops_version": self.version}
        if run_dir is None:
            run = RunDirectory.create(self.cfg.runs_root, self.cfg.experiment, header)
        else:
            self._settle_in(RunDirectory.open(run_dir))
            sync_before_resume(run_dir, tracking_uri_for(self.cfg))  # what an earlier offline run journaled
            run = RunDirectory.open(run_dir)
            run.update(**header)
        (run.path / "config.yaml").write_text(masked_yaml(self.cfg))
        logger().info(f"run directory: {run.path}")
        return run

    def _settle_in(self, run: RunDirectory) -> None:
        """A resumed folder uses the runs root it lives in now (it may have moved since it was written): that
        root's tiny-target cache and local MLflow store, whose artifact URIs are re-pointed after a move."""
        if run.manifest.get("experiment") != self.cfg.experiment:
            raise ValueError(f"{run.path}: run of experiment '{run.manifest.get('experiment')}', "
                             f"not '{self.cfg.experiment}'")
        if run.runs_root is not None and run.runs_root != Path(self.cfg.runs_root).resolve():
            logger().info(f"{run.path} lives in runs root {run.runs_root} (the config says {self.cfg.runs_root}): "
                          "using that one")
            self.cfg = self.cfg.model_copy(update={"runs_root": str(run.runs_root)})
        store = run.manifest.get("mlflow", {}).get("tracking_uri")
        if relocate_local_store(run.recorded_tracking_uri, store):
            logger().info(f"MLflow store {store} moved from {run.recorded_tracking_uri}: artifact locations "
                          "re-pointed to the folder beside it")

    def _known_to_store(self, tracking_uri: str, run_id: str) -> bool:
        """False only for a local store that lacks the run (the folder was copied without its store)."""
        return is_placeholder(run_id) or has_run(tracking_uri, run_id)

    def _open_parent_run(self, config_path: str, flow_run_id: str) -> RunLogger:
        tags = {
            "prefect.flow_run_id": flow_run_id,
            "mlflow.source.git.commit": git_commit(Path(__file__).parent),
            "eagleops.config_hash": self.config_hash,
            "eagleops.version": self.version,
            "eagleops.run_dir": str(self.run.path),
            **run_tags(self.cfg),
        }
        previous = self.run.manifest.get("mlflow", {})
        same_config = previous.get("config_hash") == self.config_hash
        same_store = previous.get("tracking_uri") == tracking_uri_for(self.cfg)
        if previous.get("parent_run_id") and same_config and same_store \
                and self._known_to_store(previous["tracking_uri"], previous["parent_run_id"]):
            parent = reopen_run(previous["tracking_uri"], previous["parent_run_id"], journal_path(self.run.path))
            parent.set_tags({"prefect.flow_run_id": flow_run_id})
        else:
            parent = start_parent_run(self.cfg, f"{self.cfg.experiment}-{self.run.run_id}", tags, config_path,
                                      journal_path(self.run.path))
            if previous.get("parent_run_id"):
                parent.set_tags({"eagleops.resumed_from": previous["parent_run_id"]})
        flow_runs = self.run.manifest.get("prefect_flow_run_ids", []) + [flow_run_id]
        self.run.update(
            mlflow={"tracking_uri": parent.tracking_uri, "parent_run_id": parent.run_id, "config_hash": self.config_hash},
            prefect_flow_run_ids=flow_runs,
        )
        link = "" if parent.offline else _run_link(parent.tracking_uri, parent.run_id)
        logger().info(f"MLflow parent run {parent.run_id} at {parent.tracking_uri}" + (f": {link}" if link else ""))
        return parent

    def _close_stale_attempts(self) -> None:
        """Attempts a killed process left `running`: interrupted in the manifest, KILLED in MLflow."""
        for name, attempt in self.run.interrupted_attempts():
            logger().warning(f"{name}: attempt {attempt['attempt']} was interrupted (its process died); "
                             "it resumes in place if its inputs are unchanged")
            if attempt.get("mlflow_run_id") and self._known_to_store(self.parent.tracking_uri, attempt["mlflow_run_id"]):
                mark_run(self.parent.tracking_uri, attempt["mlflow_run_id"], "KILLED", self.parent.journal)
            self.run.update_attempt(name, attempt, status="interrupted", error="the process running it died")

    # ------------------------------------------------------------------ selection

    def _is_selected(self, name: str) -> bool:
        return self.selected is None or name in self.selected or name in ALWAYS_SELECTED

    def _check_selection(self) -> None:
        """Fail before any work when a selected stage needs outputs that will not exist.

        Walks the stages in order with the digests known now: a stage that will run has an
        unknown output until it ran, so a deselected stage downstream of it is not reusable.
        """
        if self.selected is None:
            return
        known: dict[str, str | None] = {}
        for name in STAGES:
            spec = STAGE_SPECS[name]
            if self._is_selected(name):
                missing = [u for u in spec.needs if u not in known]
                if missing:
                    raise SelectionError(self._missing_message(name, missing[0]))
                known[name] = None if spec.always_run else self._reusable_digest(name, known)
            elif not spec.always_run and (digest := self._reusable_digest(name, known)) is not None:
                known[name] = digest

    def _reusable_digest(self, name: str, known: dict[str, str | None]) -> str | None:
        if any(known.get(u) is None for u in STAGE_SPECS[name].needs):
            return None
        digests = {k: v for k, v in known.items() if v is not None}
        fingerprint = digest_json(stage_inputs(self.cfg, name, digests, self.version))
        attempt = self.run.completed_attempt(name, fingerprint)
        return attempt.get("output_digest") if attempt else None

    def _missing_message(self, name: str, upstream: str) -> str:
        if any(a.get("status") == "completed" for a in self.run.attempts(upstream)):
            return (f"{name} needs the outputs of {upstream}, but {upstream}'s inputs changed since its last "
                    f"completed attempt in {self.run.path}; add {upstream} to --stages so it runs again")
        return (f"{name} needs the outputs of {upstream}, which {self.run.path} has not completed; add {upstream} "
                f"to --stages, or resume a run folder where it completed with --run-dir RUN")

    # ------------------------------------------------------------------ stages

    def run_stage(self, task: Any) -> dict[str, Any] | None:
        """Run one stage task unless it is deselected or reusable; return its summary."""
        name, spec = task.name, STAGE_SPECS[task.name]
        inputs = stage_inputs(self.cfg, name, self.digests, self.version)
        fingerprint = digest_json(inputs)
        reusable = None if spec.always_run else self.run.completed_attempt(name, fingerprint)
        if not self._is_selected(name):
            if reusable:
                return self._reuse(name, reusable)
            logger().info(f"{name}: skipped (not selected with --stages)")
            if not self.run.attempts(name):
                self.run.mark_stage(name, status="skipped", reason="not selected with --stages")
            return None
        if reusable:
            logger().info(f"{name}: completed earlier with the same inputs (attempt {reusable['attempt']}); reusing it")
            return self._reuse(name, reusable)
        missing = [u for u in spec.needs if u not in self.results]
        if missing:
            raise SelectionError(self._missing_message(name, missing[0]))
        attempt = self._attempt_for(name, fingerprint, inputs, spec)
        return self._execute(task, name, attempt)

    def run_pending(self, name: str, reason: str) -> None:
        """A stage that is not built yet: logged and recorded as such, never faked."""
        logger().warning(f"{name}: not available yet ({reason}); skipped")
        self.run.mark_stage(name, status="not_available", reason=reason)

    def _attempt_for(self, name: str, fingerprint: str, inputs: dict, spec: StageSpec) -> dict[str, Any]:
        resumable = None if spec.always_run else self.run.resumable_attempt(name, fingerprint)
        if resumable:
            logger().info(f"{name}: resuming attempt {resumable['attempt']} (it ended {resumable['status']})")
            return resumable
        previous = self.run.attempts(name)
        if previous and not spec.always_run:
            logger().info(f"{name}: inputs changed since attempt {previous[-1]['attempt']} "
                          f"({describe_changes(previous[-1].get('inputs', {}), inputs)}); new attempt")
        return self.run.new_attempt(name, fingerprint, inputs)

    def _execute(self, task: Any, name: str, attempt: dict[str, Any]) -> dict[str, Any]:
        child = start_child_run(self.parent, name, {"prefect.flow_run_id": self._flow_run_id(),
                                                    "eagleops.attempt": attempt["attempt"]})
        stage_dir = Path(attempt["dir"])
        ctx = StageContext(name, stage_dir, self.run.path, child.tracking_uri, child.run_id, dict(self.results),
                           attempt["attempt"], dict(self.digests))
        self.run.update_attempt(name, attempt, status="running", started=now_iso(), mlflow_run_id=child.run_id,
                                error=None)
        self.current_stage = name
        start = time.monotonic()
        try:
            with system_metrics(self.cfg.tracking.log_system_metrics, child), recording_reads(self.cfg) as reads:
                summary = task(self.cfg, ctx) or {}
            self._check_reads(name, reads)
        except BaseException as err:
            recorded = self._record_failure(name, attempt, child, err, start)
            if is_interrupt(err):
                raise
            if (full := disk_full_error(err)) is not None:
                raise self._disk_full(name, full, stage_dir, recorded) from err
            raise StageFailed(f"{name} failed: {redact(str(err))}") from err
        self.current_stage = None
        try:
            return self._record_success(name, attempt, child, summary, start, reads)
        except OSError as err:  # the stage's work is done, but its record does not fit on the disk
            if (full := disk_full_error(err)) is None:
                raise
            raise self._disk_full(name, full, stage_dir, recorded=False) from err

    def _disk_full(self, name: str, full: BaseException, stage_dir: Path, recorded: bool) -> DiskFull:
        detail = describe_disk_full(full, stage_dir)
        if not recorded:
            detail += (f"; {MANIFEST} could not be updated either and keeps its previous content (the next run "
                       "closes the attempt as interrupted)")
        return DiskFull(name, redact(detail), self.run.path, self.config_path)

    def _check_reads(self, name: str, reads: set[str]) -> None:
        """A field the stage read that its spec does not declare would leave its fingerprint stale: a warning,
        or (with STRICT_READS_ENV set, as in the tests) the stage's failure."""
        undeclared = undeclared_reads(name, self.cfg, reads)
        if not undeclared:
            return
        message = (f"{name} read {', '.join(undeclared)}, which STAGE_SPECS['{name}'] in tasks/pipeline.py neither "
                   "takes as inputs nor lists as operational: changing them would not re-run it")
        if os.environ.get(STRICT_READS_ENV):
            raise UndeclaredReads(message)
        logger().warning(message)

    def _record_success(self, name, attempt, child: RunLogger, summary: dict, start: float,
                        reads: set[str]) -> dict[str, Any]:
        wall = elapsed_since(start)
        summary = {**summary, "wall_time_s": wall}
        digest = summary.pop("output_digest", None) or digest_json(summary.get("outputs", {}))
        write_json_atomic(Path(attempt["dir"]) / "summary.json", self.run.portable(summary))
        child.log_metrics({"wall_time_s": wall, **_numbers(summary.get("metrics", {}))})
        child.finish("FINISHED")
        self.parent.log_metrics({f"{name}.{k}": v for k, v in _numbers(summary.get("metrics", {})).items()})
        self.parent.log_metrics({f"{name}.wall_time_s": wall})
        self.run.update_attempt(name, attempt, status="completed", finished=now_iso(), wall_time_s=wall,
                                summary=summary, outputs=summary.get("outputs", {}), output_digest=digest,
                                config_reads=sorted(reads))
        logger().info(f"{name}: completed in {wall:.1f}s")
        return self._remember(name, digest, summary)

    def _record_failure(self, name, attempt, child: RunLogger, err: BaseException, start: float) -> bool:
        """Record the failed or interrupted attempt (manifest, MLflow); False when the manifest could not be written."""
        interrupted = is_interrupt(err)
        detail = redact("".join(traceback.format_exception_only(type(err), err)).strip())
        status = "interrupted" if interrupted else "failed"
        if interrupted:
            detail = f"interrupted ({type(err).__name__})"
        recorded = self._update_attempt_if_possible(name, attempt, status=status, finished=now_iso(),
                                                    wall_time_s=elapsed_since(start), error=detail)
        try:
            with store_errors_reported_by_caller():
                child.set_tags({"eagleops.error": detail[:5000]})
                child.finish("KILLED" if interrupted else "FAILED")
        except Exception as tracking_err:  # the manifest already holds the truth; say why MLflow does not
            logging.getLogger("eagleops").warning(f"{name}: could not record the {status} state in MLflow: "
                                                  f"{short_error(tracking_err)}")
        if not interrupted:
            logger().error(f"{name}: failed: {detail}")
        return recorded

    def _update_attempt_if_possible(self, name: str, attempt: dict[str, Any], **fields: Any) -> bool:
        """update_attempt on the way out of a failure: a manifest that cannot be written (a full disk) keeps
        its previous content (the write is atomic) and is reported, never raised over the stage's own error."""
        try:
            self.run.update_attempt(name, attempt, **fields)
        except OSError as err:
            logging.getLogger("eagleops").warning(f"{name}: could not record the {fields.get('status')} attempt in "
                                                  f"{self.run.path / MANIFEST} ({err}); it keeps its previous content")
            return False
        return True

    def _reuse(self, name: str, attempt: dict[str, Any]) -> dict[str, Any]:
        self.run.update_attempt(name, attempt)
        return self._remember(name, attempt.get("output_digest") or "", attempt.get("summary", {}))

    def _remember(self, name: str, digest: str, summary: dict[str, Any]) -> dict[str, Any]:
        self.digests[name] = digest
        self.results[name] = summary
        return summary

    def _flow_run_id(self) -> str:
        return self.run.manifest.get("prefect_flow_run_ids", ["unknown"])[-1]

    # ------------------------------------------------------------------ end

    def finish(self, status: str) -> dict[str, Any]:
        stages = {name: entry.get("status") for name, entry in self.run.manifest["stages"].items()}
        try:
            with store_errors_reported_by_caller():
                self.parent.set_tags({"eagleops.stages": json.dumps(stages)})
                self.parent.finish(status)
        except Exception as tracking_err:
            logging.getLogger("eagleops").warning(f"could not record the run's {status} state in MLflow: "
                                                  f"{short_error(tracking_err)}")
        try:
            self.run.update(status=status.lower(), finished=now_iso())
        except OSError as err:  # a full disk: the stage's own error is the one to report
            logging.getLogger("eagleops").warning(f"could not record the run's {status} state in "
                                                  f"{self.run.path / MANIFEST} ({err}); it keeps its previous content")
        return {"run_dir": str(self.run.path), "mlflow_run_id": self.parent.run_id, "stages": stages, "status": status,
                "results": self.results}


def _numbers(metrics: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
