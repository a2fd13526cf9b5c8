"""The nightly retrain: a new draft, and the champion gate in the MLflow Model Registry.

    fetch_champion -> eagle3_experiment (data -> train -> export; the export registers the challenger)
                   -> champion_gate (champion and challenger served and benched alike on one host,
                      interleaved over nightly.rounds; promoted on the gain's lower confidence bound)
                   -> promote_or_keep (alias `champion` moves, the old one kept as `previous`; or the
                      refusal and its reason are recorded) -> the gate's table as a Prefect artifact

`nightly.start_from: champion` trains from the champion's weights (scratch while there is none; the default with
`data.source: served`); `nightly.*` holds the margins. On served traffic, a night whose window holds fewer than
`data.served.min_new_samples` samples no earlier night captured stops after the data stage ("no new traffic":
nothing trained, exported or gated) and ends Completed, saying so.
Deployments reference `flows/nightly.py:nightly_retrain`.
No `from __future__ import annotations` here: it breaks `flow.serve()` with typed parameters.
"""

from prefect import flow
from prefect.runtime import flow_run

from flows.experiment import eagle3_experiment
from flows.params import ConfigPath, RunDir
from tasks.config.load import load_experiment
from tasks.hosts.teardown import teardown_for_flow_run
from tasks.runner.flow_errors import redacted_failures
from tasks.run_lock import keeping_run_folders
from tasks.stages.data.served import no_new_traffic_outcome
from tasks.stages.gate.nightly import champion_gate, report_gate, training_config
from tasks.stages.preflight import refuse_before_stages
from tasks.tracking.registry import (
    challenger_version,
    fetch_champion,
    promote_or_keep,
    registered_model_name,
)
from tasks.tracking.views import tracking_uri_for

# Data, training and export; the gate deploys and benchmarks (report always runs in the experiment flow).
TRAINING_STAGES = ["check_environment", "generate_data", "train_draft", "export_checkpoint"]


def _teardown_hook(flow, flow_run, state) -> None:
    """Failure/cancellation/crash hook: stop every server the gate started for this flow run."""
    teardown_for_flow_run(flow_run.parameters, str(flow_run.id))


@flow(name="eagle3-nightly", log_prints=True, flow_run_name="nightly {config_path}",
      on_failure=[_teardown_hook], on_cancellation=[_teardown_hook], on_crashed=[_teardown_hook])
@redacted_failures  # an exception leaving the body reaches Prefect's state message masked
def nightly_retrain(config_path: ConfigPath, run_dir: RunDir = None) -> dict:
    """Retrain, measure against the champion on the same host and prompts, promote only on a win.

    The Prefect UI form shows these descriptions; types are in flows/params.py.

    Args:
        config_path: Experiment YAML with export.registered_model: a shipped config, or a path on the worker
            (relative to the project directory).
        run_dir: Resume an earlier nightly's run folder; finished stages are reused.
    """
    cfg = load_experiment(config_path)
    # 0. what any stage or the gate would refuse from the config and the files it names, before anything runs
    refuse_before_stages(cfg, config_path)
    name = registered_model_name(cfg)
    # the run folder the experiment subflow takes stays this run's until the gate's report is written
    with keeping_run_folders():
        # 1. the current champion, downloaded: the gate serves it, and training may start from it
        champion = fetch_champion(cfg)
        # 2. data -> train -> export, as the experiment flow runs them; the export registers the challenger
        train_path, variant = training_config(cfg, config_path, champion, run_dir)
        experiment = eagle3_experiment(train_path, stages=TRAINING_STAGES, run_dir=run_dir, variant=variant)
        if experiment.get("halted"):  # data.source served with fewer than data.served.min_new_samples new samples
            return no_new_traffic_outcome(cfg, experiment, champion)
        challenger = challenger_version(cfg, experiment)
        # 3. champion and challenger interleaved: same host, setting, prompts and runs; the nightly.* margins by bounds
        gate = champion_gate(cfg, experiment, champion, challenger, str(flow_run.id))
        # 4. the registry: promote (champion moves, previous kept) or keep, the reason recorded either way
        outcome = promote_or_keep(tracking_uri_for(cfg), name, challenger, champion["version"] if champion else None,
                                  gate["promote"], gate["reason"], gate["lineage"], experiment["mlflow_run_id"])
        # 5. the side-by-side table as a Prefect artifact, the outcome in the run's manifest
        report_gate(cfg, experiment, gate, outcome)
        return {**outcome, "run_dir": experiment["run_dir"], "mlflow_run_id": experiment["mlflow_run_id"],
                "bench_run_id": gate["bench_run_id"], "comparisons": gate["comparisons"], "rows": gate["rows"]}
