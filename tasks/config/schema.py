"""The experiment schema: the orchestration sections (hosts, deploy, bench, tracking, nightly) composed
with eagle3's ML sections into `ExperimentConfig`, and the cross-field rules a run needs to be placeable.

Secret fields are `SecretStr` and print as `**********` everywhere (dumps, logs, MLflow params).
"""

from __future__ import annotations

import getpass
import re
from typing import Annotated, Literal

from pydantic import ConfigDict, Field, SecretStr, field_validator, model_validator

from eagle3.config import (
    NAME_PATTERN,
    DataConfig,
    ExportConfig,
    StrictModel,
    TargetConfig,
    TrainConfig,
)
from eagle3.data.disk import budget_problem
from tasks.config.ssh_config import SshConfigProblem, fill_from_ssh_config

_NO_CONTROL = r"^[^\x00-\x1f\x7f]*$"  # a newline in a path would end the remote shell command there
# An environment variable's name as a shell and `env NAME=value` take it: `A=B` would set A to "B=value".
EnvName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]*$", max_length=256)]


class HostConfig(StrictModel):
    """One machine of the inventory, reached over SSH."""

    name: str = Field(..., pattern=NAME_PATTERN, description="Inventory name referenced by deploy.host.")
    address: str = Field(..., min_length=1, max_length=253, pattern=r"^[^\s@/]+$",
                         description="Host name or IP address (no spaces, no user@).")
    port: int = Field(22, ge=1, le=65535, description="SSH port.")
    user: str = Field(..., min_length=1, max_length=64, pattern=r"^[^\s:@]+$", description="SSH user.")
    key_file: str | None = Field(None, description="Private key file; None = the SSH agent / default keys.")
    key_passphrase: SecretStr | None = Field(None, description="Passphrase of key_file; use ${ENV_VAR}.")
    known_hosts: str | None = Field(
        None, description="known_hosts file used to verify the host key (unknown hosts are rejected)."
    )
    workdir: str = Field("~/eagleops", min_length=1, pattern=_NO_CONTROL,
                         description="Remote directory for checkpoints and logs.")
    python: str = Field("python3", min_length=1, pattern=_NO_CONTROL, description="Remote Python that has sglang "
                        "installed.")
    connect_timeout_s: float = Field(15.0, gt=0, le=600, description="TCP + SSH handshake timeout.")
    connect_retries: int = Field(
        3, ge=0, le=20, description="Reconnect attempts after a network error (with backoff); never after an "
        "authentication or host-key failure."
    )
    jump_host: str | None = Field(
        None,
        pattern=r"^([a-z0-9][a-z0-9_.-]{0,63}|[^@\s]+@[^@\s:]+(:\d{1,5})?)$",
        description="Reach this host through another: a hosts[].name, or user@host[:port] (same key and "
        "known_hosts as this host).",
    )
    ssh_config: bool | str = Field(
        False, description="Fill the fields left unset from OpenSSH's client config, looking `address` up as `ssh "
        "ADDRESS` does (HostName, User, Port, IdentityFile, UserKnownHostsFile, ProxyJump): true = ~/.ssh/config, or "
        "a path. Fields set here win.",
    )

    @model_validator(mode="before")
    @classmethod
    def _from_ssh_config(cls, data):
        if not isinstance(data, dict) or data.get("ssh_config") in (None, False):
            return data
        try:
            filled = fill_from_ssh_config(data)
        except ValueError as err:  # said by the field's own check below, at ssh_config's line
            return {**data, "ssh_config": SshConfigProblem(str(err).removeprefix("ssh_config: "))}
        if filled.get("user") is None:
            filled["user"] = getpass.getuser()  # ssh's default: the local user
        return filled

    @field_validator("ssh_config", mode="before")
    @classmethod
    def _ssh_config_readable(cls, value):
        if isinstance(value, SshConfigProblem):
            raise ValueError(str(value))
        return value

    @field_validator("jump_host")
    @classmethod
    def _jump_port_in_range(cls, spec: str | None) -> str | None:
        port = re.search(r"@[^@\s:]+:(\d+)$", spec or "")
        if port and not 1 <= int(port.group(1)) <= 65535:
            raise ValueError(f"the port of {spec} must be between 1 and 65535")
        return spec


