"""The error the devbox raises inside a request; the HTTP layer turns it into JSON."""

from __future__ import annotations


class ApiError(Exception):
    """A request the devbox refuses or cannot serve, with the HTTP status it answers with.

    The message goes back to the caller verbatim, so it names the offending path or argument and
    never carries secrets.
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
