"""A generated corpus of bad configs, each answered in one line: exit 2 and `file:line: field: reason`.

Every case is a mutation of a shipped config (configs/*.yaml) or of the shipped sweep
(configs/sweeps/), built here: what it changes, the file and line the answer must point at and a
fragment naming the field (or the file). Two families:
- schema-driven: for every leaf field of `ExperimentConfig` and its nested models, a value past
  its bound, of the wrong type or outside its choices, and a misspelt sibling of each section's
  first field, written into the shipped configs in turn;
- the defects found by hand: sweep overrides through a string or a list, launch flags SGLang
  refuses, model folders with a broken config.json, encodings, deep nesting, anchors, an alias
  bomb, symlink loops, Rich markup, a 50 MB file, jump hosts, malformed `${...}`, addresses with
  whitespace, seeds and ports out of range, layer ids past the target, duplicate keys;
- issue 33's (`round3_mutations`): NUL bytes, non-finite floats, ints past any run, environment names, nested
  `${...}` defaults, and what the preflight (tasks/stages/preflight.py) finds in the files the config names
  (the draft of `--speculative-draft-model-path`, prompt files) or in its lengths.
The expected line is the line the mutation wrote, found by the text edit itself (never by the
loader's line index). `eagleops validate` answers each one, `eagleops run` every fifth one the loader refuses
and every one the preflight refuses (both before Prefect starts), in-process, no traceback; each one's wall time is
measured (a hang guard, not a speed figure: `EAGLEOPS_CORPUS_TIMES=file` writes them out); the cases that try to
make the loader spend (bomb, nesting, size) are also held to a memory peak.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
import tracemalloc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import pytest
from pydantic import AwareDatetime, BaseModel, SecretStr
from typer.testing import CliRunner

from flows.cli import app
from tasks.config.schema import ExperimentConfig

REPO = Path(__file__).resolve().parents[3]
SHIPPED = {p.name: p.read_text() for p in sorted((REPO / "configs").glob("*.yaml"))}
SWEEP_NAME = "llama-3.1-8b-spec-grid.yaml"
SWEEP = (REPO / "configs" / "sweeps" / SWEEP_NAME).read_text()
SWEEP_BASE = "llama-3.1-8b.yaml"
runner = CliRunner()


@dataclass
class Mutation:
    """One bad config: the files to write (`@TMP@` = the case's folder), the one to validate, and the answer."""

    name: str
    files: dict[str, str | bytes]
    entry: str
    where: str | None  # "file:line" the answer must name; None = the file alone (it cannot be read)
    fragment: str
    at_load: bool = True  # refused by the loader (False: by the preflight, which `run` also runs before Prefect)
    links: dict[str, str] = field(default_factory=dict)  # symlink -> target, relative to the case's folder
    heavy: bool = False  # measure the memory peak too


# ------------------------------------------------------------------ editing YAML text by lines


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip(" "))


