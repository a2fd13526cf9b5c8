"""The stages wing: one module (or small package) per pipeline stage, each a Prefect task
`fn(cfg, ctx) -> summary` run by `tasks.runner.pipeline.Pipeline`.

`environment`, `data` (+ the data host, regeneration servers), `train` (+ nodes, the stream's capture
side), `export`, `deploy`, `bench` (+ its report and diagnosis), `report`, and `gate` (the nightly's
champion-vs-challenger gate). `target` finds the target a stage reads. The top of tasks/: a stage may
use another stage's functions (the benchmark launches servers as deploy does), never the flows.
"""
