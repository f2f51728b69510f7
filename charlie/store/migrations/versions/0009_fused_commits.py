"""fused commits: charlie_expect, the assertion a one-statement commit makes

A fused commit (charlie/store/fused.py) writes several phase transitions in one statement,
computed from what the worker predicted the rows to be. What it assumed is checked inside the
statement once the rows are locked; ``charlie_expect`` raises when an assumption fails, which
rolls the whole statement back (it runs in autocommit: its own transaction), and the worker
then commits the same steps the ordinary way, reading the rows as they are.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None

# SQLSTATE CH001: a class of its own, so the worker tells "an assumption failed" from any
# other error by its code alone (charlie/store/fused.py, ASSUMPTION_FAILED).
EXPECT = """
CREATE OR REPLACE FUNCTION charlie_expect(ok boolean, what text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF ok IS NOT TRUE THEN
        RAISE EXCEPTION 'charlie: a fused commit''s assumption failed: %', what
            USING ERRCODE = 'CH001';
    END IF;
    RETURN true;
END
$$
"""


def upgrade() -> None:
    # PostgreSQL only: SQLite commits each step the ordinary way and needs no function.
    if op.get_bind().dialect.name == "postgresql":
        op.execute(EXPECT)


def downgrade() -> None:
    if op.get_bind().dialect.name == "postgresql":
        op.execute("DROP FUNCTION IF EXISTS charlie_expect(boolean, text)")
