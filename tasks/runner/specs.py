"""What each stage reads (`STAGE_SPECS`): its config inputs, the fields it reads that never change its
outputs, the upstream outputs it needs or uses; and the fingerprint of an attempt's inputs built from them.

A stage's inputs are the config fields it reads and the content digests of the upstream outputs it
consumes, hashed into a fingerprint: the same fingerprint means the same outputs. So changing
`deploy.port` re-runs deploy and benchmark only, changing `train.lr` re-runs training and what
consumes the new checkpoint, and a changed secret re-runs nothing (secrets are masked before hashing).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from eagle3.data.served_source import listing_digest, local_listing
from eagle3.training.trainer import RESUMABLE_FIELDS
from tasks.config.masked import flatten, masked_dict
from tasks.config.reads import covered
from tasks.config.schema import ExperimentConfig
from tasks.hosts.remote import connect
from tasks.rundir import digest_paths


@dataclass(frozen=True)
class Reads:
    """Fields a stage reads only when `when(cfg)` holds: `config` are then inputs, `operational` read but not."""

    when: Callable[[ExperimentConfig], bool]
    config: tuple[str, ...] = ()
    operational: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageSpec:
    """What a stage reads: its inputs (dotted config prefixes, minus `operational`), the fields it reads that
    never change its outputs (`operational`: how fast, from where, how often it reports), reads that depend on
    the config (`when`), and upstream stages. A field a stage reads is an input or operational, nothing else:
    `undeclared_reads` names the rest, and the pipeline checks every attempt against it."""

    config: tuple[str, ...] = ()
    operational: tuple[str, ...] = ()
    when: tuple[Reads, ...] = ()
    needs: tuple[str, ...] = ()  # upstream outputs it cannot run without
    uses: tuple[str, ...] = ()  # upstream outputs it reads when they exist (offline figures)
    always_run: bool = False  # a measurement or a side effect on another machine: never reused

    def inputs(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return self.config + tuple(f for extra in self.when if extra.when(cfg) for f in extra.config)

    def operational_fields(self, cfg: ExperimentConfig) -> tuple[str, ...]:
        return self.operational + tuple(f for extra in self.when if extra.when(cfg) for f in extra.operational)


def _regeneration_servers(cfg: ExperimentConfig) -> bool:
    """The data stage starts servers of the target (deploy.server, deploy.model_path, ...) to regenerate."""
    regen = cfg.data.regenerate
    return cfg.data.source == "prompts" and regen.enabled and regen.backend != "local" and regen.deploy is not None


def _speculators_verifier_from_paths(cfg: ExperimentConfig) -> bool:
    """The speculators export names its verifier after deploy.model_path or target.model_path."""
    return "speculators" in cfg.export.formats and cfg.export.verifier_name_or_path is None


def _streamed(cfg: ExperimentConfig) -> bool:
    """train_draft runs the stream's capture side (data.hidden_states: stream)."""
    return cfg.data.hidden_states == "stream"


# What the capture side of a stream is given (the data and target sections, tasks/stages/train/stream.py): its content is
# decided upstream (the data stage's fingerprint and digest, an input), its pace by the budget.
_STREAM_CAPTURE = ("target.kind", "target.model_path", "target.shape", "target.tiny", "target.aux_layer_ids",
                   "target.engine", "target.trust_remote_code", "target.placement", "data.stream", "data.capture",
                   "data.capture_batch_size", "data.shard_size", "data.hidden_states_dtype", "data.max_length",
                   "data.regenerate", "data.prompts", "data.num_samples", "data.validation_fraction", "data.seed",
                   "data.host", "data.source", "data.served")


# Regeneration settings that change how fast answers arrive, not which answers.
_DATA_OPERATIONAL = tuple(f"data.regenerate.{k}" for k in (
    "concurrency", "retries", "timeout_s", "backoff_s", "api_key", "endpoint", "endpoints", "deploy", "max_failed_fraction"))


# How the SGLang capture runner batches and sizes its memory, where the HF engine places the target, and how
# much disk a stream or the served capture cache may take and where that cache lies: not which hidden states are
# written (what the cache holds is the data host's state, never an input).
_CAPTURE_OPERATIONAL = ("data.capture.max_batch_tokens", "data.capture.mem_fraction_static", "target.placement",
                        "data.stream", "data.served.cache", "data.served.cache_budget_gb")