def _content(line: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not stripped.startswith("#")


class Doc:
    """A YAML file as lines, edited the way a person would: set one key, report the line written."""

    def __init__(self, text: str):
        self.lines = text.rstrip("\n").split("\n")

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"

    def _block_end(self, i: int) -> int:
        own, j = _indent(self.lines[i]), i + 1
        while j < len(self.lines) and (not _content(self.lines[j]) or _indent(self.lines[j]) > own):
            j += 1
        return j

    def _find(self, key: str, start: int, end: int, item: int | None = None) -> int | None:
        """The line of `key` among the direct children of [start, end); in a list item (`item` = the indent of
        its dash) the key may sit on the dash line."""
        children = [i for i in range(start, end) if _content(self.lines[i])]
        if not children:
            return None
        indent = _indent(self.lines[children[0]])
        lead = rf"( {{{item}}}- | {{{item + 2}}})" if item is not None else rf"( {{{indent}}})"
        pattern = re.compile(rf"^{lead}{re.escape(key)}:(\s|$)")
        return next((i for i in children if pattern.match(self.lines[i])), None)

    def _inline(self, i: int) -> bool:
        value = self.lines[i].split(":", 1)[1].split(" #")[0].strip()
        return bool(value)

    def set(self, path: tuple, value: str) -> int | None:
        """Write `path: value` (block style); the 1-based line written, None where a flow mapping is in the way."""
        start, end, indent, item = 0, len(self.lines), 0, None
        for depth, key in enumerate(path):
            last = depth == len(path) - 1
            if isinstance(key, int):
                items = [i for i in range(start, end) if self.lines[i].lstrip().startswith("- ")
                         and _indent(self.lines[i]) == indent]
                if len(items) <= key:
                    return None
                start, end = items[key], (items[key + 1] if key + 1 < len(items) else end)
                item, indent = indent, indent + 2
                continue
            found = self._find(key, start, end, item)
            if found is None:
                if any(isinstance(k, int) for k in path[depth:]):
                    return None
                at = end if depth == 0 else start + (item is not None)
                chain = [" " * (indent + 2 * n) + f"{k}:" for n, k in enumerate(path[depth:])]
                chain[-1] += f" {value}"
                self.lines[at:at] = chain
                return at + len(chain)
            if last:
                prefix = self.lines[found][:self.lines[found].index(key)]
                del self.lines[found + 1:self._block_end(found)]
                self.lines[found] = f"{prefix}{key}: {value}"
                return found + 1
            if self._inline(found):
                return None
            start, end, item = found + 1, self._block_end(found), None
            children = [i for i in range(start, end) if _content(self.lines[i])]
            indent = _indent(self.lines[children[0]]) if children else _indent(self.lines[found]) + 2
            if children and self.lines[children[0]].lstrip().startswith("- "):
                indent = _indent(self.lines[children[0]])
        return None

    def line_of(self, needle: str, after: int = 0) -> int:
        """1-based line of the first line (at or after line `after`) that, comments aside, starts with `needle`."""
        return next(i + 1 for i, line in enumerate(self.lines) if i + 1 >= after and line.strip().startswith(needle))


def y(value: Any) -> str:
    """A value as one line of YAML (JSON is YAML's flow style)."""
    return json.dumps(value)


# ------------------------------------------------------------------ schema-driven mutations


def _model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next((m for m in map(_model, get_args(annotation)) if m), None)


def _is_list(annotation: Any) -> bool:
    return get_origin(annotation) is list or any(_is_list(a) for a in get_args(annotation) if a is not type(None))


def schema_leaves(model: type[BaseModel] = ExperimentConfig, prefix: tuple = ()):
    """(path, FieldInfo) of every leaf field; items of a list of sections get index 0."""
    for name, info in model.model_fields.items():
        sub = _model(info.annotation)
        if sub is None:
            yield prefix + (name,), info
        else:
            yield from schema_leaves(sub, prefix + (name,) + ((0,) if _is_list(info.annotation) else ()))


def sections(model: type[BaseModel] = ExperimentConfig, prefix: tuple = ()):
    """(path, first field name) of every section, for a misspelt-key mutation."""
    yield prefix, next(iter(model.model_fields))
    for name, info in model.model_fields.items():
        sub = _model(info.annotation)
        if sub is not None and not _is_list(info.annotation):
            yield from sections(sub, prefix + (name,))


def _base_type(annotation: Any) -> Any:
    args = [a for a in get_args(annotation) if a is not type(None)]
    return _base_type(args[0]) if get_origin(annotation) not in (None, Literal, list, tuple, dict) and args \
        else annotation


def bad_values(info) -> list[Any]:
    """Values the field's declared type and bounds refuse (read from the schema: the bounds are the spec)."""
    kind = _base_type(info.annotation)
    meta = {type(m).__name__: m for m in info.metadata}
    pattern = next((m.pattern for m in info.metadata if getattr(m, "pattern", None)), None)
    origin = get_origin(kind)
    if origin is Literal:
        return ["no-such-choice"]
    if kind is bool:
        return ["perhaps"]
    if kind in (int, float):
        step = 1 if kind is int else 0.5
        values = []
        if "Ge" in meta:
            values.append(meta["Ge"].ge - step)
        if "Gt" in meta:
            values.append(meta["Gt"].gt)
        if "Le" in meta:
            values.append(meta["Le"].le + step)
        if "Lt" in meta:
            values.append(meta["Lt"].lt)
        return values[:2] + ["twelve"]
    if origin is list:
        values = ["not-a-list"]
        if "MinLen" in meta:
            values.append([])
        if "MaxLen" in meta:
            values.append(list(range(meta["MaxLen"].max_length + 1)))
        return values
    if origin is tuple:
        return ["not-a-tuple"]
    if origin is dict:
        return [["not", "a", "mapping"]]
    if kind in (str, SecretStr):
        if pattern:
            return ["Not A Name!\tx"]
        if "MaxLen" in meta:
            return ["x" * (meta["MaxLen"].max_length + 1)]
        if "MinLen" in meta:
            return [""]
        return [[1, 2]]
    if kind is AwareDatetime:
        return ["2026-01-01T00:00:00"]  # no timezone
    raise AssertionError(f"no bad value for {kind}")


def schema_mutations() -> list[Mutation]:
    names = sorted(SHIPPED)
    cases: list[Mutation] = []
    for n, (path, info) in enumerate(schema_leaves()):
        dotted = ".".join(map(str, path))
        for k, value in enumerate(bad_values(info)):
            for shift in range(len(names)):  # the shipped configs in turn; the next one where the path is editable
                name = names[(n + k + shift) % len(names)]
                doc = Doc(SHIPPED[name])
                line = doc.set(path, y(value))
                if line is None and 0 in path:  # no such list item here: the list, written with one item
                    cut = path.index(0)
                    item = {".".join(map(str, path[cut + 1:])): value} if len(path) == cut + 2 else None
                    line = doc.set(path[:cut], y([item])) if item else None
                if line is not None:
                    cases.append(Mutation(f"{dotted}={str(value)[:20]}@{name}", {name: doc.text()}, name,
                                          f"{name}:{line}", f"{dotted}: "))
                    break
            else:
                raise AssertionError(f"{dotted}: no shipped config where it can be written")
    for n, (path, first) in enumerate(sections()):
        dotted = ".".join(path + (first + "_x",))
        for shift in range(len(names)):
            name = names[(n + shift) % len(names)]
            doc = Doc(SHIPPED[name])
            line = doc.set(path + (first + "_x",), "1")
            if line is not None:
                cases.append(Mutation(f"unknown {dotted}@{name}", {name: doc.text()}, name, f"{name}:{line}",
                                      f"{dotted}: unknown field (allowed: {first}"))  # `,` or `)`: one field
                break
    return cases


# ------------------------------------------------------------------ the defects found by hand


def edited(name: str, *edits: tuple[tuple, Any], raw: bool = False) -> tuple[str, int]:
    """A shipped config with fields set; the text and the line of the last edit."""
    doc = Doc(SHIPPED[name])
    line = 0
    for path, value in edits:
        line = doc.set(path, value if raw else y(value))
        assert line is not None, (name, path)
    return doc.text(), line


def case(name: str, config: str, edits: list, fragment: str, **kw) -> Mutation:
    text, line = edited(config, *edits, raw=kw.pop("raw", False))
    return Mutation(name, {config: text, **kw.pop("files", {})}, config, kw.pop("where", f"{config}:{line}"),
                    fragment, **kw)


def sweep_case(name: str, grid: str | None, fragment: str, *, base: str | None = None, where: str | None = None,
               sweep: str | None = None, **kw) -> Mutation:
    """The shipped sweep (in sweeps/) over its base (beside it); `grid` replaces the first grid entry's line."""
    text = sweep or SWEEP
    if grid is not None:
        first = next(line for line in text.splitlines() if line.strip().startswith("- {deploy.speculative"))
        text = text.replace(first, f"    - {grid}", 1)
    doc = Doc(text)
    where = where or f"{SWEEP_NAME}:{doc.line_of('- ', doc.line_of('grid:'))}"
    return Mutation(name, {f"sweeps/{SWEEP_NAME}": text, SWEEP_BASE: base or SHIPPED[SWEEP_BASE], **kw.pop("files", {})},
                    f"sweeps/{SWEEP_NAME}", where, fragment, **kw)


def bomb(levels: int = 9) -> str:
    """Billion laughs: each anchor lists the previous one 10 times (10**levels values expanded)."""
    lines = ['a0: &a0 ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    lines += [f"a{i}: &a{i} [" + ", ".join([f"*a{i - 1}"] * 10) + "]" for i in range(1, levels)]
    return "\n".join(lines) + f"\ndescription: *a{levels - 1}\n"


def hand_mutations() -> list[Mutation]:
    tiny, llama, kimi = "tiny.yaml", "llama-3.1-8b.yaml", "kimi-k2.5-int4.yaml"
    tiny_doc = Doc(SHIPPED[tiny])
    exp_line = tiny_doc.line_of("experiment: tiny")
    lr_line = tiny_doc.line_of("lr: 0.02")
    refused = {"num_steps": 2, "eagle_topk": 2, "num_draft_tokens": 32}
    adaptive = ["--speculative-adaptive", "--speculative-adaptive-config"]
    model = {"target": (("target", "kind"), "hf"), "path": (("target", "model_path"), "@TMP@/model")}
    cases = [
        # sweep overrides that cannot be applied, and grid entries SGLang refuses
        sweep_case("override through a string", '{experiment.name: x}', "sweep.grid[0]: experiment.name: experiment is a str"),
        sweep_case("override through a list", '{bench.concurrency.0: 2}', "bench.concurrency is a list in the base"),
        sweep_case("override through an int", '{train.epochs.x: 2}', "train.epochs is a int in the base"),
        sweep_case("override with an empty segment", '{deploy..port: 2}', "sweep.grid[0]: deploy..port: expected a field path"),
        sweep_case("grid entry not a mapping", "5", "sweep.grid[0]: expected a non-empty mapping"),
        sweep_case("grid entry empty", "{}", "sweep.grid[0]: expected a non-empty mapping"),
        sweep_case("grid entry out of bounds", "{deploy.speculative: {num_steps: 0}}",
                   "sweep.grid[0]: deploy.speculative.num_steps: must be >= 1"),
        sweep_case("grid entry with an unknown field", "{deploy.speculatve: {num_steps: 3}}",
                   "sweep.grid[0]: deploy.speculatve: unknown field"),
        sweep_case("grid entry naming another host", "{deploy.host: gpu-9}", "deploy.host 'gpu-9' is neither"),
        sweep_case("grid entry SGLang refuses", f"{{deploy.speculative: {y(refused)}}}", "too large for the draft tree",
                   at_load=False),
        sweep_case("grid entry SGLang rewrites", "{deploy.speculative: {num_steps: 1, eagle_topk: 1, "
                   "num_draft_tokens: 16}}", "deploy.speculative.num_draft_tokens: asked 16, SGLang runs 2",
                   at_load=False),
        sweep_case("grid empty", None, "sweep.grid: expected a non-empty list", sweep=re.sub(
            r"  grid:\n(    - .*\n)+", "  grid: []\n", SWEEP), where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('grid:')}"),
        sweep_case("sweep key misspelt", None, "sweep: expected a mapping with keys base, name, grid",
                   sweep=SWEEP.replace("  name: spec-grid", "  nmae: spec-grid"),
                   where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('sweep:')}"),
        sweep_case("sweep name not a name", None, "sweep.name: must match", sweep=SWEEP.replace(
            "  name: spec-grid", "  name: [spec, grid]"), where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('name:')}"),
        sweep_case("experiment field beside the sweep", None, "experiment: a sweep file holds only `sweep`",
                   sweep=SWEEP + "experiment: other\n", where=f"{SWEEP_NAME}:{len(SWEEP.splitlines()) + 1}"),
        sweep_case("base missing", None, "sweep.base: ../nowhere.yaml: file not found", sweep=SWEEP.replace(
            "../llama-3.1-8b.yaml", "../nowhere.yaml"), where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('base:')}"),
        sweep_case("base a list", None, "sweep.base: expected the path of an experiment file", sweep=SWEEP.replace(
            "../llama-3.1-8b.yaml", "[a, b]"), where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('base:')}"),
        sweep_case("base a symlink loop", None, "sweep.base: ../loop.yaml: cannot read", sweep=SWEEP.replace(
            "../llama-3.1-8b.yaml", "../loop.yaml"), links={"loop.yaml": "loop.yaml"},
            where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('base:')}"),
        sweep_case("base a sweep itself", None, "is a sweep file itself", sweep=SWEEP.replace(
            "../llama-3.1-8b.yaml", SWEEP_NAME), where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('base:')}"),
        sweep_case("base with an error the grid does not touch", None, "train.lr: must be > 0",
                   base=edited(llama, (("train", "lr"), 0))[0],
                   where=f"{SWEEP_BASE}:{edited(llama, (('train', 'lr'), 0))[1]}"),
        # launch flags and model folders (validate's checks; `run` leaves them to the deploy preflight)
        case("bench.sweep entry SGLang refuses", tiny, [(("bench", "sweep"), [refused])], "bench.sweep.0: sglang_settings",
             at_load=False),
        case("adaptive config missing", tiny, [(("deploy", "extra_args"), adaptive + ["@TMP@/none.json"])],
             "deploy.extra_args: sglang_settings: FileNotFoundError", at_load=False),
        case("adaptive config not JSON", tiny, [(("deploy", "extra_args"), adaptive + ["@TMP@/a.json"])],
             "deploy.extra_args: sglang_settings: JSONDecodeError", at_load=False, files={"a.json": "{not json"}),
        case("adaptive config a list", tiny, [(("deploy", "extra_args"), adaptive + ["@TMP@/a.json"])],
             "must contain at least one integer-string BS key", at_load=False, files={"a.json": "[1, 2]"}),
        case("target config.json truncated", tiny, [model["target"], model["path"]],
             "target.model_path: model_config:", at_load=False,
             files={"model/config.json": '{"architectures": ["LlamaFor'}),
        case("target config.json a list", tiny, [model["target"], model["path"]], "expected a JSON object, found a list",
             at_load=False, files={"model/config.json": "[1, 2]"}),
        case("target config.json without architectures", tiny, [model["target"], model["path"]],
             "'architectures' must be a non-empty list", at_load=False, files={"model/config.json": '{"x": 1}'}),
        case("aux ids past the config.json depth", tiny, [model["target"], model["path"],
                                                           (("target", "aux_layer_ids"), [1, 2, 9])],
             "target.aux_layer_ids: model_config: target.aux_layer_ids [1, 2, 9]: id 9 is past the 4 decoder layers",
             at_load=False, files={"model/config.json": '{"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 4}'}),
        # what the file is made of
        Mutation("not UTF-8", {tiny: SHIPPED[tiny].replace("description: Tiny", "description: Tin\xe9").encode("latin-1")},
                 tiny, f"{tiny}:{tiny_doc.line_of('description:')}", "not UTF-8 text (byte 0xe9)"),
        Mutation("UTF-16 with a BOM", {tiny: SHIPPED[tiny].encode("utf-16")}, tiny, f"{tiny}:1", "UTF-16 text"),
        Mutation("UTF-16 without a BOM", {tiny: SHIPPED[tiny].encode("utf-16-le")}, tiny, f"{tiny}:1", "NUL byte"),
        Mutation("control character", {tiny: SHIPPED[tiny].replace("Tiny CPU", "Tiny\x07CPU")}, tiny,
                 f"{tiny}:{tiny_doc.line_of('description:')}", "control characters are not allowed"),
        Mutation("a list, not a mapping", {tiny: "- experiment: tiny\n"}, tiny, f"{tiny}:1", "must be a mapping"),
        Mutation("empty file", {tiny: ""}, tiny, f"{tiny}:1", "must be a mapping of sections"),
        Mutation("two documents", {tiny: SHIPPED[tiny] + "---\nexperiment: x\n"}, tiny,
                 f"{tiny}:{len(SHIPPED[tiny].splitlines()) + 1}", "expected a single document"),
        Mutation("tab indentation", {tiny: SHIPPED[tiny].replace("  lr: 0.02", "\tlr: 0.02")}, tiny, f"{tiny}:{lr_line}",
                 "invalid YAML"),
        case("unclosed flow list", tiny, [(("bench", "concurrency"), "[1, 2")], "invalid YAML", raw=True),
        case("python tag", tiny, [(("description",), "!!python/object/apply:os.system [echo]")],
             "could not determine a constructor", raw=True),
        case("impossible date", tiny, [(("description",), "2024-13-45")], "cannot read the value '2024-13-45'", raw=True),
        case("5000-digit integer", tiny, [(("train", "max_steps"), "9" * 5000)], "cannot read the value", raw=True),
        Mutation("nested 200 levels", {tiny: SHIPPED[tiny] + "description: " + "[" * 200 + "]" * 200 + "\n"}, tiny,
                 f"{tiny}:{len(SHIPPED[tiny].splitlines()) + 1}", "nested more than 32 levels deep", heavy=True),
        Mutation("nested 100000 levels", {tiny: SHIPPED[tiny] + "description: " + "[" * 100_000 + "]" * 100_000 + "\n"},
                 tiny, f"{tiny}:{len(SHIPPED[tiny].splitlines()) + 1}", "invalid YAML", heavy=True),
        Mutation("mappings nested 40 deep", {tiny: SHIPPED[tiny] + "".join("  " * i + f"k{i}:\n" for i in range(40))},
                 tiny, f"{tiny}:{len(SHIPPED[tiny].splitlines()) + 32}", "nested more than 32 levels deep", heavy=True),
        case("anchor containing its alias", tiny, [(("description",), "&d [1, *d]")], "alias *d is used inside", raw=True),
        case("mapping anchor containing its alias", tiny, [(("target", "tiny"), "&t {x: *t}")], "alias *t is used inside",
             raw=True),
        Mutation("alias bomb", {tiny: SHIPPED[tiny] + bomb()}, tiny, None, "aliases expand this node to more than",
                 heavy=True),
        Mutation("50 MB file", {tiny: SHIPPED[tiny] + "description: " + "x" * 50_000_000 + "\n"}, tiny, None,
                 "more than 256 KiB", heavy=True),
        case("200 KB string", tiny, [(("description",), "y" * 200_000)], "(200000 characters)", heavy=True),
        Mutation("config a symlink loop", {}, "loop.yaml", None, "cannot read the file", links={"loop.yaml": "loop.yaml"}),
        Mutation("config a directory", {"dir.yaml/x": ""}, "dir.yaml", None, "not a regular file"),
        # Rich markup and regex brackets reach the terminal as written
        case("closing markup tag", tiny, [(("experiment",), "[/x]")], "(got '[/x]')"),
        case("markup in a name", tiny, [(("experiment",), "[bold red]boom[/]")], "(got '[bold red]boom[/]')"),
        case("regex in the reason", tiny, [(("experiment",), "Tiny Name")], "must match pattern '^[a-z0-9][a-z0-9_.-]{0,63}$'"),
        # hosts: jump hosts, addresses, ports
        case("unknown jump host", llama, [(("hosts", 0, "jump_host"), "bastion")], "hosts.0.jump_host 'bastion' is neither"),
        case("jump host to itself", llama, [(("hosts", 0, "jump_host"), "gpu-1")], "gpu-1 -> gpu-1 is a loop"),
        case("jump host port out of range", kimi, [(("hosts", 0, "jump_host"), "ops@bastion:70000")],
             "hosts.0.jump_host: the port of ops@bastion:70000 must be between 1 and 65535"),
        case("address with a space", llama, [(("hosts", 0, "address"), "gpu node 01")], "hosts.0.address: must match"),
        case("address with a newline", kimi, [(("hosts", 0, "address"), "gpu\nnode")], "hosts.0.address: must match"),
        case("user with a space", llama, [(("hosts", 0, "user"), "ubu ntu")], "hosts.0.user: must match"),
        case("workdir with a newline", kimi, [(("hosts", 0, "workdir"), "/scratch\nrm -rf /")], "hosts.0.workdir: must match"),
        case("endpoint with a space", tiny, [(("data", "regenerate", "backend"), "http"),
                                              (("data", "regenerate", "endpoint"), "http://gpu 1:8000")],
             "data.regenerate.endpoint: must match"),
        case("endpoints with a newline", tiny, [(("data", "regenerate", "backend"), "sglang"),
                                                 (("data", "regenerate", "endpoints"), ["http://a:1", "http://b\n:2"])],
             "data.regenerate.endpoints.1: must match"),
        case("tracking uri with a space", llama, [(("tracking", "uri"), "http://127.0.0.1: 5000")], "tracking.uri: must match"),
        case("deploy host not a name", tiny, [(("deploy", "host"), "gpu 1")], "deploy.host: must match"),
        case("train node not a name", tiny, [(("train", "nodes"), ["GPU-1"])], "train.nodes.0: must match"),
        case("rendezvous port out of range", llama, [(("train", "rendezvous"), "10.0.0.11:99999")],
             "train.rendezvous 10.0.0.11:99999: the port must be between 1 and 65535"),
        # ${...} that would be kept literally
        case("unclosed reference", llama, [(("hosts", 0, "address"), "${EAGLEOPS_GPU_HOST")],
             "hosts.0.address: malformed reference in '${EAGLEOPS_GPU_HOST'"),
        case("reference starting with a digit", kimi, [(("hosts", 0, "key_passphrase"), "${1PASS}")],
             "hosts.0.key_passphrase: malformed reference"),
        case("unclosed default", tiny, [(("description",), "${HOME:-x")], "description: malformed reference"),
        case("unset variable", tiny, [(("description",), "${EAGLEOPS_CORPUS_UNSET_VARIABLE}")],
             "description: environment variable EAGLEOPS_CORPUS_UNSET_VARIABLE is not set"),
        # seeds, layer ids, duplicate keys
        case("seed past 2**32", tiny, [(("train", "seed"), 2**64)], "train.seed: must be <= 4294967295"),
        case("data seed negative", llama, [(("data", "seed"), -1)], "data.seed: must be >= 0"),
        case("tiny aux id past the layers", tiny, [(("target", "aux_layer_ids"), [1, 3, 7])],
             "target.aux_layer_ids [1, 3, 7]: id 7 is past the tiny target's layers"),
        case("shape aux id past the layers", llama, [(("target", "aux_layer_ids"), [1, 15, 40])],
             "target.aux_layer_ids [1, 15, 40]: id 40 is past the target's target.shape.num_hidden_layers 32"),
        case("aux id repeated", kimi, [(("target", "aux_layer_ids"), [2, 2, 30])], "target.aux_layer_ids [2, 2, 30]: [2] repeated"),
        Mutation("duplicate key", {tiny: SHIPPED[tiny].replace("  lr: 0.02", "  lr: 0.02\n  lr: 0.03")}, tiny,
                 f"{tiny}:{lr_line + 1}", f"train.lr: duplicate key (first at line {lr_line})"),
        Mutation("duplicate section", {tiny: SHIPPED[tiny] + "experiment: other\n"}, tiny,
                 f"{tiny}:{len(SHIPPED[tiny].splitlines()) + 1}", f"experiment: duplicate key (first at line {exp_line})"),
        case("misspelt section", kimi, [(("deploi",), "{}")], "deploi: unknown field (allowed: experiment,", raw=True),
    ]
    return cases


NUL = "a\x00b"


def round3_mutations() -> list[Mutation]:
    """Issue 33's bad configs and their siblings: NUL bytes, non-finite floats, ints past any run, environment names
    a server would misread, nested `${...}` defaults, and what `validate` and the flow's first step find in the files
    the config names (the draft of `--speculative-draft-model-path`, prompt files) or from its lengths: each one
    refused by `run` too, before any stage."""
    tiny, llama, kimi = "tiny.yaml", "llama-3.1-8b.yaml", "kimi-k2.5-int4.yaml"
    draft_flag = "--speculative-draft-model-path"
    nul = [("runs_root", tiny, ("runs_root",)), ("hosts[].address", llama, ("hosts", 0, "address")),
           ("target.model_path", llama, ("target", "model_path")), ("data.prompts", tiny, ("data", "prompts")),
           ("bench.prompts", kimi, ("bench", "prompts")), ("train.init_checkpoint", tiny, ("train", "init_checkpoint")),
           ("hosts[].key_file", kimi, ("hosts", 0, "key_file")), ("hosts[].known_hosts", llama, ("hosts", 0, "known_hosts")),
           ("hosts[].user", kimi, ("hosts", 0, "user")), ("tracking.uri", llama, ("tracking", "uri")),
           ("tracking.experiment_name", tiny, ("tracking", "experiment_name")),
           ("deploy.model_path", kimi, ("deploy", "model_path")), ("description", tiny, ("description",)),
           ("hosts[].key_passphrase", llama, ("hosts", 0, "key_passphrase"))]
    cases = [case(f"{label} with a NUL byte", config, [(path, "x" + NUL)], f"{'.'.join(map(str, path))}: contains a NUL")
             for label, config, path in nul]
    cases += [
        case("deploy.extra_args item with a NUL byte", tiny, [(("deploy", "extra_args"), ["--log-level", NUL])],
             "deploy.extra_args: contains a NUL"),
        case("data.capture.extra_args item with a NUL byte", kimi, [(("data", "capture", "extra_args"), [NUL])],
             "data.capture.extra_args: contains a NUL"),
        case("deploy.env value with a NUL byte", tiny, [(("deploy", "env"), {"HF_TOKEN": NUL})],
             "deploy.env: contains a NUL"),
        # floats that pass a lone lower bound, or none: never finite math
        case("target.tiny.rope_theta .inf", tiny, [(("target", "tiny", "rope_theta"), ".inf")],
             "target.tiny.rope_theta: must be a finite number", raw=True),
        case("target.tiny.rope_theta .nan", tiny, [(("target", "tiny", "rope_theta"), ".nan")],
             "target.tiny.rope_theta: must be a finite number", raw=True),
        case("target.tiny.rope_theta 1e300", tiny, [(("target", "tiny", "rope_theta"), "1.0e+300")],
             "target.tiny.rope_theta: must be <= ", raw=True),
        case("train.lr .nan", llama, [(("train", "lr"), ".nan")], "train.lr: must be a finite number", raw=True),
        case("nightly.min_tok_s_gain -.inf", tiny, [(("nightly", "min_tok_s_gain"), "-.inf")],
             "nightly.min_tok_s_gain: must be a finite number", raw=True),
        case("data.stream.disk_budget_gb .inf", kimi, [(("data", "stream", "disk_budget_gb"), ".inf")],
             "data.stream.disk_budget_gb: must be a finite number", raw=True),
        case("train.betas with a .nan", tiny, [(("train", "betas"), "[.nan, 0.95]")], "train.betas.0: must be a finite",
             raw=True),
        # ints past any run
        case("train.max_steps 1e30", tiny, [(("train", "max_steps"), "1e30")], "train.max_steps: ", raw=True),
        case("train.max_steps 1.0e+30", tiny, [(("train", "max_steps"), "1.0e+30")], "train.max_steps: ", raw=True),
        case("train.max_steps 10**18", tiny, [(("train", "max_steps"), 10**18)], "train.max_steps: must be <= "),
        case("train.checkpoint_every 10**18", llama, [(("train", "checkpoint_every"), 10**18)],
             "train.checkpoint_every: must be <= "),
        case("train.eval_every 2**63", kimi, [(("train", "eval_every"), 2**63)], "train.eval_every: "),
        case("train.log_every 10**18", tiny, [(("train", "log_every"), 10**18)], "train.log_every: must be <= "),
        case("train.eval_max_batches 10**18", llama, [(("train", "eval_max_batches"), 10**18)],
             "train.eval_max_batches: must be <= "),
        # environment names the server's environment would misread
        case("deploy.env key with =", tiny, [(("deploy", "env"), {"A=B": "x"})], "deploy.env: key 'A=B': must match pattern"),
        case("deploy.env key with a space", kimi, [(("deploy", "env"), {"HF TOKEN": "x"})],
             "deploy.env: key 'HF TOKEN': must match pattern"),
        case("deploy.env key starting with a digit", llama, [(("deploy", "env"), {"1TOKEN": "x"})],
             "deploy.env: key '1TOKEN': must match pattern"),
        case("deploy.env key empty", tiny, [(("deploy", "env"), {"": "x"})], "deploy.env: key '': must match pattern"),
        case("deploy.env key with a NUL byte", tiny, [(("deploy", "env"), {"A" + NUL: "x"})], "deploy.env: contains a NUL"),
        case("deploy.env key with a newline", tiny, [(("deploy", "env"), {"A\nB": "x"})], "deploy.env: key 'A\\nB': must match"),
        # ${...} whose default is another reference: it would be kept as the text `${B}`
        case("nested default in a host address", llama, [(("hosts", 0, "address"), "${EAGLEOPS_A:-${EAGLEOPS_B}}")],
             "hosts.0.address: nested reference"),
        case("nested default with its own default", tiny, [(("deploy", "env"), {"HF_TOKEN": "${EAGLEOPS_A:-${EAGLEOPS_B:-x}}"})],
             "deploy.env.HF_TOKEN: nested reference"),
        case("nested default inside text", kimi, [(("runs_root",), "/r/${EAGLEOPS_A:-x${EAGLEOPS_B}y}/z")],
             "runs_root: nested reference"),
        case("nested default in a passphrase", kimi, [(("hosts", 0, "key_passphrase"), "${EAGLEOPS_A:-${EAGLEOPS_B}}")],
             "hosts.0.key_passphrase: nested reference"),
        # the draft that --speculative-draft-model-path names (deploy.host local: read here)
        case("extra_args draft config.json not JSON", tiny, [(("deploy", "extra_args"), [draft_flag, "@TMP@/draft"])],
             "deploy.extra_args: draft_config: ", files={"draft/config.json": "{not json"}),
        case("extra_args draft config.json a list", tiny, [(("deploy", "extra_args"), [draft_flag, "@TMP@/draft"])],
             "expected a JSON object, found a list", files={"draft/config.json": "[1, 2]"}),
        case("extra_args draft without config.json", tiny, [(("deploy", "extra_args"), [draft_flag, "@TMP@/draft"])],
             "deploy.extra_args: draft_config: ", files={"draft/README": "no config"}),
        case("extra_args draft folder missing", tiny, [(("deploy", "extra_args"), [draft_flag, "@TMP@/nowhere"])],
             "deploy.extra_args: draft_config: "),
        case("extra_args draft a target, not an EAGLE-3 draft", tiny,
             [(("deploy", "extra_args"), [f"{draft_flag}=@TMP@/draft"])], "not an EAGLE-3 draft",
             files={"draft/config.json": json.dumps({"architectures": ["LlamaForCausalLM"]})}),
        case("extra_args draft flag without a value", tiny, [(("deploy", "extra_args"), ["--log-level", "info", draft_flag])],
             "deploy.extra_args: draft_config: "),
        # lengths: prompt + answer within the trained length (builtin prompts) and the served context
        case("bench answer past the trained length", tiny, [(("bench", "max_new_tokens"), 700)],
             "bench.max_new_tokens: bench_lengths: "),
        case("bench answer past the served context", tiny, [(("bench", "prompts"), "@TMP@/p.jsonl"),
                                                              (("bench", "max_new_tokens"), 1024)],
             "bench.max_new_tokens: bench_lengths: ", files={"p.jsonl": '{"prompt": "hi"}\n'}),
        case("bench answer past --context-length", tiny, [(("deploy", "server"), "sglang"),
                                                           (("deploy", "extra_args"), ["--context-length", "100"]),
                                                           (("bench", "max_new_tokens"), 128)],
             "bench.max_new_tokens: bench_lengths: "),
        case("bench answer past the declared shape's context", llama,
             [(("target", "shape", "max_position_embeddings"), 4096), (("data", "max_length"), 2048),
              (("bench", "prompts"), "@TMP@/p.jsonl"), (("bench", "max_new_tokens"), 4096)],
             "bench.max_new_tokens: bench_lengths: ", files={"p.jsonl": '{"prompt": "hi"}\n'}),
        # prompt files the stages would read late
        case("bench prompts file missing", tiny, [(("bench", "prompts"), "@TMP@/none.jsonl")],
             "bench.prompts: prompt_file: "),
        case("bench prompts file not JSONL", tiny, [(("bench", "prompts"), "@TMP@/p.jsonl")],
             "bench.prompts: prompt_file: ", files={"p.jsonl": "{not json\n"}),
        case("data prompts file missing", tiny, [(("data", "prompts"), "@TMP@/none.jsonl")],
             "data.prompts: prompt_file: "),
        case("data prompts file empty", tiny, [(("data", "prompts"), "@TMP@/p.jsonl")],
             "data.prompts: prompt_file: ", files={"p.jsonl": "\n"}),
        case("train.init_checkpoint missing", tiny, [(("train", "init_checkpoint"), "@TMP@/none")],
             "train.init_checkpoint: init_checkpoint: "),
        # the HF target read here, as the environment and data stages read it
        case("data.max_length past the target's config.json context", tiny,
             [(("target", "kind"), "hf"), (("target", "model_path"), "@TMP@/model"), (("data", "max_length"), 256)],
             "data.max_length: target_context: 256 exceeds the target's context (max_position_embeddings 200",
             files={"model/config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8,
                                                      "max_position_embeddings": 200, "vocab_size": 32000})}),
        case("data.draft_vocab_size past the target's config.json vocabulary", tiny,
             [(("target", "kind"), "hf"), (("target", "model_path"), "@TMP@/model"), (("data", "draft_vocab_size"), 512)],
             "data.draft_vocab_size: target_vocab: 512 exceeds the target's vocabulary (vocab_size 400",
             files={"model/config.json": json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8,
                                                      "max_position_embeddings": 4096, "vocab_size": 400})}),
        case("HF target with neither config.json here nor target.shape", tiny,
             [(("target", "kind"), "hf"), (("target", "model_path"), "@TMP@/nowhere")],
             "target.model_path: target_shape: "),
    ]
    return cases


