"""Per-workspace credentials: a worker acts only on its task's workspace.

The devbox keeps one operator token. A credential for one workspace is
``cw1:<workspace id>:<HMAC-SHA256(key, workspace id)>``, with the key derived from the token,
so whoever holds the token (the operator, the workers) can make the credential of a workspace
and the devbox can check one without storing anything. A request made with a workspace's
credential may touch only that workspace and its commands; the token itself stays valid for
the operator's own use (any workspace). A worker uses the token only to derive the credential
of the workspace its task owns, which it computes from the task id, never from metadata.
"""

from __future__ import annotations

import hashlib
import hmac

PREFIX = "cw1"
_CONTEXT = b"charlie devbox workspace credential v1"

#: The shortest operator token the devbox or a worker accepts: it is the key of every workspace's
#: credential, so a short one can be guessed offline from any credential seen (32 characters of
#: ``secrets.token_urlsafe`` are 192 bits).
MIN_TOKEN_LENGTH = 32


class WeakToken(ValueError):
    """The devbox token is missing or shorter than ``MIN_TOKEN_LENGTH``."""


def check_token(token: str | None, source: str = "CHARLIE_DEVBOX_TOKEN") -> str:
    """``token`` if it is long enough; WeakToken naming the minimum (never the token) if not."""
    if not token:
        raise WeakToken(f"no devbox token: set {source} (at least {MIN_TOKEN_LENGTH} characters)")
    if len(token) < MIN_TOKEN_LENGTH:
        raise WeakToken(
            f"the devbox token ({source}) is {len(token)} characters; it must be at least "
            f"{MIN_TOKEN_LENGTH}. Make one with: "
            "python -c 'import secrets; print(secrets.token_urlsafe(32))'"
        )
    return token


def _key(token: str) -> bytes:
    return hmac.new(token.encode(), _CONTEXT, hashlib.sha256).digest()


def workspace_credential(token: str, workspace_id: str) -> str:
    """The bearer credential that opens ``workspace_id`` (and only it) on the devbox of
    ``token``."""
    mac = hmac.new(_key(token), workspace_id.encode(), hashlib.sha256).hexdigest()
    return f"{PREFIX}:{workspace_id}:{mac}"


class Unauthorized(Exception):
    pass


def scope_of(token: str, supplied: str) -> str | None:
    """What a bearer value opens: None for the operator token (everything), a workspace id for
    that workspace's credential; Unauthorized for anything else. Constant-time comparisons."""
    if hmac.compare_digest(supplied.encode(), token.encode()):
        return None
    prefix, _, rest = supplied.partition(":")
    workspace_id = rest.rpartition(":")[0]
    if prefix == PREFIX and workspace_id:
        expected = workspace_credential(token, workspace_id)
        if hmac.compare_digest(supplied.encode(), expected.encode()):
            return workspace_id
    raise Unauthorized
