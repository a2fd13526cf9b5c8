"""The model-registry writes as `RunLogger` makes them, live or replayed from the journal: each one safe to repeat.

A registry write goes through `RunLogger` like a run write (`register_version`, `set_version_tags`,
`move_champion`), so during a tracking outage it is journaled in the run folder and `eagleops sync`
makes it later, in order. A replayed entry may run twice (a sync killed between the call and its state
write, see tasks.tracking.sync), and a journaled decision may replay days later, so every op here is
idempotent and checks what it would overwrite:

- `register_version`: a version of the model with this run and source already registered is that
  version (a second replay registers nothing);
- `set_version_tags`: tags with their values (equal values overwrite themselves);
- `move_champion`: `champion` moves to the challenger only while it is still the version the gate
  measured against (none, for a first champion), that one kept as `previous`; a champion that is the
  challenger already is done (a replay never moves `previous` again). Any other champion was promoted
  meanwhile by a gate that never measured this challenger against it: the move is refused with one line
  (a `ChampionMoved`, which sync records as refused and prints) and the refusal is tagged on the version
  (`eagleops.gate.applied`), rather than flip the alias back.
"""

from __future__ import annotations

from typing import Any

from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient

CHAMPION = "champion"
PREVIOUS = "previous"
APPLIED_TAG = "eagleops.gate.applied"

# Shown on the registry page of a model eagleops registers first (a model made by hand keeps its own).
REGISTERED_MODEL_DESCRIPTION = (
    "EAGLE-3 draft checkpoints registered by eagleops' export_checkpoint, one version per run (the SGLang checkpoint "
    "folder). Deploys fetch `models:/<name>@champion`; `eagleops nightly` moves `champion` to a new version only when "
    "it wins the gate against the current one, which it keeps as `previous`."
)


class ChampionMoved(MlflowException):
    """A journaled promotion found another champion than the one its gate measured against: not applied."""


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


def register_version(client: MlflowClient, run_id: str, args: dict[str, Any]) -> str:
    """`<run's artifacts>/<artifact_path>` as a version of model `name`: the one registered already, else a new one."""
    name = args["name"]
    try:
        client.create_registered_model(name, description=REGISTERED_MODEL_DESCRIPTION)
    except MlflowException as err:
        if err.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    source = f"{client.get_run(run_id).info.artifact_uri}/{args['artifact_path']}"
    for found in client.search_model_versions(f"name = '{_quoted(name)}' and run_id = '{run_id}'"):
        if found.source == source:
            return str(found.version)
    # No wait: MLflow's own stores create a version READY, and the wait logs a line into every run's output.
    return str(client.create_model_version(name, source=source, run_id=run_id, tags=args["tags"],
                                           await_creation_for=0).version)


def set_version_tags(client: MlflowClient, args: dict[str, Any]) -> None:
    """The tags in their order (the gate's lineage first, its decision last: a crash between leaves no decision)."""
    for key, value in args["tags"].items():
        client.set_model_version_tag(args["name"], args["version"], key, value)


def move_champion(client: MlflowClient, args: dict[str, Any]) -> None:
    """`champion` -> args["challenger"] (the old one -> `previous`) if the champion is still args["measured_against"]."""
    name, challenger, measured = args["name"], args["challenger"], args.get("measured_against")
    current = champion_version(client, name)
    if current == challenger:
        return
    if current != measured:
        reason = (f"{name}: not promoting version {challenger}: the champion is {_version_shown(current)} now, not "
                  f"{_version_shown(measured)} that its gate measured it against (changed meanwhile); the champion "
                  "is left as it is")
        client.set_model_version_tag(name, challenger, APPLIED_TAG, f"no: {reason}")
        raise ChampionMoved(reason)
    if measured is not None:
        client.set_registered_model_alias(name, PREVIOUS, measured)
    client.set_registered_model_alias(name, CHAMPION, challenger)


def _version_shown(version: str | None) -> str:
    return "unset" if version is None else f"version {version}"


def _quoted(text: str) -> str:
    return text.replace("'", "\\'")
