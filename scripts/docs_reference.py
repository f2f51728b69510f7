"""Generate the documentation site's reference pages from the code itself.

- ``configuration_markdown()``: every setting, from ``charlie/config.py``'s ``Settings`` fields
  (their ``#:`` comments, their defaults, the ``CHARLIE_*`` variables ``load_settings`` reads for
  each), then every other ``CHARLIE_*`` variable any module of ``charlie/`` reads (with the
  comment above the read, a click option's help, or the docstring paragraph that names it).
- ``cli_markdown()``: every ``charlie`` command, from the click commands themselves.

The MkDocs hook (scripts/mkdocs_hooks.py) writes both into the site at build time, so neither
can drift from the code; tests/unit/test_docs.py checks that every variable read is there. A
setting added in the usual style (a ``Settings`` field with a ``#:`` comment, read in
``load_settings`` by its ``CHARLIE_*`` name) appears without touching this file.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PACKAGE = REPO / "charlie"
CONFIG = PACKAGE / "config.py"

#: a whole environment variable name of Charlie's.
VARIABLE = re.compile(r"CHARLIE_[A-Z0-9_]*[A-Z0-9]")


@dataclass
class Setting:
    """One row of the reference: a Settings field (or a group of fields one comment covers)."""

    fields: list[str]
    comment: str
    default: str | None
    variables: list[str] = field(default_factory=list)


@dataclass
class ReadElsewhere:
    """A CHARLIE_* variable a module reads itself, outside Settings."""

    name: str
    modules: list[str]
    description: str
    #: whether the description is a module's definition of it (starts with its name)
    defined: bool = False


# --- text helpers -----------------------------------------------------------------------------


def _rst_to_md(text: str) -> str:
    """Docstring and comment markup to Markdown: ``x`` to `x`, :class:`x` to `x`."""
    text = re.sub(r":(?:class|func|mod|meth|attr|data):`~?([^`]+)`", r"`\1`", text)
    return text.replace("``", "`")


def _oneline(text: str) -> str:
    return " ".join(text.split())


def _comment_above(lines: list[str], lineno: int, *, marker: str = "#") -> str:
    """The comment lines right above line ``lineno`` (1-based), joined."""
    found: list[str] = []
    i = lineno - 2
    while i >= 0 and lines[i].strip().startswith(marker):
        found.append(lines[i].strip()[len(marker) :].lstrip(":").strip())
        i -= 1
    return _oneline(" ".join(reversed(found)))


def _paragraph_naming(doc: str | None, name: str) -> str:
    """The paragraph (or list item) of a docstring that names ``name``."""
    return next(iter(_paragraphs_naming(doc, name, whole=True)), "")


def _paragraphs_naming(doc: str | None, name: str, *, whole: bool = False) -> list[str]:
    """The paragraphs (and list items) of a docstring that name ``name`` (``whole``: as a whole
    name, not the start of a longer one)."""
    if not doc:
        return []
    chunks: list[list[str]] = [[]]
    for line in doc.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("- "):
            chunks.append([])
        if stripped:
            chunks[-1].append(stripped.removeprefix("- "))
    pattern = re.escape(name) + ("(?![A-Z0-9_])" if whole else "")
    texts = [_oneline(" ".join(chunk)) for chunk in chunks]
    return [text for text in texts if re.search(pattern, text)]


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


# --- Settings ---------------------------------------------------------------------------------


def _literal(node: ast.expr) -> Any:
    """The value of a constant expression (``256 * 1024``), or raise ValueError."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Tuple) and not node.elts:
        return ()
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mult | ast.Add | ast.Sub):
        left, right = _literal(node.left), _literal(node.right)
        if isinstance(node.op, ast.Mult):
            return left * right
        return left + right if isinstance(node.op, ast.Add) else left - right
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_literal(node.operand)
    raise ValueError(ast.unparse(node))


