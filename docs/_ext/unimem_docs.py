"""Sphinx extension of unimem's documentation: what the pages take from the
running package rather than from copied text.

* ``unimem-cli-help``: the ``--help`` page of ``unimem`` or one of its
  commands, printed by the CLI's own argparse parser at build time.
* ``unimem-statistics``: a table of statistics' key families, checked against
  the keys a live allocator returns: a key the code has and the page does not
  (or the reverse) fails the build.
* References: a name a docstring writes short (``:class:`device```, the base
  class ``MemPool`` of a namespace's ``MemPool``) resolves to where the
  reference documents it; a name of unimem's internals or of another package,
  which the reference cannot link (no intersphinx: the build is offline), is
  shown unlinked only when it exists; anything else stays an error under
  ``-n``.
"""
from __future__ import annotations

import contextlib
import importlib
import inspect
import itertools
import os
import re
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

from docutils import nodes
from docutils.parsers.rst import directives
from sphinx.application import Sphinx
from sphinx.util import logging
from sphinx.util.docutils import SphinxDirective
from sphinx.util.nodes import make_refnode

logger = logging.getLogger(__name__)

#: Packages other than unimem that docstrings and signatures name: their
#: documentation cannot be linked offline, so existing names show unlinked.
EXTERNAL_PACKAGES = ("builtins", "collections", "concurrent", "contextlib", "ctypes", "cupy", "dask",
                     "distributed", "dpctl", "dpnp", "numpy", "os", "pandas", "pathlib", "prometheus_client",
                     "sys", "threading", "torch", "types", "typing", "typing_extensions", "weakref")

#: Words that napoleon's "Args:" type fields hold and are prose, not names
#: (PyTorch's "int, optional", "sequence of 16 ints").
TYPE_PROSE = re.compile(r"optional|sequence|mapping|callable|iterable|.*\s.*")

#: Type aliases that signatures name and the reference describes on its
#: arguments page (reference/arguments.md), by label.
ALIAS_LABELS = {"DeviceLike": "device-like", "MemoryLike": "memory-like", "PathLike": "path-like",
                "_history.PathLike": "path-like"}


# ---------------------------------------------------------------------------
# the CLI's help pages
# ---------------------------------------------------------------------------
#: How the pages name the command (what ``python -m unimem`` passes to the parser).
PROG = "python -m unimem"


@contextlib.contextmanager
def _columns(width: int) -> Iterator[None]:
    """argparse wraps to $COLUMNS: a fixed width, so that a page does not
    depend on the terminal that built it."""
    saved = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = str(width)
    try:
        yield
    finally:
        if saved is None:
            del os.environ["COLUMNS"]
        else:
            os.environ["COLUMNS"] = saved


def cli_help(command: Optional[str], width: int = 88) -> str:
    """What ``unimem [COMMAND] --help`` prints."""
    import argparse
    from unimem.cli.main import build_parser
    with _columns(width):
        parser = build_parser(PROG)
        if command is None:
            return parser.format_help()
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                if command not in action.choices:
                    raise ValueError(f"unimem has no command {command!r} (it has {', '.join(action.choices)})")
                return action.choices[command].format_help()
    raise ValueError("unimem's parser has no commands")


def cli_commands() -> List[str]:
    """The names of ``unimem``'s commands, in the parser's order."""
    import argparse
    from unimem.cli.main import build_parser
    for action in build_parser(PROG)._actions:
        if isinstance(action, argparse._SubParsersAction):
            return list(action.choices)
    return []


class CliHelp(SphinxDirective):
    """``unimem-cli-help [COMMAND]``: that command's ``--help`` page."""

    optional_arguments = 1

    def run(self) -> List[nodes.Node]:
        command = self.arguments[0] if self.arguments else None
        try:
            text = cli_help(command)
        except ValueError as error:
            raise self.error(str(error))
        block = nodes.literal_block(text, text, language="text")
        block["classes"].append("unimem-cli-help")
        return [block]


class CliCommands(SphinxDirective):
    """``unimem-cli-commands``: a section for each command, with its
    ``--help`` page, in the parser's order."""

    def run(self) -> List[nodes.Node]:
        sections: List[nodes.Node] = []
        for command in cli_commands():
            section = nodes.section(ids=[f"command-{command}"], names=[f"command-{command}"])
            title = f"{PROG} {command}"
            section += nodes.title(title, "", nodes.literal(title, title))
            text = cli_help(command)
            block = nodes.literal_block(text, text, language="text")
            block["classes"].append("unimem-cli-help")
            section += block
            self.state.document.note_explicit_target(section)
            sections.append(section)
        return sections


