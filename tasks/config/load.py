"""Experiment YAML -> validated `ExperimentConfig`, with errors that name file, line and field.

`load_experiment` is the only place YAML is read. `${ENV_VAR}` (and `${ENV_VAR:-default}`) is expanded
in string values before validation, so secrets live in the environment, never in the file. Sweep files
expand into one config per grid point (`load_sweep`, `load_variants`).
"""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from eagle3.config import NAME_PATTERN
from tasks.config.schema import ExperimentConfig
from tasks.config.yaml_lines import YamlProblem
from tasks.config.yaml_lines import parse as parse_yaml
from tasks.config.yaml_lines import read_text as read_yaml_text


class ConfigError(Exception):
    """A config that cannot be used; `messages` are `file:line: field.path: reason` lines."""

    def __init__(self, messages: list[str]):
        super().__init__("\n".join(messages))
        self.messages = messages


_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def load_experiment(path: str | Path, variant: int | None = None) -> ExperimentConfig:
    """Read, interpolate and validate one experiment file; raise ConfigError naming file:line: field.

    For a sweep file, `variant` picks one expanded grid point (0-based).
    """
    data, lines, shown = _read_yaml(Path(path))
    if "sweep" in data:
        variants = _expand_sweep(Path(path), data, lines, shown)
        if variant is None or not 0 <= variant < len(variants):
            raise ConfigError([f"{shown}:{_line_of(('sweep', 'grid'), lines)}: sweep.grid: {len(variants)} variants; "
                               f"choose one with variant 0..{len(variants) - 1}"])
        return variants[variant][1]
    if variant is not None:
        raise ConfigError([f"{shown}:1: not a sweep file, so it has no variant {variant}"])
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as err:
        raise ConfigError([_format_error(e, shown, lines) for e in err.errors()]) from None


def is_sweep(path: str | Path) -> bool:
    data, _, _ = _read_yaml(Path(path))
    return "sweep" in data


def load_variants(path: str | Path) -> list[tuple[str | None, ExperimentConfig]]:
    """An experiment file as [(None, config)], a sweep file as its named variants; the file is read once."""
    data, lines, shown = _read_yaml(Path(path))
    if "sweep" in data:
        return _expand_sweep(Path(path), data, lines, shown)
    try:
        return [(None, ExperimentConfig.model_validate(data))]
    except ValidationError as err:
        raise ConfigError([_format_error(e, shown, lines) for e in err.errors()]) from None


MAX_SWEEP_VARIANTS = 256  # each one a server launch; validate prints every one


def load_sweep(path: str | Path) -> list[tuple[str, ExperimentConfig]]:
    """Expand a sweep file (`sweep: {base, name, grid}`) into named, validated variants.

    Each grid entry maps dotted field paths to values that replace the base's, e.g.
    `{deploy.speculative: {num_steps: 3, eagle_topk: 1, num_draft_tokens: 4}}`. An error in an
    overridden field (or a rule naming one) points at the grid entry's line; any other at the base
    file's line, once however many variants share it.
    """
    return _expand_sweep(Path(path), *_read_yaml(Path(path)))


def _expand_sweep(path: Path, data: dict, lines: dict[tuple, int], shown: str) -> list[tuple[str, ExperimentConfig]]:
    name, grid = _sweep_shape(data, lines, shown)
    base_path = _sweep_base(path, data["sweep"]["base"], lines, shown)
    base, base_lines, base_shown = _read_yaml(base_path)
    if "sweep" in base:
        raise ConfigError([f"{shown}:{_line_of(('sweep', 'base'), lines)}: sweep.base: {base_shown} is a sweep file "
                           "itself; a sweep's base is one experiment"])
    variants, errors = [], []
    for i, overrides in enumerate(grid):
        grid_line = _line_of(("sweep", "grid", i), lines)
        try:
            variant = _apply_overrides(base, overrides)
            variants.append((f"{name}-{i}", ExperimentConfig.model_validate(variant)))
        except _OverrideError as err:
            errors.append(f"{shown}:{grid_line}: sweep.grid[{i}]: {err}")
        except ValidationError as err:
            for e in err.errors():
                if _overridden(e, overrides):
                    errors.append(_format_error(e, shown, lines, line=grid_line, tag=f"sweep.grid[{i}]"))
                else:
                    errors.append(_format_error(e, base_shown, base_lines))
    if errors:
        raise ConfigError(list(dict.fromkeys(errors)))  # a base error shared by every variant, once
    return variants