# Where the runs root and its tiny-target cache are (a moved run folder re-runs nothing), how many CPU
# threads build the tiny target, how the SSH inventory reaches a host.
_WHERE = ("runs_root", "target.tiny.num_threads", "hosts")


# A later stage finds the target the data stage recorded (by content, in the upstream digest).
_FINDS_TARGET = ("target.kind", "target.tiny", "target.model_path")


# How a server of the target is started: its port, environment, memory, patience (not what it serves).
_SERVER_OPERATIONAL = tuple(f"deploy.{k}" for k in (
    "port", "env", "tp", "mem_fraction_static", "max_running_requests", "enable_metrics", "startup_timeout_s",
    "preflight"))


STAGE_SPECS: dict[str, StageSpec] = {
    "check_environment": StageSpec(config=("target", "data", "train", "deploy", "hosts", "runs_root"), always_run=True),
    "generate_data": StageSpec(
        config=("target", "data"), operational=_DATA_OPERATIONAL + _CAPTURE_OPERATIONAL + _WHERE,
        # the servers it starts serve deploy.model_path (or the target) with deploy.server and deploy.extra_args
        when=(Reads(_regeneration_servers, config=("deploy.server", "deploy.model_path", "deploy.extra_args"),
                    operational=_SERVER_OPERATIONAL),),
    ),
    "train_draft": StageSpec(
        config=("train", "data.draft_vocab_size", "data.hidden_states", "target.dtype"),
        # data.prompts: the file name in the MLflow dataset input's name (its content is the data stage's digest)
        operational=tuple(f"train.{k}" for k in RESUMABLE_FIELDS) + _WHERE + _FINDS_TARGET + ("data.prompts",),
        needs=("generate_data",),
        # the stream's capture side captures what the data stage's fingerprint (an input, upstream) decides
        when=(Reads(_streamed, operational=_STREAM_CAPTURE),
              Reads(lambda cfg: cfg.data.hidden_states == "online", operational=("target.placement",
                                                                                  "target.trust_remote_code"))),
    ),
    "export_checkpoint": StageSpec(
        config=("export",), operational=_WHERE + ("target.kind", "target.tiny"), needs=("train_draft",),
        # the verifier the speculators config names; the sglang format has none, so then they are only looked at
        when=(Reads(_speculators_verifier_from_paths, config=("deploy.model_path", "target.model_path")),
              Reads(lambda cfg: not _speculators_verifier_from_paths(cfg),
                    operational=("deploy.model_path", "target.model_path"))),
    ),
    "deploy_server": StageSpec(config=("deploy", "hosts", "target", "experiment", "runs_root"),
                               needs=("export_checkpoint",), always_run=True),
    "run_benchmark": StageSpec(config=("bench", "deploy", "hosts", "target", "data.max_length", "experiment",
                                       "runs_root"),
                               needs=("deploy_server",), uses=("generate_data", "train_draft", "export_checkpoint"),
                               always_run=True),
    # opt-in (bench.plan): the flow runs it only then; it serves grid settings on the deploy host to check its picks
    "plan_serving": StageSpec(config=("bench", "deploy", "hosts", "target", "data.max_length", "experiment",
                                      "runs_root"),
                              needs=("deploy_server", "run_benchmark"), always_run=True),
    "report": StageSpec(config=("experiment",), operational=("description",),  # the MLflow run's description
                        uses=("generate_data", "train_draft", "export_checkpoint", "deploy_server", "run_benchmark"),
                        always_run=True),
}


# Set (the test suite does) to fail a stage that read a field its spec does not declare, instead of a warning.
STRICT_READS_ENV = "EAGLEOPS_STRICT_STAGE_READS"


# Stages that run whatever --stages says: the report summarises whatever ran.
ALWAYS_SELECTED = {"report"}


class UndeclaredReads(RuntimeError):
    """A stage read a config field its StageSpec does not declare (see StageAttempt._check_reads)."""


