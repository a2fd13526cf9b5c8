"""The local MLflow store of a runs root (`<runs_root>/mlflow.db`, artifacts in `<runs_root>/mlartifacts`) that moved.

MLflow writes absolute `file://` artifact locations into the database: an experiment's location
and every run's artifact URI. After `mv runs runs-old` (or `cp -a runs /shared/runs`), the moved
database still points at the old folder, so the next artifact a resumed run logs would recreate
the old path, or write into the original of a copy. `relocate_local_store` re-points those URIs
from the recorded runs root's `mlartifacts/` to the one beside the database now (the artifacts
moved with it) and drops those runs from MLflow's in-process artifact-repository cache.
`sqlite_uri_under` gives a relative `sqlite:///` path its meaning here: relative to the runs
root, not to whichever directory the command was started in. Risk: the rewrite is plain SQL on
MLflow's tables (`experiments`, `runs`, `model_versions`, `logged_models`; columns as of MLflow
3.17) and uses its private per-process cache; a table or column that is not there is skipped.
"""

from __future__ import annotations

import contextlib
import sqlite3
from pathlib import Path

SQLITE = "sqlite:///"
ARTIFACTS = "mlartifacts"
# (table, column) pairs that hold absolute artifact URIs in MLflow's sqlite schema.
ARTIFACT_COLUMNS = (
    ("experiments", "artifact_location"),
    ("runs", "artifact_uri"),
    ("model_versions", "source"),
    ("model_versions", "storage_location"),
    ("logged_models", "artifact_location"),
)


def sqlite_uri_under(uri: str, runs_root: str | Path) -> str:
    """`sqlite:///mlflow.db` -> `sqlite:////abs/runs_root/mlflow.db`; absolute sqlite and other URIs unchanged."""
    if not uri.startswith(SQLITE) or uri.startswith(SQLITE + "/") or uri == SQLITE + ":memory:":
        return uri
    return SQLITE + str(Path(runs_root).resolve() / uri.removeprefix(SQLITE))


def sqlite_file(uri: str | None) -> Path | None:
    """The database file of an absolute `sqlite:///` URI, else None."""
    if not uri or not uri.startswith(SQLITE + "/"):
        return None
    return Path(uri.removeprefix(SQLITE).split("?", 1)[0])


def relocate_local_store(recorded_uri: str | None, current_uri: str | None) -> int:
    """Re-point a moved store's artifact URIs from `<recorded db's folder>/mlartifacts` to `<current db's
    folder>/mlartifacts`; returns how many rows changed (0 when nothing moved or there is no such store)."""
    old_db, new_db = sqlite_file(recorded_uri), sqlite_file(current_uri)
    if old_db is None or new_db is None or old_db == new_db or not new_db.is_file():
        return 0
    old, new = (old_db.parent / ARTIFACTS).as_uri(), (new_db.parent / ARTIFACTS).as_uri()
    with contextlib.closing(sqlite3.connect(new_db)) as db, db:  # closed, and committed as one transaction
        moved_runs = [row[0] for row in db.execute(
            "SELECT run_uuid FROM runs WHERE substr(artifact_uri, 1, ?) = ?", (len(old) + 1, old + "/"))]
        changed = sum(_replace_prefix(db, table, column, old, new) for table, column in _present(db))
    _forget_artifact_repos(moved_runs)
    return changed


def _forget_artifact_repos(run_ids: list[str]) -> None:
    """MLflow caches each run's artifact repository by run id alone, for the life of the process: a process
    that logged to the original's runs (a copy has the same ids) would keep writing into the original's folder."""
    from mlflow.tracking._tracking_service import utils as tracking_utils

    cache = getattr(tracking_utils, "_artifact_repos_cache", {})
    for run_id in run_ids:
        cache.pop(run_id, None)


def _present(db: sqlite3.Connection) -> list[tuple[str, str]]:
    tables = {row[0] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    columns = {t: {row[1] for row in db.execute(f"PRAGMA table_info({t})")} for t in tables}
    return [(t, c) for t, c in ARTIFACT_COLUMNS if c in columns.get(t, ())]


def _replace_prefix(db: sqlite3.Connection, table: str, column: str, old: str, new: str) -> int:
    """`old` or `old/...` -> `new` or `new/...` (compared with substr: LIKE would read `_` in a path as a wildcard)."""
    cursor = db.execute(
        f"UPDATE {table} SET {column} = ? || substr({column}, ?) "
        f"WHERE {column} = ? OR substr({column}, 1, ?) = ?",
        (new, len(old) + 1, old, len(old) + 1, old + "/"),
    )
    return cursor.rowcount


def has_run(uri: str, run_id: str) -> bool:
    """Whether a local sqlite store holds `run_id` (a run folder copied without its store meets an empty one);
    any other store is asked nothing here (an unreachable server is the outage path's business)."""
    database = sqlite_file(uri)
    if database is None:
        return True
    if not database.is_file():
        return False
    with contextlib.closing(sqlite3.connect(database)) as db:
        try:
            return db.execute("SELECT 1 FROM runs WHERE run_uuid = ?", (run_id,)).fetchone() is not None
        except sqlite3.OperationalError:  # not an MLflow database yet (no runs table)
            return False
