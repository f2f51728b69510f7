"""Alembic environment: runs Charlie's migrations against the URL it is given.

Migrations run while workers of the previous release keep working (rolling upgrades): each
must be online on PostgreSQL, no rewrite of a table and no lock held for longer than a catalog
change (tests/integration/test_online_migrations.py checks every one). On PostgreSQL every
migration's transaction waits at most LOCK_TIMEOUT for a lock: an ALTER queued behind a long
transaction would otherwise hold every query on that table queued behind itself.
"""

from typing import Any

from alembic import context
from sqlalchemy import Connection, create_engine, event, pool

from charlie.store.engine import server_connect_args
from charlie.store.schema import Base

config = context.config
url = config.attributes.get("connection_url") or config.get_main_option("sqlalchemy.url")

#: how long a migration's statement waits for a lock before `charlie db upgrade` fails (and
#: can be run again): SET LOCAL, so nothing outlives the transaction (PgBouncer)
LOCK_TIMEOUT = "10s"


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def _bounded_lock_waits(conn: Connection) -> None:
    if conn.get_execution_options().get("isolation_level") != "AUTOCOMMIT":
        conn.exec_driver_sql(f"SET LOCAL lock_timeout = '{LOCK_TIMEOUT}'")


def run_online() -> None:
    args = {} if url.startswith("sqlite") else {"connect_args": server_connect_args(url)}
    engine = create_engine(url, poolclass=pool.NullPool, **args)
    if engine.dialect.name == "postgresql":
        event.listen(engine, "begin", _bounded_lock_waits)
    #: a test's hook, called after each migration step inside its transaction
    on_step: Any = config.attributes.get("on_version_apply")
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
            transaction_per_migration=True,
            **({"on_version_apply": on_step} if on_step else {}),
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
