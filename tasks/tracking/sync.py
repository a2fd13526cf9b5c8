"""Replaying a run folder's MLflow journal (`eagleops sync RUN_DIR`, and the start of a resumed run): in order,
once, placeholder run ids (and model versions) mapped to the real ones in the journal state and the manifest.
Registry writes replay like run writes (tasks.tracking.registry_ops says why each is safe to repeat)."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

from tasks.config.secrets import redact
from tasks.log import logger
from tasks.rundir import MANIFEST, RunDirectory, write_json_atomic
from tasks.tracking.journal import (
    Journal,
    JournalState,
    is_placeholder,
    journal_path,
    replace_ids,
)
from tasks.tracking.outage import (
    TrackingUnavailable,
    is_outage,
    probe_tracking_server,
    short_reason,
)
from tasks.tracking.run_logger import apply_op
from tasks.tracking.views import ensure_experiment

# Registry writes: a model version registered while offline is named by its placeholder until replayed.
REGISTRY_OPS = ("set_version_tags", "move_champion")


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
    and artifacts overwrite, MLflow keeps an identical metric point once, a model version is found again
    by its run and source, and the champion moves only from the version its gate measured against
    (tasks.tracking.registry_ops). A refused entry
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
        rewrite_manifest_ids(run_dir, {**state.ids, **state.versions})
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
        args = replace_ids(dict(entry["args"]), state.versions) if op in REGISTRY_OPS else dict(entry["args"])
        if op == "log_artifact":
            args["path"] = str(journal.resolve(args["path"]))
        if op == "log_batch":
            args["tags"] = replace_ids(args.get("tags", []), state.ids)
        version = apply_op(client, op, run_id, args)
        if op == "register_version" and args.get("placeholder"):
            state.versions[args["placeholder"]] = version
            state.versions[f"{args['name']}/{args['placeholder']}"] = f"{args['name']}/{version}"
    except Exception as err:
        if is_outage(err):
            raise TrackingUnavailable(f"the tracking server stopped answering during sync ({short_reason(err)}); "
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
    """Replace placeholder run ids (and model versions) by real ones everywhere in the run folder's manifest.json."""
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
        logger().warning(f"{journal.path}: {journal.pending()} MLflow calls not synced, recorded for {recorded}; "
                       f"upload them with: eagleops sync {run_dir} --tracking-uri URI")
        return
    try:
        result = sync_journal(run_dir, tracking_uri)
    except TrackingUnavailable as err:
        logger().warning(f"{journal.path}: earlier MLflow calls not synced: {err}")
        return
    logger().info(f"synced {result.replayed} journaled MLflow calls of {run_dir} ({len(result.created)} runs created)")
    for refused in result.refused:
        logger().warning(f"MLflow refused journaled {refused['op']} for run {refused['run']}: {refused['error']}")