def _show_default(node: ast.expr | None) -> str | None:
    if node is None:
        return None
    if isinstance(node, ast.Call) and ast.unparse(node.func) == "field":
        kw = {k.arg: k.value for k in node.keywords}
        if "default" not in kw:
            return None
        node = kw["default"]
    try:
        value = _literal(node)
    except ValueError:
        return f"`{ast.unparse(node)}`"
    if value is None or value == ():
        return "(none)"
    if value is True:
        return "on (`1`)"
    if value is False:
        return "off (`0`)"
    if value == "":
        return "(empty)"
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"`{value}`"


def _constants(node: ast.AST) -> Iterator[str]:
    for sub in ast.walk(node):
        if (
            isinstance(sub, ast.Constant)
            and isinstance(sub.value, str)
            and VARIABLE.fullmatch(sub.value)
        ):
            yield sub.value


def _variables_of(
    expr: ast.expr,
    assigned: dict[str, ast.expr],
    functions: dict[str, ast.FunctionDef],
    fields: set[str],
    seen: set[str],
) -> list[str]:
    """The CHARLIE_* names an expression of load_settings reads: its own constants, those of the
    local names it uses (not other settings'), and those of this module's functions it calls."""
    found = list(_constants(expr))
    for sub in ast.walk(expr):
        if isinstance(sub, ast.Name) and sub.id not in seen:
            seen.add(sub.id)
            if sub.id in assigned and sub.id not in fields:
                found += _variables_of(assigned[sub.id], assigned, functions, fields, seen)
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name):
            fn = functions.get(sub.func.id)
            if fn is not None and sub.func.id not in seen:
                seen.add(sub.func.id)
                found += [name for stmt in fn.body for name in _constants(stmt)]
    return list(dict.fromkeys(found))


def _env_default(expr: ast.expr) -> str | None:
    """``os.environ.get("CHARLIE_X", "default")``'s default, if the expression has one."""
    for sub in ast.walk(expr):
        if (
            isinstance(sub, ast.Call)
            and ast.unparse(sub.func).endswith("environ.get")
            and len(sub.args) == 2
        ):
            return _show_default(sub.args[1])
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Name) and len(sub.args) == 2:
            # _env_int("CHARLIE_X", 8) and the like
            return _show_default(sub.args[1])
    return None


def settings_reference(source: str) -> list[Setting]:
    """The Settings fields of a config module's source, with their comments, defaults and
    the CHARLIE_* variables load_settings reads for them, in the class's order."""
    tree = ast.parse(source)
    lines = source.splitlines()
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings")
    fields = [
        n for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    ]
    names = {f.target.id for f in fields if isinstance(f.target, ast.Name)}

    load = functions["load_settings"]
    assigned: dict[str, ast.expr] = {}
    for stmt in load.body:
        if isinstance(stmt, ast.Assign):
            for target in stmt.targets:
                if isinstance(target, ast.Name):
                    assigned[target.id] = stmt.value
    variables: dict[str, list[str]] = {}
    env_defaults: dict[str, str | None] = {}
    settings_call = next(
        n
        for n in ast.walk(load)
        if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "Settings"
    )
    for kw in settings_call.keywords:
        if kw.arg is not None:
            # home=home: the local variable's expression is what reads the environment
            value = kw.value
            if isinstance(value, ast.Name) and value.id in assigned:
                value = assigned[value.id]
                # computed before Settings is built: its own default, not the field's
                env_defaults[kw.arg] = _env_default(value) or "(see meaning)"
            variables[kw.arg] = _variables_of(value, assigned, functions, names, {kw.arg})
        elif isinstance(kw.value, ast.Call) and isinstance(kw.value.func, ast.Name):
            # **helper(): the helper returns {"field": <expression reading CHARLIE_X>, ...}
            fn = functions.get(kw.value.func.id)
            for node in ast.walk(fn) if fn is not None else ():
                if isinstance(node, ast.Return) and isinstance(node.value, ast.Dict):
                    for key, value in zip(node.value.keys, node.value.values, strict=True):
                        if isinstance(key, ast.Constant) and isinstance(key.value, str):
                            variables[key.value] = list(_constants(value))

    rows: list[Setting] = []
    previous_end = -1
    for f in fields:
        assert isinstance(f.target, ast.Name)
        name = f.target.id
        comment = _rst_to_md(_comment_above(lines, f.lineno, marker="#:"))
        default = env_defaults.get(name) or _show_default(f.value)
        found = variables.get(name, [])
        if not comment and rows and rows[-1].comment and previous_end == f.lineno - 1:
            # a field right under another, without its own comment: that comment covers it
            if found:
                rows[-1].fields.append(name)
            rows[-1].variables += [v for v in found if v not in rows[-1].variables]
            if found and default and default != rows[-1].default:
                rows[-1].default = f"{rows[-1].default or '(none)'}, {default}"
        else:
            rows.append(Setting([name], comment, default, list(found)))
        previous_end = f.end_lineno or f.lineno
    return [row for row in rows if row.variables]


