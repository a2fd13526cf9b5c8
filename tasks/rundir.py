"""Run directories: `runs/<experiment>/<run-id>/`, one folder per stage and attempt, and `manifest.json`.

A stage runs in `<stage>/attempt-N/`. A new attempt starts whenever the stage's inputs (its
fingerprint: the config fields it reads plus the content digests of the upstream outputs it
consumes) differ from the latest attempt's; an unfinished attempt with the same inputs is
resumed in place (training continues from its checkpoint, data from its finished shards).
Earlier attempts are never overwritten, so changing `train.lr` and back again reuses the
first training. The manifest records, per stage, every attempt (status, fingerprint, inputs,
outputs, output digest, MLflow run id) and which attempt is current. Writes are atomic
(temp file + rename) and pass through `tasks.secrets.redact`, so a kill never leaves half a
manifest and no secret reaches the folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterable

from tasks.secrets import redact

MANIFEST = "manifest.json"
# Statuses of an attempt that ended without completing and may be resumed in place.
UNFINISHED = ("running", "failed", "interrupted")


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(redact(json.dumps(data, indent=2, default=str)) + "\n")
    os.replace(tmp, path)


def digest_json(data: Any) -> str:
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


def file_sha256(path: Path, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def digest_paths(paths: Iterable[str | Path]) -> str:
    """Content digest of files and directory trees (relative names + bytes); missing paths count as absent."""
    entries = []
    for root in sorted(str(p) for p in paths):
        base = Path(root)
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()) if base.is_dir() else []
        entries.append([root, [[str(f.relative_to(base)) if f != base else "", file_sha256(f)] for f in files]])
    # The roots' absolute locations do not matter, only what is in them.
    return digest_json([e[1] for e in entries])


@dataclass
class RunDirectory:
    path: Path
    manifest: dict[str, Any]

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
            manifest = json.loads(manifest_path.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{manifest_path}: unreadable manifest ({err})") from None
        return cls(path, manifest)

    @property
    def run_id(self) -> str:
        return self.manifest["run_id"]

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
        write_json_atomic(self.path / MANIFEST, self.manifest)


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def elapsed_since(start: float) -> float:
    return round(time.monotonic() - start, 3)