class SpeculativeConfig(StrictModel):
    """The `--speculative-*` flags handed to SGLang; unset values are left for SGLang to choose."""

    algorithm: Literal["EAGLE3"] = Field("EAGLE3", description="--speculative-algorithm.")
    num_steps: int | None = Field(None, ge=1, le=64, description="--speculative-num-steps (draft depth).")
    eagle_topk: int | None = Field(None, ge=1, le=64, description="--speculative-eagle-topk (branching).")
    num_draft_tokens: int | None = Field(
        None, ge=2, le=1024, description="--speculative-num-draft-tokens (verified tokens incl. the root)."
    )
    allow_adjustments: bool = Field(
        False,
        description="Launch even when SGLang would rewrite the asked values (e.g. topk 1 forces num_draft_tokens = "
        "num_steps + 1); the asked and the effective values are both recorded. Off: the preflight refuses.",
    )


class DumpRequestsConfig(StrictModel):
    """SGLang's own request dumping on the deployed server (its `/configure_logging` API): the finished requests,
    with the target's own output token ids, pickled in batches on the serving host, for a nightly that trains
    on served traffic."""

    enabled: bool = Field(False, description="Turn dumping on once the server is healthy.")
    folder: str = Field(
        "request-dumps", min_length=1, pattern=_NO_CONTROL,
        description="Folder on the serving host for the dump files; relative: under the deploy workdir "
        "(hosts[].workdir, or the deploy stage's folder for a local server)."
    )
    threshold: int = Field(
        1000, ge=1, le=1_000_000, description="Finished requests per dump file (SGLang's dump_requests_threshold; "
        "requests short of it stay in the server's memory until the next file)."
    )


class DeployConfig(StrictModel):
    """Where and how the draft is served."""

    host: str = Field("local", pattern=NAME_PATTERN, description="`local` or a hosts[].name.")
    server: Literal["reference", "sglang"] = Field(
        "reference", description="`reference`: python -m eagle3.serve; `sglang`: python -m sglang.launch_server."
    )
    port: int = Field(30000, ge=1, le=65535, description="Server port (bound to 127.0.0.1 on the host).")
    model_path: str | None = Field(None, description="Target path on the host; None = the pipeline's target.")
    speculative: SpeculativeConfig = Field(default_factory=SpeculativeConfig, description="Speculative flags.")
    max_running_requests: int | None = Field(None, ge=1, le=65536, description="--max-running-requests.")
    tp: int = Field(1, ge=1, le=128, description="--tp (tensor parallel size).")
    mem_fraction_static: float | None = Field(None, gt=0, lt=1, description="--mem-fraction-static.")
    extra_args: list[str] = Field(default_factory=list, description="Further SGLang flags, passed verbatim.")
    enable_metrics: bool = Field(
        True, description="--enable-metrics: /metrics counters let the benchmark cross-check its accept length and "
        "token counts exactly against the server's."
    )
    env: dict[EnvName, SecretStr] = Field(
        default_factory=dict, description="Environment for the server process (e.g. HF_TOKEN: ${HF_TOKEN}). Every "
        "value is a secret: masked in every record (dumps, manifest, MLflow), passed in clear only to the server. "
        "Names are letters, digits and _, not starting with a digit (a `=` would split the name on the host)."
    )
    startup_timeout_s: float = Field(900.0, gt=0, le=7200, description="Seconds to wait for /health.")
    baseline: bool = Field(
        True, description="Also serve without speculation to measure the baseline; false: no baseline server, and "
        "every speedup is reported as unknown."
    )
    preflight: Literal["enforce", "warn"] = Field(
        "enforce", description="`enforce`: a failed preflight check stops the deploy; `warn`: log it and launch "
        "anyway (to reproduce a failure on purpose; the benchmark's diagnosis still names it)."
    )
    dump_requests: DumpRequestsConfig = Field(
        default_factory=DumpRequestsConfig, description="Request dumping on the deployed server (served traffic)."
    )

    def server_env(self) -> dict[str, str]:
        """`env` with its real values: what the server process gets (and nothing else should)."""
        return {k: v.get_secret_value() if isinstance(v, SecretStr) else str(v) for k, v in self.env.items()}


