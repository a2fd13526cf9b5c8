"""What a serving host really serves: the model and draft a launch names, read from that host.

Owns the one answer to "which files does this server load, and what do they say", used by the
deploy preflight, the benchmark's sweep preflight, the diagnosis and the nightly gate:
- the paths come from the launch argv (last flag wins, as SGLang's argparse does, so a
  `--model-path`, `--tokenizer-path` or `--chat-template` in `deploy.extra_args` counts), or,
  once a server runs, from its own `/server_info` (what it says it loaded);
- the files -- the target's config.json and chat template, the draft's config.json and its
  training record -- are read over the executor from the host that serves them. A folder eagleops
  uploads itself (the tiny target, the draft) is read from the local copy before the upload:
  the upload is sha256-verified, so the host ends up with exactly those bytes.
Whatever cannot be read is named in `missing`, never guessed from the training machine.

Risk: the training target's files and the served ones differ whenever `deploy.model_path`
names another model or the extra flags point the server elsewhere; a check run on the local
copy then passes while the server runs something else.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any

from eagle3.export import TRAINING_RECORD
from tasks.hosts.remote import CommandFailed, Executor

# SGLang flag spellings (and aliases) of the paths a server loads; the last occurrence wins.
PATH_FLAGS = {
    "model": ("--model-path", "--model"),
    "draft": ("--speculative-draft-model-path", "--speculative-draft-model"),
    "tokenizer": ("--tokenizer-path",),
    "chat_template": ("--chat-template",),
}
# The same paths under their /server_info names (SGLang's resolved ServerArgs fields).
INFO_KEYS = {"model": "model_path", "draft": "speculative_draft_model_path", "tokenizer": "tokenizer_path",
             "chat_template": "chat_template"}


@dataclass
class ServedModel:
    """The served target and draft as the host has them; `missing` says what could not be read."""

    host: str
    paths: dict[str, str | None]  # model, draft, tokenizer, chat_template (as the server gets them)
    paths_from: str  # "launch command" | "/server_info"
    target_config: dict[str, Any]
    draft_config: dict[str, Any] | None = None
    training_record: dict[str, Any] | None = None
    chat_template_sha256: str | None = None
    template_source: str = ""
    draft_local_dir: str | None = None  # a local folder with the served draft's bytes, when there is one
    missing: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------ paths


def launch_paths(argv: Sequence[str]) -> dict[str, str | None]:
    """The paths a launch argv makes the server load; `--flag value` and `--flag=value`, last one wins."""
    found: dict[str, str | None] = {key: None for key in PATH_FLAGS}
    args = list(argv)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        for key, flags in PATH_FLAGS.items():
            if name in flags:
                found[key] = value if eq else (args[i + 1] if i + 1 < len(args) else None)
    return found


def reported_paths(server_info: dict[str, Any]) -> dict[str, str | None] | None:
    """The paths a running server reports in /server_info; None when it reports no model path."""
    if not server_info.get("model_path"):
        return None
    return {key: server_info.get(info_key) or None for key, info_key in INFO_KEYS.items()}


# ------------------------------------------------------------------ reading


class _HostFiles:
    """Text files as the serving host has them: uploads-to-be from their local source, the rest over the executor."""

    def __init__(self, executor: Executor, uploads: dict[str, Path], cwd: str | None):
        self.executor, self.uploads, self.cwd = executor, uploads, cwd

    def absolute(self, path: str) -> str:
        path = self.executor.expand_path(path)
        return path if path.startswith("/") or self.cwd is None else str(PurePosixPath(self.cwd) / path)

    def local_source(self, path: str) -> Path | None:
        """The local folder or file whose bytes the host will have at `path` (an upload), or None."""
        target = PurePosixPath(self.absolute(path))
        for remote, local in self.uploads.items():
            base = PurePosixPath(remote)
            if target == base or base in target.parents:
                return Path(local) / target.relative_to(base)
        return None

    def read(self, path: str) -> str | None:
        """The file's text, or None when the host has no readable file there."""
        local = self.local_source(path)
        if local is not None:
            return local.read_text() if local.is_file() else None
        try:
            return self.executor.read_file(self.absolute(path))
        except (FileNotFoundError, CommandFailed):  # absent or unreadable there: the caller names what is missing
            return None