ROUND3 = round3_mutations()
CORPUS = schema_mutations() + hand_mutations() + ROUND3


# ------------------------------------------------------------------ running one case


def write_case(mutation: Mutation, folder: Path) -> Path:
    for rel, content in mutation.files.items():
        path = folder / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str):
            content = content.replace("@TMP@", str(folder)).encode()
        path.write_bytes(content)
    for link, target in mutation.links.items():
        (folder / link).symlink_to(target)
    return folder / mutation.entry


HANG_S = 60  # a case still running after this is stuck (or went on to run the flow): it fails, the suite goes on


class Hung(Exception):
    """Raised in the CLI's thread when a case runs past HANG_S."""


def _hung(signum, frame):
    raise Hung(f"no answer within {HANG_S} s")


def answer(args: list[str], heavy: bool, name: str = "") -> tuple[Any, float, int]:
    """The CLI's answer, its wall time and (for heavy cases) the Python memory peak in bytes; `Hung` as the
    answer's exception past HANG_S (a hang guard: the time itself is measured, never asserted)."""
    if heavy:
        tracemalloc.start()
    previous = signal.signal(signal.SIGALRM, _hung)
    signal.alarm(HANG_S)
    start = time.perf_counter()
    try:
        result = runner.invoke(app, args, env={"COLUMNS": "200", "EAGLEOPS_CORPUS_UNSET_VARIABLE": None,
                                               "EAGLEOPS_A": None, "EAGLEOPS_B": None})
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    wall = time.perf_counter() - start
    if os.environ.get("EAGLEOPS_CORPUS_TIMES"):  # the figures, for a report: one JSON line per answer
        with open(os.environ["EAGLEOPS_CORPUS_TIMES"], "a") as out:
            out.write(json.dumps({"case": name, "command": args[0], "wall_s": round(wall, 4)}) + "\n")
    peak = tracemalloc.get_traced_memory()[1] if heavy else 0
    if heavy:
        tracemalloc.stop()
    return result, wall, peak


