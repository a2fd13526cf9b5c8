"""The server launch command built from the config, and what SGLang will really run with it.

Owns the argv for `python -m sglang.launch_server` (deploy.server: sglang) and for the reference
server `python -m eagle3.serve` (deploy.server: reference; same flags), and the comparison of
the settings the config asks for with SGLang's effective ones (`eagle3.serving.sglang_args`). Used by
`eagleops validate` and by the deploy preflight. Risk: the seed's failure — SGLang silently
turned `--speculative-num-draft-tokens 16` into 2 because topk 1 forces num_steps + 1 — so any
asked value that SGLang would change is an error unless the config opts into adjustments.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from pathlib import Path

from eagle3.serving.sglang_args import SpecResolution, resolve_speculative_args
from tasks.config.schema import ExperimentConfig, SpeculativeConfig

SERVER_MODULES = {"sglang": "sglang.launch_server", "reference": "eagle3.serve"}
SPEC_FIELDS = {"num_steps": "speculative_num_steps", "eagle_topk": "speculative_eagle_topk",
               "num_draft_tokens": "speculative_num_draft_tokens"}


@dataclass(frozen=True)
class Finding:
    """One preflight result: `error` stops the launch, `warning` and `info` are logged."""

    level: str  # error | warning | info
    check: str
    message: str
    field: str = ""  # the config field it is about (dotted, list items by index: bench.sweep.0), for file:line

    def line(self) -> str:
        return f"{self.check}: {self.message}"


def speculative_flags(spec: SpeculativeConfig, draft_path: str) -> list[str]:
    flags = ["--speculative-algorithm", spec.algorithm, "--speculative-draft-model-path", draft_path]
    for field, flag in (("num_steps", "--speculative-num-steps"), ("eagle_topk", "--speculative-eagle-topk"),
                        ("num_draft_tokens", "--speculative-num-draft-tokens")):
        value = getattr(spec, field)
        if value is not None:
            flags += [flag, str(value)]
    return flags


def launch_args(cfg: ExperimentConfig, *, model_path: str, draft_path: str | None, port: int,
                spec: SpeculativeConfig | None = None) -> list[str]:
    """Server flags (after `python -m MODULE`); `draft_path=None` = the baseline without speculation."""
    deploy = cfg.deploy
    args = ["--model-path", model_path, "--host", "127.0.0.1", "--port", str(port)]
    if draft_path is not None:
        args += speculative_flags(spec or deploy.speculative, draft_path)
    if deploy.tp > 1:
        args += ["--tp-size", str(deploy.tp)]
    if deploy.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(deploy.mem_fraction_static)]
    if deploy.max_running_requests is not None:
        args += ["--max-running-requests", str(deploy.max_running_requests)]
    if deploy.enable_metrics:
        args.append("--enable-metrics")
    return args + list(deploy.extra_args)


def read_model_config(folder: str | Path) -> dict | None:
    """A local model folder's config.json (None when there is none); ValueError naming the file when it is
    not a JSON object (truncated, a list, not UTF-8)."""
    path = Path(folder).expanduser() / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable JSON config ({err})") from None
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object, found a {type(config).__name__}")
    return config


def target_architecture(cfg: ExperimentConfig, model_dir: str | Path | None = None) -> str | None:
    """`architectures[0]` of the target: from a readable config.json, the declared shape, or the tiny target."""
    for folder in (model_dir, cfg.target.model_path):
        config = read_model_config(folder) if folder else None
        if config is not None:
            archs = config.get("architectures")
            return archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if cfg.target.shape:
        return cfg.target.shape.architecture
    return "LlamaForCausalLM" if cfg.target.kind == "tiny" else None


def predict(cfg: ExperimentConfig, args: list[str], architecture: str | None) -> SpecResolution:
    """SGLang 0.5.23's effective settings for these flags (on a GPU host unless --device says otherwise)."""
    return resolve_speculative_args(args, target_architecture=architecture, detected_device="cuda")


def settings_findings(spec: SpeculativeConfig, res: SpecResolution) -> list[Finding]:
    """What SGLang would refuse (error), rewrite (error unless allowed) or choose silently (info)."""
    findings = [Finding("error", "sglang_settings", e) for e in res.errors + res.runtime_errors]
    if res.errors:
        return findings
    for level, text in res.adjustments:
        findings.append(Finding("info", "sglang_log", f"SGLang will log ({level}): {text}"))
    for field, key in SPEC_FIELDS.items():
        asked, effective = getattr(spec, field), getattr(res, key)
        if asked is None and effective is not None:
            findings.append(Finding("info", "sglang_settings", f"{key} unset: SGLang chooses {effective}"))
        elif asked is not None and asked != effective:
            why = _rewrite_reason(res)
            level = "warning" if spec.allow_adjustments else "error"
            hint = "" if spec.allow_adjustments else (
                f"; ask for {effective} (or set deploy.speculative.allow_adjustments: true to run with SGLang's value)")
            findings.append(Finding(level, "sglang_settings",
                                    f"deploy.speculative.{field}: asked {asked}, SGLang runs {effective} ({why}){hint}"))
    return findings


def _rewrite_reason(res: SpecResolution) -> str:
    """SGLang's own log line for the rewrite, when it logs one."""
    texts = [text for _, text in res.adjustments if "adjusted" in text or "disabled" in text]
    return f"SGLang: \"{texts[0]}\"" if texts else "SGLang's automatic choice"


def effective_settings(spec: SpeculativeConfig, res: SpecResolution) -> dict[str, int | None]:
    """`{num_steps, eagle_topk, num_draft_tokens}` as the server will run them."""
    return {field: getattr(res, key) for field, key in SPEC_FIELDS.items()}


