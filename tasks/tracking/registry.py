"""The MLflow Model Registry side of the nightly retrain: the champion, lineage tags, promotion.

A draft model (`export.registered_model`) has versions registered by the export stage (the raw
SGLang directory as the version's source, see tasks/stages/export.py). Two aliases carry the state:
`champion` (what deploys fetch as `models:/NAME@champion`) and `previous` (the champion it
replaced, for a rollback). `promote_or_keep` writes a decision in an order that a crash at any
point leaves consistent and a re-run completes: lineage tags, then the `eagleops.gate` tag
(the decision), then `previous` and `champion`, then the tags of the experiment's parent run.

Outage. Every registry write goes through the experiment's `RunLogger` (tasks.tracking.registry_ops):
registering the challenger (the export stage), the decision's tags, the alias move, so while the
tracking server does not answer they are journaled in the run folder with the run's other writes and
`eagleops sync RUN_DIR` (or the next run on the folder) makes them, in order and once. The alias move
carries the champion the gate measured against and is applied only while that is still the champion:
a journaled promotion never replaces a champion promoted meanwhile that this gate never measured.
Reading is another matter: the champion decides what to train from and what to measure against, so
the nightly never guesses it. A nightly that cannot read it stops with one line (`RegistryUnavailable`)
before anything is trained; one whose export was journaled (no version number yet) stops after the
export with one line naming the resume command, its data, training and export kept in the run folder;
a gate that cannot look up an earlier decision on the challenger reads the run folder's instead.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from mlflow.artifacts import download_artifacts
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.log import logger
from tasks.rundir import RunDirectory, digest_paths
from tasks.tracking.journal import is_placeholder
from tasks.tracking.outage import is_outage, short_reason
from tasks.tracking.registry_ops import CHAMPION, PREVIOUS, champion_version
from tasks.tracking.run_logger import MAX_TAG_LENGTH, RunLogger
from tasks.tracking.runs import run_tags
from tasks.tracking.views import tracking_uri_for

GATE_TAG = "eagleops.gate"
SGLANG_FILES = ("config.json", "model.safetensors")
DOWNLOAD_MARKER = ".download-complete"  # written last into a downloaded version's folder


def _retry_on_outage(task, task_run, state) -> bool:
    """Prefect retry condition: retry only when the tracking server did not answer."""
    try:
        state.result()
    except Exception as err:  # the failed state re-raises the task's exception
        return is_outage(err)
    return False


class RegistryUnavailable(RuntimeError):
    """The registry did not answer where the nightly must read it; str() is one line saying what was kept."""


REGISTRY_RETRIES = {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": _retry_on_outage}


def registered_model_name(cfg: ExperimentConfig) -> str:
    if not cfg.export.registered_model:
        raise ValueError("export.registered_model: the nightly retrain needs a registered model name (the champion "
                         "lives in the MLflow Model Registry under it)")
    if "sglang" not in cfg.export.formats:
        raise ValueError("export.formats: the nightly retrain registers the sglang export; add sglang")
    return cfg.export.registered_model


# ------------------------------------------------------------------ reading


def download_version(tracking_uri: str, name: str, version: str, destination: Path) -> Path:
    """`models:/NAME/VERSION` into `destination` (a fresh folder), checked to be a directory SGLang loads.

    Reused as is when an earlier download completed (the marker file is written last), so a
    resumed nightly trains from byte-identical weights.
    """
    marker = destination / DOWNLOAD_MARKER
    if marker.is_file():
        return destination
    staging = destination.with_name(destination.name + ".partial")
    for leftover in (destination, staging):  # a partial download of an earlier, interrupted attempt
        if leftover.exists():
            shutil.rmtree(leftover)
    staging.mkdir(parents=True)
    # The version's source, resolved here: download_artifacts("models:/...") looks the name up in the default
    # store (MLFLOW_TRACKING_URI, else ./mlflow.db, created on the spot), not in the tracking_uri it is given.
    source = MlflowClient(tracking_uri).get_model_version_download_uri(name, version)
    # A folder URI lands as <staging>/<its last name>/...; the path returned is that folder.
    local = Path(download_artifacts(artifact_uri=source, dst_path=str(staging), tracking_uri=tracking_uri))
    missing = [f for f in SGLANG_FILES if not (local / f).is_file()]
    if missing:
        found = sorted(str(p.relative_to(staging)) for p in staging.rglob("*") if p.is_file())[:20]
        raise FileNotFoundError(f"models:/{name}/{version} ({source}) has no {missing} at its top level "
                                f"(downloaded {found}); its source is not an SGLang checkpoint directory")
    local.rename(destination)
    shutil.rmtree(staging, ignore_errors=True)
    marker.write_text(f"models:/{name}/{version}\n")
    return destination


@task(name="fetch_champion", cache_policy=NO_CACHE, **REGISTRY_RETRIES)
def fetch_champion(cfg: ExperimentConfig) -> dict[str, str] | None:
    """The current champion as {version, dir, uri}, downloaded under <runs_root>/nightly/; None if there is none."""
    name, uri = registered_model_name(cfg), tracking_uri_for(cfg)
    try:
        version = champion_version(MlflowClient(uri), name)
    except Exception as err:
        if not is_outage(err):
            raise
        raise RegistryUnavailable(
            f"the champion of {name} cannot be read: the MLflow registry at {redact(uri)} does not answer "
            f"({short_reason(err)}); the nightly does not guess a champion, so nothing was trained or changed: "
            "run it again once the server answers") from err
    if version is None:
        logger().info(f"{name}: no champion yet; the new draft becomes champion if it passes the floor")
        return None
    folder = Path(cfg.runs_root).resolve() / "nightly" / cfg.experiment / f"{name}-v{version}"
    draft_dir = download_version(uri, name, version, folder)
    logger().info(f"{name}: champion is version {version}, downloaded to {draft_dir}")
    return {"version": version, "dir": str(draft_dir), "uri": f"models:/{name}/{version}"}


def challenger_version(cfg: ExperimentConfig, experiment: dict[str, Any]) -> str:
    """The version the export stage registered for this run's draft ("name/3" in its outputs)."""
    outputs = experiment["results"].get("export_checkpoint", {}).get("outputs", {})
    registered = outputs.get("registered_model_version", "")
    name, _, version = registered.partition("/")
    if name == cfg.export.registered_model and is_placeholder(version):
        run_dir = experiment["run_dir"]
        raise RegistryUnavailable(
            f"{name}: the export's registration is journaled in {run_dir} (the MLflow registry did not answer), so "
            "the challenger has no version number to gate and promote yet; data, training and export are kept: once "
            f"the server answers, resume with: eagleops nightly {cfg_path_hint(experiment)} --run-dir {run_dir}")
    if name != cfg.export.registered_model or not version.isdigit():
        raise RuntimeError(f"export_checkpoint did not register a version of {cfg.export.registered_model} "
                           f"(recorded: {registered or 'nothing'})")
    return version