# ---------------------------------------------------------------------------
# the statistics' keys
# ---------------------------------------------------------------------------
def expand(pattern: str) -> List[str]:
    """The keys a pattern such as ``allocated_bytes.{all,small_pool}.current`` names."""
    pieces = re.split(r"\{([^{}]*)\}", pattern)
    choices = [[piece] if i % 2 == 0 else piece.split(",") for i, piece in enumerate(pieces)]
    return ["".join(parts) for parts in itertools.product(*choices)]


def live_statistics(kind: str) -> Sequence[str]:
    """The keys of the statistics a live pool returns after one allocation:
    ``device`` (a device pool: the ``cpu`` one, whose keys every device
    type shares) or ``host`` (the pinned host pool)."""
    import unimem
    if kind == "device":
        from unimem import cpu
        address = cpu.caching_allocator_alloc(1000)
        try:
            return list(cpu.memory_stats())
        finally:
            cpu.caching_allocator_delete(address)
    if kind == "host":
        address = unimem.host.caching_host_alloc(1000)
        try:
            return list(unimem.host_memory_stats())
        finally:
            unimem.host.caching_host_delete(address)
    raise ValueError(f"unknown statistics {kind!r}: device or host")


class Statistics(SphinxDirective):
    """``unimem-statistics device|host``; each line of its content is
    ``PATTERN: meaning``. Renders the table, and fails the build unless the
    patterns name exactly the keys the live pool returns."""

    required_arguments = 1
    has_content = True
    option_spec = {"header": directives.unchanged}

    def run(self) -> List[nodes.Node]:
        kind = self.arguments[0]
        rows: List[Tuple[str, str]] = []
        for line in self.content:
            if not line.strip():
                continue
            pattern, sep, meaning = line.partition(": ")
            if not sep:
                raise self.error(f"expected 'PATTERN: meaning', got {line!r}")
            rows.append((pattern.strip().strip("`"), meaning.strip()))
        try:
            live = set(live_statistics(kind))
        except ValueError as error:
            raise self.error(str(error))
        documented = [key for pattern, _ in rows for key in expand(pattern)]
        missing = sorted(live - set(documented))
        stale = sorted(set(documented) - live)
        if missing or stale:
            raise self.error(f"the {kind} statistics' table is out of step with the code: "
                             f"keys not in the table: {missing or 'none'}; "
                             f"keys in the table the code does not return: {stale or 'none'}")
        return self._table(rows)

    def _table(self, rows: List[Tuple[str, str]]) -> List[nodes.Node]:
        table = nodes.table(classes=["unimem-statistics"])
        group = nodes.tgroup(cols=2)
        table += group
        group += nodes.colspec(colwidth=45)
        group += nodes.colspec(colwidth=55)
        head = nodes.thead()
        group += head
        head += self._row(nodes.literal("", "key"), nodes.Text("meaning"), header=True)
        body = nodes.tbody()
        group += body
        for pattern, meaning in rows:
            text_nodes, messages = self.state.inline_text(meaning, self.lineno)
            paragraph = nodes.paragraph("", "", *text_nodes)
            body += self._row(nodes.literal(pattern, pattern), paragraph)
            body += messages
        return [table]

    @staticmethod
    def _row(left: nodes.Node, right: nodes.Node, header: bool = False) -> nodes.row:
        row = nodes.row()
        for content in (left, right):
            entry = nodes.entry()
            entry += content if isinstance(content, nodes.paragraph) else nodes.paragraph("", "", content)
            row += entry
        return row


# ---------------------------------------------------------------------------
# docstrings: unimem's "#:" comments are prose
# ---------------------------------------------------------------------------
_original_lines: Dict[Tuple[str, str], List[str]] = {}


def _keep_prose(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: List[str]) -> None:
    """Before napoleon: remember an attribute's text (napoleon would read
    "The pinned host pool: one allocator" as a type and a description)."""
    if what in ("attribute", "data", "property"):
        _original_lines[(what, name)] = list(lines)


def _restore_prose(app: Sphinx, what: str, name: str, obj: Any, options: Any, lines: List[str]) -> None:
    original = _original_lines.pop((what, name), None)
    if original is not None:
        lines[:] = original