def validate_launch(cfg: ExperimentConfig) -> list[Finding]:
    """The launch-flag check behind `eagleops validate`: the model folders readable here, then the config's
    speculative setting and every bench.sweep setting against SGLang's rules."""
    problems = model_config_findings(cfg) + draft_config_findings(cfg)
    if problems:  # SGLang's rules read these files: predicting with a broken one says nothing
        return problems
    model_path = cfg.deploy.model_path or cfg.target.model_path or "TARGET"
    architecture = target_architecture(cfg, cfg.deploy.model_path)
    args = launch_args(cfg, model_path=model_path, draft_path="DRAFT", port=cfg.deploy.port)
    findings = [replace(f, field=f.field or _field_of(f.message, cfg.deploy.extra_args))
                for f in settings_findings(cfg.deploy.speculative, predict(cfg, args, architecture))]
    for i, spec in enumerate(cfg.bench.sweep):
        args = launch_args(cfg, model_path=model_path, draft_path="DRAFT", port=cfg.deploy.port, spec=spec)
        findings += sweep_setting_findings(i, spec, predict(cfg, args, architecture))
    return findings


def _field_of(message: str, extra_args: list[str]) -> str:
    """deploy.extra_args when SGLang's message is about one of its flags (--speculative-adaptive-config is
    `speculative_adaptive_config` there), else deploy.speculative."""
    flags = {a.lstrip("-").replace("-", "_") for a in extra_args if a.startswith("--")}
    return "deploy.extra_args" if any(re.search(rf"\b{re.escape(f)}\b", message) for f in flags) else \
        "deploy.speculative"


def sweep_setting_findings(index: int, spec: SpeculativeConfig, res: SpecResolution) -> list[Finding]:
    """A bench.sweep setting: what SGLang refuses is an error; a rewrite runs, reported under SGLang's values."""
    field = f"bench.sweep.{index}"
    findings = [Finding("error", "sglang_settings", e, field) for e in res.errors + res.runtime_errors]
    if findings:
        return findings
    for name, key in SPEC_FIELDS.items():
        asked, effective = getattr(spec, name), getattr(res, key)
        if asked is not None and asked != effective:
            findings.append(Finding("info", "sglang_settings", f"bench.sweep[{index}].{name}: asked {asked}, SGLang "
                                    f"runs {effective} ({_rewrite_reason(res)}); reported under {effective}", field))
    return findings


def model_config_findings(cfg: ExperimentConfig) -> list[Finding]:
    """The config.json of each model folder the config names that is readable here: a JSON object with an
    architecture, and deep enough for target.aux_layer_ids (no id can select a layer past the last one)."""
    findings = []
    for field in ("deploy.model_path", "target.model_path"):
        folder = getattr(getattr(cfg, field.split(".")[0]), "model_path")
        try:
            config = read_model_config(folder) if folder else None
        except ValueError as err:
            findings.append(Finding("error", "model_config", str(err), field))
            continue
        if config is None:
            continue
        if target_architecture(cfg, folder) is None:
            findings.append(Finding("error", "model_config", f"{folder}/config.json: 'architectures' must be a "
                                    "non-empty list of names (SGLang picks the model class by it)", field))
        text_config = config.get("text_config")
        layers = config.get("num_hidden_layers", text_config.get("num_hidden_layers")
                            if isinstance(text_config, dict) else None)
        ids = cfg.target.aux_layer_ids or []
        if isinstance(layers, int) and ids and max(ids) > layers:
            findings.append(Finding("error", "model_config", f"target.aux_layer_ids {ids}: id {max(ids)} is past "
                                    f"the {layers} decoder layers of {folder}", "target.aux_layer_ids"))
    return findings


DRAFT_FLAGS = ("--speculative-draft-model-path", "--speculative-draft-model")


def extra_draft_path(extra_args: list[str]) -> tuple[bool, str | None]:
    """(named, path) of a draft that deploy.extra_args makes the server load (`--flag D` or `--flag=D`, the last
    one wins as in SGLang's argparse); path None when the last such flag has no value."""
    named, path = False, None
    for i, arg in enumerate(extra_args):
        flag, eq, value = arg.partition("=")
        if flag in DRAFT_FLAGS:
            nxt = extra_args[i + 1] if i + 1 < len(extra_args) else None
            named, path = True, value if eq else (nxt if nxt is not None and not nxt.startswith("--") else None)
    return named, path


def draft_config_findings(cfg: ExperimentConfig) -> list[Finding]:
    """The draft deploy.extra_args names instead of this run's export, when it is served from this machine
    (deploy.host local): a folder whose config.json is a JSON object with an EAGLE-3 draft architecture. A
    remote host's folder is read there, by the deploy stage's preflight."""
    named, path = extra_draft_path(cfg.deploy.extra_args)
    if not named or cfg.deploy.host != "local":
        return []
    field = "deploy.extra_args"
    if path is None:
        return [Finding("error", "draft_config", f"{DRAFT_FLAGS[0]} has no value: name the draft's folder", field)]
    try:
        config = read_model_config(path)
    except ValueError as err:
        return [Finding("error", "draft_config", str(err), field)]
    if config is None:
        where = "has no config.json" if Path(path).expanduser().is_dir() else "is not a folder here"
        return [Finding("error", "draft_config", f"{path} {where}: the draft SGLang would load (deploy.host "
                        "local) is a folder with the draft's config.json", field)]
    archs = config.get("architectures")
    if not (isinstance(archs, list) and any(isinstance(a, str) and "eagle3" in a.lower() for a in archs)):
        return [Finding("error", "draft_config", f"{path}/config.json: architectures {_shown(archs)} is not an "
                        "EAGLE-3 draft (e.g. LlamaForCausalLMEagle3): the flag names the draft, not the target",
                        field)]
    return []


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:120] + "..."
