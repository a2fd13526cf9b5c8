"""The target a stage reads: the tiny target built (or reused from the content-addressed cache under
`<runs_root>/cache/targets`, the runs root the run folder lives in) or `target.model_path`; and, for the
stages after the data stage, the target it recorded, found again when the run folder moved."""

from __future__ import annotations

from pathlib import Path

from eagle3.data.tiny_target import build_tiny_target
from tasks.config.schema import ExperimentConfig
from tasks.log import logger
from tasks.runner.context import StageContext


def resolve_target_dir(cfg: ExperimentConfig, ctx: StageContext) -> Path:
    """The target's HF directory on this machine: the built tiny target or target.model_path."""
    if cfg.target.kind == "tiny":
        cache = Path(cfg.runs_root).resolve() / "cache" / "targets"
        target_dir = build_tiny_target(cfg.target.tiny, cache, on_progress=ctx.progress("tiny target"),
                                       log=logger().info)
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
