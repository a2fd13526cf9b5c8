"""Secrets in `deploy.env` and secrets with characters serialisers escape: masked in every record, in
every escaped form, while the server still gets the real value, and rotating one re-runs nothing.

The escaped forms are written out by hand below (not computed by the code under test), and the
files are searched as bytes, so a UTF-8 secret is found whatever its encoding in the file.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tasks.config.load import load_experiment
from tasks.config.masked import (
    config_hash,
    flatten,
    masked_dict,
    masked_yaml,
    secret_values,
)
from tasks.config.secrets import MASK, redact, register_secrets
from tasks.rundir import write_json_atomic
from tasks.runner.specs import stage_inputs
from tasks.runner.stages import STAGES
from tasks.tracking.journal import Journal, journal_path

# A token with a backslash, a double quote and a non-ASCII character, and how serialisers write it.
TOKEN = 'hf_tok\\en"é-4471c9'
TOKEN_FORMS = (
    'hf_tok\\en"é-4471c9',  # as is
    'hf_tok\\\\en\\"\\u00e9-4471c9',  # json.dumps (ASCII)
    'hf_tok\\\\en\\"é-4471c9',  # json.dumps(ensure_ascii=False)
    "hf_tok\\\\en\"é-4471c9",  # repr
    "hf_tok%5Cen%22%C3%A9-4471c9",  # URL-encoded
)
OTHER = "auth€-leaky-91d3e0"  # a long value under a name that does not look secret
OTHER_FORMS = ("auth€-leaky-91d3e0", "auth\\u20ac-leaky-91d3e0", "auth%E2%82%AC-leaky-91d3e0")

CONFIG = """\
experiment: secrets
target: {kind: tiny}
deploy:
  env:
    HF_TOKEN: ${SECRETS_TEST_TOKEN}
    SERVE_OPTS: ${SECRETS_TEST_OTHER}
    NCCL_DEBUG: INFO
"""


@pytest.fixture
def config(tmp_path, monkeypatch):
    path = tmp_path / "secrets.yaml"
    path.write_text(CONFIG)

    def load(token: str = TOKEN):
        monkeypatch.setenv("SECRETS_TEST_TOKEN", token)
        monkeypatch.setenv("SECRETS_TEST_OTHER", OTHER)
        return load_experiment(path)

    return load


def assert_no_form(data: bytes | str, where: str) -> None:
    raw = data.encode() if isinstance(data, str) else data
    for form in TOKEN_FORMS + OTHER_FORMS:
        assert form.encode() not in raw, f"{form!r} in {where}"


def test_deploy_env_values_are_masked_in_every_record_and_reach_the_server_in_clear(config):
    cfg = config()
    assert cfg.deploy.server_env() == {"HF_TOKEN": TOKEN, "SERVE_OPTS": OTHER, "NCCL_DEBUG": "INFO"}
    flat = flatten(masked_dict(cfg))
    assert {flat[f"deploy.env.{k}"] for k in ("HF_TOKEN", "SERVE_OPTS", "NCCL_DEBUG")} == {MASK}
    for name, text in {"the YAML dump": masked_yaml(cfg), "the params": repr(flat), "repr": repr(cfg),
                       "stage inputs": repr([stage_inputs(cfg, s, {}, "v") for s in STAGES])}.items():
        assert_no_form(text, name)


def test_rotating_a_deploy_env_secret_re_runs_nothing(config):
    before, after = config(), config(token="hf_rotated-0000000000")
    assert before.deploy.server_env() != after.deploy.server_env()
    assert config_hash(before) == config_hash(after)
    for stage in STAGES:
        assert stage_inputs(before, stage, {}, "v") == stage_inputs(after, stage, {}, "v"), stage


def test_every_escaped_form_is_masked_in_free_text_but_short_plain_values_stay_readable(config):
    cfg = config()
    register_secrets(secret_values(cfg))
    for form in TOKEN_FORMS + OTHER_FORMS:
        assert redact(f"GET /x?token={form} failed") == f"GET /x?token={MASK} failed"
    # A logged command line quotes K=V for the shell: a ' inside the value becomes '"'"'.
    register_secrets(["it's-a-secret-42"])
    assert redact("started: 'K=it'\"'\"'s-a-secret-42' python -m x") == f"started: 'K={MASK}' python -m x"
    # NCCL_DEBUG: INFO is masked in records (above) but not in text: every log line says INFO somewhere.
    assert "INFO" not in secret_values(cfg)
    assert redact("NCCL INFO Bootstrap") == "NCCL INFO Bootstrap"


def test_run_folder_json_and_the_journal_are_redacted_before_serialising(config, tmp_path):
    register_secrets(secret_values(config()))
    record = {"error": f"server said: {TOKEN}", "nested": [{"env": OTHER}], TOKEN: "as a key"}
    manifest = tmp_path / "manifest.json"
    write_json_atomic(manifest, record)
    assert_no_form(manifest.read_bytes(), "manifest.json")
    assert MASK in manifest.read_text()
    journal = Journal(journal_path(tmp_path))
    journal.append("log_batch", "offline-x", 0, {"tags": [["eagleops.error", record["error"]]], "raw": record})
    assert_no_form(Path(journal.path).read_bytes(), "the MLflow journal")
    assert journal.entries()[0]["args"]["tags"] == [["eagleops.error", f"server said: {MASK}"]]
