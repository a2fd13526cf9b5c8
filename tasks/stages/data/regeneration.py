"""The data stage's own regeneration servers (`data.regenerate.deploy`): N baseline servers of the target
(`deploy.server`: SGLang or the reference server; no draft) started on `data.regenerate.deploy.host`
through `tasks.hosts.servers.launch`, one port and GPU set each, and stopped in a `finally`. They are
recorded in the run's servers.json like every server, so the flow's teardown also stops those of a
killed run. Risk: GPUs held by servers left running; hence the finally, the registry and one GPU set
per server."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from pydantic import SecretStr

from tasks.config.schema import ExperimentConfig, HostConfig
from tasks.hosts.remote import Executor, connect
from tasks.hosts.servers import Placement, PortTaken, ServerHandle, launch, stop
from tasks.log import logger
from tasks.runner.context import StageContext

PORT_TRIES = 3


@contextlib.contextmanager
def regeneration_servers(cfg: ExperimentConfig, ctx: StageContext, target_dir: Path | None, *,
                         reach_from_host: bool = False) -> Iterator[list[str]]:
    """data.regenerate.deploy: start N baseline servers of the target, yield the URLs this process
    reaches them at (SSH tunnels for remote hosts) -- or, with `reach_from_host`, the URLs a process
    on their host reaches them at (the data stage on data.host) -- and stop every one of them on exit."""
    wanted = cfg.data.regenerate.deploy
    if wanted is None:
        raise ValueError("data.regenerate.deploy is not set: no servers to start")
    host = regeneration_host(cfg, wanted.host)
    executor = connect(host, cfg.hosts)
    handles: list[ServerHandle] = []
    try:
        placement = target_placement(cfg, executor, host, ctx, target_dir)
        port = cfg.deploy.port
        for k in range(wanted.servers):
            handles.append(launch_on_a_free_port(cfg, executor, placement, ctx, port, k))
            port = handles[-1].port + 1
        yield [f"http://127.0.0.1:{h.port}" if reach_from_host else h.local_url for h in handles]
    finally:
        for handle in handles:
            stop(ctx.run_dir, handle, executor)
        executor.close()


def launch_on_a_free_port(cfg: ExperimentConfig, executor: Executor, placement: Placement, ctx: StageContext,
                          port: int, k: int) -> ServerHandle:
    """Server k on the first free port from `port` (a killed run's servers may hold some). These ports are the
    stage's to pick, so a port another process binds while the server starts (PortTaken) moves it to the next
    free one, up to PORT_TRIES times, where a deploy.port the user set would fail the launch."""
    port = executor.first_free_port(port)
    for tries_left in reversed(range(PORT_TRIES)):
        try:
            return launch(server_config(cfg, port, k), placement, ctx.run_dir, label=f"regenerate {k}",
                          spec=None, predicted=None)
        except PortTaken:
            if not tries_left:
                raise
            logger().warning(f"regenerate {k}: port {port} on {executor.name} was taken while the server started; "
                             "starting it on the next free port")
            port = executor.first_free_port(port + 1)
    raise AssertionError("PORT_TRIES must be at least 1")


def regeneration_host(cfg: ExperimentConfig, name: str) -> HostConfig | None:
    if name == "local":
        return None
    names = [h.name for h in cfg.hosts]
    if name not in names:
        raise ValueError(f"data.regenerate.deploy.host '{name}' is neither 'local' nor one of hosts[].name {names}")
    return cfg.host(name)


def target_placement(cfg: ExperimentConfig, executor: Executor, host: HostConfig | None, ctx: StageContext,
                     target_dir: Path) -> Placement:
    """Where the host finds the target: in place locally; a tiny target is uploaded (verified, resumable)
    to <workdir>/targets/ on a remote host, any other is read at deploy.model_path or target.model_path."""
    if host is None:
        return Placement(executor, None, str(ctx.stage_dir / "servers"), cfg.deploy.model_path or str(target_dir), "")
    workdir = executor.expand_path(host.workdir)
    model = cfg.deploy.model_path or cfg.target.model_path or ""
    if cfg.target.kind == "tiny" and cfg.deploy.model_path is None:  # our own target travels
        model = f"{workdir}/targets/{target_dir.name}"
        results = executor.upload_dir(target_dir, model)
        logger().info(f"[{executor.name}] {target_dir.name} -> {model}: {len(results)} files, "
                      f"{sum(r.bytes_sent for r in results) / 1e6:.1f} MB sent")
    return Placement(executor, host, workdir, model, "")


def server_config(cfg: ExperimentConfig, port: int, k: int) -> ExperimentConfig:
    """The config `launch` reads for server k: its port and, for SGLang, its own GPUs (k*tp .. k*tp+tp-1)
    unless deploy.env pins CUDA_VISIBLE_DEVICES."""
    env = dict(cfg.deploy.env)
    if cfg.deploy.server == "sglang" and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = SecretStr(",".join(str(k * cfg.deploy.tp + j) for j in range(cfg.deploy.tp)))
    return cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"port": port, "env": env})})
