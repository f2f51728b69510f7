"""What callers above the store hold and catch, under the store's own names.

A module above charlie/store passes connections and engines along and catches the database's
errors, but never builds a statement; it takes these names from here, so that no module outside
charlie/store imports SQLAlchemy (the "SQL lives in the store" contract in pyproject.toml,
docs/architecture.md). They are the SQLAlchemy types themselves, not wrappers: what is raised
and caught is unchanged, and so is what a tick costs.
"""

from __future__ import annotations

from sqlalchemy import Connection as Connection
from sqlalchemy import Engine as Engine
from sqlalchemy.exc import DBAPIError, IntegrityError, OperationalError, SQLAlchemyError

#: Anything the database layer raised: a statement refused, a connection lost, a bad URL.
DatabaseError = SQLAlchemyError

#: An error the database driver raised; ``connection_invalidated`` says whether the pooled
#: connection died (a database restart), so that nothing was committed on it.
DriverError = DBAPIError

#: A constraint refused a write: most often a second row under a unique key (a request id, a
#: task id, a message id) that a racing writer committed first.
ConstraintViolation = IntegrityError

#: The database could not run the statement for now: unreachable, restarting, or (SQLite)
#: locked past its busy timeout. Worth retrying.
DatabaseUnavailable = OperationalError

__all__ = [
    "Connection",
    "ConstraintViolation",
    "DatabaseError",
    "DatabaseUnavailable",
    "DriverError",
    "Engine",
]