class SlaConfig(StrictModel):
    """Latency limits a serving plan must keep (any subset; an unset one does not limit)."""

    itl_ms_p50: float | None = Field(None, gt=0, le=1e6, description="Median inter-token latency, ms.")
    itl_ms_p99: float | None = Field(None, gt=0, le=1e6, description="99th-percentile inter-token latency, ms.")
    ttft_ms_p99: float | None = Field(None, gt=0, le=1e7, description="99th-percentile time to first token, ms.")


class PlanConfig(StrictModel):
    """The plan_serving stage (opt-in: set this section): which setting to serve at each bench.concurrency."""

    num_steps: list[int] = Field(default_factory=lambda: [1, 2, 3, 4, 5, 6], min_length=1,
                                 description="Draft depths of the grid the plan predicts.")
    eagle_topk: list[int] = Field(default_factory=lambda: [1, 2, 4], min_length=1,
                                  description="Branchings of the grid (1 = chains).")
    num_draft_tokens: list[int] = Field(default_factory=lambda: [4, 8, 16], min_length=1,
                                        description="Draft tokens of the grid's trees (chains verify num_steps + 1).")
    check_top: int = Field(1, ge=0, le=10, description="Predicted best settings measured per concurrency.")
    held_out: int = Field(2, ge=0, le=50, description="Further grid settings measured to check the prediction.")
    load: int | None = Field(None, ge=1, le=4096, description="The concurrency whose pick becomes the static launch "
                             "flags; unset: the highest of bench.concurrency.")
    adaptive_slack: float = Field(0.05, ge=0, lt=1, description="A depth joins a tier's candidate_steps in the "
                                  "adaptive config when within this share of the tier's best tok/s per GPU.")

    @model_validator(mode="after")
    def _grid_bounds(self) -> PlanConfig:
        for name in ("num_steps", "eagle_topk"):
            if any(v < 1 or v > 64 for v in getattr(self, name)):
                raise ValueError(f"bench.plan.{name}: each value must be between 1 and 64")
        if any(v < 2 or v > 1024 for v in self.num_draft_tokens):
            raise ValueError("bench.plan.num_draft_tokens: each value must be between 2 and 1024")
        return self


class BenchConfig(StrictModel):
    """Timed generations against the deployed server."""

    prompts: str = Field("builtin", min_length=1, description="`builtin` or a .jsonl of prompts.")
    num_prompts: int = Field(8, ge=1, le=100_000, description="Prompts per timed run.")
    warmup_runs: int = Field(2, ge=0, le=100, description="Untimed runs first.")
    timed_runs: int = Field(5, ge=1, le=1000, description="Timed runs; the median is reported.")
    max_new_tokens: int = Field(128, ge=1, le=131072, description="Tokens generated per prompt.")
    temperature: float = Field(0.0, ge=0, le=2, description="Sampling temperature.")
    concurrency: list[int] = Field(default_factory=lambda: [1], min_length=1, description="Concurrent requests.")
    min_speedup: float | None = Field(
        None, gt=0, le=100, description="Fail the benchmark stage, once its report is recorded, when the best "
        "setting's speedup over the baseline is below this (needs deploy.baseline)."
    )
    accept_length_tolerance: float = Field(
        0.25, ge=0, le=1, description="Max relative gap between online and offline accept length."
    )
    endpoint: Literal["generate", "chat", "completions"] = Field(
        "generate", description="`generate`: token ids through the target's chat template (needs the tokenizer "
        "here); `chat`/`completions`: the OpenAI endpoints (the server applies its template)."
    )
    sweep: list[SpeculativeConfig] = Field(
        default_factory=list, description="Further (num_steps, eagle_topk, num_draft_tokens) settings, one server "
        "launch each; a setting the server would rewrite runs under its effective values."
    )
    offline_reference: bool = Field(
        True, description="Also run the reference decoder in-process on the same prompts (targets readable here)."
    )
    sla: SlaConfig = Field(default_factory=SlaConfig, description="Latency limits the serving plan keeps.")
    plan_tolerance: float = Field(
        0.10, gt=0, le=10, description="The plan keeps a predicted pick whose measured total tok/s is within this "
        "relative error of the prediction; beyond it, the measured best within bench.sla instead (said so)."
    )
    plan: PlanConfig | None = Field(
        None, description="Opt in to the plan_serving stage after the benchmark: predict a grid of settings at "
        "each bench.concurrency from the measured step costs and acceptance, choose per concurrency within "
        "bench.sla, check the choices by measuring them."
    )

    @model_validator(mode="after")
    def _positive_concurrency(self) -> BenchConfig:
        if any(c < 1 or c > 4096 for c in self.concurrency):
            raise ValueError("bench.concurrency: each value must be between 1 and 4096")
        if self.plan is not None and self.plan.load is not None and self.plan.load not in self.concurrency:
            raise ValueError(f"bench.plan.load: {self.plan.load} is not one of bench.concurrency {self.concurrency}")
        return self