# --- variables read elsewhere ------------------------------------------------------------------


def _docstring_nodes(tree: ast.AST) -> set[int]:
    ids: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _template(node: ast.JoinedStr) -> str | None:
    """``f"CHARLIE_MODEL_{env_name(model)}_"`` as ``CHARLIE_MODEL_<NAME>_``."""
    parts = node.values
    if not parts or not isinstance(parts[0], ast.Constant):
        return None
    if not str(parts[0].value).startswith("CHARLIE_"):
        return None
    text = "".join(str(p.value) if isinstance(p, ast.Constant) else "<NAME>" for p in parts).rstrip(
        "_"
    )
    return text if re.fullmatch(r"CHARLIE_[A-Z0-9_<>]+", text) else None


def _read_sites(path: Path) -> Iterator[tuple[str, str]]:
    """(variable, description) for each CHARLIE_* name a module's code mentions as a string."""
    source = path.read_text()
    tree = ast.parse(source)
    lines = source.splitlines()
    docstrings = _docstring_nodes(tree)
    module_doc = ast.get_docstring(tree)
    parents: dict[int, ast.AST] = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            parents[id(child)] = node
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            if id(node) in docstrings or not VARIABLE.fullmatch(node.value):
                continue
            name = node.value
        elif isinstance(node, ast.JoinedStr):
            found = _template(node)
            if found is None:
                continue
            name = found
        else:
            continue
        yield name, _describe(node, name, lines, parents, module_doc)


