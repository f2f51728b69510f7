"""Which schema revision this code needs, and whether it can work on the database's.

Rolling upgrades: `charlie db upgrade` runs while workers of the previous release keep
running, and new workers may start before it. The rules, for code at revision C (the newest
migration it ships) and a database at R:

- R = C: current.
- R is older than C (one of C's ancestors): the code needs columns or tables the database
  lacks yet; it must not claim work until `charlie db upgrade` ran.
- R is newer than C (a revision C does not know): the migrations since C only added (they are
  online and expand-only by rule), so C still works, unless a migration raised the schema
  floor (``schema_floor``) past C: then C's code is too old for this schema.
- no ``alembic_version`` table: not migrated.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from enum import Enum

from sqlalchemy import Connection, inspect, select, text

from charlie.store.alembic_config import alembic_config
from charlie.store.schema import schema_floor


class SchemaFit(Enum):
    CURRENT = "current"
    #: the database is newer, and still works for this code (its floor is at or below it)
    NEWER_COMPATIBLE = "newer-compatible"
    #: the database is older than this code: wait for `charlie db upgrade`
    DATABASE_BEHIND = "database-behind"
    #: the database's floor is newer than this code: upgrade this code
    CODE_TOO_OLD = "code-too-old"
    NOT_MIGRATED = "not-migrated"


@dataclass(frozen=True)
class SchemaCheck:
    fit: SchemaFit
    #: the revision this code needs (its newest migration)
    code: str
    #: the database's revision (None: not migrated)
    database: str | None
    #: the database's floor (None: none set, or not read)
    floor: str | None = None

    @property
    def can_claim(self) -> bool:
        """This code may claim and run work on this database."""
        return self.fit in (SchemaFit.CURRENT, SchemaFit.NEWER_COMPATIBLE)

    @property
    def why(self) -> str:
        """One line for a log or `charlie doctor`: what the check found and what to do."""
        if self.fit is SchemaFit.CURRENT:
            return f"schema at {self.code}, as this code needs"
        if self.fit is SchemaFit.NEWER_COMPATIBLE:
            floor = f" (floor {self.floor})" if self.floor else ""
            return (
                f"schema at {self.database}, newer than this code's {self.code}, and still "
                f"compatible with it{floor}"
            )
        if self.fit is SchemaFit.DATABASE_BEHIND:
            return (
                f"schema at {self.database}, this code needs {self.code}: waiting for "
                "`charlie db upgrade`"
            )
        if self.fit is SchemaFit.CODE_TOO_OLD:
            return (
                f"schema at {self.database} needs code at revision {self.floor} or newer; this "
                f"code is at {self.code}: upgrade Charlie on this machine"
            )
        return (
            f"the database is not migrated (this code needs {self.code}): run `charlie db upgrade`"
        )


@functools.cache
def code_revisions() -> tuple[str, ...]:
    """This code's revisions, newest (the head it needs) first, back to the first."""
    from alembic.script import ScriptDirectory

    script = ScriptDirectory.from_config(alembic_config("sqlite://"))
    head = script.get_current_head()
    assert head is not None
    return tuple(rev.revision for rev in script.iterate_revisions(head, "base"))


def database_revision(conn: Connection) -> str | None:
    if not inspect(conn).has_table("alembic_version"):
        return None
    value = conn.execute(text("SELECT version_num FROM alembic_version")).scalar()
    return str(value) if value is not None else None


def database_floor(conn: Connection) -> str | None:
    if not inspect(conn).has_table("schema_floor"):
        return None
    value = conn.execute(select(schema_floor.c.revision).order_by(schema_floor.c.id)).scalar()
    return str(value) if value is not None else None


def check_schema(conn: Connection, known: tuple[str, ...] | None = None) -> SchemaCheck:
    """How this code (``known``: its revisions, newest first; default: this package's) fits
    the database ``conn`` reaches."""
    known = known or code_revisions()
    code = known[0]
    database = database_revision(conn)
    if database is None:
        return SchemaCheck(SchemaFit.NOT_MIGRATED, code, None)
    if database == code:
        return SchemaCheck(SchemaFit.CURRENT, code, database)
    if database in known:
        return SchemaCheck(SchemaFit.DATABASE_BEHIND, code, database)
    floor = database_floor(conn)
    if floor is None or floor in known:
        return SchemaCheck(SchemaFit.NEWER_COMPATIBLE, code, database, floor)
    return SchemaCheck(SchemaFit.CODE_TOO_OLD, code, database, floor)


__all__ = ["SchemaCheck", "SchemaFit", "check_schema", "code_revisions"]