def check_answer(mutation: Mutation, result, wall: float, peak: int) -> None:
    output = result.output
    assert result.exit_code == 2, (mutation.name, output[-3000:])
    assert "Traceback" not in output and (result.exception is None or isinstance(result.exception, SystemExit)), (
        mutation.name, result.exception)
    assert peak < 64 * 2**20, (mutation.name, f"{peak / 2**20:.0f} MiB peak")
    errors = [line for line in output.splitlines() if line.startswith("error ")]
    assert errors, (mutation.name, output[-2000:])
    assert all(len(line) < 2000 for line in errors), (mutation.name, "an error line echoes too much")
    if mutation.where is None:
        located = [line for line in errors if re.match(rf"^error \S*{re.escape(mutation.entry)}(:\d+)?: ", line)]
    else:
        file, line = mutation.where.rsplit(":", 1)
        located = [e for e in errors if re.match(rf"^error (\S*/)?{re.escape(file)}:{line}: ", e)]
    assert any(mutation.fragment in e for e in located), (mutation.name, mutation.where, mutation.fragment, errors)


# ------------------------------------------------------------------ tests


@pytest.fixture(scope="module", autouse=True)
def command_built_once():
    """Typer's CliRunner rebuilds the click command on every call (11 ms, a third of a case): build it once."""
    import typer.main

    command = typer.main.get_command(app)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("typer.testing._get_command", lambda _: command)
        yield


