"""MkDocs hooks (mkdocs.yml ``hooks:``): the reference pages are generated from the code when the
site is built, so the site cannot drift from it (scripts/docs_reference.py says how); the same
pages are committed in docs/reference/ for the repository's web view, and
tests/unit/test_docs.py fails when those are not current."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

_HERE = Path(__file__).resolve().parent


def _reference() -> Any:
    spec = importlib.util.spec_from_file_location(
        "charlie_docs_reference", _HERE / "docs_reference.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def on_files(files: Files, config: Any) -> Files:
    reference = _reference()
    pages = {
        "reference/configuration.md": reference.configuration_markdown(),
        "reference/cli.md": reference.cli_markdown(),
    }
    for path, content in pages.items():
        existing = files.get_file_from_path(path)
        if existing is not None:
            files.remove(existing)
        files.append(File.generated(config, path, content=content))
    return files
