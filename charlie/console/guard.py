"""Which requests the console answers and where it sends a browser.

**Host names.** A page on ``evil.example`` whose DNS name is made to resolve to 127.0.0.1
(DNS rebinding) reaches a console on this machine as its own origin, so the browser lets its
script read what the console answers. Its requests still say ``Host: evil.example``: the
console answers only the names it was told of. By default those are the address it listens on,
``localhost``, ``127.0.0.1`` and ``[::1]``, each with the port it listens on; more are given by
``--allowed-host`` / ``CHARLIE_UI_ALLOWED_HOSTS`` (``NAME:PORT`` exactly, or ``NAME`` on any
port: the name a TLS proxy forwards usually has none).

**Redirects.** Every redirect the console sends is to a path of its own: ``//evil.example/``
and ``/\\evil.example`` are other sites to a browser (a backslash counts as a slash, and tabs
and newlines are dropped from a URL), so such a path is never a redirect's target.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

#: what a host name may be made of (letters, digits, dots, dashes; an IPv6 literal in brackets)
_NAME = re.compile(r"[a-z0-9._-]+|\[[0-9a-f:.]+\]")
#: what makes a browser read a path as another site or cut it up: backslashes, controls, blanks
_UNSAFE_IN_PATH = re.compile(r"[\x00-\x20\x7f\\]")
#: the names a local console answers to besides the address it listens on
LOCAL_NAMES = ("localhost", "127.0.0.1", "[::1]")


def split_host(value: str) -> tuple[str, int | None] | None:
    """A ``Host`` header (or an allowed-host entry) as (name, port), lowercased; None when it is
    not a host name with an optional port."""
    value = value.strip().lower()
    if value.startswith("["):
        end = value.find("]")
        if end < 0:
            return None
        name, rest = value[: end + 1], value[end + 1 :]
    elif value.count(":") == 1:
        name, _, after = value.partition(":")
        rest = ":" + after
    elif ":" in value:  # a bare IPv6 address: not a Host header's form
        return None
    else:
        name, rest = value, ""
    if not _NAME.fullmatch(name):
        return None
    if not rest:
        return name, None
    if not rest.startswith(":") or not rest[1:].isdigit() or len(rest) > 6:
        return None
    number = int(rest[1:])
    return (name, number) if 0 < number < 65536 else None


def address_name(host: str) -> str:
    """The name a browser puts in ``Host`` for a listening address (IPv6 in brackets)."""
    host = host.strip().lower()
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


@dataclass(frozen=True)
class AllowedHosts:
    """The ``Host`` headers the console answers (see the module's docstring)."""

    #: (name, port) pairs allowed exactly; a request without a port is on port 80
    exact: frozenset[tuple[str, int]]
    #: names allowed on any port (or none)
    any_port: frozenset[str]

    @classmethod
    def build(cls, listen: str, port: int, extra: Iterable[str] = ()) -> AllowedHosts:
        exact = {(name, port) for name in (address_name(listen), *LOCAL_NAMES)}
        any_port: set[str] = set()
        for entry in extra:
            parsed = split_host(entry)
            if parsed is None:
                raise ValueError(f"{entry!r} is not a host name (NAME or NAME:PORT)")
            name, given = parsed
            if given is None:
                any_port.add(name)
            else:
                exact.add((name, given))
        return cls(exact=frozenset(exact), any_port=frozenset(any_port))

    def allows(self, host: str | None) -> bool:
        parsed = split_host(host or "")
        if parsed is None:
            return False
        name, port = parsed
        return name in self.any_port or (name, 80 if port is None else port) in self.exact

    def describe(self) -> str:
        shown = sorted(f"{n}:{p}" for n, p in self.exact) + sorted(
            f"{n} (any port)" for n in self.any_port
        )
        return ", ".join(shown)


def parse_hosts(values: Iterable[str]) -> list[str]:
    """Allowed-host entries from options and ``CHARLIE_UI_ALLOWED_HOSTS`` (commas or blanks
    between them)."""
    return [part for value in values for part in re.split(r"[\s,]+", value) if part]


def local_path(url: str) -> str | None:
    """``url`` when a browser reads it as a path on this site, else None: it starts with one
    ``/`` and has no scheme, no host, no backslash, no control or blank character."""
    if not url.startswith("/") or url.startswith("//") or _UNSAFE_IN_PATH.search(url):
        return None
    parts = urlsplit(url)
    if parts.scheme or parts.netloc:
        return None
    return url
