"""The runner wing: how a run's stages run.

`stages` (the stage names and the errors a stage ends with; light, read before Prefect starts),
`specs` (what each stage reads, the fingerprint of an attempt), `context` (what a stage task is given),
`attempt` (one stage attempt, top-down: its folder, manifest entry, MLflow child run and recorded
reads), `pipeline` (selection, reuse and resume over a run folder), `diskspace` (a full disk said in
one line), `gpu_hours` (the GPUs an attempt held and for how long; a flow run's total), `flow_errors`
(an exception leaving a flow body, masked for Prefect's state message). Imports config,
the run folder, hosts and tracking; the stages import it.
"""
