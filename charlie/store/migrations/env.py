"""Alembic environment: runs Charlie's migrations against the URL it is given."""

from alembic import context
from sqlalchemy import create_engine, pool

from charlie.store.engine import server_connect_args
from charlie.store.schema import Base

config = context.config
url = config.attributes.get("connection_url") or config.get_main_option("sqlalchemy.url")


def run_offline() -> None:
    context.configure(url=url, target_metadata=Base.metadata, literal_binds=True)
    with context.begin_transaction():
        context.run_migrations()


def run_online() -> None:
    args = {} if url.startswith("sqlite") else {"connect_args": server_connect_args(url)}
    engine = create_engine(url, poolclass=pool.NullPool, **args)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=Base.metadata,
            render_as_batch=connection.dialect.name == "sqlite",
        )
        with context.begin_transaction():
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():
    run_offline()
else:
    run_online()