class TrackingConfig(StrictModel):
    """MLflow destination."""

    uri: str | None = Field(
        None, pattern=r"^\S+$", description="MLflow tracking URI; None = sqlite:///<runs_root>/mlflow.db (artifacts beside it). "
        "A relative sqlite:/// path is relative to runs_root, not to the working directory."
    )
    experiment_name: str | None = Field(None, min_length=1, description="MLflow experiment; None = `experiment`.")
    log_system_metrics: bool = Field(
        False, description="Sample this machine's CPU, memory, disk, network (and GPU, with nvidia-ml-py) into each "
        "stage's MLflow run as system/* metrics, every MLFLOW_SYSTEM_METRICS_SAMPLING_INTERVAL s (default 10) and "
        "once when the stage ends; journaled like every MLflow write during an outage."
    )

    @model_validator(mode="after")
    def _known_scheme(self) -> TrackingConfig:
        if self.uri and not re.match(r"^(sqlite:///|https?://|postgresql(\+\w+)?://|databricks)", self.uri):
            raise ValueError("tracking.uri must start with sqlite:///, http://, https:// or postgresql://")
        return self


class NightlyConfig(StrictModel):
    """The nightly retrain (flows/nightly.py): where training starts and the gate a new draft must pass
    against the current champion (same host, prompts and speculative setting) to replace it."""

    start_from: Literal["scratch", "champion"] | None = Field(
        None, description="`scratch`: a fresh init; `champion`: train.init_checkpoint = the downloaded "
        "`@champion` version (scratch while there is none). Training keeps the champion's draft vocabulary (not the night's data's). "
        "Unset: `champion` with data.source: served (a night's new traffic refines the champion), else `scratch`."
    )
    min_tok_s_gain: float = Field(
        0.02, ge=-1, le=10, description="Relative tok/s gain over the champion needed to promote (0.02 = 2% faster), "
        "at every bench.concurrency level, by the gain's lower confidence bound (nightly.confidence), not its "
        "median; a negative value tolerates a slowdown (the challenger must then win on accept length)."
    )
    rounds: int = Field(
        3, ge=2, le=50, description="Champion and challenger are each served anew and benchmarked this many times, "
        "interleaved (champion, challenger, challenger, champion, ...), one server at a time; each round's "
        "median tok/s is one sample of the spread the decision uses."
    )
    confidence: float = Field(
        0.95, gt=0.5, lt=1, description="One-sided confidence of the bounds on the gains (Welch's t over the "
        "rounds): a challenger is promoted only when the lower bound clears the margins."
    )
    accept_length_tolerance: float = Field(
        0.0, ge=0, le=1, description="Relative online accept-length drop vs the champion still accepted "
        "(0 = must not lose), at every bench.concurrency level."
    )
    min_accept_length: float = Field(
        1.1, ge=1, le=64, description="Floor on the new draft's online accept length, champion or not: a first "
        "draft below it does not become champion (1.0 = any draft that serves)."
    )


class WatchBandConfig(StrictModel):
    """How far below the champion's recorded accept length a window may fall before it counts as low."""

    sigmas: float = Field(3.0, ge=0, le=20, description="Standard deviations of the champion's per-round accept "
                          "lengths (its gate evidence) below their mean.")
    tolerance: float = Field(0.15, ge=0, lt=1, description="At least this fraction of the mean below it (production "
                             "prompts differ from the benchmark's): lower = mean - max(sigmas x sd, tolerance x mean).")


