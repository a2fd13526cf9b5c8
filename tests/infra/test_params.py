"""The experiment flow's parameters: the schema Prefect serves to the UI form, and overrides reaching the config."""

from pathlib import Path

import pytest
from prefect.utilities.schema_tools import ValidationError as SchemaError
from prefect.utilities.schema_tools import validate

from flows.experiment import eagle3_experiment
from flows.nightly import nightly_retrain
from flows.params import (
    SHIPPED_CONFIGS,
    ConfigOverrides,
    apply_overrides,
    shipped_configs,
)
from tasks.config.load import ConfigError, load_experiment
from tasks.runner.stages import STAGES

REPO = Path(__file__).resolve().parents[2]
WITH_HOSTS = """\
experiment: params
target: {kind: tiny}
deploy:
  host: local
  speculative: {num_steps: 5, eagle_topk: 1, num_draft_tokens: 6}
hosts:
  - {name: gpu-1, address: 10.0.0.5, user: eagle, key_file: /dev/null}
"""


@pytest.fixture
def cfg(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(WITH_HOSTS)
    return load_experiment(path)


def schema() -> dict:
    return eagle3_experiment.parameters.model_dump()


def test_shipped_configs_are_the_repo_yaml_files_including_sweeps():
    on_disk = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "configs").rglob("*.yaml"))
    assert list(SHIPPED_CONFIGS) == on_disk and "configs/tiny.yaml" in on_disk
    assert any(p.startswith("configs/sweeps/") for p in on_disk)


def test_shipped_configs_of_a_tree_without_configs_is_empty(tmp_path):
    (tmp_path / "configs").mkdir()
    assert shipped_configs(tmp_path) == ()


def test_schema_offers_the_shipped_configs_and_the_stage_names():
    props = schema()["properties"]
    choices = [option for option in props["config_path"]["anyOf"] if "enum" in option]
    assert choices[0]["enum"] == list(SHIPPED_CONFIGS)
    assert props["config_path"]["default"] == "configs/tiny.yaml"
    assert props["stages"]["items"]["enum"] == STAGES
    for name in ("config_path", "stages", "run_dir", "variant", "overrides"):
        assert props[name]["description"], f"{name} has no description for the UI form"
    for name in ("config_path", "run_dir"):
        assert nightly_retrain.parameters.model_dump()["properties"][name]["description"], f"nightly {name}"


# --------------------------------------------------------------------------- the Custom run form
# What Prefect 3.9.1's form does with the schema (ui-v2 schema-form, as in its bundle): an `anyOf` property is a row
# of toggles labelled by each branch's title, else its format, else its type's Python name; a `{"type": "null"}`
# branch shows 'Property is type "None"'; each property's `default` is put into the form as its value, and the
# form's values go to the server's schema check before the run is created. Written out here, not imported from
# the code under test.
TYPE_LABELS = {"null": "None", "string": "str", "boolean": "bool", "integer": "int", "number": "float",
               "array": "list", "object": "dict"}
FLOWS = {"eagle3_experiment": eagle3_experiment, "nightly_retrain": nightly_retrain}


def form_properties(flow) -> dict[str, dict]:
    """Every property the form renders: the flow's parameters and the fields of the models they hold."""
    found = flow.parameters.model_dump()
    nested = {f"{model}.{name}": prop for model, definition in found.get("definitions", {}).items()
              for name, prop in definition.get("properties", {}).items()}
    return {**found["properties"], **nested}


def toggle_labels(prop: dict) -> list[str]:
    return [b.get("title") or b.get("format") or TYPE_LABELS.get(b.get("type"), "Field") for b in prop.get("anyOf", [])]


@pytest.mark.parametrize("flow", FLOWS)
def test_every_toggle_of_the_form_has_its_own_label(flow):
    for name, prop in form_properties(FLOWS[flow]).items():
        labels = toggle_labels(prop)
        assert len(set(labels)) == len(labels), f"{flow}.{name}: toggles read {labels}"
    assert toggle_labels(form_properties(FLOWS[flow])["config_path"]) == ["shipped config", "path on the worker"]


def test_only_the_sweep_variant_has_a_none_toggle():
    for flow, function in FLOWS.items():
        with_none = {name for name, prop in form_properties(function).items() if "None" in toggle_labels(prop)
                     or "not a sweep" in toggle_labels(prop)}
        assert with_none == ({"variant"} if flow == "eagle3_experiment" else set()), flow
    assert toggle_labels(schema()["properties"]["variant"]) == ["grid point", "not a sweep"]