# ---------------------------------------------------------------------------
# references
# ---------------------------------------------------------------------------
def _lookup(path: str) -> Tuple[bool, Any]:
    """``(True, object)`` if the dotted ``path`` names an existing object."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj: Any = importlib.import_module(".".join(parts[:cut]))
        except Exception:
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return False, None
        return True, obj
    return False, None


def _documented_object(node: nodes.Node) -> Optional[str]:
    """The full name of the object whose docstring holds ``node``, from its
    source ("...: docstring of unimem.cpu.MemPool")."""
    source = node.source or ""
    match = re.search(r"docstring of ([\w.]+)", source)
    return match.group(1) if match else None


def _scopes(node: nodes.Node) -> List[str]:
    """Where a short name in ``node`` may live: the documented object and its
    parents, the module of the page, and the package."""
    scopes = []
    owner = _documented_object(node)
    if owner:
        parts = owner.split(".")
        scopes += [".".join(parts[:cut]) for cut in range(len(parts), 0, -1)]
    for key in ("py:class", "py:module"):
        if node.get(key):
            if key == "py:class" and node.get("py:module"):
                scopes.insert(0, f"{node['py:module']}.{node[key]}")
            else:
                scopes.append(node[key])
    scopes.append("unimem")
    return list(dict.fromkeys(scopes))


def _is_argument(node: nodes.Node, name: str) -> bool:
    """Whether ``name`` is an argument of the object whose docstring holds
    ``node``: PyTorch's docstrings, which unimem's follow, mark an argument
    with ``:attr:``."""
    owner = _documented_object(node)
    found, obj = _lookup(owner) if owner else (False, None)
    if not found:
        return False
    try:
        return name in inspect.signature(obj).parameters
    except (TypeError, ValueError):
        return False


def _plain(contnode: nodes.Node) -> nodes.Node:
    return contnode


def resolve_missing(app: Sphinx, env: Any, node: nodes.Element, contnode: nodes.Node) -> Optional[nodes.Node]:
    if node.get("refdomain") != "py":
        return None
    target: str = node["reftarget"]
    reftype: str = node["reftype"]
    domain = env.get_domain("py")
    builder = app.builder
    fromdocname = node.get("refdoc", env.docname)

    label = ALIAS_LABELS.get(target)
    if label is not None:
        docname, labelid, _ = env.get_domain("std").labels[label]
        return make_refnode(builder, fromdocname, docname, labelid, contnode, target)

    # A short or private name of something the reference documents publicly.
    short = target.rsplit(".", 1)[-1]
    candidates = [f"{scope}.{target}" for scope in _scopes(node)]
    if target.startswith("unimem.") and ("._" in target or target.startswith("unimem.backends.")):
        candidates += [f"{scope}.{short}" for scope in _scopes(node)]
    for candidate in candidates:
        for objtype in domain.objtypes_for_role(reftype) or ():
            if candidate in domain.objects and domain.objects[candidate].objtype == objtype:
                return domain.resolve_xref(env, fromdocname, builder, reftype, candidate, node, contnode)

    # No link to make: shown as written, if it names something that exists.
    if reftype == "class" and TYPE_PROSE.fullmatch(target):
        return _plain(contnode)
    if reftype == "attr" and "." not in target and _is_argument(node, target):
        return _plain(contnode)
    top = target.split(".", 1)[0]
    if top in EXTERNAL_PACKAGES or top == "unimem":
        found, obj = _lookup(target)
        if found:
            _unlinked.add(_real_name(target, obj))
            return _plain(contnode)
    for scope in _scopes(node):
        found, obj = _lookup(f"{scope}.{target}")
        if found:
            _unlinked.add(_real_name(f"{scope}.{target}", obj))
            return _plain(contnode)
    return None


def _real_name(path: str, obj: Any) -> str:
    """Where ``obj``, found as ``path``, is defined (``typing.List`` rather than
    ``unimem.List``), for the build's list of unlinked names."""
    module, name = getattr(obj, "__module__", None), getattr(obj, "__qualname__", None)
    if isinstance(module, str) and isinstance(name, str) and not path.startswith(module + "."):
        return f"{module}.{name}"
    return path


_unlinked: set = set()


def _report_unlinked(app: Sphinx, exception: Optional[BaseException]) -> None:
    if exception is None and _unlinked:
        logger.info("unimem_docs: %d names outside the reference shown unlinked: %s",
                    len(_unlinked), ", ".join(sorted(_unlinked)))


def setup(app: Sphinx) -> Dict[str, Any]:
    app.add_directive("unimem-cli-help", CliHelp)
    app.add_directive("unimem-cli-commands", CliCommands)
    app.add_directive("unimem-statistics", Statistics)
    app.connect("autodoc-process-docstring", _keep_prose, priority=100)
    app.connect("autodoc-process-docstring", _restore_prose, priority=900)
    app.connect("missing-reference", resolve_missing)
    app.connect("build-finished", _report_unlinked)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