def cfg_path_hint(experiment: dict[str, Any]) -> str:
    """The nightly's config file, for a resume command: the one the run started with, or the base of the overlay
    that trained from the champion (tasks.stages.gate.nightly.training_config)."""
    started_with = RunDirectory.open(experiment["run_dir"]).manifest.get("config_path")
    if not started_with:
        return "CONFIG"
    try:
        return str(json.loads(Path(started_with).read_text())["sweep"]["base"])
    except (OSError, ValueError, KeyError, TypeError):  # not an overlay: the config itself
        return str(started_with)


def recorded_decision(cfg: ExperimentConfig, version: str) -> dict[str, str] | None:
    """The tags of a version the gate decided already (a resumed nightly whose gate had run), or None."""
    found = MlflowClient(tracking_uri_for(cfg)).get_model_version(registered_model_name(cfg), version)
    return dict(found.tags) if GATE_TAG in found.tags else None


# ------------------------------------------------------------------ lineage


def lineage_tags(cfg: ExperimentConfig, run_dir: str | Path, benchmark_run_id: str, init_from: str) -> dict[str, str]:
    """Where a version came from: data, target, layers, vocab map, config, the run that measured it."""
    run = RunDirectory.open(run_dir)
    data = run.stage("generate_data")
    vocab = data.get("outputs", {}).get("vocab")
    return {
        "eagleops.data_hash": str(data.get("output_digest", "unknown")),
        "eagleops.target": run_tags(cfg)["eagleops.target"],
        "eagleops.layer_ids": ",".join(map(str, data.get("summary", {}).get("aux_layer_ids", []))) or "unknown",
        "eagleops.vocab_map_hash": digest_paths([vocab]) if vocab and Path(vocab).exists() else "unknown",
        "eagleops.config_hash": str(run.manifest.get("config_hash", "unknown")),
        "eagleops.benchmark_run_id": benchmark_run_id,
        "eagleops.experiment_run_id": str(run.manifest.get("mlflow", {}).get("parent_run_id", "unknown")),
        "eagleops.run_dir": str(run.path),
        "eagleops.init_from": init_from,
    }


# ------------------------------------------------------------------ writing


@task(name="promote_or_keep", cache_policy=NO_CACHE, **REGISTRY_RETRIES)
def promote_or_keep(tracking_uri: str, name: str, challenger: str, champion: str | None, promote: bool,
                    reason: str, lineage: dict[str, str], parent_run_id: str) -> dict[str, Any]:
    """Record the gate's decision on `challenger`; when `promote`, it becomes `champion` and the old one `previous`.

    `reason` starts with "promoted:" or "refused:". Written through the experiment's parent run's logger: while
    the server does not answer, journaled and made by `eagleops sync` (the alias only if `champion` is still
    the champion then). Returns the aliases after the call (none while journaled, `journaled` then says where).
    """
    parent = RunLogger(tracking_uri, parent_run_id)
    parent.set_version_tags(name, challenger, {**lineage, GATE_TAG: reason})
    if promote:
        parent.move_champion(name, challenger, champion)
    parent.set_tags({GATE_TAG: _tag_value(reason), "eagleops.gate.decision": "promoted" if promote else "refused",
                     "eagleops.gate.model_version": f"{name}/{challenger}"})
    outcome = {"promoted": promote, "reason": reason, "model": name, "challenger": challenger,
               "champion_before": champion}
    if parent.offline:
        journal = parent.journal
        logger().warning(f"{name} version {challenger}: {reason} -- not in the registry yet: the MLflow server does "
                         f"not answer, so this decision is journaled in {journal} and `eagleops sync {journal.parent}` "
                         f"makes it" + (f" (champion moves only if it is still {_shown(champion)} then)" if promote else ""))
        return {**outcome, "aliases": {}, "journaled": str(journal)}
    client = MlflowClient(tracking_uri)
    aliases = {alias: version for alias, version in _aliases(client, name).items() if alias in (CHAMPION, PREVIOUS)}
    logger().info(f"{name} version {challenger}: {reason} (aliases now {aliases})")
    return {**outcome, "aliases": aliases}


def _shown(champion: str | None) -> str:
    return "unset (a first champion)" if champion is None else f"version {champion}"


def _aliases(client: MlflowClient, name: str) -> dict[str, str]:
    return dict(client.get_registered_model(name).aliases)


def _tag_value(value: str) -> str:
    return redact(str(value))[:MAX_TAG_LENGTH]
