"""generate_data on the data host (`data.host`): the data stage runs where the target is, and its
outputs stay there.

In order:
1. the host's Python imports eagle3 (and sglang for `target.engine: sglang`);
2. the target is read on the host at `target.model_path` (a tiny target is built here and uploaded,
   verified, to `<workdir>/targets/`); its small files -- config, tokenizer, chat template,
   generation config, remote code -- come back as the run's *target card*, which export, deploy
   and benchmark read: the weights never cross;
3. samples: with `data.regenerate.deploy` and prompts left to answer (`--plan` asks the host), the
   regeneration servers start on the host and `python -m eagle3.data.generate --samples-only`
   runs there against them at 127.0.0.1; the servers stop before the capture (they hold its GPUs);
   with `data.source: served` the dumps are read there, in `data.served.dumps` on the host (never copied);
4. hidden states: `python -m eagle3.data.generate` again (the samples are reused by fingerprint),
   its capture engine on the host's GPUs, the shards written into the host's dataset folder;
5. `summary.json`, `samples.meta.json`, `vocab/` and the shards' `manifest.json` come back;
   `samples.jsonl` and the shards stay on the host, where `train_draft` reads them
   (`train.nodes: [data.host]`).

Each job runs detached in its own process group (`tasks.hosts.jobs`); its progress and log lines
are relayed into the run log, and Ctrl-C or a failure stops it. A rerun resumes in the same host
folder (`<workdir>/data/<runs>/<run>/generate_data/attempt-N/dataset`), as the local stage does.
"""

from __future__ import annotations

import json
import posixpath
from pathlib import Path

from eagle3.data.generate import API_KEY_ENV, SUMMARY_FILE
from eagle3.data.samples import FAILED_FILE, SAMPLES_META
from eagle3.data.served_source import served_metrics
from eagle3.data.shards import MANIFEST
from tasks.config.schema import ExperimentConfig
from tasks.hosts.jobs import HostJob
from tasks.hosts.remote import CommandFailed, Executor, connect
from tasks.log import logger
from tasks.rundir import digest_json, digest_paths
from tasks.runner.context import StageContext
from tasks.stages.data.regeneration import regeneration_servers
from tasks.stages.data.served import with_cache_folder
from tasks.stages.target import resolve_target_dir

# The target's files a card carries: everything but the weights (a remote-code tokenizer needs its .py).
CARD_SUFFIXES = (".json", ".jinja", ".py", ".model", ".tiktoken", ".txt")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".index.json")
CARD_MAX_BYTES = 64 << 20


