"""The champion as the watch knows it (MLflow registry) and its monitoring run (MLflow tracking).

Owns two things the watch reads from and writes to MLflow:
- the champion: `models:/NAME@champion`'s version, its tags and the band built from its recorded gate
  figures (`eagleops.gate.band`, else the older `eagleops.gate.evidence`);
- one long-lived monitoring run per served model version (tags `eagleops.kind: watch`,
  `eagleops.watch.model_version: NAME/VERSION`), RUNNING while that version is champion, FINISHED once
  another version is: each window's accept length, accept rate, live num_steps / num_draft_tokens, tok/s,
  request rate and requests, and the band, stepped by window and stamped with the window's end. The run
  page charts metrics in name order, so `accept_length` is the first chart it opens on.

Risk: MLflow down. The champion then cannot be read (the watch says so and judges no drift; settings and
reachability are still watched), and a window's figures are dropped with one line rather than journaled:
the series is a dashboard, Prometheus keeps the history.
"""

from __future__ import annotations

import json
from typing import Any

from mlflow.entities import Metric
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.config.schema import ExperimentConfig
from tasks.log import logger
from tasks.tracking.outage import short_reason
from tasks.tracking.registry import CHAMPION
from tasks.tracking.views import ensure_experiment, tracking_uri_for
from tasks.watch.rules import Band, Window, band_from_evidence

BAND_TAG = "eagleops.gate.band"
EVIDENCE_TAG = "eagleops.gate.evidence"
KIND_TAG, VERSION_TAG = "eagleops.kind", "eagleops.watch.model_version"


class ChampionUnknown(Exception):
    """The registry has no champion to watch, or does not answer; str() is one line."""


def read_champion(cfg: ExperimentConfig) -> tuple[str, dict[str, str]]:
    """(version, tags) of `export.registered_model`'s champion; ChampionUnknown when there is none or no answer."""
    name, uri = cfg.export.registered_model, tracking_uri_for(cfg)
    if not name:
        raise ChampionUnknown("export.registered_model is not set: there is no champion to watch against")
    try:
        found = MlflowClient(uri).get_model_version_by_alias(name, CHAMPION)
    except MlflowException as err:
        if err.error_code in ("RESOURCE_DOES_NOT_EXIST", "INVALID_PARAMETER_VALUE"):
            raise ChampionUnknown(f"{name} has no {CHAMPION} yet (no nightly promoted one)") from None
        raise ChampionUnknown(f"the model registry at {uri} does not answer ({short_reason(err)})") from None
    except OSError as err:
        raise ChampionUnknown(f"the model registry at {uri} does not answer ({short_reason(err)})") from None
    return str(found.version), dict(found.tags)


def champion_band(cfg: ExperimentConfig, name: str, version: str, tags: dict[str, str]) -> Band | None:
    """The band from the champion's recorded figures; None (and why, logged) when it has none."""
    for tag in (BAND_TAG, EVIDENCE_TAG):
        if tag in tags:
            try:
                band = band_from_evidence(json.loads(tags[tag]), cfg.watch.band.tolerance, cfg.watch.band.sigmas,
                                          f"models:/{name}/{version} {tag}")
            except (ValueError, TypeError, KeyError) as err:
                logger().warning(f"{name} v{version}: {tag} is not readable ({err}); trying the next record")
                continue
            if band is not None:
                return band
    logger().warning(f"{name} v{version}: no recorded accept length in its gate evidence; drift is not judged "
                     "(settings, identity and reachability still are)")
    return None


class MonitoringRun:
    """The monitoring run of one model version; every call logs one line instead of raising on an outage."""

    def __init__(self, cfg: ExperimentConfig, name: str, version: str) -> None:
        self.uri, self.name, self.version = tracking_uri_for(cfg), name, version
        self.client = MlflowClient(self.uri)
        self.run_id: str | None = None
        self._cfg = cfg

    def open(self, endpoints: list[str], band: Band | None) -> str | None:
        """Find or create the run (RUNNING); the runs of older versions are finished. None when MLflow is down."""
        try:
            experiment = ensure_experiment(self.client, self._cfg.mlflow_experiment, self._cfg.runs_root,
                                           self.uri.startswith("sqlite:"))
            self.run_id = self._find_or_create(experiment, endpoints, band)
            self._finish_older(experiment)
        except (MlflowException, OSError) as err:
            logger().warning(f"MLflow at {self.uri}: the monitoring run is not available ({short_reason(err)}); "
                             "this window's figures are not recorded")
            self.run_id = None
        return self.run_id

    def _find_or_create(self, experiment: str, endpoints: list[str], band: Band | None) -> str:
        key = f"{self.name}/{self.version}"
        found = self.client.search_runs([experiment], f"tags.`{KIND_TAG}` = 'watch' and tags.`{VERSION_TAG}` = '{key}'",
                                        max_results=1)
        if found:
            return found[0].info.run_id
        tags = {KIND_TAG: "watch", VERSION_TAG: key, "mlflow.note.content":
                f"Production watch of {key}: one point per window per metric; the band is the champion's recorded "
                f"gate figures ({band.source if band else 'none recorded'})."}
        run = self.client.create_run(experiment, run_name=f"watch {self.name} v{self.version}", tags=tags)
        params = {"watch.endpoints": ",".join(endpoints), "watch.window_s": self._cfg.watch.window_s,
                  "watch.for": self._cfg.watch.for_windows, "watch.min_requests": self._cfg.watch.min_requests}
        if band is not None:
            params.update({"band.center": round(band.center, 4), "band.spread": round(band.spread, 4),
                           "band.lower": round(band.lower, 4), "band.samples": band.samples})
        for k, v in params.items():
            self.client.log_param(run.info.run_id, k, str(v))
        return run.info.run_id

    def _finish_older(self, experiment: str) -> None:
        running = self.client.search_runs([experiment], f"tags.`{KIND_TAG}` = 'watch' and attributes.status = 'RUNNING'")
        for run in running:
            if run.info.run_id != self.run_id and run.data.tags.get(VERSION_TAG, "").startswith(f"{self.name}/"):
                self.client.set_terminated(run.info.run_id, "FINISHED")

    def log_window(self, window: Window, band: Band | None, step: int, prefix: str = "") -> None:
        if self.run_id is None:
            return
        figures = window.figures()
        if band is not None:
            figures.update({"band_lower": band.lower, "band_center": band.center})
        timestamp = int(window.end * 1000)
        metrics = [Metric(f"{prefix}{key}", float(value), timestamp, step) for key, value in figures.items()]
        try:
            self.client.log_batch(self.run_id, metrics=metrics)
        except (MlflowException, OSError) as err:
            logger().warning(f"MLflow at {self.uri} does not answer ({short_reason(err)}): window {step}'s figures "
                             "are not recorded")

    def set_tags(self, tags: dict[str, Any]) -> None:
        if self.run_id is None:
            return
        try:
            for key, value in tags.items():
                self.client.set_tag(self.run_id, key, str(value)[:5000])
        except (MlflowException, OSError) as err:
            logger().warning(f"MLflow at {self.uri} does not answer ({short_reason(err)})")
