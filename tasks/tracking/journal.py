"""The offline MLflow journal of one run folder: what could not reach the tracking server, kept for replay.

While the tracking server does not answer, `tasks.tracking.RunLogger` appends each write to
`<run_dir>/mlflow-journal.jsonl`, one JSON object a line in call order:
`{"op": ..., "run": <run id or offline-<uuid>>, "time": <ms>, "args": {...}}`. Artifact files
are copied under `<run_dir>/mlflow-journal/files/<entry>/` when the call is made, so a stage
that later rewrites or deletes them loses nothing. Runs created while offline get placeholder
ids `offline-<uuid>` that the pipeline stores in the manifest like real ids; model versions registered
while offline get `offline-version-<uuid>`, and the registry writes that follow name them so.

Replay progress lives in `<run_dir>/mlflow-journal.state.json`: how many entries are done, the
placeholder -> real id map, and the entries the server refused. This module only stores;
`tasks.tracking.sync.sync_journal` replays. Every line passes through `tasks.config.secrets.redact`, like
every other write to the run folder. Risk: a process killed between an MLflow call and the
state write replays that one entry again; see `sync_journal` for why that is harmless.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tasks.config.secrets import redact, redact_obj
from tasks.rundir import write_json_atomic

JOURNAL_FILE = "mlflow-journal.jsonl"
STATE_FILE = "mlflow-journal.state.json"
FILES_DIR = "mlflow-journal/files"
PLACEHOLDER_PREFIX = "offline-"

_append_lock = threading.Lock()  # stages log from Prefect worker threads; one line per write() call


def journal_path(run_dir: str | Path) -> Path:
    """Where a run folder's journal lives (what the pipeline passes to RunLogger as `journal`)."""
    return Path(run_dir) / JOURNAL_FILE


def new_placeholder_id(kind: str = "") -> str:
    """`offline-<uuid>` for a run; `offline-version-<uuid>` (kind "version-") for a model version."""
    return f"{PLACEHOLDER_PREFIX}{kind}{uuid.uuid4().hex}"


def is_placeholder(run_id: str) -> bool:
    return run_id.startswith(PLACEHOLDER_PREFIX)


@dataclass
class JournalState:
    """Replay progress: entries done (in order), placeholder -> real run id, refused entries, and placeholder ->
    registered model version (also as `name/<placeholder>` -> `name/<version>`, the form the manifest records)."""

    done: int = 0
    ids: dict[str, str] = field(default_factory=dict)
    refused: list[dict[str, Any]] = field(default_factory=list)
    versions: dict[str, str] = field(default_factory=dict)


class Journal:
    """Append-only journal file of one run folder plus its copied artifact files and replay state."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.run_dir = self.path.parent

    def append(self, op: str, run_id: str, time_ms: int, args: dict[str, Any]) -> None:
        # Redacted before serialising too: json.dumps escapes a secret with `"`, `\` or non-ASCII characters.
        entry = redact_obj({"op": op, "run": run_id, "time": time_ms, "args": args})
        line = redact(json.dumps(entry, default=str))
        with _append_lock, self.path.open("a") as f:
            f.write(line + "\n")

    def entries(self) -> list[dict[str, Any]]:
        if not self.path.is_file():
            return []
        entries = []
        for number, line in enumerate(self.path.read_text().splitlines(), start=1):
            if not line.strip():
                continue
            try:
                entries.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ValueError(f"{self.path}:{number}: unreadable journal entry ({err})") from None
        return entries

    def new_files_dir(self) -> Path:
        """A fresh folder for one entry's artifact files (relative paths in the entry point here)."""
        folder = self.run_dir / FILES_DIR / uuid.uuid4().hex[:12]
        folder.mkdir(parents=True)
        return folder

    def keep_copy(self, source: Path) -> str:
        """Keep a file or directory as it is now; returns its path relative to the run folder.

        Hard links where the filesystem allows (a multi-GB checkpoint is not stored twice; a file
        later replaced by rename keeps its old content in the journal), else a copy.
        """
        target = self.new_files_dir() / source.name
        if source.is_dir():
            shutil.copytree(source, target, copy_function=_link_or_copy)
        else:
            _link_or_copy(str(source), str(target))
        return str(target.relative_to(self.run_dir))

    def resolve(self, relative: str) -> Path:
        return self.run_dir / relative

    # ------------------------------------------------------------------ replay state

    @property
    def state_path(self) -> Path:
        return self.run_dir / STATE_FILE

    def load_state(self) -> JournalState:
        if not self.state_path.is_file():
            return JournalState()
        try:
            data = json.loads(self.state_path.read_text())
            return JournalState(int(data["done"]), dict(data["ids"]), list(data.get("refused", [])),
                                dict(data.get("versions", {})))
        except (json.JSONDecodeError, KeyError, TypeError, ValueError) as err:
            raise ValueError(f"{self.state_path}: unreadable journal state ({err})") from None

    def save_state(self, state: JournalState) -> None:
        write_json_atomic(self.state_path, {"done": state.done, "ids": state.ids, "refused": state.refused,
                                            "versions": state.versions})

    def pending(self) -> int:
        return max(0, len(self.entries()) - self.load_state().done)


def _link_or_copy(source: str, target: str) -> str:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(source, target)
    return target


def replace_ids(data: Any, ids: dict[str, str]) -> Any:
    """`data` with every string equal to a placeholder replaced by its real id (manifests, tag values)."""
    if isinstance(data, str):
        return ids.get(data, data)
    if isinstance(data, dict):
        return {k: replace_ids(v, ids) for k, v in data.items()}
    if isinstance(data, list):
        return [replace_ids(v, ids) for v in data]
    return data