def _describe(
    node: ast.AST, name: str, lines: list[str], parents: dict[int, ast.AST], doc: str | None
) -> str:
    parent = parents.get(id(node))
    if isinstance(parent, ast.keyword) and parent.arg == "envvar":
        call = parents.get(id(parent))
        if isinstance(call, ast.Call):
            flags = [a.value for a in call.args if isinstance(a, ast.Constant)]
            helps = [k.value for k in call.keywords if k.arg == "help"]
            text = _literal(helps[0]) if helps and isinstance(helps[0], ast.Constant) else ""
            shown = ", ".join(f"`{f}`" for f in flags if str(f).startswith("-"))
            return _oneline(f"{text} (the option {shown})" if shown else str(text))
    # the comment above the statement that reads it, else a docstring that names it
    statement: ast.AST | None = node
    while statement is not None and not isinstance(statement, ast.stmt):
        statement = parents.get(id(statement))
    if isinstance(statement, ast.stmt):
        comment = _comment_above(lines, statement.lineno)
        if comment:
            return comment
    scope = statement
    key = name.split("<NAME>")[0] + "<NAME>" if "<NAME>" in name else name
    while scope is not None:
        if isinstance(scope, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            text = _paragraph_naming(ast.get_docstring(scope), key)
            if text:
                return text
        scope = parents.get(id(scope))
    if "<NAME>" in name:
        # a family of variables: every paragraph of the module's docstring that names one
        return " ".join(_paragraphs_naming(doc, key))
    return _paragraph_naming(doc, key) or _text_naming(parents, name)


def _text_naming(parents: dict[int, ast.AST], name: str) -> str:
    """Some other text of the module that names the variable (an option's help)."""
    for node_id, parent in parents.items():
        del node_id
        for child in ast.iter_child_nodes(parent):
            if (
                isinstance(child, ast.Constant)
                and isinstance(child.value, str)
                and child.value != name
                and name in child.value
            ):
                return _oneline(child.value)
    return ""


def read_elsewhere(package: Path = PACKAGE, known: set[str] | None = None) -> list[ReadElsewhere]:
    """Every CHARLIE_* variable a module of ``package`` names in its code that is not a
    Settings variable (``known``), with the modules that read it and what it does."""
    known = known or set()
    found: dict[str, ReadElsewhere] = {}
    for path in sorted(package.rglob("*.py")):
        if path == package / "config.py" or "migrations" in path.parts:
            continue
        module = path.relative_to(package.parent).with_suffix("").as_posix().replace("/", ".")
        for name, description in _read_sites(path):
            if name in known:
                continue
            entry = found.setdefault(name, ReadElsewhere(name, [], ""))
            if module not in entry.modules:
                entry.modules.append(module)
            # A module that defines the variable (a paragraph that starts with its name) says
            # what it is; one that only mentions it (the demo passing keys on) says less.
            defines = description.lstrip("`").startswith(name)
            if description and (not entry.description or (defines and not entry.defined)):
                entry.description = description
                entry.defined = defines
    return sorted(found.values(), key=lambda e: e.name)


# --- the pages ---------------------------------------------------------------------------------

CONFIGURATION_INTRO = """\
# Configuration reference

Charlie is configured by its environment: every process (worker, beat, producer, console,
`charlie doctor`) reads the same variables, so processes started with the same environment agree
on where the database and the broker are. This page is generated from the code
(`python scripts/docs_reference.py --write`; a test fails when it is not current): the first
table from the `Settings` fields of `charlie/config.py` (their `#:` comments
and defaults, and the variables `load_settings` reads for each), the second from every other
`CHARLIE_*` variable a module of `charlie/` reads. Celery's own settings live in
`celeryconfig.py`, each with the reason it is set.

Besides Charlie's own, workers read OpenTelemetry's standard environment
(`OTEL_EXPORTER_OTLP_ENDPOINT`, `OTEL_SERVICE_NAME`, `OTEL_TRACES_EXPORTER`, `OTEL_*`: see
[Telemetry](../telemetry.md)) and the `anthropic:` models read `ANTHROPIC_API_KEY` and
`ANTHROPIC_BASE_URL` (see [Models](../models/index.md)).

With the defaults, a run whose worker was killed moves again within lease + sweep interval
(about 6 s, plus queueing).
"""


def configuration_markdown(config: Path = CONFIG, package: Path = PACKAGE) -> str:
    rows = settings_reference(config.read_text())
    out = [CONFIGURATION_INTRO, "## Settings\n"]
    out.append("| Variable | Default | Meaning |")
    out.append("| --- | --- | --- |")
    for row in rows:
        names = ", ".join(f"`{v}`" for v in row.variables)
        anchor = "".join(f'<a id="{v.lower()}"></a>' for v in row.variables)
        meaning = row.comment or "(no description: add a `#:` comment to the field)"
        fields = ", ".join(f"`{f}`" for f in row.fields)
        out.append(
            f"| {anchor}{names} | {_cell(row.default or '(computed)')} | "
            f"{_cell(meaning)} (`Settings.{fields.strip('`')}`) |"
        )
    known = {v for row in rows for v in row.variables}
    others = read_elsewhere(package, known)
    out.append("\n## Read by one component\n")
    out.append(
        "Variables a module reads itself (a command's option, the model clients, the metrics "
        "server). `<NAME>` stands for a model's name upper-cased, each character other than "
        "A-Z and 0-9 turned to `_` (`gpt-4.1-mini`: `GPT_4_1_MINI`).\n"
    )
    out.append("| Variable | Read by | Meaning |")
    out.append("| --- | --- | --- |")
    for entry in others:
        name = entry.name + ("_*" if entry.name.endswith("<NAME>") else "")
        anchor = f'<a id="{entry.name.lower()}"></a>' if "<" not in entry.name else ""
        modules = ", ".join(f"`{m}`" for m in entry.modules)
        meaning = _rst_to_md(entry.description) or "(read here; no comment names it)"
        out.append(f"| {anchor}`{name}` | {modules} | {_cell(meaning)} |")
    return "\n".join(out) + "\n"


def documented_variables(markdown: str) -> set[str]:
    """The variable names a generated configuration page lists."""
    return set(VARIABLE.findall(markdown))


# --- the CLI -----------------------------------------------------------------------------------


def cli_markdown() -> str:
    import click

    from charlie.cli import main

    out = [
        "# CLI reference",
        "",
        "Every `charlie` command, generated from the commands themselves (`python "
        "scripts/docs_reference.py --write`; a test fails when it is not current; `charlie "
        "COMMAND --help` prints the same). Each reads the "
        "[configuration](configuration.md) from the environment.",
        "",
    ]

    def walk(command: click.Command, path: list[str], parent: click.Context | None) -> None:
        # a fixed width: the page is the same whatever terminal generates it (it is committed)
        ctx = click.Context(
            command, info_name=path[-1], parent=parent, terminal_width=88, max_content_width=88
        )
        if path != ["charlie"]:
            out.append(f"## `{' '.join(path)}`\n")
            out.append("```text")
            out.append(command.get_usage(ctx).removeprefix("Usage: "))
            out.append("```\n")
            if command.help:
                out.append(_escape_md(click.unstyle(command.help)).strip() + "\n")
            records = [
                (p, p.get_help_record(ctx))
                for p in command.get_params(ctx)
                if isinstance(p, click.Option)
            ]
            records = [
                (p, r)
                for p, r in records
                if r is not None and p is not command.get_help_option(ctx)
            ]
            if records:
                out.append("| Option | Meaning |")
                out.append("| --- | --- |")
                for param, (opts, text) in records:  # type: ignore[misc]
                    env = f" Environment: `{param.envvar}`." if param.envvar else ""
                    out.append(f"| `{_cell(opts)}` | {_cell(_escape_md(text))}{env} |")
                out.append("")
        if isinstance(command, click.Group):
            for name in sorted(command.list_commands(ctx)):
                sub = command.get_command(ctx, name)
                if sub is not None and not sub.hidden:
                    walk(sub, [*path, name], ctx)

    walk(main, ["charlie"], None)
    return "\n".join(out) + "\n"


def _escape_md(text: str) -> str:
    """Help text as Markdown text: angle brackets and underscores shown as written."""
    return _oneline(text.replace("<", "&lt;").replace(">", "&gt;").replace("\b", ""))


#: the pages this module writes, committed so that the repository's web view shows them too
PAGES = {
    "docs/reference/configuration.md": configuration_markdown,
    "docs/reference/cli.md": cli_markdown,
}


def write_pages() -> list[str]:
    """Write the reference pages into docs/reference/; the paths of those that changed."""
    changed = []
    for path, make in PAGES.items():
        target = REPO / path
        text = make()
        if not target.exists() or target.read_text() != text:
            target.write_text(text)
            changed.append(path)
    return changed


if __name__ == "__main__":  # pragma: no cover - the pages by hand, or written into docs/
    import sys

    page = sys.argv[1] if len(sys.argv) > 1 else "configuration"
    if page == "--write":
        print("\n".join(write_pages()) or "the reference pages are current")
    else:
        print(configuration_markdown() if page == "configuration" else cli_markdown())
