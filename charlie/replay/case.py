"""The exported case file: its format, how it is read back, and what never goes into it (I35).

A case is one JSON object (docs/reference/case-format.md)::

    {"format": "charlie-case", "format_version": 1, "exported_at": ..., "exported_by": ...,
     "task": {...}, "settings": {...}, "context_state": {...}, "tools": {...},
     "transcript": [...], "calls": [...], "actions": [...], "model_calls": [...],
     "children": [...], "redacted": {...}}

``format_version`` changes only when a reader of the old version would misread the new one;
keys a reader does not know are ignored (a newer exporter may add some), a version it does not
know is refused: the case cannot be replayed (exit 2), never replayed wrong.

Secrets never go in: the values of environment variables whose names look like secrets (keys,
tokens, passwords, credentials; the password of a URL), any metadata key that looks like one or
holds headers, and whatever the exporter's ``--redact`` patterns match, are replaced by
``[redacted]`` wherever they occur, in every string of the case.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

FORMAT = "charlie-case"
FORMAT_VERSION = 1
#: the task kinds this version replays; a Pydantic AI agent's task would be another kind, with
#: its own "agent" block (docs/reference/case-format.md)
KINDS = ("native",)
REDACTED = "[redacted]"

#: an environment variable, or a metadata key, whose value is a secret by its name
SECRET_NAME = re.compile(
    r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|PASSPHRASE|CREDENTIAL|AUTH|COOKIE|SESSION|PRIVATE|"
    r"SIGNATURE|HEADERS?)",
    re.IGNORECASE,
)
#: values shorter than this are not hunted in text (a "1" would blank every digit)
MIN_SECRET = 6


class CaseError(ValueError):
    """The case cannot be replayed: not a case, an incompatible version, a kind not known."""


def load_case(path: Path) -> dict[str, Any]:
    """The case in ``path``, checked for what a replay needs, or CaseError saying what is
    wrong."""
    try:
        raw = path.read_text()
    except OSError as exc:
        raise CaseError(f"cannot read {path}: {exc.strerror}") from exc
    try:
        case = json.loads(raw)
    except ValueError as exc:
        raise CaseError(f"{path} is not JSON: {exc}") from exc
    return check_case(case, str(path))


def check_case(case: Any, where: str = "the case", *, replaying: bool = True) -> dict[str, Any]:
    """``case`` if it is a case this version reads (``replaying``: and replays: its tasks'
    kinds known), else CaseError saying what is wrong."""
    if not isinstance(case, dict) or case.get("format") != FORMAT:
        raise CaseError(f'{where} is not a Charlie case (no "format": "{FORMAT}")')
    version = case.get("format_version")
    if version != FORMAT_VERSION:
        raise CaseError(
            f"{where} is a case of format version {version!r}; this Charlie reads version "
            f"{FORMAT_VERSION} (export it again with this version, or replay it with the "
            "version that exported it)"
        )
    _check_task(case, where, replaying)
    return case


def _check_task(case: dict[str, Any], where: str, replaying: bool) -> None:
    task = case.get("task")
    if not isinstance(task, dict):
        raise CaseError(f"{where} has no task")
    kind = task.get("kind", "native")
    if replaying and kind not in KINDS:
        raise CaseError(
            f"{where}: task {task.get('id')!r} is of kind {kind!r}; this version replays "
            f"{', '.join(KINDS)} tasks only"
        )
    for key in ("id", "prompt", "model"):
        if not isinstance(task.get(key), str):
            raise CaseError(f"{where}: the task has no {key!r}")
    for key in ("transcript", "calls", "model_calls"):
        if not isinstance(case.get(key), list):
            raise CaseError(f"{where}: {key!r} must be a list")
    for child in case.get("children") or []:
        _check_task(child, f"{where} (child {child.get('task', {}).get('id')!r})", replaying)


# -- secrets --------------------------------------------------------------------------------


def environment_secrets(environ: Mapping[str, str] | None = None) -> list[str]:
    """The values of the environment that must not leave it: every variable named like a
    secret, and the password of any URL in the environment (a database's, a broker's)."""
    env = os.environ if environ is None else environ
    found: set[str] = set()
    for name, value in env.items():
        if not value:
            continue
        # (a number is a setting, CHARLIE_MODEL_*_CONTEXT_TOKENS, not a credential)
        if SECRET_NAME.search(name) and len(value) >= MIN_SECRET and not value.isdigit():
            found.add(value)
        if "://" in value:
            try:
                password = urlsplit(value).password
            except ValueError:
                password = None
            if password and len(password) >= MIN_SECRET:
                found.add(password)
    # longest first, so a secret that contains another is blanked whole
    return sorted(found, key=len, reverse=True)


class Scrubber:
    """Blanks secrets in every string of a JSON value: the given literal values and the
    regular expressions of ``--redact``; metadata keys named like secrets lose their value."""

    def __init__(self, secrets: Iterable[str], patterns: Iterable[str] = ()) -> None:
        self.secrets = [s for s in secrets if s]
        self.patterns: list[re.Pattern[str]] = []
        for pattern in patterns:
            try:
                self.patterns.append(re.compile(pattern))
            except re.error as exc:
                raise ValueError(
                    f"--redact {pattern!r} is not a regular expression: {exc}"
                ) from exc
        self.count = 0

    def text(self, value: str) -> str:
        for secret in self.secrets:
            if secret in value:
                self.count += value.count(secret)
                value = value.replace(secret, REDACTED)
        for pattern in self.patterns:
            value, n = pattern.subn(REDACTED, value)
            self.count += n
        return value

    def value(self, value: Any) -> Any:
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(v) for v in value]
        if isinstance(value, dict):
            return {self.text(str(k)): self.value(v) for k, v in value.items()}
        return value

    def metadata(self, metadata: Any) -> Any:
        """A task's metadata: a key named like a secret (or headers) keeps its name only."""
        if not isinstance(metadata, dict):
            return self.value(metadata)
        out: dict[str, Any] = {}
        for key, val in metadata.items():
            if SECRET_NAME.search(str(key)) and val not in (None, "", {}, []):
                self.count += 1
                out[self.text(str(key))] = REDACTED
            else:
                nested = isinstance(val, dict)
                out[self.text(str(key))] = self.metadata(val) if nested else self.value(val)
        return out