def generate_on_host(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    """The data stage on cfg.data.host; returns generate_data's result with this machine's copies."""
    host = cfg.host(cfg.data.host)
    executor = connect(host, cfg.hosts)
    try:
        _check_python(cfg, executor, host.python)
        workdir = executor.expand_path(host.workdir)
        root = _job_root(ctx, workdir)
        target = _host_target(cfg, ctx, executor, workdir)
        dataset = posixpath.join(root, "dataset")
        config = _upload_config(cfg, ctx, executor, root, target, workdir)
        command = [host.python, "-m", "eagle3.data.generate", "--target-dir", target, "--out-dir", dataset,
                   "--config", config]
        env = _job_env(cfg)
        _run_samples(cfg, ctx, executor, root, command, env)
        _run(ctx, executor, root, "capture", command, env)
        return _bring_back(cfg, ctx, executor, target, dataset)
    finally:
        executor.close()


def _check_python(cfg: ExperimentConfig, executor: Executor, python: str) -> None:
    """The host's Python has eagleops (and sglang for the SGLang engine): found, not imported (that takes
    seconds; the jobs import them anyway and fail with their own message)."""
    modules = ["eagle3.data.generate"] + (["sglang"] if cfg.target.engine == "sglang" else [])
    probe = f"import importlib.util, sys; sys.exit(0 if all(map(importlib.util.find_spec, {modules!r})) else 3)"
    try:
        executor.run([python, "-c", probe], log_output=False, timeout=120)
    except CommandFailed as err:
        raise RuntimeError(f"data.host {cfg.data.host}: {python} lacks {' or '.join(modules)} (install eagleops"
                           f"{'[serve]' if cfg.target.engine == 'sglang' else ''} there): {err}") from err


def _job_root(ctx: StageContext, workdir: str) -> str:
    """This attempt's folder on the host, named like the run folder here, so a rerun resumes in it."""
    run = ctx.run_dir
    return posixpath.join(workdir, "data", run.parent.name, run.name, ctx.stage_dir.relative_to(run).as_posix())


def _host_target(cfg: ExperimentConfig, ctx: StageContext, executor: Executor, workdir: str) -> str:
    """The target's folder on the host: target.model_path, or the tiny target built here and uploaded."""
    if cfg.target.kind != "tiny":
        path = cfg.target.model_path or ""
        if not executor.path_exists(posixpath.join(path, "config.json")):
            raise FileNotFoundError(f"target.model_path: {path}/config.json not found on {executor.name} "
                                    f"(data.host {cfg.data.host})")
        return path
    local = resolve_target_dir(cfg, ctx)
    remote = posixpath.join(workdir, "targets", local.name)
    results = executor.upload_dir(local, remote)
    logger().info(f"[{executor.name}] tiny target {local.name} -> {remote}: {len(results)} files, "
                  f"{sum(r.bytes_sent for r in results) / 1e6:.1f} MB sent")
    return remote


def _upload_config(cfg: ExperimentConfig, ctx: StageContext, executor: Executor, root: str, target: str,
                   workdir: str) -> str:
    """The target and data sections as the host's command reads them (the API key travels in its env; a served
    source's capture cache defaults to the host's workdir)."""
    target_cfg = cfg.target.model_copy(update={"kind": "hf", "model_path": target})
    data = json.loads(with_cache_folder(cfg.data, workdir).model_dump_json(exclude={"regenerate": {"api_key"}}))
    local = ctx.stage_dir / "host_data_config.json"
    local.write_text(json.dumps({"target": json.loads(target_cfg.model_dump_json()), "data": data}, indent=2))
    remote = posixpath.join(root, local.name)
    executor.makedirs(root)
    executor.upload_file(local, remote)
    return remote


def _job_env(cfg: ExperimentConfig) -> dict[str, str]:
    key = cfg.data.regenerate.api_key
    return {API_KEY_ENV: key.get_secret_value()} if key else {}


def _run_samples(cfg: ExperimentConfig, ctx: StageContext, executor: Executor, root: str, command: list[str],
                 env: dict[str, str]) -> None:
    """Samples and vocab, with the regeneration servers up only while prompts are left to answer."""
    if cfg.data.source == "served":
        return  # served dumps: read on the host by the capture job, nothing regenerated
    rcfg = cfg.data.regenerate
    if not (rcfg.enabled and rcfg.deploy is not None):
        return  # regeneration (if any) needs no servers of ours: the capture job makes the samples too
    if _run(ctx, executor, root, "plan", [*command, "--plan"], env).get("samples_ready"):
        logger().info(f"[{executor.name}] samples are done already: no regeneration servers needed")
        return
    if rcfg.deploy.host != cfg.data.host:
        raise ValueError(f"data.regenerate.deploy.host '{rcfg.deploy.host}' must be data.host '{cfg.data.host}': "
                         "the data stage there asks them at 127.0.0.1")
    local_tiny = resolve_target_dir(cfg, ctx) if cfg.target.kind == "tiny" else None  # uploaded for the servers
    with regeneration_servers(cfg, ctx, local_tiny, reach_from_host=True) as urls:
        endpoints = [word for url in urls for word in ("--endpoint", url)]
        _run(ctx, executor, root, "samples", [*command, "--samples-only", *endpoints], env)


def _run(ctx: StageContext, executor: Executor, root: str, label: str, argv: list[str],
         env: dict[str, str]) -> dict:
    """One job of the data stage on the host, its progress and log relayed here; its `done` event."""
    progress, log = ctx.progress(), logger()

    def on_event(event: dict) -> None:
        if event["event"] == "progress":
            progress(event["stage"], event["done"], event["total"])
        elif event["event"] in ("log", "error"):
            log.info(f"[{executor.name}] {event['message']}")

    return HostJob(executor, f"data-{label}", root).run(argv, env=env, on_event=on_event,
                                                       on_line=lambda line: log.info(f"[{executor.name}] {line}"))


def _bring_back(cfg: ExperimentConfig, ctx: StageContext, executor: Executor, target: str, dataset: str) -> dict:
    """The small outputs and the target card here; the result generate_data returns."""
    local = ctx.stage_dir / "dataset"
    local.mkdir(parents=True, exist_ok=True)
    executor.download_file(posixpath.join(dataset, SUMMARY_FILE), local / SUMMARY_FILE)
    executor.download_file(posixpath.join(dataset, SAMPLES_META), local / SAMPLES_META)
    summary = json.loads((local / SUMMARY_FILE).read_text())
    hashed = [local / SAMPLES_META]
    if summary["paths"].get("vocab"):  # none on a served night with no new traffic
        executor.download_dir(posixpath.join(dataset, "vocab"), local / "vocab")
        hashed.append(local / "vocab")
    if summary["paths"].get("hidden_states"):
        (local / "hidden_states").mkdir(exist_ok=True)
        executor.download_file(posixpath.join(dataset, "hidden_states", MANIFEST), local / "hidden_states" / MANIFEST)
        hashed.append(local / "hidden_states" / MANIFEST)
    if summary["paths"].get("failed"):
        executor.download_file(posixpath.join(dataset, FAILED_FILE), local / FAILED_FILE)
    card = download_target_card(executor, target, ctx.stage_dir / "target")
    hashed.append(card / "config.json")
    return _result(cfg, summary, local, card, target, dataset, digest_json([digest_paths(hashed)]))


def download_target_card(executor: Executor, target: str, local: Path) -> Path:
    """The target's files but its weights, from the host into `local` (verified, skipped when equal)."""
    listing = executor.run(["find", target, "-maxdepth", "1", "-type", "f", "-printf", "%f\\t%s\\n"],
                           log_output=False, timeout=120).stdout
    local.mkdir(parents=True, exist_ok=True)
    for line in listing.splitlines():
        name, _, size = line.partition("\t")
        if _card_file(name, int(size or 0)):
            executor.download_file(posixpath.join(target, name), local / name)
    if not (local / "config.json").is_file():
        raise FileNotFoundError(f"{executor.name}:{target} has no config.json")
    return local


def _card_file(name: str, size: int) -> bool:
    return name.endswith(CARD_SUFFIXES) and not name.endswith(WEIGHT_SUFFIXES) and size <= CARD_MAX_BYTES


def _result(cfg: ExperimentConfig, summary: dict, local: Path, card: Path, target: str, dataset: str,
            digest: str) -> dict:
    keys = ("loss_mask_fraction", "hidden_states_bytes", "bytes_written", "num_dropped", "num_failed")
    metrics = {k: summary[k] for k in keys if isinstance(summary.get(k), (int, float))} | split_counts(summary)
    coverage = summary.get("vocab", {}).get("coverage")
    if isinstance(coverage, (int, float)):
        metrics["draft_vocab_coverage"] = coverage
    metrics |= served_metrics(summary)
    host_paths = {k: v for k, v in summary["paths"].items() if v}
    return {
        **summary,
        "metrics": metrics,
        "outputs": {"target_dir": str(card), "dataset_dir": str(local), "vocab": str(local / "vocab"),
                    "host": cfg.data.host, "host_target_dir": target, "host_dataset_dir": dataset,
                    **{f"host_{k}": v for k, v in host_paths.items()}},
        "output_digest": digest,
    }


def split_counts(summary: dict) -> dict[str, float]:
    """Samples and tokens per split and in all (`num_samples`: what `eagleops compare` shows), from the summary's
    `{"train": N, "validation": M}` counts; a count the summary does not hold is left out."""
    samples, tokens = summary.get("num_samples"), summary.get("num_tokens")
    counts: dict[str, float] = {}
    if isinstance(samples, dict) and all(isinstance(v, int) for v in samples.values()):
        counts |= {"num_train": samples.get("train", 0), "num_val": samples.get("validation", 0),
                   "num_samples": sum(samples.values())}
    if isinstance(tokens, dict) and all(isinstance(v, int) for v in tokens.values()):
        counts["tokens"] = sum(tokens.values())
    if isinstance(summary.get("num_assistant_tokens"), int):
        counts["assistant_tokens"] = summary["num_assistant_tokens"]
    return counts
