"""Run directories: `runs/<experiment>/<run-id>/`, one subfolder per stage, and `manifest.json`.

The manifest makes a run readable without MLflow and resumable: per stage it records the
status, a fingerprint of the stage's inputs (its config sections, the upstream stages'
fingerprints and the eagleops version), the stage's outputs and its MLflow run id. A stage
is skipped on resume only when it completed with the same fingerprint and its folder is
still there. Writes are atomic (temp file + rename), so a kill never leaves half a manifest.
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
from typing import Any

MANIFEST = "manifest.json"


def new_run_id() -> str:
    return datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S-") + secrets.token_hex(3)


def write_json_atomic(path: Path, data: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(data, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def fingerprint(stage: str, section_hash: str, upstream: list[str], version: str) -> str:
    payload = json.dumps([stage, section_hash, upstream, version])
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


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

    def stage_dir(self, stage: str) -> Path:
        folder = self.path / stage
        folder.mkdir(exist_ok=True)
        return folder

    def stage(self, stage: str) -> dict[str, Any]:
        return self.manifest["stages"].get(stage, {})

    def is_reusable(self, stage: str, stage_fingerprint: str) -> bool:
        entry = self.stage(stage)
        return (
            entry.get("status") == "completed"
            and entry.get("fingerprint") == stage_fingerprint
            and (self.path / stage).is_dir()
        )

    def update_stage(self, stage: str, **fields: Any) -> None:
        entry = self.manifest["stages"].setdefault(stage, {})
        entry.update(fields)
        self.save()

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
