"""One version, set in pyproject.toml: the package metadata, ``charlie.__version__``,
`charlie --version` and the changelog's latest release say the same."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from click.testing import CliRunner

import charlie
from charlie.cli import main

pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]


def test_the_version_is_the_package_metadata() -> None:
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    assert version("charlie") == declared, "reinstall (pip install -e .) after a version change"
    assert charlie.__version__ == declared


def test_charlie_version_prints_it() -> None:
    result = CliRunner().invoke(main, ["--version"], prog_name="charlie")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"charlie, version {charlie.__version__}"


def test_the_changelog_has_an_unreleased_section_and_this_release() -> None:
    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), re.M)
    assert headings[0] == "Unreleased"
    assert headings[1] == charlie.__version__, (
        "CHANGELOG.md's latest release is not the package's version: move Unreleased under it"
    )
