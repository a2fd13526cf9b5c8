"""The credentials workers hand to runs, as Prefect Secret blocks referenced from prefect.yaml's job variables.

A deployment's `job_variables.env` names a secret as `HF_TOKEN: "{{ prefect.blocks.secret.eagleops-hf-token }}"`.
`eagleops deploy-flows` saves each referenced block from the variable of the same name in its own environment
(never printing the value), and leaves a block it finds alone when that variable is unset here: edited once in
the UI (Blocks), it reaches every worker through the server, with no env file to copy to each GPU host. With
neither the variable nor the block it refuses, naming both.

Why deploy-flows writes the references back after `prefect deploy`: Prefect 3.9.1's `prefect deploy` resolves
block references everywhere in a deployment's config before it registers it, job variables included, so the
secret would be stored in the deployment and shown in clear on its Configuration tab (checked here against a
server: `{'env': {'HF_TOKEN': '<the value>'}}`; PrefectHQ/prefect#14088, #17432). The worker resolves
references itself when it builds a run's job configuration (`BaseJobConfiguration.from_template_and_values`),
so the registered deployment keeps the reference and only the run's process sees the value.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import yaml

SECRET_REFERENCE = re.compile(r"^\{\{\s*prefect\.blocks\.secret\.(?P<slug>[a-z0-9-]+)\s*\}\}$")


@dataclass(frozen=True)
class SecretReference:
    """`env_name: {{ prefect.blocks.secret.slug }}` at `path` in one deployment's job variables."""

    deployment: str
    entrypoint: str
    path: tuple[str, ...]
    env_name: str
    slug: str
    reference: str


def secret_references(prefect_file: Path) -> list[SecretReference]:
    """Every Secret block reference in the job variables of prefect.yaml's deployments."""
    data = yaml.safe_load(prefect_file.read_text()) or {}
    found = []
    for entry in data.get("deployments") or []:
        job_variables = (entry.get("work_pool") or {}).get("job_variables") or {}
        for path, value in _leaves(job_variables, ()):
            match = SECRET_REFERENCE.match(value) if isinstance(value, str) else None
            if match:
                found.append(SecretReference(entry["name"], entry["entrypoint"], path, path[-1], match["slug"],
                                             value))
    return found


def _leaves(node: Any, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Any]]:
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, (*path, str(key)))
    else:
        yield path, node


def ensure_secret_blocks(references: list[SecretReference], environ: dict[str, str] | None = None) -> dict[str, str]:
    """Save each referenced block from its variable here; {slug: what happened}, for the output (no values).

    A variable set here, even empty, is saved (empty: a deliberate "no token"); a block that exists is kept when
    the variable is unset. Neither: ValueError naming both, before anything is saved, since a missing block fails
    the registration and every run, and an empty one made up here would override a worker's own variable."""
    from prefect.blocks.system import Secret

    environ = os.environ if environ is None else environ
    slugs = {ref.slug: ref.env_name for ref in references}
    missing = [f"{slug} (${env_name})" for slug, env_name in slugs.items()
               if env_name not in environ and not _block_exists(slug)]
    if missing:
        raise ValueError(f"no value for the Secret block(s) {', '.join(missing)} that prefect.yaml's job variables "
                         "reference: export the variable (empty for none) or create the block in the UI (Blocks)")
    outcome: dict[str, str] = {}
    for slug, env_name in slugs.items():
        if env_name in environ:
            Secret(value=environ[env_name]).save(slug, overwrite=True)
            outcome[slug] = f"saved from ${env_name}" + (" (empty)" if not environ[env_name] else "")
        else:
            outcome[slug] = f"kept (no ${env_name} here)"
    return outcome


def _block_exists(slug: str) -> bool:
    from prefect.blocks.system import Secret

    try:
        Secret.load(slug)
    except ValueError:  # "Unable to find block document named ..."
        return False
    return True


def restore_references(client, references: list[SecretReference]) -> list[str]:
    """Put the references back into the registered deployments' job variables (see the module docstring);
    the names of the deployments rewritten."""
    from prefect.client.schemas.actions import DeploymentUpdate
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName

    rewritten = []
    for name in sorted({ref.deployment for ref in references}):
        mine = [ref for ref in references if ref.deployment == name]
        for deployment in client.read_deployments(
                deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=[name]))):
            if deployment.entrypoint != mine[0].entrypoint:
                continue
            job_variables = dict(deployment.job_variables or {})
            for ref in mine:
                _set(job_variables, ref.path, ref.reference)
            client.update_deployment(deployment.id, DeploymentUpdate(job_variables=job_variables))
            rewritten.append(name)
    return rewritten


def _set(node: dict, path: tuple[str, ...], value: str) -> None:
    for key in path[:-1]:
        node[key] = dict(node.get(key) or {})
        node = node[key]
    node[path[-1]] = value
