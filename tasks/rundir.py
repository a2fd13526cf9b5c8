"""Run directories: `runs/<experiment>/<run-id>/`, one folder per stage and attempt, and `manifest.json`.

A stage runs in `<stage>/attempt-N/`. A new attempt starts whenever the stage's inputs (its
fingerprint: the config fields it reads plus the content digests of the upstream outputs it
consumes) differ from the latest attempt's; an unfinished attempt with the same inputs is
resumed in place (training continues from its checkpoint, data from its finished shards).
Earlier attempts are never overwritten, so changing `train.lr` and back again reuses the
first training. The manifest records, per stage, every attempt (status, fingerprint, inputs,
outputs, output digest, MLflow run id) and which attempt is current. Writes are atomic
(temp file + rename, the temp file removed when the write fails) and pass through
`tasks.config.secrets.redact`, so a kill or a full disk never leaves half a manifest and no secret
reaches the folder.

A run folder can be moved or copied (renamed `runs/`, rsync to shared storage): on disk, every
absolute path inside it is written relative to it (`./train_draft/attempt-1/draft`), and one
inside the runs root it lives in (`<runs_root>/<experiment>/<run-id>`: the tiny-target cache, a
local MLflow store) relative to it too (`../../cache/targets/...`, `mlflow.tracking_store`).
`open` resolves them against where the folder is now, so the in-memory manifest holds absolute
paths and a resumed copy writes only into the copy. Stage inputs are kept as recorded (they
are compared, never opened). Risk: a string in a summary that starts with `./` or `../` is read
as a path of the run folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from tasks.config.secrets import redact, redact_obj

MANIFEST = "manifest.json"
SQLITE = "sqlite:///"
# Statuses of an attempt that ended without completing and may be resumed in place.
UNFINISHED = ("running", "failed", "interrupted")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def write_json_atomic(path: Path, data: Any) -> None:
    """Replace `path` with `data` as JSON, secrets masked; on any failure (a full disk) the old file stays
    as it was and no temp file is left. Redacted before serialising (a secret with `"`, `\\` or non-ASCII
    characters is escaped by json.dumps) and after (strings that `default=str` made)."""
    text = redact(json.dumps(redact_obj(data), indent=2, default=str)) + "\n"
    # One temp file per writer (process and thread): two threads sharing a name would rename each
    # other's half-written file into place.
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException as err:
        tmp.unlink(missing_ok=True)
        if isinstance(err, OSError) and err.filename is None:  # a failed write() names no file: name it
            raise OSError(err.errno, err.strerror, str(path)) from err
        raise


def digest_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def digest_paths(paths: Iterable[str | Path]) -> str:
    """Content digest of files and directory trees (relative names + bytes), in the order given; missing
    paths count as absent. Where the roots lie decides nothing: not the digest, not their order (sorting
    by path would reorder a run folder's files against a target outside it when the folder moves)."""
    entries = []
    for root in paths:
        base = Path(root)
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        entries.append([[str(f.relative_to(base)) if f != base else "", file_sha256(f)] for f in files])
    return digest_json(entries)


@dataclass
class RunDirectory:
    path: Path
    manifest: dict[str, Any]
    recorded_tracking_uri: str | None = None  # the manifest's tracking URI as written, before `open` located it

    @classmethod
    def create(cls, runs_root: str | Path, experiment: str, header: dict[str, Any]) -> RunDirectory:
        run_id = new_run_id()
        path = Path(runs_root).resolve() / experiment / run_id
        path.mkdir(parents=True, exist_ok=False)
        manifest = {"experiment": experiment, "run_id": run_id, "created": now_iso(), **header, "stages": {}}
        run = cls(path, manifest)
        run.save()
        return run

    @classmethod
    def open(cls, path: str | Path) -> RunDirectory:
        """Open an existing run for resuming; ValueError if it is not one."""
        path = Path(path).resolve()
        manifest_path = path / MANIFEST
        if not manifest_path.is_file():
            raise ValueError(f"{path}: not a run directory (no {MANIFEST})")
        try:
            recorded = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{manifest_path}: unreadable manifest ({err})") from None
        run = cls(path, located_paths(recorded, path))
        run.recorded_tracking_uri = recorded.get("mlflow", {}).get("tracking_uri")
        run._locate_tracking_store()
        return run

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

    @property
    def runs_root(self) -> Path | None:
        """The runs root the folder lives in now (`<runs_root>/<experiment>/<run-id>`); None outside that layout."""
        return self.path.parent.parent if self.path.parent.name == self.manifest.get("experiment") else None

    def portable(self, data: Any) -> Any:
        """`data` with absolute paths inside the run folder or its runs root made relative to the run folder."""
        return portable_paths(data, self.path, self.runs_root)

    def _locate_tracking_store(self) -> None:
        """A sqlite store recorded relative to the folder (its runs root's mlflow.db) is the one beside it now."""
        mlflow = self.manifest.get("mlflow", {})
        store = mlflow.get("tracking_store")  # made absolute by located_paths
        if store and self.runs_root is not None:  # outside the layout, the recorded URI is all there is
            mlflow["tracking_uri"] = SQLITE + store

    # ------------------------------------------------------------------ stages and attempts

    def stage(self, stage: str) -> dict[str, Any]:
        return self.manifest["stages"].get(stage, {})

    def attempts(self, stage: str) -> list[dict[str, Any]]:
        return self.stage(stage).get("attempts", [])

    def completed_attempt(self, stage: str, fingerprint: str) -> dict[str, Any] | None:
        """The newest completed attempt with these inputs whose folder still exists."""
        for attempt in reversed(self.attempts(stage)):
            if attempt.get("status") == "completed" and attempt.get("fingerprint") == fingerprint \
                    and Path(attempt["dir"]).is_dir():
                return attempt
        return None

    def resumable_attempt(self, stage: str, fingerprint: str) -> dict[str, Any] | None:
        """The latest attempt when it ended unfinished with the same inputs (resume it in place)."""
        attempts = self.attempts(stage)
        if attempts and attempts[-1].get("status") in UNFINISHED and attempts[-1].get("fingerprint") == fingerprint:
            return attempts[-1]
        return None

    def new_attempt(self, stage: str, fingerprint: str, inputs: dict[str, Any]) -> dict[str, Any]:
        number = len(self.attempts(stage)) + 1
        folder = self.path / stage / f"attempt-{number}"
        folder.mkdir(parents=True, exist_ok=False)
        attempt = {"attempt": number, "dir": str(folder), "fingerprint": fingerprint, "inputs": inputs}
        self.manifest["stages"].setdefault(stage, {}).setdefault("attempts", []).append(attempt)
        self.save()
        return attempt

    def update_attempt(self, stage: str, attempt: dict[str, Any], **fields: Any) -> None:
        """Update one attempt and mirror it as the stage's current state."""
        attempt.update(fields)
        entry = self.manifest["stages"].setdefault(stage, {})
        entry.update({k: v for k, v in attempt.items() if k not in ("inputs",)}, current_attempt=attempt["attempt"])
        entry.pop("reason", None)
        self.save()

    def mark_stage(self, stage: str, **fields: Any) -> None:
        """A stage-level note that is not an attempt (skipped, not selected); attempts stay as they were."""
        self.manifest["stages"].setdefault(stage, {}).update(fields)
        self.save()

    def interrupted_attempts(self) -> list[tuple[str, dict[str, Any]]]:
        """Attempts left `running` by a process that died (kill -9, power loss)."""
        return [(name, a) for name, entry in self.manifest["stages"].items()
                for a in entry.get("attempts", []) if a.get("status") == "running"]

    def update(self, **fields: Any) -> None:
        self.manifest.update(fields)
        self.save()

    def save(self) -> None:
        self.manifest["updated"] = now_iso()
        write_json_atomic(self.path / MANIFEST, self._portable_manifest())

    def _portable_manifest(self) -> dict[str, Any]:
        manifest = self.portable(self.manifest)
        mlflow = manifest.get("mlflow", {})
        uri = mlflow.get("tracking_uri") or ""
        database = uri.removeprefix(SQLITE) if uri.startswith(SQLITE) else None
        store = self.portable(database) if database else None
        if store != database:  # a sqlite file inside the runs root: it moves with the folder
            mlflow["tracking_store"] = store
        else:
            mlflow.pop("tracking_store", None)
        return manifest


def folder_of_flow_run(runs_root: str | Path, experiment: str, flow_run_id: str) -> Path | None:
    """The run folder whose manifest lists this Prefect flow run (a Retry's earlier attempt wrote it), newest
    first; None when there is none."""
    for folder in sorted((Path(runs_root) / experiment).glob("*"), reverse=True):
        manifest = folder / MANIFEST
        try:
            if manifest.is_file() and flow_run_id in json.loads(manifest.read_text()).get("prefect_flow_run_ids", []):
                return folder
        except (OSError, ValueError):  # an unreadable manifest is no folder of this run
            continue
    return None


def portable_paths(data: Any, run_path: Path, runs_root: Path | None) -> Any:
    """Every string that is an absolute path inside `run_path` -> `./<relative>`, inside `runs_root` ->
    relative to `run_path` (`../../cache/...`); stage inputs (`inputs`) are left as recorded."""
    if isinstance(data, dict):
        return {k: v if k == "inputs" else portable_paths(v, run_path, runs_root) for k, v in data.items()}
    if isinstance(data, list):
        return [portable_paths(v, run_path, runs_root) for v in data]
    if not isinstance(data, str) or not data.startswith("/"):
        return data
    path = Path(data)
    if path == run_path:
        return "."
    if run_path in path.parents:
        return "./" + path.relative_to(run_path).as_posix()
    if runs_root is not None and (path == runs_root or runs_root in path.parents):
        return os.path.relpath(path, run_path)
    return data


def located_paths(data: Any, run_path: Path) -> Any:
    """The inverse of `portable_paths` for a folder now at `run_path`: `.`, `./x` and `../x` become absolute."""
    if isinstance(data, dict):
        return {k: v if k == "inputs" else located_paths(v, run_path) for k, v in data.items()}
    if isinstance(data, list):
        return [located_paths(v, run_path) for v in data]
    if isinstance(data, str) and (data == "." or data.startswith(("./", "../"))):
        return os.path.normpath(run_path / data)
    return data


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def elapsed_since(start: float) -> float:
    return round(time.monotonic() - start, 3)
