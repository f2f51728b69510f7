"""The documentation: a README a newcomer reads in minutes, examples that work as written, and
reference pages generated from the code that name every setting and command there is."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.cluster import REPO

pytestmark = pytest.mark.backend_free

README = REPO / "README.md"
EXAMPLES = REPO / "docs" / "examples"
README_MAX_LINES = 250


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "charlie_docs_reference", REPO / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _blocks(markdown: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", markdown, flags=re.S | re.M)


def _example_env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLIE_")}
    env["CHARLIE_HOME"] = str(tmp_path / "home")
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def test_the_readme_is_short() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines, more than {README_MAX_LINES}: move the detail into "
        "a page of the documentation site (docs/) and link to it"
    )


def test_the_readme_examples_are_the_tested_files() -> None:
    """Each Python block of the README that names a file (`# labels.py`) is that file of
    docs/examples/, which the next test runs; a block naming no file is not allowed."""
    blocks = _blocks(README.read_text(), "python")
    assert blocks, "the README shows no Python example"
    for block in blocks:
        first, _, body = block.partition("\n")
        named = re.fullmatch(r"# (\w+\.py)", first.strip())
        assert named, f"a README Python block names no docs/examples file:\n{block}"
        assert body == (EXAMPLES / named.group(1)).read_text(), (
            f"README's {named.group(1)} differs from docs/examples/{named.group(1)}"
        )


def test_the_documented_examples_run(tmp_path: Path) -> None:
    """docs/examples/ (the README's and the pages' tool and its test) passes as written."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(EXAMPLES)],
        cwd=tmp_path,
        env=_example_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert " passed" in run.stdout and " failed" not in run.stdout


def _variables_read_in_charlie() -> set[str]:
    """Every CHARLIE_* name written as a whole string in charlie/'s code, found by text alone
    (not by the generator's own parsing)."""
    found: set[str] = set()
    for path in (REPO / "charlie").rglob("*.py"):
        found |= set(re.findall(r"""["'](CHARLIE_[A-Z0-9_]*[A-Z0-9])["']""", path.read_text()))
    return found


def test_the_configuration_reference_names_every_variable_read() -> None:
    reference = _reference()
    page = reference.configuration_markdown()
    listed = reference.documented_variables(page)
    missing = sorted(_variables_read_in_charlie() - listed)
    assert not missing, f"read in charlie/ but not in the configuration reference: {missing}"
    # the families of per-model variables, read under a prefix
    assert "CHARLIE_MODEL_<NAME>_*" in page
    assert "(no description" not in page, "a setting without a #: comment"


def test_a_setting_added_in_the_usual_style_appears(tmp_path: Path) -> None:
    """A Settings field with a `#:` comment, read in load_settings by its CHARLIE_* name, is
    in the reference with its comment and default, with no edit to the generator."""
    source = (REPO / "charlie" / "config.py").read_text()
    source = source.replace(
        "    #: I14: at most this many new tool dispatches per tick.\n",
        "    #: how many widgets a turn may frob (a test's setting).\n"
        "    widget_frobs: int = 7\n"
        "    #: I14: at most this many new tool dispatches per tick.\n",
    ).replace(
        '        dispatch_batch=_env_int("CHARLIE_DISPATCH_BATCH", 8),\n',
        '        dispatch_batch=_env_int("CHARLIE_DISPATCH_BATCH", 8),\n'
        '        widget_frobs=_env_int("CHARLIE_WIDGET_FROBS", 7),\n',
    )
    assert "CHARLIE_WIDGET_FROBS" in source
    config = tmp_path / "config.py"
    config.write_text(source)
    page = _reference().configuration_markdown(config=config)
    row = next(line for line in page.splitlines() if "`CHARLIE_WIDGET_FROBS`" in line)
    assert "how many widgets a turn may frob" in row and "| `7` |" in row


def test_the_cli_reference_has_every_command_and_option() -> None:
    import click

    from charlie.cli import main

    page = _reference().cli_markdown()

    def walk(command: click.Command, path: list[str]) -> None:
        ctx = click.Context(command, info_name=path[-1])
        if len(path) > 1:
            assert f"## `{' '.join(path)}`" in page, f"{' '.join(path)} is not in the reference"
            for param in command.params:
                if isinstance(param, click.Option) and not param.hidden:
                    # an option the reference lists without a meaning leaves a reader guessing
                    assert param.help, f"{' '.join(path)} {param.opts[0]} has no help text"
                    for flag in param.opts:
                        assert flag in page, f"{' '.join(path)} {flag} is not in the reference"
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                walk(sub, [*path, name])

    walk(main, ["charlie"])
    assert "`--search TEXT`" in page


def test_no_machine_paths_and_the_invariants_are_in_the_repository() -> None:
    """A clone has everything the docs point to: the invariants are docs/invariants.md, and no
    page names a path of one machine or a folder outside the repository."""
    invariants = (REPO / "docs" / "invariants.md").read_text()
    assert all(f"**I{n} " in invariants for n in range(1, 37))
    texts = {README: README.read_text()}
    texts |= {p: p.read_text() for p in (REPO / "docs").rglob("*.md")}
    texts[REPO / "celeryconfig.py"] = (REPO / "celeryconfig.py").read_text()
    # spelled in pieces so this file does not name them itself (test_source_hygiene)
    machine_paths = ("../" + "shared/", "/" + "work/", "INVARIANTS.md", "/tmp/dbosenv")
    for path, text in texts.items():
        for bad in machine_paths:
            assert bad not in text, f"{path.relative_to(REPO)} names {bad!r}"


def test_the_readme_links_into_the_site() -> None:
    """Every relative link of the README names a page that is in the repository."""
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    local = [link for link in links if "://" not in link]
    assert any(link.startswith("docs/") for link in local)
    missing = [link for link in local if not (REPO / link).is_file()]
    assert not missing, f"README links to files that are not there: {missing}"
