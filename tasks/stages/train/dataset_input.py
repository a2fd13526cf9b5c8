"""The training data as an MLflow dataset input, on train_draft's run and the parent run.

MLflow's runs table has a Datasets column and groups runs by dataset (name + digest), so two drafts
trained on the same data sit together whatever their settings. The dataset is the data stage's output:
its digest is that stage's output digest (samples, vocab map, hidden-state manifest, target identity:
`tasks.stages.data.stage.dataset_digest`), so the same data regenerated elsewhere groups with itself and
any change of content starts a new group. Its name says where it came from (`prompts:<file>` or
`served:<dump folder>`); the source names where the files lie (`local` on this machine, `ssh` on
data.host); the profile carries the figures (samples and tokens, in all and per split) and, for served traffic,
the window the samples were taken from. Risk: the name is the grouping key beside the digest, so it
must stay stable for equal data: no run id, date or path of the run folder in it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tasks.config.schema import ExperimentConfig



def size_profile(data: dict[str, Any]) -> dict[str, Any]:
    """Samples and tokens, in all and per split, as the data summary counts them ({"train": n, "validation": m})."""
    profile: dict[str, Any] = {}
    for name, key in (("samples", "num_samples"), ("tokens", "num_tokens")):
        counts = data.get(key)
        if isinstance(counts, dict):
            profile[name] = sum(counts.values())
            profile |= {f"{name}_{split}": n for split, n in counts.items()}
    if data.get("num_assistant_tokens") is not None:
        profile["assistant_tokens"] = data["num_assistant_tokens"]
    if data.get("hidden_states"):
        profile["hidden_states"] = data["hidden_states"]
    return profile


def training_dataset(cfg: ExperimentConfig, data: dict[str, Any], digest: str) -> dict[str, str]:
    """The dataset input of the data stage's summary `data` (its output digest `digest`), as RunLogger.log_dataset takes it."""
    served = data.get("served")
    outputs = data.get("outputs", {})
    on_host = outputs.get("host") not in (None, "local")
    location = outputs.get("host_dataset_dir") if on_host else outputs.get("dataset_dir")
    source = {"uri": f"ssh://{outputs['host']}{location}" if on_host else Path(location).resolve().as_uri()}
    profile = {**size_profile(data), "digest": digest}
    if served:
        folder = served["dumps"]  # as the data stage read it
        name = f"served:{Path(str(folder)).name}"
        window = {"since": served["window"]["since"], "until": served["window"]["until"]}
        source |= {"served_dumps": str(folder), "window": window}
        profile |= {"source": "served", "window_since": window["since"], "window_until": window["until"]}
    else:
        name = f"prompts:{Path(cfg.data.prompts).name}"
        source["prompts"] = cfg.data.prompts
        profile["source"] = "prompts"
    return {"name": name, "digest": digest[:36], "source_type": "ssh" if on_host else "local",
            "source": json.dumps(source), "profile": json.dumps(profile)}
