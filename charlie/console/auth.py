"""Who may use the console: the holder of its token.

A page accepts ``?token=...`` once and then keeps a signed session cookie (HttpOnly,
SameSite=Lax; Secure behind HTTPS or a TLS proxy); the JSON API takes ``Authorization:
Bearer``. Tokens are compared in constant time. The cookie's signing key is derived from the
token, so restarting the console with the same token keeps sessions, and changing the token
ends every one.

Each login starts a session with its own random id (in the signed cookie). A form's XSRF token
is an HMAC of that id under a key derived from the token, masked anew on every render: a
form token from one session (someone else's, or one planted with a cookie) is refused in any
other, and nothing but the session cookie needs to be set.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
import stat
from pathlib import Path

#: the session cookie's name
SESSION_COOKIE = "charlie_ui"
#: how long a session lasts (days)
SESSION_DAYS = 7
#: what the cookie says: a version and the session's id ("v1" had no id: refused)
SESSION_PREFIX = "v2:"
_SESSION_ID = re.compile(r"[A-Za-z0-9_-]{32}")
#: a form's XSRF token: its version, then the mask and the masked HMAC (hex)
XSRF_PREFIX = "s1"


def new_token() -> str:
    """A token for a console started without one (printed in its URL, as Jupyter does)."""
    return secrets.token_urlsafe(32)


def check_token(token: str) -> str:
    token = token.strip()
    if len(token) < 16:
        raise ValueError("the console's token must be at least 16 characters")
    return token


def read_token_file(path: Path) -> tuple[str, str | None]:
    """The token in ``path`` (its first line, trimmed) and a warning when others may read it."""
    try:
        mode = path.stat().st_mode
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"cannot read the token file {path}: {exc.strerror or exc}") from None
    lines = text.strip().splitlines()
    if not lines:
        raise ValueError(f"the token file {path} is empty")
    warning = None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        warning = (
            f"the token file {path} can be read by others (mode {stat.S_IMODE(mode):04o}): "
            f"chmod 600 it"
        )
    return check_token(lines[0]), warning


def write_token_file(path: Path, token: str) -> None:
    """Write a generated token where only this user can read it (0600, replaced whole)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as out:
        out.write(token + "\n")
    os.replace(partial, path)


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison; no token never matches."""
    if not given:
        return False
    return hmac.compare_digest(given.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    """The token of an ``Authorization: Bearer T`` header, else None."""
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    if scheme.lower() != "bearer":
        return None
    return value.strip() or None


def cookie_secret(token: str) -> str:
    """The session cookies' signing key: the token's, never the token itself."""
    return hmac.new(token.encode(), b"charlie-console-session-v1", hashlib.sha256).hexdigest()


# -- sessions and the forms' XSRF tokens --------------------------------------------------------


def new_session() -> str:
    """A new session's id (what its cookie holds, signed)."""
    return secrets.token_urlsafe(24)


def session_value(session: str) -> str:
    return SESSION_PREFIX + session


def session_of(value: bytes | None) -> str | None:
    """The session id in a (verified) session cookie's value; None for none or another format."""
    if not value:
        return None
    text = value.decode("ascii", "replace")
    if not text.startswith(SESSION_PREFIX):
        return None
    session = text[len(SESSION_PREFIX) :]
    return session if _SESSION_ID.fullmatch(session) else None


def xsrf_key(token: str) -> bytes:
    """The key of the forms' XSRF tokens: the token's, apart from the cookies' key."""
    return hmac.new(token.encode(), b"charlie-console-xsrf-v1", hashlib.sha256).digest()


def _xsrf_raw(key: bytes, session: str) -> bytes:
    return hmac.new(key, session.encode(), hashlib.sha256).digest()


def xsrf_token(key: bytes, session: str) -> str:
    """A form's token for this session, masked with fresh random bytes (so a page's bytes never
    repeat a secret: no compression side channel reads it)."""
    raw = _xsrf_raw(key, session)
    mask = secrets.token_bytes(len(raw))
    masked = bytes(a ^ b for a, b in zip(mask, raw, strict=True))
    return f"{XSRF_PREFIX}|{mask.hex()}|{masked.hex()}"


def xsrf_matches(given: str, key: bytes, session: str | None) -> bool:
    """Whether a posted form token is this session's (constant time); no session never."""
    if session is None:
        return False
    version, _, rest = given.partition("|")
    mask_hex, _, masked_hex = rest.partition("|")
    try:
        mask, masked = bytes.fromhex(mask_hex), bytes.fromhex(masked_hex)
    except ValueError:
        return False
    if version != XSRF_PREFIX or len(mask) != 32 or len(masked) != 32:
        return False
    raw = bytes(a ^ b for a, b in zip(mask, masked, strict=True))
    return hmac.compare_digest(raw, _xsrf_raw(key, session))
