"""The production watch: one look at every production server per flow run, on an interval schedule.

    read_watched_champion (models:/NAME@champion, its band from the recorded gate figures)
        -> open the champion's monitoring run (MLflow)
        -> watch_endpoint per server (Prometheus or /metrics, /server_info, digests on the serving host;
           drift / changed / unreachable events; the window into the monitoring run)

The deployment `watch` (infra/prefect.yaml) runs this every `watch.window_s`; `eagleops watch CONFIG` runs it
in a loop from a terminal. What a tick remembers lives in `<runs_root>/watch/<experiment>/`.
No `from __future__ import annotations` here: it breaks `flow.serve()` with typed parameters.
"""

from prefect import flow, task
from prefect.cache_policies import NO_CACHE

from flows.params import ConfigPath
from tasks.config.load import load_experiment
from tasks.config.schema import ExperimentConfig
from tasks.log import logger
from tasks.runner.flow_errors import redacted_failures
from tasks.watch.monitor import ChampionUnknown, MonitoringRun, champion_band, read_champion
from tasks.watch.tick import Champion, watch_endpoint, watch_endpoints
from tasks.watch.state import state_path


@task(name="read_watched_champion", cache_policy=NO_CACHE)
@redacted_failures  # its exception reaches the task run's Prefect state message masked
def read_watched_champion(cfg: ExperimentConfig) -> Champion:
    """The champion and its band; a champion of unknown version when the registry has none or does not answer."""
    name = cfg.export.registered_model
    try:
        version, tags = read_champion(cfg)
    except ChampionUnknown as why:
        logger().warning(f"{why}: drift is not judged this time (settings and reachability still are)")
        return Champion(name, None)
    return Champion(name, version, tags, champion_band(cfg, name, version, tags))


@flow(name="eagle3-watch", log_prints=True, flow_run_name="watch {config_path}")
@redacted_failures  # an exception leaving the body reaches Prefect's state message masked
def watch_production(config_path: ConfigPath) -> dict:
    """Look at every production server once: drift, changed settings or identity, reachability.

    Args:
        config_path: Experiment YAML with a `watch` section and export.registered_model (the champion watched).
    """
    cfg = load_experiment(config_path)
    endpoints = watch_endpoints(cfg)
    # 1. the champion the servers are held to, and the band its gate measured
    champion = read_watched_champion(cfg)
    # 2. its long-lived monitoring run (one per model version)
    monitor = None
    if champion.version is not None:
        monitor = MonitoringRun(cfg, champion.name, champion.version)
        monitor.open(endpoints, champion.band)
    # 3. each server: read, decide, emit, record (one metric prefix per server when there are several)
    results = [watch_endpoint(cfg, endpoint, champion, monitor, _prefix(cfg, endpoint, len(endpoints)))
               for endpoint in endpoints]
    return {"model": champion.name, "version": champion.version, "band": champion.band.to_dict() if champion.band
            else None, "monitoring_run_id": monitor.run_id if monitor else None,
            "endpoints": [vars(result) for result in results]}


def _prefix(cfg: ExperimentConfig, endpoint: str, count: int) -> str:
    return "" if count == 1 else state_path(cfg.runs_root, cfg.experiment, endpoint).stem + "/"
