"""schema floor: the oldest code revision that can still run on this schema

Rolling upgrades: workers of the previous release keep running while `charlie db upgrade`
applies an additive (expand) migration; one that removes or changes what older code uses
raises the floor, and older workers then stop claiming work (charlie.store.revisions). No row:
no floor (every migration up to here only added).

A new table only: no lock on, and no rewrite of, any existing table.

Revision ID: 0014
Revises: 0012
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0014"
down_revision = "0012"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "schema_floor",
        sa.Column("id", sa.Integer(), primary_key=True),
        sa.Column("revision", sa.String(32), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("schema_floor")