def _sweep_shape(data: dict, lines: dict[tuple, int], shown: str) -> tuple[str, list[dict]]:
    """The sweep's name and grid, or ConfigError naming the key that is not what a sweep file holds."""
    sweep = data.get("sweep")
    if set(data) != {"sweep"}:
        extra = next(k for k in data if k != "sweep")
        raise ConfigError([f"{shown}:{_line_of((extra,), lines)}: {_short(extra)}: a sweep file holds only `sweep` "
                           "(base, name, grid); put experiment fields in the base"])
    if not isinstance(sweep, dict) or set(sweep) - {"base", "name", "grid"} or "base" not in sweep:
        raise ConfigError([f"{shown}:{_line_of(('sweep',), lines)}: sweep: expected a mapping with keys base, name, grid"])
    name = sweep.get("name", "sweep")
    if not isinstance(name, str) or not re.match(NAME_PATTERN, name):
        raise ConfigError([f"{shown}:{_line_of(('sweep', 'name'), lines)}: sweep.name: must match {NAME_PATTERN} "
                           f"(got {_short(repr(name))})"])
    grid = sweep.get("grid")
    where = f"{shown}:{_line_of(('sweep', 'grid'), lines)}: sweep.grid"
    if not isinstance(grid, list) or not grid:
        raise ConfigError([f"{where}: expected a non-empty list of {{field.path: value}} mappings"])
    if len(grid) > MAX_SWEEP_VARIANTS:
        raise ConfigError([f"{where}: {len(grid)} entries; a sweep has at most {MAX_SWEEP_VARIANTS}"])
    for i, entry in enumerate(grid):
        if not isinstance(entry, dict) or not entry:
            raise ConfigError([f"{shown}:{_line_of(('sweep', 'grid', i), lines)}: sweep.grid[{i}]: expected a "
                               "non-empty mapping of field paths to values, e.g. {deploy.port: 30001}"])
    return name, grid


def _sweep_base(path: Path, base: Any, lines: dict[tuple, int], shown: str) -> Path:
    """The base file next to the sweep file; a missing or unreadable one is named at the sweep's line."""
    where = f"{shown}:{_line_of(('sweep', 'base'), lines)}: sweep.base"
    if not isinstance(base, str) or not base.strip():
        raise ConfigError([f"{where}: expected the path of an experiment file (got {_short(repr(base))})"])
    base_path = _absolute(path.parent / base)
    try:
        os.stat(base_path)
    except FileNotFoundError:
        raise ConfigError([f"{where}: {_short(base)}: file not found (relative to the sweep file)"]) from None
    except OSError as err:
        raise ConfigError([f"{where}: {_short(base)}: cannot read ({err.strerror or err})"]) from None
    return base_path


class _OverrideError(ValueError):
    """A grid entry key that cannot be applied to the base (a path through a value that is not a section)."""


def field_location(path: str | Path, field: str, variant: int | None = None) -> str:
    """`file:line` where `field` (dotted; list items by index, bench.sweep.0) is written in a config that loads:
    in a sweep variant, its grid entry's line when the entry sets the field, else the base file's line."""
    path = Path(path)
    data, lines, shown = _read_yaml(path)
    loc = tuple(int(part) if part.isdigit() else part for part in field.split("."))
    if "sweep" in data and variant is not None:
        if _overridden({"loc": loc, "type": "field", "msg": ""}, data["sweep"]["grid"][variant]):
            return f"{shown}:{_line_of(('sweep', 'grid', variant), lines)}"
        _, lines, shown = _read_yaml(_sweep_base(path, data["sweep"]["base"], lines, shown))
    return f"{shown}:{_line_of(loc, lines)}"