@pytest.mark.parametrize("flow", FLOWS)
def test_the_forms_first_values_pass_the_servers_check(flow):
    """An untouched Custom run form submits every property's default: the server must take them all."""
    parameters = FLOWS[flow].parameters.model_dump()
    untouched = {name: prop["default"] for name, prop in parameters["properties"].items() if "default" in prop}
    validate(untouched, parameters, raise_on_error=True, preprocess=True, ignore_required=True)


def test_the_forms_first_values_mean_what_unset_means_to_the_flow():
    untouched = {name: prop["default"] for name, prop in schema()["properties"].items() if "default" in prop}
    as_sent = eagle3_experiment.validate_parameters({**untouched, "config_path": "configs/tiny.yaml"})
    assert as_sent["stages"] == STAGES  # every stage: what None selects
    assert as_sent["run_dir"] is None and as_sent["variant"] is None
    assert apply_overrides(load_experiment(REPO / "configs" / "tiny.yaml"), as_sent["overrides"]) \
        == load_experiment(REPO / "configs" / "tiny.yaml")


def test_python_callers_still_pass_none_for_unset():
    """The CLI and the nightly call the flow with None; the schema's form defaults do not change that."""
    given = {"config_path": "configs/tiny.yaml", "stages": None, "run_dir": None, "variant": None,
             "overrides": {"host": None, "num_steps": None}}
    assert {k: v for k, v in eagle3_experiment.validate_parameters(given).items() if k != "overrides"} == \
        {"config_path": "configs/tiny.yaml", "stages": None, "run_dir": None, "variant": None}
    assert nightly_retrain.validate_parameters({"config_path": "x.yaml"})["run_dir"] is None
    validate({"overrides": {"num_steps": None}}, schema(), raise_on_error=True, preprocess=True, ignore_required=True)


def test_a_run_folder_typed_into_the_form_is_kept():
    assert eagle3_experiment.validate_parameters({"run_dir": "runs/tiny/20261201-1"})["run_dir"] == "runs/tiny/20261201-1"


@pytest.mark.parametrize(
    ("parameters", "field"),
    [
        ({"stages": ["train"]}, "stages"),
        ({"stages": []}, "stages"),
        ({"variant": -1}, "variant"),
        ({"overrides": {"num_steps": 0}}, "num_steps"),
        ({"overrides": {"num_draft_tokens": 5000}}, "num_draft_tokens"),
        ({"overrides": {"host": "Not A Name"}}, "host"),
        ({"overrides": {"topk": 2}}, "topk"),
    ],
)
def test_schema_refuses_bad_values_naming_the_field(parameters, field):
    with pytest.raises(SchemaError, match=field):
        validate(parameters, schema(), raise_on_error=True, preprocess=True, ignore_required=True)


def test_schema_accepts_a_free_config_path_and_good_overrides():
    good = {"config_path": "/srv/team/my.yaml", "stages": ["check_environment"], "variant": 2,
            "overrides": {"host": "gpu-1", "num_steps": 3, "eagle_topk": 1, "num_draft_tokens": 4}}
    validate(good, schema(), raise_on_error=True, preprocess=True, ignore_required=True)


def test_overrides_replace_only_the_given_deploy_fields(cfg):
    out = apply_overrides(cfg, ConfigOverrides(host="gpu-1", num_steps=3))
    assert out.deploy.host == "gpu-1"
    assert (out.deploy.speculative.num_steps, out.deploy.speculative.eagle_topk,
            out.deploy.speculative.num_draft_tokens) == (3, 1, 6)
    assert out.train == cfg.train and out.hosts == cfg.hosts
    assert cfg.deploy.host == "local" and cfg.deploy.speculative.num_steps == 5  # input untouched


def test_overrides_from_a_dict_as_prefect_passes_them(cfg):
    assert apply_overrides(cfg, {"num_draft_tokens": 4}).deploy.speculative.num_draft_tokens == 4


def test_no_overrides_keep_the_config(cfg):
    assert apply_overrides(cfg, ConfigOverrides()) is cfg
    assert apply_overrides(cfg, None) is cfg


def test_an_override_host_missing_from_the_inventory_is_refused_by_name(cfg):
    with pytest.raises(ConfigError) as err:
        apply_overrides(cfg, ConfigOverrides(host="gpu-9"))
    assert "overrides" in err.value.messages[0] and "deploy.host 'gpu-9'" in err.value.messages[0]


def test_an_override_out_of_bounds_is_refused_before_the_config():
    with pytest.raises(ValueError, match="num_steps"):
        ConfigOverrides(num_steps=65)