class WatchConfig(StrictModel):
    """The production watch (`eagleops watch`, flows/watch.py): what it reads, how often, and when it alarms."""

    model_config = ConfigDict(extra="forbid", validate_default=True, populate_by_name=True, serialize_by_alias=True)

    endpoints: list[str] = Field(
        default_factory=list, description="Production servers (http://host:port); empty: the server a run deploys "
        "(127.0.0.1:deploy.port, deploy.host local only)."
    )
    prometheus: str | None = Field(
        None, pattern=r"^https?://\S+$", description="A Prometheus server that scrapes the endpoints (matched by its "
        "instance label host:port); None: the watch scrapes /metrics itself."
    )
    window_s: float = Field(300.0, ge=1, le=86400, description="Window length in seconds; the schedule's interval.")
    for_windows: int = Field(
        3, alias="for", ge=1, le=1000, description="Consecutive low windows before drift fires (Prometheus `for:`)."
    )
    min_requests: int = Field(
        20, ge=1, le=10_000_000, description="Requests a window needs to be judged; fewer: no verdict, the `for` "
        "count starts over (low traffic never alarms)."
    )
    band: WatchBandConfig = Field(default_factory=WatchBandConfig, description="The accept-length band.")
    cooldown_s: float = Field(
        21600.0, ge=0, le=30 * 86400, description="An alert that lasts is sent again (and the nightly started again) "
        "at most once per this many seconds; a new change or a new episode is sent at once."
    )
    digests: bool = Field(True, description="Hash the served draft (and the target's config and weight index) on "
                          "the serving host each window.")
    host: str | None = Field(None, pattern=NAME_PATTERN, description="The serving host the digests are read on (a "
                             "hosts[].name or local); None: deploy.host.")
    timeout_s: float = Field(10.0, gt=0, le=300, description="Seconds per HTTP request to a server or Prometheus.")

    @field_validator("endpoints")
    @classmethod
    def _http_urls(cls, endpoints: list[str]) -> list[str]:
        bad = [e for e in endpoints if not re.match(r"^https?://[^\s/]+/?$", e)]
        if bad:
            raise ValueError(f"each endpoint must be http(s)://host:port, found {bad}")
        return [e.rstrip("/") for e in endpoints]


