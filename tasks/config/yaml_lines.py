"""One config file's bytes -> YAML node tree + plain data, without letting the file decide what it costs.

Owns the reading rules that `tasks.config.load` applies before any validation: a size cap (read no more than
`MAX_BYTES`), UTF-8 only (UTF-16/32 and NUL bytes named as such, with the line), nesting at most
`MAX_DEPTH` levels, anchors that never contain their own alias, aliases that expand the document to at
most `MAX_NODES` values (a "billion laughs" file is refused before anything is expanded), and no
duplicate keys (YAML says they are an error; PyYAML keeps the last one silently). Every refusal is a
`YamlProblem` with the 1-based line it is about.

Risk: the expansion limit. PyYAML shares an aliased node, so parsing a bomb is cheap, but everything
after it (interpolation, validation, printing) copies each use: the limit is checked on the node graph,
before the first copy.
"""

from __future__ import annotations

import codecs
import os
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import Composer
from yaml.constructor import SafeConstructor
from yaml.resolver import Resolver

MAX_BYTES = 256 * 1024  # 50x the largest shipped config; parsing it stays well under a second
MAX_DEPTH = 32  # shipped configs nest 4 levels
MAX_NODES = 100_000  # values after expanding every alias

try:  # libyaml's parser (8x faster) under PyYAML's composer, which is where the limits are checked
    from yaml._yaml import CParser

    _PARSER_BASES: tuple[type, ...] = (CParser,)

    def _init_parser(loader: Any, text: str) -> None:
        CParser.__init__(loader, text)
except ImportError:  # pragma: no cover - PyYAML built without libyaml
    from yaml.parser import Parser
    from yaml.reader import Reader
    from yaml.scanner import Scanner

    _PARSER_BASES = (Reader, Scanner, Parser)

    def _init_parser(loader: Any, text: str) -> None:
        Reader.__init__(loader, text)
        Scanner.__init__(loader)
        Parser.__init__(loader)


class YamlProblem(Exception):
    """Why a config file cannot be read; `line` is 1-based (0: the file as a whole)."""

    def __init__(self, line: int, message: str):
        super().__init__(message)
        self.line, self.message = line, message


