"""A setting whose value is a JSON object, inline or in a file whose path it names.

CHARLIE_PRICES and CHARLIE_MODEL_LIMITS are read this way: the same errors, each naming the
setting and where the text came from, so an operator knows which one to fix.
"""

from __future__ import annotations

import json
import os
from typing import Any


def json_object(setting: str, raw: str, error: type[Exception], shape: str) -> dict[str, Any]:
    """The JSON object ``raw`` holds (text starting with ``{``) or names (a file's path);
    ``error`` naming ``setting`` and where the text came from when it cannot be read, is not
    JSON or is not an object (``shape`` says what is expected, e.g. "model: price")."""
    text = raw.strip()
    source = "the inline JSON"
    if not text.startswith("{"):
        path = os.path.expanduser(text)
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except OSError as exc:
            raise error(
                f"{setting}={raw!r} is neither a JSON object nor a readable file: "
                f"{exc.strerror or exc}"
            ) from None
        source = path
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{setting}: {source} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise error(f"{setting}: {source} must be a JSON object of {shape}")
    return data
