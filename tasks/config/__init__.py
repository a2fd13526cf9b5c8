"""The config wing: what an experiment file may say and how it is read.

`schema` (the pydantic sections composed into `ExperimentConfig`), `load` (YAML -> validated config,
errors as `file:line: field: reason`, sweeps), `yaml_lines` (the reading rules before validation),
`masked` (the config as recorded: secrets masked, flattened, hashed), `secrets` (redaction of every
secret in free text and records), `reads` (which fields a stage read). The bottom of tasks/: it
imports only eagle3.
"""
