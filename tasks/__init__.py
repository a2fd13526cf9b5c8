"""The orchestration floor: Prefect tasks and the outside world (SSH, SGLang servers, MLflow), over eagle3.

Wings, bottom first; a module imports its own wing and the wings below it, never one above, and
never `flows` (tests/test_architecture.py checks both, and that there is no import circle):
- `config`: the experiment schema, YAML loading with line numbers, secrets and redaction, recorded reads;
- `log`, `rundir`: where the pipeline's lines go; the run folder on disk (manifest, attempts, digests),
  which tracking's journal and the hosts' server registry write into, so it sits below them;
- `hosts`: running things on hosts: SSH (`remote`), host jobs, SGLang launch rules, servers started
  and torn down, the served model's evidence;
- `tracking`: MLflow: runs, the outage journal and its sync, the local store, links and views, the
  model registry, system metrics;
- `runner`: the stage runner (`Pipeline`, `STAGE_SPECS`): selection, resume by real inputs, one attempt;
- `stages`: one module (or small package) per pipeline stage, and the nightly gate.
"""
