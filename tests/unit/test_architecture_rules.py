"""The rules of docs/architecture.md are the import-linter contracts of pyproject.toml, and the
two say the same thing.

`lint-imports` checks the code against the contracts; this checks the contracts against the
documentation and against the package's modules: the Layers list names every layer of the
layers contract in its order, each module in its layer's row, and no module of the package is
left out of the layers contract or of "SQL lives in the store" without a reason.
"""

from __future__ import annotations

import itertools
import re
import tomllib
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.backend_free

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "charlie"

#: Top-level modules in no layer, and why.
UNLAYERED = {
    # the `python -m charlie` entry point: it calls charlie.cli.main and nothing imports it
    "__main__",
    # the tool author's harness: imports the tools SDK and the ports, is imported by nothing in
    # the package, and its rule is the "Tools never import the engine" contract's
    "testing",
}


def _contracts() -> list[dict[str, Any]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts: list[dict[str, Any]] = config["tool"]["importlinter"]["contracts"]
    return contracts


def _contract(name_starts: str) -> dict[str, Any]:
    (found,) = [c for c in _contracts() if c["name"].startswith(name_starts)]
    return found


def _layers() -> list[list[str]]:
    """The layers contract's layers, top first, each its modules' short names."""
    layers = _contract("Dependencies point one way")["layers"]
    return [
        [name.strip().removeprefix("charlie.") for name in re.split(r"[|:]", layer)]
        for layer in layers
    ]


def _top_level_modules() -> set[str]:
    names = set()
    for path in PACKAGE.iterdir():
        if path.is_dir() and (path / "__init__.py").exists():
            names.add(path.name)
        elif path.suffix == ".py" and path.name != "__init__.py":
            names.add(path.stem)
    return names


def _layers_block() -> str:
    """The code block under docs/architecture.md's "## Layers"."""
    text = (ROOT / "docs" / "architecture.md").read_text()
    section = text.split("\n## Layers\n", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def _mentions(block: str) -> dict[str, int]:
    """Where the block first names each top-level module (``charlie/NAME.py`` or
    ``charlie/NAME/``)."""
    first: dict[str, int] = {}
    for match in re.finditer(r"charlie/([a-z_]+)(?:\.py\b|/)", block):
        first.setdefault(match.group(1), match.start())
    return first


def test_every_module_of_the_package_is_in_a_layer() -> None:
    layered = {name for layer in _layers() for name in layer}
    missing = _top_level_modules() - layered - UNLAYERED
    assert not missing, (
        f"add these to a layer in pyproject.toml (and docs/architecture.md): {missing}"
    )
    assert not (layered & UNLAYERED)
    assert not (layered - _top_level_modules()), "the contract names a module that is gone"


def test_the_documented_layers_are_the_contracts_in_its_order() -> None:
    block = _layers_block()
    mentioned = _mentions(block)
    layers = _layers()
    missing = [name for layer in layers for name in layer if name not in mentioned]
    assert not missing, f"docs/architecture.md's Layers list does not name charlie/{missing}"
    unknown = set(mentioned) - {name for layer in layers for name in layer} - UNLAYERED
    assert not unknown, f"the Layers list names modules no layer holds: {unknown}"
    for upper, lower in itertools.pairwise(layers):
        last_of_upper = max(mentioned[name] for name in upper)
        first_of_lower = min(mentioned[name] for name in lower)
        assert last_of_upper < first_of_lower, (
            f"docs/architecture.md lists {lower} above {upper}; pyproject.toml's layers "
            "contract has them the other way round"
        )


def test_sql_lives_in_the_store_covers_every_module_but_the_store() -> None:
    contract = _contract("SQL lives in the store")
    sources = {name.removeprefix("charlie.") for name in contract["source_modules"]}
    assert sources == _top_level_modules() - {"store"}, (
        "the SQL contract's source_modules must be every top-level module but charlie.store"
    )
    assert {"sqlalchemy", "alembic"} <= set(contract["forbidden_modules"])


def test_the_checks_see_a_disagreement() -> None:
    """The parsing above reads what it should: a layer moved in the text is caught."""
    block = _layers_block()
    moved = block.replace("charlie/observe.py", "charlie/observe_moved.py")
    moved = "charlie/observe.py\n" + moved
    mentioned = _mentions(moved)
    assert mentioned["observe"] < mentioned["cli"]
