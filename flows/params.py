"""The experiment flow's parameters as the Prefect UI shows them, and how overrides reach the config.

Owns the types of `eagle3_experiment`'s parameters: which config (one of the shipped
`configs/**/*.yaml`, listed at import, or any other path on the worker), which stages (an enum
of `tasks.pipeline.STAGES`), which sweep grid point, and `ConfigOverrides` (deploy host and the
speculative flags). Prefect turns these types into the deployment's parameter schema, so the
UI's Custom run renders a form and the server refuses a bad value (`enforce_parameter_schema`)
before any run starts; the same types validate a direct Python call of the flow.
`apply_overrides` puts the overrides into the loaded `ExperimentConfig` and validates the result
again, so an override is held to the same rules as the YAML (bounds, deploy.host in hosts[]).

Risk: the shipped-config list is read from the source tree at import; a wheel without the
configs folder lists none, and the field then takes any path.
"""

from pathlib import Path
from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tasks.config import NAME_PATTERN, ConfigError, ExperimentConfig
from tasks.pipeline import STAGES

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/tiny.yaml"


def shipped_configs(root: Path = REPO_ROOT) -> tuple[str, ...]:
    """Experiment and sweep files under `<root>/configs`, as repo-relative POSIX paths, sorted."""
    folder = root / "configs"
    return tuple(sorted(p.relative_to(root).as_posix() for p in folder.rglob("*.yaml")))


SHIPPED_CONFIGS = shipped_configs()

# Bounds live in these types; the descriptions the UI shows come from the flow's docstring (Args:),
# because Prefect's schema builder replaces an Annotated Field's description with the docstring's.
# Literal[...] of the shipped paths renders as a drop-down; `| str` keeps any other file usable
# (a team's own config on the worker, a test's temporary file). Pydantic's smart union keeps a
# plain str either way.
ShippedConfig = Literal[SHIPPED_CONFIGS] if SHIPPED_CONFIGS else str  # type: ignore[valid-type]
ConfigPath = Annotated[
    Union[ShippedConfig, str],
    Field(min_length=1),
]
StageName = Literal[tuple(STAGES)]  # type: ignore[valid-type]
StageSelection = Annotated[
    Union[list[StageName], None],
    Field(min_length=1),
]
RunDir = Annotated[
    Union[str, None],
    Field(min_length=1),
]
SweepVariant = Annotated[
    Union[int, None],
    Field(ge=0, le=10_000),
]


class ConfigOverrides(BaseModel):
    """Values that replace the config's deploy section for one run (unset: keep the YAML's)."""

    model_config = ConfigDict(extra="forbid")

    host: str | None = Field(
        None, pattern=NAME_PATTERN, description="deploy.host: `local` or one of the config's hosts[].name."
    )
    num_steps: int | None = Field(
        None, ge=1, le=64, description="deploy.speculative.num_steps (--speculative-num-steps, draft depth)."
    )
    eagle_topk: int | None = Field(
        None, ge=1, le=64, description="deploy.speculative.eagle_topk (--speculative-eagle-topk, branching)."
    )
    num_draft_tokens: int | None = Field(
        None, ge=2, le=1024,
        description="deploy.speculative.num_draft_tokens (--speculative-num-draft-tokens, incl. the root).",
    )

    def deploy_update(self) -> dict:
        """The deploy-section keys to replace, e.g. {"host": "gpu-1", "speculative": {"num_steps": 3}}."""
        update: dict = {} if self.host is None else {"host": self.host}
        speculative = self.model_dump(include={"num_steps", "eagle_topk", "num_draft_tokens"}, exclude_none=True)
        if speculative:
            update["speculative"] = speculative
        return update


def apply_overrides(cfg: ExperimentConfig, overrides: ConfigOverrides | dict | None) -> ExperimentConfig:
    """Return `cfg` with the overrides in its deploy section, validated again as a whole config.

    Raises ConfigError naming the overridden field when the result breaks a config rule
    (e.g. a host that is not in hosts[]).
    """
    overrides = ConfigOverrides.model_validate(overrides or {})
    update = overrides.deploy_update()
    if not update:
        return cfg
    deploy = cfg.deploy.model_dump()
    deploy["speculative"] = {**deploy["speculative"], **update.pop("speculative", {})}
    deploy.update(update)
    # model_copy does not validate; a round trip through model_validate re-checks the field
    # bounds and the cross-section rules (deploy.host must name a hosts[] entry).
    try:
        return ExperimentConfig.model_validate({**cfg.model_dump(), "deploy": deploy})
    except ValidationError as err:
        raise ConfigError([_override_error(e) for e in err.errors()]) from None


def _override_error(error: dict) -> str:
    field = ".".join(str(part) for part in error["loc"])
    where = f"{field}: " if field else ""
    return f"overrides: {where}{error['msg'].removeprefix('Value error, ')}"