def read_text(path: Path) -> str:
    """The file as UTF-8 text, at most MAX_BYTES; OSError (unreadable, a symlink loop) is the caller's to name."""
    if not stat.S_ISREG(os.stat(path).st_mode):  # a FIFO or a device would block or never end
        raise YamlProblem(0, "not a regular file")
    with open(path, "rb") as handle:
        raw = handle.read(MAX_BYTES + 1)
    if len(raw) > MAX_BYTES:
        raise YamlProblem(0, f"more than {MAX_BYTES // 1024} KiB: a config file is at most that big")
    for bom, name in ((codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
                      (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16")):
        if raw.startswith(bom):
            raise YamlProblem(1, f"{name} text (byte-order mark): save the file as UTF-8")
    if b"\0" in raw:
        raise YamlProblem(_line_at(raw, raw.index(b"\0")), "NUL byte (UTF-16 text?): save the file as UTF-8")
    try:
        return raw.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise YamlProblem(_line_at(raw, err.start), f"not UTF-8 text (byte 0x{raw[err.start]:02x}): save the file "
                                                    "as UTF-8") from None


def _line_at(raw: bytes, offset: int) -> int:
    return raw.count(b"\n", 0, offset) + 1


class _BoundedLoader(*_PARSER_BASES, Composer, SafeConstructor, Resolver):
    """PyYAML's safe loader whose composer refuses deep nesting and anchors that contain their own alias."""

    def __init__(self, text: str):
        _init_parser(self, text)
        Composer.__init__(self)
        SafeConstructor.__init__(self)
        Resolver.__init__(self)
        self._depth = 0
        self._open_anchors: set[str] = set()

    get_single_node = Composer.get_single_node
    compose_document = Composer.compose_document

    def compose_node(self, parent, index):
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            if event.anchor in self._open_anchors:
                raise YamlProblem(event.start_mark.line + 1,
                                  f"alias *{event.anchor} is used inside the node &{event.anchor} it names")
            return Composer.compose_node(self, parent, index)
        if self._depth >= MAX_DEPTH:
            raise YamlProblem(event.start_mark.line + 1, f"nested more than {MAX_DEPTH} levels deep")
        self._depth += 1
        if event.anchor is not None:
            self._open_anchors.add(event.anchor)
        try:
            return Composer.compose_node(self, parent, index)
        finally:
            self._depth -= 1
            self._open_anchors.discard(event.anchor)

    def construct_object(self, node, deep=False):
        try:
            return SafeConstructor.construct_object(self, node, deep)
        except (ValueError, OverflowError) as err:  # a date past the calendar, an int of 5000 digits
            reason = str(err).split(";")[0]
            raise YamlProblem(node.start_mark.line + 1, f"cannot read the value {node.value!r:.40}: {reason}") from None


def parse(text: str) -> tuple[yaml.Node | None, Any]:
    """The document's node tree (for line numbers) and its plain data; YamlProblem for what may not be read."""
    loader = _BoundedLoader(text)
    try:
        try:
            root = loader.get_single_node()
            if root is None:
                return None, None
            check_expansion(root)
            check_duplicate_keys(root)
            return root, loader.construct_document(root)
        except yaml.YAMLError as err:
            raise YamlProblem(_error_line(err, text), f"invalid YAML: {_error_text(err)}") from None
    finally:
        loader.dispose()


def _error_line(err: yaml.YAMLError, text: str) -> int:
    """Where the problem is; for an unclosed flow collection (`[1, 2` ...) the line that opens it, since the
    parser only notices at the next token, often lines later."""
    context, problem = getattr(err, "context_mark", None), getattr(err, "problem_mark", None)
    if context is not None and "flow" in str(getattr(err, "context", "")):
        return context.line + 1
    mark = problem or context
    if mark is not None:
        return mark.line + 1
    position = getattr(err, "position", None)  # a ReaderError: a character YAML does not allow
    return text.count("\n", 0, position) + 1 if isinstance(position, int) else 1


def _error_text(err: yaml.YAMLError) -> str:
    problem = getattr(err, "problem", None)
    context = getattr(err, "context", None)
    if problem:
        return f"{context}, {problem}" if context else str(problem)
    return str(err).splitlines()[0]


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_expansion(root: yaml.Node) -> None:
    """Refuse a node graph whose aliases expand it past MAX_NODES values or MAX_DEPTH levels.

    Sizes are summed bottom-up over the shared nodes (iteratively: an expanded chain of aliases is
    deeper than Python's stack), so a bomb costs one visit per node as written, never its expansion.
    """
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, children_done = stack.pop()
        if id(node) in size:
            continue
        kids = _children(node)
        if not children_done:
            stack.append((node, True))
            stack.extend((kid, False) for kid in kids if id(kid) not in size)
            continue
        size[id(node)] = 1 + sum(size[id(kid)] for kid in kids)
        depth[id(node)] = 1 + max((depth[id(kid)] for kid in kids), default=0)
        if size[id(node)] > MAX_NODES:
            raise YamlProblem(node.start_mark.line + 1, f"aliases expand this node to more than {MAX_NODES} values; "
                                                        "a config needs far fewer (write them out)")
        if depth[id(node)] > MAX_DEPTH:
            raise YamlProblem(node.start_mark.line + 1, f"aliases nest this node more than {MAX_DEPTH} levels deep")


def check_duplicate_keys(root: yaml.Node) -> None:
    """YAML forbids a key twice in one mapping; name the second one, its path and where the first is."""
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, tuple]] = [(root, ())]
    while stack:
        node, path = stack.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            first: dict[str, int] = {}
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.tag != "tag:yaml.org,2002:merge":
                    line = key.start_mark.line + 1
                    if key.value in first:
                        field = ".".join(map(str, path + (key.value,)))
                        raise YamlProblem(line, f"{field}: duplicate key (first at line {first[key.value]}); "
                                                "keep one")
                    first[key.value] = line
                stack.append((value, path + (getattr(key, "value", "?"),)))
        elif isinstance(node, yaml.SequenceNode):
            stack.extend((item, path + (i,)) for i, item in enumerate(node.value))