def stage_inputs(cfg: ExperimentConfig, name: str, upstream_digests: dict[str, str | None], version: str) -> dict:
    """The config fields a stage reads (flattened, secrets masked) and its upstream digests."""
    spec = STAGE_SPECS[name]
    flat = flatten(masked_dict(cfg))
    inputs, operational = spec.inputs(cfg), spec.operational_fields(cfg)
    fields = {key: value for key, value in flat.items() if covered(key, inputs) and not covered(key, operational)}
    upstream = {u: upstream_digests.get(u) for u in spec.needs + spec.uses}
    if name == "generate_data" and cfg.data.source == "served":  # new dump files re-run the stage
        upstream["served_dumps"] = served_dumps_digest(cfg)
    if name == "train_draft" and cfg.train.init_checkpoint:  # a file input named by the config: its content counts
        start = Path(cfg.train.init_checkpoint)
        upstream["init_checkpoint"] = digest_paths([start]) if start.exists() else "missing"
    return {"config": fields, "upstream": upstream, "version": version}


def served_dumps_digest(cfg: ExperimentConfig) -> str:
    """Digest of the names and sizes of the dump files in data.served.dumps, listed where the data stage reads
    them: on this machine, or on data.host over its executor (the dumps never come here). It is an input of
    generate_data like an upstream digest: the config alone cannot tell that new traffic arrived.

    Listed here, when the fingerprint is computed, rather than by the stage: the fingerprint decides whether the
    stage runs at all. With data.served.newest_days the window slides with the clock, so today's UTC date is
    part of it: a resume the same day reuses, the next day reads again. A host that cannot be listed gives a
    value no earlier attempt has, so the stage runs (and meets the same error, said by the stage)."""
    folder = cfg.data.served.dumps or ""
    try:
        listing = local_listing(folder) if cfg.data.host == "local" else _host_listing(cfg, folder)
        digest = listing_digest(listing)
    except Exception as err:  # noqa: BLE001 - any failure to list means: do not reuse (the time: never equal)
        digest = f"unlisted ({type(err).__name__}) {datetime.now(timezone.utc).isoformat()}"
    if cfg.data.served.newest_days is not None:
        digest += f" {datetime.now(timezone.utc).date().isoformat()}"
    return digest


def _host_listing(cfg: ExperimentConfig, folder: str) -> list[tuple[str, int]]:
    """(name, size) of the `*.pkl` files of `folder` on data.host (GNU find, as the target card's listing)."""
    executor = connect(cfg.data.host, cfg.hosts)
    try:
        out = executor.run(["find", folder, "-maxdepth", "1", "-type", "f", "-name", "*.pkl", "-printf", "%f\\t%s\\n"],
                           log_output=False, timeout=120).stdout
    finally:
        executor.close()
    return [(name, int(size)) for name, _, size in (line.partition("\t") for line in out.splitlines()) if size]


def undeclared_reads(name: str, cfg: ExperimentConfig, reads: set[str], spec: StageSpec | None = None) -> list[str]:
    """The fields a stage read that its StageSpec (or `spec`) neither takes as inputs nor lists as operational."""
    spec = spec or STAGE_SPECS[name]
    declared = spec.inputs(cfg) + spec.operational_fields(cfg)
    return sorted(field for field in reads if not covered(field, declared))


def describe_changes(before: dict, after: dict) -> str:
    """`train.lr 0.001 -> 0.002, generate_data output changed` for a log line."""
    changes = []
    old_cfg, new_cfg = before.get("config", {}), after.get("config", {})
    for key in sorted(set(old_cfg) | set(new_cfg)):
        if old_cfg.get(key) != new_cfg.get(key):
            changes.append(f"{key} {old_cfg.get(key, '(unset)')} -> {new_cfg.get(key, '(unset)')}")
    for name in sorted(set(before.get("upstream", {})) | set(after.get("upstream", {}))):
        if before.get("upstream", {}).get(name) != after.get("upstream", {}).get(name):
            changes.append(f"{name} output changed")
    if before.get("version") != after.get("version"):
        changes.append(f"eagleops {before.get('version')} -> {after.get('version')}")
    return ", ".join(changes) or "nothing recorded"
