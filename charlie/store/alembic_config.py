"""Where Charlie's migrations are and the Alembic configuration that runs them: read by the
engine (upgrade, the head) and by the schema-revision check alike, so neither imports the
other."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def migrations_dir() -> Path:
    return Path(__file__).parent / "migrations"


def alembic_config(url: str) -> Any:
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(migrations_dir()))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    cfg.attributes["configure_logger"] = False
    return cfg
