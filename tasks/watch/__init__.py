"""The watch wing: the draft in production, after the nightly gate has looked away.

`rules` (pure decisions: windows, the band, Prometheus `for:` drift, changes, when to tell again; no
Prefect, MLflow, HTTP or SSH), `sources` (Prometheus and the server's own /metrics and /server_info),
`identity` (what the server serves vs what the champion was measured with, digests read on the serving
host), `state` (what a stateless schedule remembers between ticks), `events` (the Prefect events and
their resources, the automations' contract; the nightly gate emits the champion's too), `monitor` (the
champion from the registry and its long-lived MLflow monitoring run), `tick` (one look at one server).

Imports: the wings below (config, the run folder and log, hosts, tracking); the stages import `events`.
"""
