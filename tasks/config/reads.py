"""Which config fields running code reads: the recording view the stage fingerprints are checked against.

While `recording_reads()` is open, every field of an `ExperimentConfig` (and of its sections, and of
the copies `model_copy`/`copy` make of them) that code in eagle3/, tasks/ or flows/ reads is recorded
as its schema path: an attribute read (`cfg.train.lr` -> `train.lr`), or a use of a whole section
(`model_dump`, iteration, `==`, `repr`) as a read of every field below it. List items lose their
index (`hosts.address`, `bench.sweep.num_steps`). Getting a section is not a read of its fields; an
optional section that is None is (`target.shape` None tells a stage something). Reads by other code
(Prefect walking a task's parameters, pydantic itself) are not a stage's and are left out.

Risk: code that reads around the view (`vars(section)`, a config rebuilt by `model_validate` from a
dump) is not seen. The recording is global while open (threads a stage starts count), so it is for
one stage at a time, as the pipeline runs them.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from eagle3.config import StrictModel

_ROOT = Path(__file__).resolve().parents[2]
_PROJECT = tuple(str(_ROOT / d) + os.sep for d in ("eagle3", "tasks", "flows"))
_THIS = str(Path(__file__).resolve())
_WHOLE = ("model_dump", "model_dump_json", "__iter__", "__eq__", "__repr__", "__str__")
_COPIES = ("__copy__", "__deepcopy__")


class ReadRecorder:
    """The schema paths read from the configs it has seen; configs are adopted when first touched."""

    def __init__(self, configs: tuple[BaseModel, ...] = ()) -> None:
        self.reads: set[str] = set()
        self._paths: dict[int, tuple[str, ...]] = {}
        self._kept: list[BaseModel] = []  # keeps every mapped object alive, so no id is reused
        self._lock = threading.Lock()
        for cfg in configs:
            self._map(cfg, ())

    def _map(self, model: BaseModel, path: tuple[str, ...]) -> None:
        self._paths[id(model)] = path
        self._kept.append(model)
        for name in type(model).__pydantic_fields__:
            for item in _sections_in(model.__dict__.get(name)):
                if id(item) not in self._paths:
                    self._map(item, path + (name,))

    def _path(self, model: BaseModel) -> tuple[str, ...] | None:
        path = self._paths.get(id(model))
        if path is None and _is_experiment(model):
            self._map(model, ())
            path = ()
        return path

    def note(self, model: BaseModel, name: str) -> None:
        with self._lock:
            path = self._path(model)
            if path is None:
                return
            value = model.__dict__.get(name)
            sections = _sections_in(value)
            if sections:  # a section (or a list of them): its fields are read one by one
                for item in sections:
                    if id(item) not in self._paths:
                        self._map(item, path + (name,))
                return
            self.reads.add(".".join(path + (name,)))

    def note_all(self, model: BaseModel) -> None:
        with self._lock:
            path = self._path(model)
            if path is not None:
                self.reads.update(_leaves(model, path))

    def adopt(self, original: BaseModel, copied: BaseModel) -> None:
        with self._lock:
            path = self._paths.get(id(original))
            if path is not None and isinstance(copied, BaseModel):
                self._map(copied, path)


def _is_experiment(model: BaseModel) -> bool:
    return type(model).__name__ == "ExperimentConfig" and type(model).__module__ == "tasks.config.schema"


def _sections_in(value: Any) -> list[BaseModel]:
    if isinstance(value, BaseModel):
        return [value]
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, BaseModel) for v in value):
        return list(value)
    return []


def _leaves(model: BaseModel, path: tuple[str, ...]) -> set[str]:
    found = set()
    for name in type(model).__pydantic_fields__:
        value = model.__dict__.get(name)
        sections = _sections_in(value)
        if sections:
            for item in sections:
                found |= _leaves(item, path + (name,))
        else:
            found.add(".".join(path + (name,)))
    return found


# ------------------------------------------------------------------ the hooks on StrictModel

_active: list[ReadRecorder] = []
_install_lock = threading.Lock()
_saved: dict[str, Any] = {}


def _from_project(depth: int = 2) -> bool:
    """Whether the code that made this call (two frames up: past the hook) is eagle3/, tasks/ or flows/."""
    name = sys._getframe(depth).f_code.co_filename
    return name.startswith(_PROJECT) and name != _THIS


def _getattribute(self: BaseModel, name: str) -> Any:
    if _active and name[0] != "_" and name in type(self).__pydantic_fields__ and _from_project():
        for recorder in list(_active):
            recorder.note(self, name)
    return object.__getattribute__(self, name)


def _whole(method_name: str):
    original = getattr(StrictModel, method_name)

    def hooked(self, *args, **kwargs):
        if _active and _from_project():
            for recorder in list(_active):
                recorder.note_all(self)
        return original(self, *args, **kwargs)

    hooked.__name__ = method_name
    return hooked


def _copying(method_name: str):
    original = getattr(StrictModel, method_name)

    def hooked(self, *args, **kwargs):
        copied = original(self, *args, **kwargs)
        for recorder in list(_active):
            recorder.adopt(self, copied)
        return copied

    hooked.__name__ = method_name
    return hooked


def _install() -> None:
    for name in ("__getattribute__", *_WHOLE, *_COPIES):
        _saved[name] = StrictModel.__dict__.get(name)
    StrictModel.__getattribute__ = _getattribute
    for name in _WHOLE:
        setattr(StrictModel, name, _whole(name))
    for name in _COPIES:
        setattr(StrictModel, name, _copying(name))


def _uninstall() -> None:
    for name, value in _saved.items():
        if value is None:
            delattr(StrictModel, name)
        else:
            setattr(StrictModel, name, value)
    _saved.clear()


@contextlib.contextmanager
def recording_reads(*configs: BaseModel) -> Iterator[set[str]]:
    """Record the config fields read inside the block; yields the set, filled as they are read.

    `configs` (ExperimentConfig objects) are known from the start, so a section taken from one by other
    code (a test, Prefect) is still theirs; a config first touched inside the block is adopted then."""
    recorder = ReadRecorder(configs)
    with _install_lock:
        if not _active:
            _install()
        _active.append(recorder)
    try:
        yield recorder.reads
    finally:
        with _install_lock:
            _active.remove(recorder)
            if not _active:
                _uninstall()


def covered(field: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    """Whether a dotted field is one of `prefixes` or lies under one (`train.lr` under `train`)."""
    return any(field == p or field.startswith(p + ".") for p in prefixes)