def _apply_overrides(base: dict, overrides: dict) -> dict:
    variant = copy.deepcopy(base)
    for dotted, value in overrides.items():
        parts = str(dotted).split(".")
        if not all(part.strip() for part in parts):
            raise _OverrideError(f"{_short(str(dotted))}: expected a field path such as deploy.port")
        node = variant
        for depth, part in enumerate(parts[:-1]):
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                parent = ".".join(parts[:depth + 1])
                kind = "a list" if isinstance(node, list) else "null" if node is None else f"a {type(node).__name__}"
                raise _OverrideError(f"{_short(str(dotted))}: {parent} is {kind} in the base, not a section; "
                                     f"replace {parent} whole")
        node[parts[-1]] = copy.deepcopy(value)
    return variant


def _overridden(error: dict, overrides: dict) -> bool:
    """Whether a grid entry caused this error: its field is at or under an overridden path (or above one),
    or a cross-field rule names an overridden field."""
    keys = [tuple(str(k).split(".")) for k in overrides]
    named = [tuple(map(str, error["loc"]))] if error["loc"] else []
    if error["type"] == "value_error":
        named += [tuple(d.split(".")) for d in re.findall(r"\b[a-z_]+(?:\.(?:[a-z_]+|\d+))+\b", error["msg"])]
    return any(n[:len(k)] == k or k[:len(n)] == n for n in named for k in keys if n)


def _read_yaml(path: Path) -> tuple[dict, dict[tuple, int], str]:
    """Parsed + interpolated mapping, its key-path -> line index, and the path as shown in errors."""
    shown = _display_path(path)
    try:
        root, data = parse_yaml(read_yaml_text(path))
    except FileNotFoundError:
        raise ConfigError([f"{shown}: file not found"]) from None
    except OSError as err:  # a symlink loop, a directory, no permission
        raise ConfigError([f"{shown}: cannot read the file ({err.strerror or err})"]) from None
    except YamlProblem as problem:
        where = f"{shown}:{problem.line}" if problem.line else shown
        raise ConfigError([f"{where}: {problem.message}"]) from None
    if not isinstance(data, dict):
        raise ConfigError([f"{shown}:1: the file must be a mapping of sections (experiment, target, data, ...)"])
    lines = _line_index(root)
    return _interpolate(data, (), shown, lines), lines, shown


def _absolute(path: Path) -> Path:
    """`path.resolve()`, or the plain absolute path where resolving fails (a symlink loop)."""
    try:
        return path.resolve()
    except (OSError, RuntimeError):
        return Path(os.path.abspath(path))


def _display_path(path: Path) -> str:
    try:
        return str(_absolute(path).relative_to(Path.cwd()))
    except ValueError:
        return str(path)


def _line_index(node: yaml.Node | None, prefix: tuple = ()) -> dict[tuple, int]:
    """Map every key path, e.g. ('train', 'ttt_steps') or ('hosts', 0, 'port'), to its 1-based line."""
    index: dict[tuple, int] = {}
    if node is None:
        return index
    index[prefix] = node.start_mark.line + 1
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            path = prefix + (key_node.value,)
            index.update(_line_index(value_node, path))
            index[path] = key_node.start_mark.line + 1
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            index.update(_line_index(item, prefix + (i,)))
    return index


def _line_of(loc: tuple, lines: dict[tuple, int]) -> int:
    """Line of the deepest existing prefix of `loc` (a missing key reports its parent's line)."""
    for end in range(len(loc), -1, -1):
        if loc[:end] in lines:
            return lines[loc[:end]]
    return 1


def _interpolate(value: Any, loc: tuple, shown: str, lines: dict[tuple, int]) -> Any:
    if isinstance(value, dict):
        return {k: _interpolate(v, loc + (k,), shown, lines) for k, v in value.items()}
    if isinstance(value, list):
        return [_interpolate(v, loc + (i,), shown, lines) for i, v in enumerate(value)]
    if not isinstance(value, str):
        return value

    def expand(match: re.Match) -> str:
        name, default = match.group(1), match.group(2)
        if name in os.environ:
            return os.environ[name]
        if default is not None:
            return default
        raise ConfigError([f"{shown}:{_line_of(loc, lines)}: {_field_name(loc)}: environment variable {name} is not set"])

    if "${" in _ENV_REF.sub("", value):  # kept literally, it would reach a server or a shell as `${...`
        raise ConfigError([f"{shown}:{_line_of(loc, lines)}: {_field_name(loc)}: malformed reference in "
                           f"{_short(repr(value))}: write ${{NAME}} or ${{NAME:-default}} (NAME: letters, digits, _)"])
    if any("${" in (m.group(2) or "") for m in _ENV_REF.finditer(value)):
        # `${A:-${B}}`: the default would end at B's `}`, and with A unset the text `${B}` would be kept
        raise ConfigError([f"{shown}:{_line_of(loc, lines)}: {_field_name(loc)}: nested reference in "
                           f"{_short(repr(value))}: a default is text, not another ${{...}}; write "
                           "${NAME:-text}, or set NAME"])
    return _ENV_REF.sub(expand, value)