def read_served_model(executor: Executor, paths: dict[str, str | None], *, paths_from: str,
                      uploads: dict[str, Path] | None = None, cwd: str | None = None) -> ServedModel:
    """Read the served target and draft from the host (see the module docstring).

    Args:
        paths: `launch_paths(argv)` or `reported_paths(server_info)`.
        uploads: {host path: local folder} eagleops is about to upload (read locally, same bytes).
        cwd: the server's working directory (relative paths in the argv are relative to it).
    Raises FileNotFoundError when the served model's config.json cannot be read on the host:
    nothing about the target can be checked without it.
    """
    files = _HostFiles(executor, dict(uploads or {}), cwd)
    model = paths.get("model")
    text = files.read(f"{model}/config.json") if model else None
    if text is None:
        raise FileNotFoundError(f"[{executor.name}] {model}/config.json: the served model's config is not on the "
                                "serving host (deploy.model_path, or the target this run uploads, must be a folder "
                                "there with a config.json)")
    config = json.loads(text)
    served = ServedModel(executor.name, dict(paths), paths_from, {**config, **config.get("text_config", {})})
    _read_draft(served, files)
    served.chat_template_sha256, served.template_source = served_template(files.read, paths)
    if served.chat_template_sha256 is None:
        served.missing.append(f"chat template: {served.template_source}")
    return served


def _read_draft(served: ServedModel, files: _HostFiles) -> None:
    draft = served.paths.get("draft")
    if not draft:
        return
    config, record = files.read(f"{draft}/config.json"), files.read(f"{draft}/{TRAINING_RECORD}")
    served.draft_config = json.loads(config) if config is not None else None
    served.training_record = json.loads(record) if record is not None else None
    if config is None:
        served.missing.append(f"draft: {served.host}:{draft}/config.json is not readable")
    if record is None:
        served.missing.append(f"draft: {served.host}:{draft} carries no {TRAINING_RECORD} (what it was trained on)")
    local = files.local_source(draft)
    if local is None and files.executor.name == "local":
        local = Path(files.absolute(draft))
    served.draft_local_dir = str(local) if local is not None and local.is_dir() else None


# ------------------------------------------------------------------ chat template


def template_sha256(template: str | dict[str, str]) -> str:
    """sha256 of a chat template as `eagle3.data.chat.chat_template_sha256` hashes a tokenizer's."""
    if isinstance(template, dict):
        template = "\n".join(f"{k}\n{v}" for k, v in sorted(template.items()))
    return hashlib.sha256(template.encode()).hexdigest()


def served_template(read: Callable[[str], str | None], paths: dict[str, str | None]) -> tuple[str | None, str]:
    """(sha256 of the chat template the server applies, where it comes from); (None, why) when unknown.

    SGLang applies `--chat-template` when given (a .jinja file, an SGLang .json conversation
    template, or a built-in name), else the tokenizer's own template (`--tokenizer-path`, else
    the model folder): `chat_template.jinja`, else `tokenizer_config.json`'s `chat_template`.
    """
    given = paths.get("chat_template")
    if given:
        if given.endswith(".json"):
            return None, f"--chat-template {given} is an SGLang conversation template, not comparable with a Jinja one"
        if not (given.endswith(".jinja") or "/" in given):
            return None, f"--chat-template {given} is SGLang's built-in template of that name, not a file to compare"
        text = read(given)
        return (template_sha256(text), f"--chat-template {given}") if text is not None else \
            (None, f"--chat-template {given} is not readable on the serving host")
    folder = paths.get("tokenizer") or paths.get("model")
    jinja = read(f"{folder}/chat_template.jinja")
    if jinja is not None:
        return template_sha256(jinja), f"{folder}/chat_template.jinja"
    config = read(f"{folder}/tokenizer_config.json")
    if config is None:
        return None, f"{folder}/tokenizer_config.json is not readable on the serving host"
    template = json.loads(config).get("chat_template")
    if isinstance(template, list):  # [{name, template}, ...], as transformers reads it into a dict
        template = {t["name"]: t["template"] for t in template}
    if not template:
        return None, f"{folder}/tokenizer_config.json has no chat_template"
    return template_sha256(template), f"{folder}/tokenizer_config.json"
