"""generate_data: target -> regenerated answers -> loss-masked samples -> draft vocab -> hidden states.

A thin wrapper over `eagle3.data.generate.generate_dataset`. The tiny target is built (or reused from
the content-addressed cache under `<runs_root>/cache/targets`, the runs root the run folder lives in) here,
so the whole CPU default needs nothing from a hub; `recorded_target_dir` finds it again for the later
stages of a run folder that moved. Everything the data depends on is logged to the stage's MLflow
run: the aux layer ids in SGLang's convention *and* as HF indices, the chat-template hash,
regeneration settings (no secrets) and the draft vocab map.

With `data.regenerate.deploy`, the stage starts N baseline servers of the target (`deploy.server`:
SGLang or the reference server; no draft) on `data.regenerate.deploy.host` through the deploy
stage's `launch`, regenerates through them, and stops them in a `finally`; they are started only
when prompts are left to answer, and are recorded in the run's servers.json like every server, so
the flow's teardown also stops those of a killed run.
Risk: GPUs held by servers left running; hence the finally, the registry and one GPU set per server.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE
from pydantic import SecretStr

from eagle3.data.generate import generate_dataset
from eagle3.data.samples import SAMPLES_META
from eagle3.data.tiny_target import build_tiny_target
from tasks.config import ExperimentConfig, HostConfig
from tasks.deploy import Placement, ServerHandle, launch, stop
from tasks.pipeline import StageContext, logger
from tasks.remote import Executor, connect
from tasks.rundir import digest_paths


def resolve_target_dir(cfg: ExperimentConfig, ctx: StageContext) -> Path:
    """The target's HF directory on this machine: the built tiny target or target.model_path."""
    if cfg.target.kind == "tiny":
        cache = Path(cfg.runs_root).resolve() / "cache" / "targets"
        target_dir = build_tiny_target(cfg.target.tiny, cache, on_progress=ctx.progress("tiny target"))
        logger().info(f"tiny target: {target_dir}")
        return target_dir
    target_dir = Path(cfg.target.model_path or "").expanduser()
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(
            f"target.model_path: {target_dir}/config.json not found on this machine; "
            "run the data stage where the target weights are"
        )
    return target_dir.resolve()  # recorded absolute: a resume from another working directory finds it


def recorded_target_dir(cfg: ExperimentConfig, ctx: StageContext, recorded: str) -> Path:
    """The target an upstream stage recorded; for a run folder copied without its runs root's tiny-target
    cache, the same tiny target (same content key, so the same name) resolved in the runs root it lives in now."""
    target_dir = Path(recorded)
    if (target_dir / "config.json").is_file() or cfg.target.kind != "tiny":
        return target_dir
    logger().info(f"tiny target: {target_dir.name} is not at {target_dir.parent} (the run folder was moved "
                  f"without it); resolving it under {cfg.runs_root}")
    found = resolve_target_dir(cfg, ctx)
    if found.name != target_dir.name:
        raise FileNotFoundError(f"tiny target {target_dir.name}, which this run was trained on, is not in "
                                f"{found.parent} and this eagleops builds {found.name} from target.tiny: copy "
                                f"{target_dir.name} from the original runs root's cache/targets")
    return found


@task(name="generate_data", cache_policy=NO_CACHE)
def generate_data(cfg: ExperimentConfig, ctx: StageContext) -> dict:
    if cfg.data.host != "local":  # where the target is: the hidden states are written and stay there
        from tasks.data_host import generate_on_host

        return generate_on_host(cfg, ctx)
    target_dir = resolve_target_dir(cfg, ctx)
    dataset_dir = ctx.stage_dir / "dataset"
    summary = generate_dataset(target_dir, cfg.target, cfg.data, dataset_dir, on_progress=ctx.progress(),
                               log=logger().info, open_endpoints=lambda: regeneration_servers(cfg, ctx, target_dir))
    _log_to_mlflow(ctx, target_dir, summary)
    metrics = {
        key: summary[key]
        for key in ("num_train", "num_val", "num_samples", "tokens", "assistant_tokens", "loss_mask_fraction",
                    "hidden_states_bytes", "bytes_written", "num_dropped", "num_failed")
        if isinstance(summary.get(key), (int, float))
    }
    vocab = summary.get("vocab", {})
    if isinstance(vocab.get("coverage"), (int, float)):
        metrics["draft_vocab_coverage"] = vocab["coverage"]
    return {
        **summary,
        "metrics": metrics,
        "outputs": {"target_dir": str(target_dir), "dataset_dir": str(dataset_dir), **{k: v for k, v in summary["paths"].items() if v}},
        "output_digest": dataset_digest(target_dir, summary),
    }


# ------------------------------------------------------------------ regeneration servers


