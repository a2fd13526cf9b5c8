"""What a production server says it serves, and what the champion was measured with, in one shape.

Owns the two dicts `tasks.watch.rules.served_changes` compares: the served side from `/server_info`
(resolved speculative settings, adaptive mode, engine version), the live gauges and the content digests
of the served draft and target read on the serving host (`tasks.hosts.served`: the paths the server
reports, the files where it loads them); the expected side from the champion's registry tags.

Digests: the draft's `model.safetensors` is hashed on the host (a draft is small: up to a few GB for a
Kimi-size draft); the target only by its `config.json` and, when present, `model.safetensors.index.json`
(hashing a 600 GB target every window is not an option; an upgrade or requantisation changes them).

Risk: a server whose draft or target path is not readable from the serving host's executor gives no
digest; that is reported as unknown (never as a change).
"""

from __future__ import annotations

import hashlib
from typing import Any

from tasks.hosts.remote import Executor
from tasks.hosts.served import reported_paths
from tasks.watch.rules import NUM_DRAFT_TOKENS, NUM_STEPS, SETTING_KEYS, Band, Reading, Window

TARGET_FILES = ("config.json", "model.safetensors.index.json")


def served_settings(server_info: dict[str, Any]) -> dict[str, Any]:
    """The speculative settings and engine version a server reports (SGLang's resolved names)."""
    settings = {key: server_info.get(name) for key, name in SETTING_KEYS.items()}
    settings["adaptive"] = bool(server_info.get("speculative_adaptive"))
    settings["engine_version"] = server_info.get("version")
    settings["algorithm"] = server_info.get("speculative_algorithm")
    return settings


def live_settings(latest: Window | Reading | None) -> dict[str, Any]:
    """The depth the server runs right now (the gauges), unknown (None) when not exported or not yet set."""
    if isinstance(latest, Window):
        return {"live_num_steps": latest.num_steps, "live_num_draft_tokens": latest.num_draft_tokens}
    gauges = latest.gauges if isinstance(latest, Reading) else {}
    return {"live_num_steps": gauges.get(NUM_STEPS) or None, "live_num_draft_tokens": gauges.get(NUM_DRAFT_TOKENS) or None}


def served_digests(executor: Executor, server_info: dict[str, Any]) -> dict[str, str | None]:
    """{draft_sha256, target_sha256} of the files at the paths the server reports, read on its host."""
    paths = reported_paths(server_info) or {}
    draft, model = paths.get("draft"), paths.get("model")
    draft_sha = executor.sha256(f"{executor.expand_path(draft)}/model.safetensors") if draft else None
    return {"draft_sha256": draft_sha, "target_sha256": target_fingerprint(executor, model) if model else None}


def target_fingerprint(executor: Executor, model_dir: str) -> str | None:
    """sha256 over the target's config.json and weight index digests (None when config.json is not there)."""
    folder = executor.expand_path(model_dir)
    parts = []
    for name in TARGET_FILES:
        digest = executor.sha256(f"{folder}/{name}")
        if digest is None and name == "config.json":
            return None
        parts.append(f"{name}={digest}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def expected_identity(band: Band | None, champion_tags: dict[str, str], baseline: dict[str, Any]) -> dict[str, Any]:
    """What the champion was measured with: the band's settings and engine, its weights digest; the target's
    fingerprint and the engine version first seen serving it (`baseline`) where the gate recorded none."""
    expected: dict[str, Any] = dict(band.settings) if band else {}
    expected["draft_sha256"] = champion_tags.get("eagleops.gate.challenger_weights_sha256")
    expected["engine_version"] = (band.engine_version if band else None) or baseline.get("engine_version")
    expected["target_sha256"] = baseline.get("target_sha256")
    return expected
