"""The stage runner behind the experiment flow: selection, resume by real inputs, run folder, MLflow runs.

A stage is a Prefect task `fn(cfg, ctx) -> summary` (see `StageContext`). `Pipeline.run_stage`
decides from its fingerprint (`tasks.runner.specs`):
- a completed attempt with the same fingerprint exists -> reuse its outputs (no new work);
- the latest attempt ended unfinished with the same fingerprint -> resume it in place;
- otherwise -> a new attempt folder (earlier attempts are kept, never overwritten).
Stages that measure or touch other machines (`always_run`) run every time. One attempt then runs
as `tasks.runner.attempt.StageAttempt` says. A resumed folder uses the runs root it lives in now,
not the config's (`_settle_in`): a moved or copied run folder finds its tiny-target cache and local
MLflow store there, and output digests hold no absolute path, so nothing re-runs because a path changed.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from tasks.config.masked import config_hash, masked_yaml, secret_values
from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import install_log_redaction, register_secrets
from tasks.hosts.teardown import teardown_run, unstopped_servers
from tasks.log import logger
from tasks.run_lock import RunLock, acquire_run_folder
from tasks.rundir import (
    MANIFEST,
    RunDirectory,
    digest_json,
    now_iso,
)
from tasks.runner.attempt import StageAttempt
from tasks.runner.gpu_hours import ThisRunsGpuHours
from tasks.runner.reused import show_reused_stage
from tasks.runner.specs import (
    ALWAYS_SELECTED,
    STAGE_SPECS,
    StageSpec,
    describe_changes,
    stage_inputs,
)
from tasks.runner.stages import STAGES, SelectionError
from tasks.tracking.journal import is_placeholder, journal_path
from tasks.tracking.outage import short_error, store_errors_reported_by_caller
from tasks.tracking.run_logger import (
    RunLogger,
    mark_run,
    reopen_run,
    start_parent_run,
)
from tasks.tracking.runs import FULL_RETRAIN_TAG, eagleops_version, git_commit, run_tags
from tasks.tracking.store import has_run, relocate_local_store
from tasks.tracking.sync import sync_before_resume
from tasks.tracking.views import run_links, tracking_uri_for


def _run_link(tracking_uri: str, run_id: str) -> str:
    """The run's page in MLflow's UI in model-training mode (a link to the UI's root opens GenAI mode in a fresh
    browser); empty when the store cannot say (its link then is whatever the user opens)."""
    from mlflow.exceptions import MlflowException

    try:
        return run_links(tracking_uri, run_id)["run"]
    except (MlflowException, OSError) as err:  # a link is a courtesy: no store error fails the run for it
        logger().debug(f"no MLflow link for run {run_id}: {err}")
        return ""


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
        self.halted: str | None = None  # why no later stage runs: a stage's result said `halt` (no new traffic)
        self.gpu = ThisRunsGpuHours()
        self.current_stage: str | None = None
        self.lock: RunLock | None = None
        try:
            self.run = self._open_run_dir(config_path, run_dir, flow_run_id)
            self._stop_servers_left_running()
            self._check_selection()
            self.parent = self._open_parent_run(config_path, flow_run_id)
            self._close_stale_attempts()
        except BaseException:
            self.release_folder()
            raise
        Pipeline.active = self

    # ------------------------------------------------------------------ setup

    def _open_run_dir(self, config_path: str, run_dir: str | None, flow_run_id: str) -> RunDirectory:
        """The run folder, created or resumed, held by this run (`tasks.run_lock`) from before its first write
        (a new folder's name is its own until its manifest is written) until `release_folder`."""
        header = {"config_path": str(Path(config_path).resolve()), "config_hash": self.config_hash,
                  "eagleops_version": self.version}
        if run_dir is None:
            run = RunDirectory.create(self.cfg.runs_root, self.cfg.experiment, header)
            self.lock = acquire_run_folder(run.path, flow_run_id)
        else:
            self.lock = acquire_run_folder(run_dir, flow_run_id)  # RunFolderHeld: another run holds it
            if (line := self.lock.takeover_line()) is not None:
                logger().warning(line)
            self._settle_in(RunDirectory.open(run_dir))
            sync_before_resume(run_dir, tracking_uri_for(self.cfg))  # what an earlier offline run journaled
            run = RunDirectory.open(run_dir)
            run.update(**header)
        (run.path / "config.yaml").write_text(masked_yaml(self.cfg))
        logger().info(f"run directory: {run.path}")
        return run

    def _stop_servers_left_running(self) -> None:
        """Servers an earlier run left recorded as running in this folder (its process or its worker was killed
        before its teardown, or the teardown could not reach the host): stopped before any stage starts one.
        Held by this run now, the folder has no other live run whose servers these could be."""
        if not unstopped_servers(self.run.path):
            return
        for server in teardown_run(self.run.path, self.cfg):
            logger().warning(f"stopped {server}, left running by an earlier run on {self.run.path}")

    def release_folder(self) -> None:
        """Give the run folder up for the next run: after the flow's teardown."""
        if self.lock is not None:
            self.lock.release()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release_folder()

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
        if self.halted and name not in ALWAYS_SELECTED:
            return self._skip_halted(name)
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

    def _skip_halted(self, name: str) -> None:
        """A stage after one whose result said `halt` (a served night with no new traffic): not run, and why."""
        logger().info(f"{name}: skipped ({self.halted})")
        self.run.mark_stage(name, status="skipped", reason=self.halted)

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

    def _execute(self, task: Any, name: str, entry: dict[str, Any]) -> dict[str, Any]:
        attempt = StageAttempt(name, entry, self.run, self.parent, self.cfg, self.config_path)
        self.current_stage = name  # stays set when the attempt fails: the CLI's interrupt line names it
        try:
            digest, summary = attempt.run_task(task, dict(self.results), dict(self.digests), self._flow_run_id())
        finally:  # a failed attempt held its GPUs too
            self._count_gpu_hours(name, entry.get("gpu_hours") or 0.0, reused=False)
        self.current_stage = None
        return self._remember(name, digest, summary)

    def _reuse(self, name: str, attempt: dict[str, Any]) -> dict[str, Any]:
        self.run.update_attempt(name, attempt)
        link = _run_link(self.parent.tracking_uri, attempt["mlflow_run_id"]) if attempt.get("mlflow_run_id") else ""
        show_reused_stage(name, attempt, link)
        self._count_gpu_hours(name, attempt.get("gpu_hours") or 0.0, reused=True)
        return self._remember(name, attempt.get("output_digest") or "", attempt.get("summary", {}))

    def _count_gpu_hours(self, name: str, hours: float, reused: bool) -> None:
        """This run's GPU-hours so far in the manifest (the report shows them); a reused stage held nothing in
        this run: 0 on the parent, its figure from when it ran as `<stage>.gpu_hours_reused`."""
        self.gpu.count(name, hours, reused)
        try:
            self.run.update(gpu_hours=self.gpu.block(self._flow_run_id()))
        except OSError as err:  # a full disk: the stage's own error (if any) is the one to report
            logging.getLogger("eagleops").warning(f"{name}: GPU-hours not written to {self.run.path / MANIFEST} ({err})")
        if reused:
            self.parent.log_metrics({f"{name}.gpu_hours": 0.0, f"{name}.gpu_hours_reused": hours})

    def _remember(self, name: str, digest: str, summary: dict[str, Any]) -> dict[str, Any]:
        self.digests[name] = digest
        self.results[name] = summary
        self.halted = self.halted or summary.get("halt")
        return summary

    def _flow_run_id(self) -> str:
        return self.run.manifest.get("prefect_flow_run_ids", ["unknown"])[-1]

    # ------------------------------------------------------------------ end

    def finish(self, status: str) -> dict[str, Any]:
        stages = {name: entry.get("status") for name, entry in self.run.manifest["stages"].items()}
        try:
            with store_errors_reported_by_caller():
                self.parent.log_metrics(self.gpu.parent_metrics())
                self.parent.set_tags({"eagleops.stages": json.dumps(stages)})
                if self.gpu.is_full_retrain(self.cfg, stages):  # a later resume that reuses them leaves both as they are
                    self.parent.log_metrics({"gpu_hours_retrain": self.gpu.retrain})
                    self.parent.set_tags({FULL_RETRAIN_TAG: "true"})
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
                "halted": self.halted,
                "results": self.results, "gpu_hours": self.gpu.block(self._flow_run_id())}

