"""`eagleops deploy-flows`: the work pools, the per-GPU-host queues and the deployments of infra/prefect.yaml.

Owns what a team's Prefect server must hold before a worker can run anything: the `cpu` and
`gpu` process pools, one `gpu` work queue per GPU host with a concurrency limit of 1, one global
concurrency limit of 1 per GPU host (`gpu-host-<queue>`, taken by every GPU stage, tasks/runner/host_slots.py),
and the deployments (registered by `prefect --no-prompt deploy` in a subprocess, exactly as by hand).
Every step is idempotent: a second call creates nothing and resets a changed limit to 1.

Why both a work-queue limit and a global concurrency limit for "one training per GPU host" in
Prefect 3.9.1: the queue's limit is checked before the server hands a run to the host's worker,
so a second deployment run of that queue waits as Scheduled, with no process started; but only
runs of that queue see it. The global limit is taken inside the run by each GPU stage (`with
concurrency(...)`), so it also holds a run started from the CLI, a UI run whose host override
points elsewhere than its queue, and a nightly on another queue; such a run waits with its process
started, holding no GPU. A pool limit would cap all GPU hosts together.

Risk: `prefect deploy` imports each entrypoint to build its parameter schema, so a flow module
that fails to import fails the registration (the error names it).
"""

import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import yaml

from tasks.runner.host_slots import limit_name

REPO_ROOT = Path(__file__).resolve().parents[1]
PREFECT_FILE = REPO_ROOT / "infra" / "prefect.yaml"
POOLS = {
    "cpu": "Orchestration and the embedded CPU default; one worker anywhere.",
    "gpu": "Stages that run where the GPUs are; one worker per GPU host on its own queue (limit 1).",
}
GPU_POOL = "gpu"
RUNS_PER_GPU_HOST = 1


@dataclass(frozen=True)
class Deployment:
    """One entry of prefect.yaml's `deployments:` list, as far as registration needs it."""

    name: str
    entrypoint: str
    pool: str
    queue: str | None

    def entrypoint_file(self, project_dir: Path) -> Path:
        return project_dir / self.entrypoint.rsplit(":", 1)[0]


def read_deployments(prefect_file: Path) -> list[Deployment]:
    """The deployments a prefect.yaml declares; ValueError naming the file and entry when one is incomplete."""
    try:
        data = yaml.safe_load(prefect_file.read_text()) or {}
    except yaml.YAMLError as error:
        raise ValueError(f"{prefect_file}: not valid YAML: {error}") from None
    found = []
    for index, entry in enumerate(data.get("deployments") or []):
        pool = (entry.get("work_pool") or {})
        if not entry.get("name") or not entry.get("entrypoint") or not pool.get("name"):
            raise ValueError(f"{prefect_file}: deployments[{index}] needs name, entrypoint and work_pool.name")
        found.append(Deployment(entry["name"], entry["entrypoint"], pool["name"], pool.get("work_queue_name")))
    return found


def ensure_work_pools(client) -> dict[str, str]:
    """Create the `process` pools that are missing; return {pool: "created" | "exists"}."""
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.exceptions import ObjectNotFound
    from prefect.workers.process import ProcessWorker

    outcome = {}
    for name, description in POOLS.items():
        try:
            client.read_work_pool(name)
            outcome[name] = "exists"
        except ObjectNotFound:
            # The worker type's own template, so job variables (env, working_dir, ...) work as with
            # `prefect work-pool create --type process`.
            client.create_work_pool(WorkPoolCreate(
                name=name, type="process", description=description,
                base_job_template=ProcessWorker.get_default_base_job_template(),
            ))
            outcome[name] = "created"
    return outcome


def ensure_gpu_queues(client, queues: list[str]) -> dict[str, str]:
    """One queue per GPU host in the gpu pool, each limited to one run; return {queue: "created" | "limit set" | "exists"}."""
    from prefect.exceptions import ObjectNotFound

    outcome = {}
    for queue in queues:
        try:
            found = client.read_work_queue_by_name(queue, work_pool_name=GPU_POOL)
        except ObjectNotFound:
            client.create_work_queue(name=queue, work_pool_name=GPU_POOL, concurrency_limit=RUNS_PER_GPU_HOST,
                                     description=f"GPU host {queue}: one run at a time.")
            outcome[queue] = "created"
            continue
        if found.concurrency_limit != RUNS_PER_GPU_HOST:
            client.update_work_queue(found.id, concurrency_limit=RUNS_PER_GPU_HOST)
            outcome[queue] = "limit set"
        else:
            outcome[queue] = "exists"
    return outcome


def missing_entrypoints(deployments: list[Deployment], project_dir: Path) -> list[str]:
    return [f"{d.name} ({d.entrypoint})" for d in deployments if not d.entrypoint_file(project_dir).is_file()]


def register_deployments(prefect_file: Path, project_dir: Path, names: list[str] | None = None,
                         timeout_s: float = 600) -> subprocess.CompletedProcess:
    """`prefect --no-prompt deploy --all` (or `--name N ...`) from the project dir, output captured."""
    selection = ["--all"] if not names else [arg for name in names for arg in ("--name", name)]
    command = [sys.executable, "-m", "prefect", "--no-prompt", "deploy", *selection, "--prefect-file", str(prefect_file)]
    env = {**os.environ, "EAGLEOPS_PROJECT_DIR": str(project_dir)}
    return subprocess.run(command, cwd=project_dir, env=env, capture_output=True, text=True, timeout=timeout_s)


def ensure_gpu_host_limits(client, hosts: list[str]) -> dict[str, str]:
    """A global concurrency limit of 1 per GPU host; {limit name: "created" | "limit set" | "exists"}."""
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate, GlobalConcurrencyLimitUpdate
    from prefect.exceptions import ObjectNotFound

    outcome = {}
    for host in hosts:
        name = limit_name(host)
        try:
            found = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=RUNS_PER_GPU_HOST))
            outcome[name] = "created"
            continue
        if found.limit != RUNS_PER_GPU_HOST or not found.active:
            client.update_global_concurrency_limit(name, GlobalConcurrencyLimitUpdate(limit=RUNS_PER_GPU_HOST,
                                                                                      active=True))
            outcome[name] = "limit set"
        else:
            outcome[name] = "exists"
    return outcome
