"""The MLflow Model Registry side of the nightly retrain: the champion, lineage tags, promotion.

A draft model (`export.registered_model`) has versions registered by the export stage (the raw
SGLang directory as the version's source, see tasks/stages/export.py). Two aliases carry the state:
`champion` (what deploys fetch as `models:/NAME@champion`) and `previous` (the champion it
replaced, for a rollback). `promote_or_keep` writes a decision in an order that a crash at any
point leaves consistent and a re-run completes: lineage tags, then the `eagleops.gate` tag
(the decision), then `previous`, then `champion`, then the tags of the experiment's parent run.

Risk: every call here needs the tracking server; the tasks retry on an outage and then fail the
nightly run rather than guess a champion. That is by design, not a gap in the outage journal
(tasks.tracking.journal): registering a version is journaled (RunLogger.register_version, the export
stage, so every demo run registers offline too), but reading the champion decides what to train from
and what to measure against, and a promotion replayed later could move `champion` away from a
version promoted meanwhile that this gate never measured.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from mlflow.artifacts import download_artifacts
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import redact
from tasks.log import logger
from tasks.rundir import RunDirectory, digest_paths
from tasks.tracking.outage import is_outage
from tasks.tracking.runs import run_tags
from tasks.tracking.views import tracking_uri_for

CHAMPION = "champion"
PREVIOUS = "previous"
GATE_TAG = "eagleops.gate"
MAX_TAG_LENGTH = 5000  # MLflow's limit on a tag value
SGLANG_FILES = ("config.json", "model.safetensors")
DOWNLOAD_MARKER = ".download-complete"  # written last into a downloaded version's folder


def _retry_on_outage(task, task_run, state) -> bool:
    """Prefect retry condition: retry only when the tracking server did not answer."""
    try:
        state.result()
    except Exception as err:  # the failed state re-raises the task's exception
        return is_outage(err)
    return False


REGISTRY_RETRIES = {"retries": 2, "retry_delay_seconds": 5, "retry_condition_fn": _retry_on_outage}


def registered_model_name(cfg: ExperimentConfig) -> str:
    if not cfg.export.registered_model:
        raise ValueError("export.registered_model: the nightly retrain needs a registered model name (the champion "
                         "lives in the MLflow Model Registry under it)")
    if "sglang" not in cfg.export.formats:
        raise ValueError("export.formats: the nightly retrain registers the sglang export; add sglang")
    return cfg.export.registered_model


# ------------------------------------------------------------------ reading


def champion_version(client: MlflowClient, name: str) -> str | None:
    """The version under the `champion` alias, or None (no such model, or no champion yet)."""
    try:
        return client.get_model_version_by_alias(name, CHAMPION).version
    except MlflowException as err:
        no_model = err.error_code == "RESOURCE_DOES_NOT_EXIST"
        # A model without the alias answers INVALID_PARAMETER_VALUE "Registered model alias champion not found."
        no_alias = err.error_code == "INVALID_PARAMETER_VALUE" and "alias" in str(err) and "not found" in str(err)
        if no_model or no_alias:
            return None
        raise


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
    version = champion_version(MlflowClient(uri), name)
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
    if name != cfg.export.registered_model or not version.isdigit():
        raise RuntimeError(f"export_checkpoint did not register a version of {cfg.export.registered_model} "
                           f"(recorded: {registered or 'nothing'}); the nightly gate needs the MLflow registry "
                           "reachable during the export")
    return version


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

    `reason` starts with "promoted:" or "refused:". Returns the aliases after the call.
    """
    client = MlflowClient(tracking_uri)
    for key, value in lineage.items():
        client.set_model_version_tag(name, challenger, key, _tag_value(value))
    client.set_model_version_tag(name, challenger, GATE_TAG, _tag_value(reason))
    if promote:
        if champion is not None and champion != challenger:
            client.set_registered_model_alias(name, PREVIOUS, champion)
        client.set_registered_model_alias(name, CHAMPION, challenger)
    client.set_tag(parent_run_id, GATE_TAG, _tag_value(reason))
    client.set_tag(parent_run_id, "eagleops.gate.decision", "promoted" if promote else "refused")
    client.set_tag(parent_run_id, "eagleops.gate.model_version", f"{name}/{challenger}")
    aliases = {alias: version for alias, version in _aliases(client, name).items() if alias in (CHAMPION, PREVIOUS)}
    logger().info(f"{name} version {challenger}: {reason} (aliases now {aliases})")
    return {"promoted": promote, "reason": reason, "model": name, "challenger": challenger,
            "champion_before": champion, "aliases": aliases}


def _aliases(client: MlflowClient, name: str) -> dict[str, str]:
    return dict(client.get_registered_model(name).aliases)


def _tag_value(value: str) -> str:
    return redact(str(value))[:MAX_TAG_LENGTH]