@contextlib.contextmanager
def regeneration_servers(cfg: ExperimentConfig, ctx: StageContext, target_dir: Path | None, *,
                         reach_from_host: bool = False) -> Iterator[list[str]]:
    """data.regenerate.deploy: start N baseline servers of the target, yield the URLs this process
    reaches them at (SSH tunnels for remote hosts) -- or, with `reach_from_host`, the URLs a process
    on their host reaches them at (the data stage on data.host) -- and stop every one of them on exit."""
    wanted = cfg.data.regenerate.deploy
    if wanted is None:
        raise ValueError("data.regenerate.deploy is not set: no servers to start")
    host = regeneration_host(cfg, wanted.host)
    executor = connect(host, cfg.hosts)
    handles: list[ServerHandle] = []
    try:
        placement = target_placement(cfg, executor, host, ctx, target_dir)
        port = cfg.deploy.port
        for k in range(wanted.servers):
            port = next_free_port(executor, port)
            handles.append(launch(server_config(cfg, port, k), placement, ctx.run_dir, label=f"regenerate {k}",
                                  spec=None, predicted=None))
            port += 1
        yield [f"http://127.0.0.1:{h.port}" if reach_from_host else h.local_url for h in handles]
    finally:
        for handle in handles:
            stop(ctx.run_dir, handle, executor)
        executor.close()


def regeneration_host(cfg: ExperimentConfig, name: str) -> HostConfig | None:
    if name == "local":
        return None
    names = [h.name for h in cfg.hosts]
    if name not in names:
        raise ValueError(f"data.regenerate.deploy.host '{name}' is neither 'local' nor one of hosts[].name {names}")
    return cfg.host(name)


def target_placement(cfg: ExperimentConfig, executor: Executor, host: HostConfig | None, ctx: StageContext,
                     target_dir: Path) -> Placement:
    """Where the host finds the target: in place locally; a tiny target is uploaded (verified, resumable)
    to <workdir>/targets/ on a remote host, any other is read at deploy.model_path or target.model_path."""
    if host is None:
        return Placement(executor, None, str(ctx.stage_dir / "servers"), cfg.deploy.model_path or str(target_dir), "")
    workdir = executor.expand_path(host.workdir)
    model = cfg.deploy.model_path or cfg.target.model_path or ""
    if cfg.target.kind == "tiny" and cfg.deploy.model_path is None:  # our own target travels
        model = f"{workdir}/targets/{target_dir.name}"
        results = executor.upload_dir(target_dir, model)
        logger().info(f"[{executor.name}] {target_dir.name} -> {model}: {len(results)} files, "
                      f"{sum(r.bytes_sent for r in results) / 1e6:.1f} MB sent")
    return Placement(executor, host, workdir, model, "")


def next_free_port(executor: Executor, port: int, tries: int = 200) -> int:
    """The first port from `port` on that nothing listens on at the host (a killed run's servers may)."""
    for candidate in range(port, min(port + tries, 65536)):
        if not executor.port_in_use(candidate):
            return candidate
    raise RuntimeError(f"no free port in {port}..{port + tries - 1} on {executor.name} for a regeneration server")


def server_config(cfg: ExperimentConfig, port: int, k: int) -> ExperimentConfig:
    """The config `launch` reads for server k: its port and, for SGLang, its own GPUs (k*tp .. k*tp+tp-1)
    unless deploy.env pins CUDA_VISIBLE_DEVICES."""
    env = dict(cfg.deploy.env)
    if cfg.deploy.server == "sglang" and "CUDA_VISIBLE_DEVICES" not in env:
        env["CUDA_VISIBLE_DEVICES"] = SecretStr(",".join(str(k * cfg.deploy.tp + j) for j in range(cfg.deploy.tp)))
    return cfg.model_copy(update={"deploy": cfg.deploy.model_copy(update={"port": port, "env": env})})


def dataset_digest(target_dir: Path, summary: dict) -> str:
    """Content digest of what training consumes: samples, vocab map, the hidden-state shards'
    manifest (it holds each shard's sha256, so terabytes are not re-read) and the target's identity:
    its config.json and the samples' meta, whose fingerprint names the target by its config, weight
    and tokenizer files -- never by where it lies, so a moved run folder or runs root keeps the digest."""
    paths = summary["paths"]
    hashed = [paths["samples"], Path(paths["samples"]).with_name(SAMPLES_META), paths["vocab"], target_dir / "config.json"]
    if paths.get("hidden_states"):
        hashed.append(Path(paths["hidden_states"]) / "manifest.json")
    return digest_paths(hashed)


def _log_to_mlflow(ctx: StageContext, target_dir: Path, summary: dict) -> None:
    run = ctx.mlflow
    run.log_params({
        "aux_layer_ids": json.dumps(summary["aux_layer_ids"]),
        "hf_hidden_state_indices": json.dumps(summary["hf_indices"]),
        "architecture": summary["architecture"],
        "chat_template_sha256": summary["chat_template_sha256"],
        "hidden_states": summary["hidden_states"],
        "target_dir": str(target_dir),
        **{f"regenerate.{k}": v for k, v in summary["regeneration"].items()},
    })
    run.log_dict(summary, "data/summary.json")
    vocab_dir = Path(summary["paths"]["vocab"])
    if vocab_dir.is_dir():
        run.log_artifact(vocab_dir, "vocab")
    eval_file = target_dir / "eval.json"
    if eval_file.is_file():
        run.log_artifact(eval_file, "target")
