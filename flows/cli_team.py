"""The commands a team runs against its servers: `deploy-flows` (pools, queues, limits, Secret blocks,
deployments, automations), `nightly`, `watch`, and `hosts trust`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

import typer

from flows.cli_app import BAD_INPUT, STAGE_FAILED, _fail_config, _say, app, err, out
from flows.cli_run import _exit_interrupted, _refuse_held_folder
from tasks.config.load import ConfigError, load_experiment


@app.command("deploy-flows")
def deploy_flows(
    prefect_file: Path = typer.Option(Path("infra/prefect.yaml"), "--prefect-file", help="Deployments to register."),
    gpu_queue: Optional[list[str]] = typer.Option(
        None, "--gpu-queue", help="A GPU host's work queue in the gpu pool, limited to one run (repeat per host); "
        "default: the queues prefect.yaml's gpu deployments name."),
    only: Optional[list[str]] = typer.Option(None, "--only", help="Register only this deployment (repeatable)."),
) -> None:
    """Create the cpu and gpu work pools, one gpu queue per GPU host (concurrency limit 1), then register
    the deployments (prefect --no-prompt deploy). Idempotent; needs PREFECT_API_URL."""
    from prefect.client.orchestration import get_client

    from flows.deployments import (
        GPU_POOL,
        ensure_gpu_host_limits,
        ensure_gpu_queues,
        ensure_work_pools,
        missing_entrypoints,
        read_deployments,
        register_deployments,
    )
    from flows.secret_blocks import ensure_secret_blocks, restore_references, secret_references
    from tasks.config.secrets import redact

    if not os.environ.get("PREFECT_API_URL"):
        err.print("[red]error[/red] PREFECT_API_URL is not set: point it at the team's Prefect server, "
                  "e.g. http://127.0.0.1:4200/api")
        raise typer.Exit(BAD_INPUT)
    project_dir = Path.cwd()
    try:
        deployments = read_deployments(prefect_file)
    except (OSError, ValueError) as error:
        err.print(f"[red]error[/red] --prefect-file: {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    chosen = [d for d in deployments if not only or d.name in only]
    unknown = sorted(set(only or []) - {d.name for d in deployments})
    missing = missing_entrypoints(chosen, project_dir)
    if unknown or missing:
        problem = f"unknown deployment(s) {unknown}" if unknown else f"entrypoint file missing for {missing}"
        err.print(f"[red]error[/red] {prefect_file}: {problem}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    queues = gpu_queue or sorted({d.queue for d in deployments if d.pool == GPU_POOL and d.queue})
    with get_client(sync_client=True) as client:
        for pool, outcome in ensure_work_pools(client).items():
            out.print(f"work pool {pool}: {outcome}", highlight=False)
        for queue, outcome in ensure_gpu_queues(client, queues).items():
            out.print(f"work queue {GPU_POOL}/{queue} (1 run at a time): {outcome}", highlight=False)
        for limit, outcome in ensure_gpu_host_limits(client, queues).items():
            out.print(f"concurrency limit {limit} (1 GPU stage at a time, whatever started it): {outcome}",
                      highlight=False, soft_wrap=True)
    references = [ref for ref in secret_references(prefect_file) if ref.deployment in {d.name for d in chosen}]
    try:
        saved = ensure_secret_blocks(references)
    except ValueError as error:
        err.print(f"[red]error[/red] {prefect_file}: {error}", highlight=False, soft_wrap=True)
        raise typer.Exit(BAD_INPUT)
    for slug, outcome in saved.items():
        out.print(f"secret block {slug}: {outcome}", highlight=False, soft_wrap=True)
    done = register_deployments(prefect_file, project_dir, [d.name for d in chosen] if only else None)
    if done.returncode != 0:
        err.print(f"[red]error[/red] prefect deploy exited {done.returncode}:")
        err.print(redact((done.stdout + done.stderr)[-3000:]), highlight=False, soft_wrap=True, markup=False)
        raise typer.Exit(STAGE_FAILED)
    with get_client(sync_client=True) as client:
        restore_references(client, references)  # `prefect deploy` stored the secrets' values in their place
    out.print(f"registered {len(chosen)} deployments from {prefect_file}: {', '.join(d.name for d in chosen)}",
              highlight=False, soft_wrap=True)
    _ensure_automations(prefect_file, project_dir)


def _ensure_automations(prefect_file: Path, project_dir: Path) -> None:
    """The watch's and the nightly's automations and the on-call webhook block (flows/automations.py)."""
    from prefect.client.orchestration import get_client

    from flows.automations import (
        BLOCK_NAME,
        WEBHOOK_ENV,
        automation_specs,
        ensure_automations,
        ensure_webhook_block,
        nightly_deployments,
    )

    block_id = ensure_webhook_block()
    if block_id is None:
        out.print(f"notifications: off (set {WEBHOOK_ENV} to a webhook URL and run deploy-flows again)", highlight=False)
    else:
        out.print(f"notification block {BLOCK_NAME}: saved (webhook from ${WEBHOOK_ENV})", highlight=False)
    with get_client(sync_client=True) as client:
        nightlies = nightly_deployments(client, prefect_file, project_dir)
    for name, outcome in ensure_automations(automation_specs(nightlies, block_id)).items():
        out.print(f"automation {name}: {outcome}", highlight=False, soft_wrap=True)


@app.command()
def nightly(
    config: Path = typer.Argument(..., help="Experiment YAML with export.registered_model and a nightly section."),
    run_dir: Optional[Path] = typer.Option(None, "--run-dir", help="Resume this nightly's run directory."),
) -> None:
    """Retrain, benchmark against the registry's champion on the same host and prompts, promote or keep."""
    from flows.runtime import (
        prefect_api,
        redacted_stdio,
        signals_as_exceptions,
        temporary_server,
    )
    from tasks.config.secrets import redact
    from tasks.run_lock import RunFolderHeld
    from tasks.runner.stages import StageFailed

    if run_dir is not None:
        _refuse_held_folder(run_dir)
    try:
        cfg = load_experiment(config)
        from tasks.stages.preflight import refuse_before_stages

        refuse_before_stages(cfg, config)  # the gate deploys and benchmarks: every stage's checks
        with signals_as_exceptions(), temporary_server() as server:
            from flows.nightly import (
                nightly_retrain,  # imported while the temporary server boots
            )

            with redacted_stdio(), prefect_api(server):
                result = nightly_retrain(str(config), run_dir=str(run_dir) if run_dir else None)
    except ConfigError as error:
        _fail_config(error)
    except KeyboardInterrupt as stop:
        _exit_interrupted(config, None, stop)
    except RunFolderHeld as held:  # taken between the check above and the flow's start
        _say("error", "red", f"--run-dir: {held}")
        raise typer.Exit(BAD_INPUT)
    except (StageFailed, ValueError) as failure:
        err.print(f"[red]nightly failed[/red] {redact(str(failure))}", highlight=False, soft_wrap=True)
        raise typer.Exit(STAGE_FAILED)
    from tasks.tracking.views import tracking_uri_for

    for line in nightly_outcome(result, tracking_uri_for(cfg)):
        out.print(line, highlight=False, soft_wrap=True)


