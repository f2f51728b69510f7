"""Who may use the console: the holder of its token.

A page accepts ``?token=...`` once and then keeps a signed session cookie (HttpOnly,
SameSite=Lax, Secure behind HTTPS); the JSON API takes ``Authorization: Bearer``. Tokens are
compared in constant time. The cookie's signing key is derived from the token, so restarting
the console with the same token keeps sessions, and changing the token ends every one.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

#: the session cookie's name
SESSION_COOKIE = "charlie_ui"
#: how long a session lasts (days)
SESSION_DAYS = 7
#: what the cookie says: a version, so a later format can refuse this one
SESSION_VALUE = "v1"


def new_token() -> str:
    """A token for a console started without one (printed in its URL, as Jupyter does)."""
    return secrets.token_urlsafe(32)


def check_token(token: str) -> str:
    token = token.strip()
    if len(token) < 16:
        raise ValueError("the console's token must be at least 16 characters")
    return token


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
