"""The experiment flow's parameters as the Prefect UI shows them, and how overrides reach the config.

Owns the types of `eagle3_experiment`'s parameters: which config (one of the shipped
`configs/**/*.yaml`, listed at import, or any other path on the worker), which stages (an enum
of `tasks.runner.stages.STAGES`), which sweep grid point, and `ConfigOverrides` (deploy host and the
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

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError
from pydantic.json_schema import SkipJsonSchema

from eagle3.config import NAME_PATTERN
from tasks.config.load import ConfigError
from tasks.config.schema import ExperimentConfig
from tasks.runner.stages import STAGES

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = "configs/tiny.yaml"


def shipped_configs(root: Path = REPO_ROOT) -> tuple[str, ...]:
    """Experiment and sweep files under `<root>/configs`, as repo-relative POSIX paths, sorted."""
    folder = root / "configs"
    return tuple(sorted(p.relative_to(root).as_posix() for p in folder.rglob("*.yaml")))


SHIPPED_CONFIGS = shipped_configs()

# Bounds live in these types; the descriptions the UI shows come from the flow's docstring (Args:),
# because Prefect's schema builder replaces an Annotated Field's description with the docstring's.
#
# The shapes below follow what Prefect 3.9.1's Custom run form (UI v2, the default, and v1) does with
# the JSON schema (ui-v2 schema-form: getSchemaObjectLabel, SchemaFormInputAnyOf, SchemaFormProperty):
# - an `anyOf` property is a row of toggles, one per branch, labelled by the branch's `title`, else
#   its type ("str", "int", "list", "None"): config_path's two branches carry titles, or both read "str";
# - a property's `default` is put into the form as its value; Prefect writes the signature's None as
#   `"default": null`, which needs a `{"type": "null"}` branch to pass the server's check, and that
#   branch is then the one shown: 'Property is type "None"' instead of an input. So where a value
#   means "unset" the schema's default is that value instead (all stages, an empty run folder), the
#   None branch is left out of the schema (`SkipJsonSchema`), and None stays valid in Python (the CLI
#   and the nightly pass it). Only `variant` has no such value (any int names a grid point, and the
#   failure hooks load the config with the raw parameter), so it keeps a titled None branch.
ShippedConfig = Annotated[
    Literal[SHIPPED_CONFIGS] if SHIPPED_CONFIGS else str,  # type: ignore[valid-type]
    Field(title="shipped config"),
]
OtherConfig = Annotated[str, Field(title="path on the worker")]
# Pydantic's smart union keeps a plain str either way: a shipped path matches the Literal, any other
# file (a team's own config on the worker, a test's temporary file) the str.
ConfigPath = Annotated[Union[ShippedConfig, OtherConfig], Field(min_length=1)]
StageName = Literal[tuple(STAGES)]  # type: ignore[valid-type]
StageSelection = Annotated[
    Union[Annotated[list[StageName], Field(min_length=1)], SkipJsonSchema[None]],
    Field(json_schema_extra={"default": list(STAGES)}),
]


def _empty_is_unset(value: str | None) -> str | None:
    """The form's empty run folder is no run folder: a new one is created."""
    return value or None


RunDir = Annotated[
    Union[str, SkipJsonSchema[None]],
    AfterValidator(_empty_is_unset),
    Field(json_schema_extra={"default": ""}),
]
SweepVariant = Union[
    Annotated[int, Field(ge=0, le=10_000, title="grid point")],
    Annotated[None, Field(title="not a sweep")],
]


def _unset_means_keep(schema: dict) -> None:
    """An override field's schema without its `"default": null`: the form then shows an empty input
    (not a None branch), and the server's schema check (prefect.utilities.schema_tools.validation,
    `_fix_null_typing`) still accepts an explicit null for a field that has no default."""
    schema.pop("default", None)


class ConfigOverrides(BaseModel):
    """Values that replace the config's deploy section for one run (unset: keep the YAML's)."""

    model_config = ConfigDict(extra="forbid")

    # Bounds sit on the non-None branch: on the union they would reach the schema unconverted ("ge": 1).
    host: Annotated[str, Field(pattern=NAME_PATTERN)] | SkipJsonSchema[None] = Field(
        None, description="deploy.host: `local` or one of the config's hosts[].name.", json_schema_extra=_unset_means_keep,
    )
    num_steps: Annotated[int, Field(ge=1, le=64)] | SkipJsonSchema[None] = Field(
        None, description="deploy.speculative.num_steps (--speculative-num-steps, draft depth).",
        json_schema_extra=_unset_means_keep,
    )
    eagle_topk: Annotated[int, Field(ge=1, le=64)] | SkipJsonSchema[None] = Field(
        None, description="deploy.speculative.eagle_topk (--speculative-eagle-topk, branching).",
        json_schema_extra=_unset_means_keep,
    )
    num_draft_tokens: Annotated[int, Field(ge=2, le=1024)] | SkipJsonSchema[None] = Field(
        None, description="deploy.speculative.num_draft_tokens (--speculative-num-draft-tokens, incl. the root).",
        json_schema_extra=_unset_means_keep,
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