def nightly_outcome(result: dict, tracking_uri: str) -> list[str]:
    """The nightly's answer in two lines: which version moved to champion (or was refused) and why, then its page
    in the model registry."""
    from tasks.tracking.views import model_version_url, ui_base

    if result.get("no_new_traffic"):  # a served night below data.served.min_new_samples: nothing ran after data
        return [f"[yellow]no new traffic[/yellow]: {result['no_new_traffic'].removeprefix('no new traffic: ')}; "
                f"nothing trained, exported or gated (champion version {result['champion_before']} stays)",
                f"run folder: {result['run_dir']}"]
    name, version = result["model"], result["challenger"]
    why = result["reason"].split(": ", 1)[-1]  # the recorded reason opens with the decision ("promoted: ...")
    if result["promoted"]:
        decided = f"[green]promoted[/green] {name} version {version} to champion: {why}"
    else:
        decided = (f"[yellow]kept the champion[/yellow] (version {result['champion_before']}); "
                   f"{name} version {version} refused: {why}")
    return [decided, f"MLflow model: {model_version_url(ui_base(tracking_uri), name, version)}"]


@app.command()
def watch(
    config: Path = typer.Argument(..., help="Experiment YAML with a watch section and export.registered_model."),
    once: bool = typer.Option(False, "--once", help="One look at every server, then exit (what the schedule runs)."),
    ticks: Optional[int] = typer.Option(None, "--ticks", min=1, help="Stop after this many looks (default: until "
                                        "Ctrl-C)."),
) -> None:
    """Watch the champion in production: one line per server per watch.window_s; drift, changed settings or
    identity and unreachable servers become Prefect events (see README, Watching a draft in production)."""
    import time

    from flows.runtime import prefect_api, redacted_stdio, signals_as_exceptions, temporary_server

    try:
        cfg = load_experiment(config)
        from tasks.watch.tick import watch_endpoints

        watch_endpoints(cfg)
    except ConfigError as error:
        _fail_config(error)
    except ValueError as error:
        _say("error", "red", f"{config}: {error}")
        raise typer.Exit(BAD_INPUT)
    count = 1 if once else ticks
    try:
        with signals_as_exceptions(), temporary_server() as server:
            from flows.watch import watch_production  # imported while the temporary server boots

            with redacted_stdio(), prefect_api(server):
                done = 0
                while count is None or done < count:
                    started = time.monotonic()
                    watch_production(str(config))
                    done += 1
                    if count is None or done < count:
                        time.sleep(max(0.0, cfg.watch.window_s - (time.monotonic() - started)))
    except KeyboardInterrupt as stop:  # the way a watch from a terminal ends
        err.print("watch stopped", highlight=False)
        raise typer.Exit(143 if getattr(stop, "signal_name", "") == "SIGTERM" else 130)