class ExperimentConfig(StrictModel):
    """One experiment: every section of a `configs/*.yaml` file."""

    experiment: str = Field(..., pattern=NAME_PATTERN, description="Name used for runs/<experiment>/ and MLflow.")
    description: str = Field("", max_length=2000, description="Free text, shown in MLflow.")
    runs_root: str = Field("runs", min_length=1, description="Where run directories and the local MLflow store go.")
    target: TargetConfig = Field(default_factory=TargetConfig, description="The model being accelerated.")
    data: DataConfig = Field(default_factory=DataConfig, description="Data generation.")
    train: TrainConfig = Field(default_factory=TrainConfig, description="Draft training.")
    export: ExportConfig = Field(default_factory=ExportConfig, description="Checkpoint export.")
    deploy: DeployConfig = Field(default_factory=DeployConfig, description="Serving.")
    bench: BenchConfig = Field(default_factory=BenchConfig, description="Benchmark.")
    tracking: TrackingConfig = Field(default_factory=TrackingConfig, description="MLflow.")
    hosts: list[HostConfig] = Field(default_factory=list, description="SSH inventory.")
    nightly: NightlyConfig = Field(default_factory=NightlyConfig, description="Nightly retrain and champion gate.")
    watch: WatchConfig = Field(default_factory=WatchConfig, description="The production watch.")

    @model_validator(mode="after")
    def _cross_section_rules(self) -> ExperimentConfig:
        names = [h.name for h in self.hosts]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"hosts: duplicate host names {duplicates}")
        if self.deploy.host != "local" and self.deploy.host not in names:
            raise ValueError(f"deploy.host '{self.deploy.host}' is neither 'local' nor one of hosts[].name {names}")
        for problem in jump_host_problems(self.hosts):
            raise ValueError(problem)
        unknown_nodes = [n for n in self.train.nodes if n != "local" and n not in names]
        if unknown_nodes:
            raise ValueError(f"train.nodes {unknown_nodes} are neither 'local' nor hosts[].name {names}")
        if self.train.nodes and self.data.hidden_states == "online":
            raise ValueError("train.nodes needs data.hidden_states: offline or stream (online features load the "
                             "target in the orchestrating process)")
        if self.target.kind == "tiny" and self.data.draft_vocab_size > self.target.tiny.vocab_size:
            raise ValueError(
                f"data.draft_vocab_size ({self.data.draft_vocab_size}) exceeds the target vocabulary "
                f"target.tiny.vocab_size ({self.target.tiny.vocab_size})"
            )
        watched = self.watch.host or self.deploy.host
        if watched != "local" and watched not in names:
            raise ValueError(f"watch.host '{watched}' is neither 'local' nor one of hosts[].name {names}")
        if self.bench.min_speedup is not None and not self.deploy.baseline:
            raise ValueError("bench.min_speedup needs a baseline to compare with, and deploy.baseline is false; set "
                             "deploy.baseline: true or drop bench.min_speedup")
        if self.bench.plan is not None and not self.deploy.baseline:
            raise ValueError("bench.plan predicts each setting against the baseline (speculation off is one of its "
                             "picks), and deploy.baseline is false; set deploy.baseline: true or drop bench.plan")
        if self.target.shape and self.data.max_length > self.target.shape.max_position_embeddings:
            raise ValueError(f"data.max_length ({self.data.max_length}) exceeds the target's context "
                             f"target.shape.max_position_embeddings ({self.target.shape.max_position_embeddings})")
        if self.target.shape and self.data.draft_vocab_size > self.target.shape.vocab_size:
            raise ValueError(
                f"data.draft_vocab_size ({self.data.draft_vocab_size}) exceeds target.shape.vocab_size "
                f"({self.target.shape.vocab_size})"
            )
        return self

    @model_validator(mode="after")
    def _nightly_start(self) -> ExperimentConfig:
        """nightly.start_from unset: from the champion on served traffic (a night trains on its new samples and a
        replay, not on everything), from scratch on a prompts file."""
        if self.nightly.start_from is None:
            self.nightly.start_from = "champion" if self.data.source == "served" else "scratch"
        return self

    @model_validator(mode="after")
    def _where_data_and_training_run(self) -> ExperimentConfig:
        """Refuse every data/capture/training placement the stages cannot run (each message names its field)."""
        for problem in runnable_placement_problems(self):
            raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _export_holds_the_draft(self) -> ExperimentConfig:
        """The speculators format (vLLM's Eagle3Speculator) describes its layer as a Llama `transformer_layer_config`
        (GQA q/k/v projections): it has no field for multi-latent attention."""
        if self.train.draft.architecture == "deepseek_mla" and "speculators" in self.export.formats:
            raise ValueError("export.formats: speculators cannot hold the deepseek_mla draft (train.draft.architecture): "
                             "its transformer_layer_config is a Llama layer with GQA q/k/v projections, and vLLM's "
                             "speculators loader has no multi-latent attention; export sglang only "
                             "(Eagle3DeepseekV2ForCausalLM)")
        return self

    @property
    def mlflow_experiment(self) -> str:
        return self.tracking.experiment_name or self.experiment

    def host(self, name: str) -> HostConfig:
        return next(h for h in self.hosts if h.name == name)


def jump_host_problems(hosts: list[HostConfig]) -> list[str]:
    """Jump hosts that name no inventory host, or whose chain comes back to a host already on it."""
    by_name = {h.name: h for h in hosts}
    index = {h.name: i for i, h in enumerate(hosts)}
    problems = []
    for i, host in enumerate(hosts):
        chain, hop = [host.name], host
        while hop.jump_host and "@" not in hop.jump_host:
            if hop.jump_host not in by_name:
                problems.append(f"hosts.{index[hop.name]}.jump_host '{hop.jump_host}' is neither user@host[:port] nor "
                                f"one of hosts[].name {list(by_name)}")
                break
            hop = by_name[hop.jump_host]
            if hop.name in chain:
                problems.append(f"hosts.{i}.jump_host: {' -> '.join(chain + [hop.name])} is a loop; the last hop must "
                                "be reachable directly")
                break
            chain.append(hop.name)
    return list(dict.fromkeys(problems))


