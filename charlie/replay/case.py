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
tokens, passwords, credentials; the password of a URL; percent-encoded or decoded), and whatever
the exporter's ``--redact`` patterns match, are replaced by ``[redacted]`` wherever they occur, in
every string of the case. Whatever the environment: the password of any URL, ``Bearer``/``Basic``
credentials and well-known token shapes are blanked in every string, a metadata key that looks
like a secret (or holds headers) keeps only its name at any depth, and so does a field named like
one (``password``, ``api_key``, ``Authorization``, ``headers``, ...) anywhere in the task's
arguments, results and transcript, as a value or as JSON inside a string. The environment is the
exporter's, not the workers': a secret only the workers hold needs ``--redact``.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit

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
#: a field anywhere in a case (arguments, results, transcript) whose value is a secret by its
#: name; narrower than SECRET_NAME, which metadata keys meet, so a ledger's "key" or a tool's
#: "author" stays readable (a number or a boolean is never a secret: token counts stay)
SECRET_FIELD = re.compile(
    r"(api[_-]?key|access[_-]?key|secret|token|passw(?:or)?d|passphrase|credential|"
    r"authori[sz]ation|(?:^|[_-])auth(?:$|[_-])|cookie|session[_-]?(?:id|key|token)|"
    r"private[_-]?key|^headers?$)",
    re.IGNORECASE,
)
#: the password of any URL (scheme://user:password@host): the password goes, the rest stays
URL_PASSWORD = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.\-]*://[^\s/:@\"']*:)([^\s/@\"']+)(@)")
#: an HTTP credential: "Bearer <token>", "Basic <token>"
HTTP_CREDENTIAL = re.compile(r"\b(Bearer|Basic)(\s+)([A-Za-z0-9\-._~+/]{4,}=*)")
#: tokens whose shape alone says what they are
TOKEN_SHAPES = re.compile(
    r"\bsk-(?:[A-Za-z]+-)?[A-Za-z0-9_\-]{16,}|\bgh[pousr]_[A-Za-z0-9]{10,}|"
    r"\bgithub_pat_[A-Za-z0-9_]{20,}|\bglpat-[A-Za-z0-9_\-]{20,}|\bxox[abposr]-[A-Za-z0-9\-]{10,}|"
    r"\b(?:AKIA|ASIA)[0-9A-Z]{16}\b|\bAIza[0-9A-Za-z_\-]{35}|"
    r"-----BEGIN [A-Z ]*PRIVATE KEY-----[\s\S]*?-----END [A-Z ]*PRIVATE KEY-----"
)
#: a JSON field inside a string (a tool's raw arguments, a rendered result): "name": value
JSON_FIELD = re.compile(
    r'("([A-Za-z0-9_.\-]{1,64})"\s*:\s*)("(?:[^"\\]|\\.)*"|\{[^{}]*\}|\[[^\[\]]*\])'
)
#: NAME=value in text (an environment dump, a command line, a query string)
ASSIGNMENT = re.compile(r"\b([A-Za-z_][A-Za-z0-9_\-]*)=([^\s&\"';,]{6,})")
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
    # a URL's password is percent-encoded (p%40ss); a text may hold it decoded (p@ss)
    for value in list(found):
        decoded = unquote(value)
        if decoded != value and len(decoded) >= MIN_SECRET:
            found.add(decoded)
    # longest first, so a secret that contains another is blanked whole
    return sorted(found, key=len, reverse=True)


class Scrubber:
    """Blanks secrets in every string of a JSON value: the given literal values, the regular
    expressions of ``--redact``, and what is a secret whatever the environment (a URL's password,
    an HTTP credential, a token of a known shape, a field named like a secret); metadata keys
    named like secrets lose their value at any depth."""

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
        value, n = URL_PASSWORD.subn(rf"\g<1>{REDACTED}\g<3>", value)
        self.count += n
        value = HTTP_CREDENTIAL.sub(self._credential, value)
        value, n = TOKEN_SHAPES.subn(REDACTED, value)
        self.count += n
        if ":" in value:
            value = JSON_FIELD.sub(self._json_field, value)
        if "=" in value:
            value = ASSIGNMENT.sub(self._assignment, value)
        return value

    def _credential(self, match: re.Match[str]) -> str:
        token = match.group(3)
        # "Basic usage", "Bearer Tokens": a word of prose, not a credential
        if token.isalpha() and token[1:].islower():
            return match.group(0)
        self.count += 1
        return f"{match.group(1)}{match.group(2)}{REDACTED}"

    def _json_field(self, match: re.Match[str]) -> str:
        body = match.group(3)
        if not SECRET_FIELD.search(match.group(2)) or body in ('""', f'"{REDACTED}"', "{}", "[]"):
            return match.group(0)
        self.count += 1
        return f'{match.group(1)}"{REDACTED}"'

    def _assignment(self, match: re.Match[str]) -> str:
        value = match.group(2)
        if not SECRET_FIELD.search(match.group(1)) or value.isdigit() or REDACTED in value:
            return match.group(0)
        self.count += 1
        return f"{match.group(1)}={REDACTED}"

    def strings(self, value: Any) -> Any:
        """``value`` with its strings scrubbed and its keys' names not looked at: for what must
        stay as it is to replay (a tool's parameter schema may name a ``password``)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.strings(v) for v in value]
        if isinstance(value, dict):
            return {self.text(str(k)): self.strings(v) for k, v in value.items()}
        return value

    def value(
        self, value: Any, secret_key: re.Pattern[str] = SECRET_FIELD, numbers: bool = False
    ) -> Any:
        """``value`` with its strings scrubbed, and the value of any key named like a secret
        (``secret_key``), at any depth, blanked whole unless it is empty, or a number or a
        boolean (unless ``numbers``)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.value(v, secret_key, numbers) for v in value]
        if isinstance(value, dict):
            out: dict[str, Any] = {}
            for key, val in value.items():
                name = self.text(str(key))
                if secret_key.search(str(key)) and _holds_secret(val, numbers):
                    self.count += 1
                    out[name] = REDACTED
                else:
                    out[name] = self.value(val, secret_key, numbers)
            return out
        return value

    def metadata(self, metadata: Any) -> Any:
        """A task's metadata: a key named like a secret (or headers), at any depth, through
        lists and dicts, keeps its name only."""
        return self.value(metadata, SECRET_NAME, numbers=True)


def _holds_secret(value: Any, numbers: bool) -> bool:
    # outside metadata a number or a boolean is a count or a setting (input_tokens,
    # auth_required), not a secret
    if value is None or (not numbers and isinstance(value, bool | int | float)):
        return False
    return value not in ("", {}, [], REDACTED)