def test_the_corpus_is_large_and_starts_from_configs_that_validate(tmp_path):
    assert len(CORPUS) >= 150
    assert len({m.name for m in CORPUS}) == len(CORPUS)
    for name, text in {**SHIPPED, f"sweeps/{SWEEP_NAME}": SWEEP}.items():  # so each exit 2 is the mutation's
        path = tmp_path / name
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    for name in [*SHIPPED, f"sweeps/{SWEEP_NAME}"]:
        result = runner.invoke(app, ["validate", str(tmp_path / name)])
        assert result.exit_code == 0, (name, result.output[-2000:])


@pytest.mark.parametrize("mutation", CORPUS, ids=[m.name for m in CORPUS])
def test_validate_answers_a_bad_config_in_one_line(mutation, tmp_path):
    path = write_case(mutation, tmp_path)
    check_answer(mutation, *answer(["validate", str(path)], mutation.heavy, mutation.name))


_ROUND3_NAMES = {m.name for m in ROUND3}
# every fifth the loader refuses (the same loader, another command), every one the preflight refuses, issue 33's
RUN_CASES = [m for m in CORPUS if m.at_load and m.name not in _ROUND3_NAMES][::5] + \
    [m for m in CORPUS if not m.at_load and m.name not in _ROUND3_NAMES] + ROUND3


