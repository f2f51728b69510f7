"""The documentation as most people read it: in the repository's web view, where no MkDocs runs.
What a page shows is there in the file (no snippet markers: the code itself, kept equal to
docs/examples/), every link goes to a file the repository holds (the generated references are
committed, and kept current), and every page's code blocks fit the column."""

from __future__ import annotations

import importlib.util
import os
import re
import sys
from types import ModuleType

import pytest

from tests.support.cluster import REPO

pytestmark = pytest.mark.backend_free

DOCS = REPO / "docs"
EXAMPLES = DOCS / "examples"
#: what a person reads in the web view: the pages, the README and CONTRIBUTING
PAGES = [*sorted(DOCS.rglob("*.md")), REPO / "README.md", REPO / "CONTRIBUTING.md"]
#: the width a code block is wrapped at, so it fits the column of the web view and the site
CODE_WIDTH = 88


def _reference() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "charlie_docs_reference", REPO / "scripts" / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _outside_code(text: str) -> str:
    return re.sub(r"^\s*```.*?^\s*```", "", text, flags=re.S | re.M)


def test_no_page_has_a_snippet_marker() -> None:
    for page in PAGES:
        assert "--8<--" not in page.read_text(), f"{page.relative_to(REPO)} includes a snippet"


def test_the_code_a_page_shows_is_the_tested_example() -> None:
    """A block titled with a docs/examples/ file's name is that file, as the tests run it."""
    shown = 0
    for page in PAGES:
        for name, body in re.findall(
            r'^```python title="([\w.]+)"\n(.*?)^```', page.read_text(), flags=re.S | re.M
        ):
            example = EXAMPLES / name
            assert example.exists(), f"{page.name} shows {name}, which docs/examples/ lacks"
            assert body == example.read_text(), f"{page.name}'s {name} differs from {example}"
            shown += 1
    assert shown >= 4  # labels.py and test_labels.py, in the getting started and tools pages


def test_every_link_goes_to_a_file_the_repository_holds() -> None:
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _outside_code(page.read_text())):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = os.path.normpath(page.parent / target.split("#")[0])
            assert os.path.exists(path), f"{page.relative_to(REPO)} links to {target}: no file"


def test_the_committed_references_are_current() -> None:
    """docs/reference/configuration.md and cli.md are generated from the code and committed
    (the web view shows them); regenerate with `python scripts/docs_reference.py --write`."""
    reference = _reference()
    for path, make in reference.PAGES.items():
        assert (REPO / path).read_text() == make(), (
            f"{path} is not current: run `python scripts/docs_reference.py --write`"
        )


def test_code_blocks_fit_the_column() -> None:
    for page in PAGES:
        inside = False
        for n, line in enumerate(page.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside = not inside
                continue
            assert not inside or len(line) <= CODE_WIDTH, (
                f"{page.relative_to(REPO)}:{n} is {len(line)} characters in a code block "
                f"(wrap at {CODE_WIDTH})"
            )


def test_the_api_reference_starts_with_what_a_user_calls_first() -> None:
    page = (DOCS / "reference" / "api.md").read_text()
    directives = re.findall(r"^::: ([\w.]+)", page, flags=re.M)
    first = ["charlie.api.submit", "charlie.api.wait", "charlie.api.get_task"]
    assert directives[:4] == [*first, "charlie.api.approve"], directives


def test_the_reference_tables_keep_a_variable_name_whole() -> None:
    css = (DOCS / "stylesheets" / "extra.css").read_text()
    assert "td:first-child code" in css and "white-space: nowrap" in css
    assert "stylesheets/extra.css" in (REPO / "mkdocs.yml").read_text()


def test_the_readme_installs_the_test_extra_before_running_the_example_test() -> None:
    readme = (REPO / "README.md").read_text()
    extra, run = readme.find("pip install -e '.[test]'"), readme.find("pytest test_labels.py")
    assert 0 <= extra < run, "the README runs pytest test_labels.py before installing pytest"


def test_the_tool_option_says_what_leaving_it_out_gives_naming_every_built_in() -> None:
    import charlie.tools  # noqa: F401  (registers the built-ins)
    from charlie.cli import submit
    from charlie.tools.registry import REGISTRY

    (option,) = [p for p in submit.params if p.name == "tools"]
    text = str(getattr(option, "help", ""))
    assert "Left out, the model may use every tool the workers offer" in text, text
    # the built-ins: Charlie's own (a test session's sample tools are registered too)
    built_in = [
        name
        for name in REGISTRY.names()
        if (tool := REGISTRY.get(name)) is not None
        and tool.handler.__module__.startswith("charlie.tools")
    ]
    assert "recall" in built_in and len(built_in) >= 8, built_in
    assert not [name for name in built_in if name not in text], built_in


def test_the_docs_build_as_contributing_says_silences_the_themes_end_of_life_notice() -> None:
    contributing = (REPO / "CONTRIBUTING.md").read_text()
    ci = (REPO / ".ci" / "run").read_text()
    assert "NO_MKDOCS_2_WARNING=1" in contributing and "NO_MKDOCS_2_WARNING=1 mkdocs" in ci