def runnable_placement_problems(cfg: ExperimentConfig) -> list[str]:
    """Why the data stage, its capture engine and training cannot run where the config puts them."""
    data, target, train = cfg.data, cfg.target, cfg.train
    names = [h.name for h in cfg.hosts]
    problems = []
    if data.host != "local" and data.host not in names:
        problems.append(f"data.host '{data.host}' is neither 'local' nor one of hosts[].name {names}")
    if data.hidden_states == "online":
        if train.devices > 1:
            problems.append("data.hidden_states: online computes the target's features inside one training process; "
                            f"with train.devices {train.devices} (torchrun ranks) use data.hidden_states: offline")
        if target.engine == "sglang":
            problems.append("data.hidden_states: online loads the target in transformers, which target.engine "
                            "sglang never does: use data.hidden_states: offline")
        if data.host != "local":
            problems.append(f"data.hidden_states: online needs the target where training runs; with data.host "
                            f"'{data.host}' use data.hidden_states: offline")
    rcfg = data.regenerate
    if target.engine == "sglang" and rcfg.enabled and rcfg.backend == "local":
        problems.append("data.regenerate.backend: local generates with transformers in-process, which target.engine "
                        "sglang never does: use backend sglang with data.regenerate.deploy (or endpoints)")
    if target.engine == "sglang" and target.aux_layer_ids and min(target.aux_layer_ids) < 0:
        problems.append(f"target.aux_layer_ids {target.aux_layer_ids}: SGLang's capture takes ids >= 0, so -1 (the "
                        "embeddings) cannot be captured with target.engine sglang")
    if target.engine == "sglang" and target.placement.devices is not None:
        problems.append(f"target.placement.devices {target.placement.devices}: the placement is the HF engine's "
                        "(target.engine hf); SGLang's runner places the target over data.capture.tp GPUs")
    tokens = data.capture_batch_size * data.max_length
    if target.engine == "sglang" and data.hidden_states != "online" and tokens > data.capture.max_batch_tokens:
        problems.append(f"data.capture.max_batch_tokens {data.capture.max_batch_tokens} is below data.capture_batch_size "
                        f"x data.max_length = {tokens}: a capture forward is never chunked, so raise it or lower those")
    if data.host != "local":
        problems += _remote_data_problems(cfg)
    if data.hidden_states == "stream":
        problems += _stream_problems(cfg)
    return problems


def _stream_problems(cfg: ExperimentConfig) -> list[str]:
    """data.hidden_states: stream -- every rank reads the shards on the data host's disk, within the budget."""
    data, train = cfg.data, cfg.train
    problems = []
    if data.host == "local" and any(node != "local" for node in train.nodes):
        problems.append(f"train.nodes {train.nodes}: streamed shards stay on the data host's disk (data.host local), "
                        "so every rank trains on this machine: train.nodes [] or [local]")
    if len(train.nodes) > 1:
        problems.append(f"train.nodes {train.nodes}: with data.hidden_states stream every rank reads the data host's "
                        "disk, so training runs on one node (the data host) with train.devices ranks")
    hidden = cfg.target.tiny.hidden_size if cfg.target.kind == "tiny" else getattr(cfg.target.shape, "hidden_size", None)
    if hidden is not None:  # a target read only on the GPU host is checked there, before any capture
        per_step = train.batch_size * train.devices * max(1, len(train.nodes)) * train.grad_accum
        problem = budget_problem(int(data.stream.disk_budget_gb * 1e9), per_step, data, hidden,
                                 len(cfg.target.aux_layer_ids or [0, 0, 0]))
        problems += [problem] if problem else []
    return problems


def _remote_data_problems(cfg: ExperimentConfig) -> list[str]:
    """data.host is a host: the dataset stays there, so training, regeneration and export must fit that."""
    data, host = cfg.data, cfg.data.host
    problems = []
    if cfg.train.nodes != [host]:
        problems.append(f"train.nodes {cfg.train.nodes}: the shards stay on data.host '{host}' (they never cross this "
                        f"machine), so training reads them there: set train.nodes: [{host}]")
    deploy = data.regenerate.deploy
    if data.regenerate.enabled and deploy is not None and deploy.host != host:
        problems.append(f"data.regenerate.deploy.host '{deploy.host}': the data stage on data.host '{host}' asks its "
                        f"regeneration servers at 127.0.0.1 there, so start them on '{host}'")
    if "speculators" in cfg.export.formats:
        problems.append(f"export.formats: speculators embeds the target's embedding read from its weights, which stay "
                        f"on data.host '{host}'; export sglang only")
    return problems