hosts_app = typer.Typer(no_args_is_help=True, help="The SSH inventory of a config.")
app.add_typer(hosts_app, name="hosts")


@hosts_app.command("trust")
def hosts_trust(
    name: str = typer.Argument(..., help="hosts[].name in the config."),
    config: Path = typer.Option(..., "--config", "-c", help="Experiment YAML whose hosts list has NAME."),
    yes: bool = typer.Option(False, "--yes", help="Record the key without asking (after checking it elsewhere)."),
) -> None:
    """Show the host key NAME presents now and record it in its known_hosts after you confirm it."""
    from tasks.hosts.remote import RemoteError, host_key_fingerprint, trust_host

    try:
        cfg = load_experiment(config)
    except ConfigError as error:
        _fail_config(error)
    host = next((h for h in cfg.hosts if h.name == name), None)
    if host is None:
        err.print(f"[red]error[/red] {config}: no hosts[] entry named {name!r} ({[h.name for h in cfg.hosts]})")
        raise typer.Exit(BAD_INPUT)
    try:
        key_type, fingerprint = host_key_fingerprint(host, cfg.hosts)
        out.print(f"{name} ({host.address}:{host.port}) presents {key_type} {fingerprint}", highlight=False)
        if not yes and not typer.confirm("Is this the host's key (compare it with the host's own ssh-keygen -lf)?"):
            raise typer.Exit(BAD_INPUT)
        out.print(trust_host(host, cfg.hosts), highlight=False)
    except RemoteError as error:
        err.print(f"[red]error[/red] {error}", highlight=False)
        raise typer.Exit(STAGE_FAILED)