def _field_name(loc: tuple) -> str:
    return ".".join(_short(str(p), 80) for p in loc)


def _short(text: str, limit: int = 120) -> str:
    """`text` cut to `limit` characters: an error names a value, it does not echo a 50 MB one."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


def _shown(value: Any) -> str:
    """A value as an error quotes it: its repr, cut, with a long string's own length."""
    text = repr(value)
    if len(text) <= 120:
        return text
    return f"{text[:120]}... ({len(value) if isinstance(value, str) else len(text)} characters)"


def _format_error(error: dict, shown: str, lines: dict[tuple, int], line: int | None = None,
                  tag: str | None = None) -> str:
    """`file:line: field: reason` for one pydantic error; `line` overrides the lookup, `tag` (a sweep's
    grid entry) goes before the field."""
    loc = tuple(error["loc"])
    reason = _reason(error, loc)
    line_loc = loc
    if len(loc) >= 2 and loc[-1] == "[key]":  # a mapping's key (deploy.env): the mapping, the key's line and repr
        line_loc, loc = loc[:-1], loc[:-2]
        reason = f"key {_shown(line_loc[-1])}: {reason.removesuffix(f' (got {_shown(line_loc[-1])})')}"
    field = _field_name(loc)
    if line is None:
        line = _line_of(line_loc, lines)
        if error["type"] == "value_error":
            line = _line_of_named_field(reason, lines) or line
    where = f"{shown}:{line}: " + (f"{tag}: " if tag else "")
    if not field or any(reason.startswith(field + sep) for sep in (" ", ":", ".")):
        return where + reason
    return f"{where}{field}: {reason}"


def _line_of_named_field(reason: str, lines: dict[tuple, int]) -> int | None:
    """Cross-field rules name their fields ("deploy.host '...' is ..."): point at the first one present."""
    leading = re.match(r"^([a-z_]+):", reason)
    for dotted in ([leading.group(1)] if leading else []) + re.findall(r"\b[a-z_]+(?:\.(?:[a-z_]+|\d+))+\b", reason):
        path = tuple(int(part) if part.isdigit() else part for part in dotted.split("."))
        if path in lines:
            return lines[path]
    return None


def _reason(error: dict, loc: tuple) -> str:
    kind, ctx, given = error["type"], error.get("ctx") or {}, error.get("input")
    bounds = {"greater_than_equal": ">=", "greater_than": ">", "less_than_equal": "<=", "less_than": "<"}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        return f"must be {bounds[kind]} {limit} (got {_shown(given)})"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        allowed = _allowed_fields(loc[:-1])
        return f"unknown field (allowed: {', '.join(allowed)})" if allowed else "unknown field"
    if kind == "value_error":
        return _short(error["msg"].removeprefix("Value error, "), 1000)
    message = error["msg"].replace("Input should be", "must be").replace("String should", "must")
    if isinstance(given, (str, int, float, bool)) or given is None:
        return f"{message} (got {_shown(given)})"
    return message


def _allowed_fields(parent: tuple) -> list[str]:
    """Field names of the section at `parent`, for 'unknown field' messages."""
    model: Any = ExperimentConfig
    for part in parent:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if isinstance(model, type) else None
        if field is None:
            return []
        model = _model_type(field.annotation)
        if model is None:
            return []
    return list(model.model_fields)


def _model_type(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = _model_type(arg)
        if found:
            return found
    return None
