"""The hosts wing: running things on the machines a run uses, this one or SSH hosts alike.

`remote` (executors: commands, detached processes, verified transfers, tunnels, host keys), `jobs`
(a detached `python -m eagle3...` job on a host, followed by its progress file), `launch` (the
server's launch flags and what SGLang will make of them), `servers` (launch, health, stop, with
`server_registry` recording every live one in the run folder), `teardown` (stopping what a run left),
`served` (the served model's files as the serving host has them), `signals` (holding signals while a
teardown runs), `gpus` (how many GPUs a host has, for GPU-hours). Imports config, the run log and the
run folder; never tracking, the runner or stages.
"""
