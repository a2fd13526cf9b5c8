"""The config as it is recorded: secrets masked (dict, YAML), flattened to dotted params, hashed, and
the plain secret values that free text must never show."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from pydantic import BaseModel, SecretStr

from tasks.config.schema import ExperimentConfig
from tasks.config.secrets import MASK, maskable_env_value, redact_obj, url_credentials

SECRET_MASK = MASK


def masked_dict(cfg: BaseModel) -> dict:
    """JSON-able dump with every secret replaced by the mask: `SecretStr` fields (pydantic dumps
    them masked) and credentials inside URL strings (`https://user:pass@host` -> `https://****@host`)."""
    return redact_obj(cfg.model_dump(mode="json"))


def masked_yaml(cfg: BaseModel) -> str:
    return yaml.safe_dump(masked_dict(cfg), sort_keys=False)


def config_hash(cfg: BaseModel) -> str:
    """Stable short hash of the validated config (secrets masked, so rotating a key keeps the hash)."""
    payload = json.dumps(masked_dict(cfg), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def section_hash(cfg: ExperimentConfig, sections: list[str]) -> str:
    dump = masked_dict(cfg)
    payload = json.dumps({s: dump[s] for s in sections}, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """{"train": {"lr": 1e-4}} -> {"train.lr": "0.0001"}; lists become JSON strings."""
    if isinstance(value, dict):
        flat: dict[str, str] = {}
        for key, item in value.items():
            flat.update(flatten(item, f"{prefix}{key}."))
        return flat
    rendered = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return {prefix.rstrip("."): rendered}


def secret_values(cfg: BaseModel) -> list[str]:
    """Every secret's plain value (non-empty) to mask in free text: `SecretStr` fields, URL credentials and
    the `deploy.env` values `tasks.config.secrets.maskable_env_value` accepts (short values under names that do
    not look secret, `NCCL_DEBUG: INFO`, are masked in records only), for
    `tasks.config.secrets.register_secrets` and for tests that assert none of them leak."""
    found: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, SecretStr):
            if value.get_secret_value():
                found.append(value.get_secret_value())
        elif isinstance(value, str):
            found.extend(url_credentials(value))
        elif isinstance(value, BaseModel):
            for name in type(value).model_fields:
                walk(getattr(value, name))
        elif isinstance(value, (list, tuple)):
            for item in value:
                walk(item)
        elif isinstance(value, dict):
            for key, item in value.items():
                if isinstance(item, SecretStr) and not maskable_env_value(str(key), item.get_secret_value()):
                    continue
                walk(item)

    walk(cfg)
    return found