@pytest.mark.parametrize("mutation", RUN_CASES, ids=[m.name for m in RUN_CASES])
def test_run_refuses_a_bad_config_before_starting(mutation, tmp_path):
    path = write_case(mutation, tmp_path)
    check_answer(mutation, *answer(["run", str(path)], mutation.heavy, mutation.name))


def test_run_refuses_a_sweep_variant_that_does_not_exist(tmp_path):
    mutation = sweep_case("variant out of range", None, "sweep.grid: 5 variants; choose one with variant 0..4",
                          where=f"{SWEEP_NAME}:{Doc(SWEEP).line_of('grid:')}")
    path = write_case(mutation, tmp_path)
    check_answer(mutation, *answer(["run", str(path), "--variant", "7"], False))


def test_every_number_field_is_bounded_and_every_float_finite():
    # the general rules behind the schema-driven family: an int or float field without an upper bound lets a
    # huge value through (train.max_steps: 10**18 was accepted); a float passes `.inf`/`.nan` unless the sections'
    # base refuses them (StrictModel: allow_inf_nan false)
    unbounded = []
    for path, info in schema_leaves():
        kind = _base_type(info.annotation)
        meta = {type(m).__name__ for m in info.metadata}
        if kind in (int, float) and not ({"Le", "Lt"} & meta and {"Ge", "Gt"} & meta):
            unbounded.append(".".join(map(str, path)))
    assert unbounded == []
    assert ExperimentConfig.model_config["allow_inf_nan"] is False
